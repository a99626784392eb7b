// Checkpoints refuse weights of another model config instead of loading them into resized parameters.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <string>

#include "train/checkpoint.h"
#include "unit/error_of.h"

using namespace dcp;

TEST(Checkpoint, LoadRefusesAnotherAttentionShapeNamingTheParameter) {
  Config cfg;
  cfg.model.d_model = 32;
  cfg.model.n_layers = 1;
  cfg.model.n_heads = 2;
  cfg.model.d_ff = 64;
  cfg.attention.backend = "flexformer";
  cfg.attention.num_features = 8;
  Transformer saved(cfg.model, cfg.attention);
  torch::optim::AdamW optimizer(saved->parameters());
  const std::string dir = (std::filesystem::temp_directory_path() / "dcp_test_checkpoint_shape").string();
  save_checkpoint(dir, saved, optimizer, TrainState{}, cfg);

  Transformer same(cfg.model, cfg.attention);
  EXPECT_EQ(load_checkpoint(dir, same, nullptr).step, 0);
  EXPECT_TRUE(torch::equal(same->named_parameters()["blocks.0.attention.omega"],
                           saved->named_parameters()["blocks.0.attention.omega"]));

  AttentionConfig fewer = cfg.attention;
  fewer.num_features = 4;
  Transformer other(cfg.model, fewer);
  const std::string e = test::error_of([&] { load_checkpoint(dir, other, nullptr); });
  EXPECT_NE(e.find("parameter 'blocks.0.attention.omega' is [2, 8, 16] there but the config builds [2, 4, 16]"),
            std::string::npos)
      << e;
  std::filesystem::remove_all(dir);
}
