// Checkpoints: refuse weights of another model config, corrupt or hand-edited files and optimizer states of
// another shape; survive write errors and the crash windows of the install renames; the step guard.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/optim/adamw.h>

#include <cctype>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "dcp/checkpoint.h"
#include "train/step_guard.h"
#include "util/error_message.h"
#include "unit/checkpoint_edit.h"
#include "unit/error_of.h"

using namespace dcp;
namespace fs = std::filesystem;
using nlohmann::json;
using test::read_file;
using test::replace_with_manifest;
using test::write_file;

namespace {

Config small_config() {
  Config cfg;
  cfg.model.d_model = 32;
  cfg.model.n_layers = 1;
  cfg.model.n_heads = 2;
  cfg.model.d_ff = 64;
  return cfg;
}

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("dcp_test_checkpoint_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}


// Saves a checkpoint of a fresh small model at `step` (index and epoch 0) into `dir`.
void save_at(const std::string& dir, int64_t step) {
  const Config cfg = small_config();
  Transformer model(cfg.model, cfg.attention);
  torch::optim::AdamW optimizer(model->parameters());
  TrainState s;
  s.step = step;
  s.data_fingerprint = "test corpus";
  save_checkpoint(dir, model, optimizer, s, cfg);
}

int64_t loaded_step(const std::string& dir) {
  const Config cfg = small_config();
  Transformer model(cfg.model, cfg.attention);
  return load_checkpoint(dir, model, nullptr).step;
}


}  // namespace

TEST(Checkpoint, LoadRefusesAnotherAttentionShapeNamingTheParameter) {
  Config cfg = small_config();
  cfg.attention.backend = "flexformer";
  cfg.attention.num_features = 8;
  Transformer saved(cfg.model, cfg.attention);
  torch::optim::AdamW optimizer(saved->parameters());
  const std::string dir = (scratch("shape") / "checkpoint").string();
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
  fs::remove_all(fs::path(dir).parent_path());
}

// R2: a flipped byte or a truncated file is refused naming the file, by every reader (resume, generate and
// distill all load through load_checkpoint / load_checkpoint_config).
TEST(Checkpoint, CorruptOrTruncatedFilesAreRefusedNamingTheFile) {
  const fs::path root = scratch("corrupt");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 3);
  EXPECT_EQ(loaded_step(dir), 3);
  const json manifest = json::parse(read_file(fs::path(dir) / "manifest.json"));
  EXPECT_EQ(manifest["step"], 3);
  for (const char* f : {"model.pt", "optimizer.pt", "state.json", "config.yaml"}) {
    EXPECT_TRUE(manifest["files"].contains(f)) << f;
  }

  std::string model = read_file(fs::path(dir) / "model.pt");
  model[model.size() / 2] = static_cast<char>(model[model.size() / 2] ^ 0xFF);
  write_file(fs::path(dir) / "model.pt", model);
  std::string e = test::error_of([&] { loaded_step(dir); });
  EXPECT_NE(e.find("checkpoint file '" + dir + "/model.pt' is corrupt: its CRC32 is"), std::string::npos) << e;

  save_at(dir, 3);
  const std::string config = read_file(fs::path(dir) / "config.yaml");
  write_file(fs::path(dir) / "config.yaml", config.substr(0, config.size() / 2));
  e = test::error_of([&] { load_checkpoint_config(dir); });
  EXPECT_NE(e.find("config.yaml' is " + std::to_string(config.size() / 2) + " bytes but manifest.json records " +
                   std::to_string(config.size())),
            std::string::npos)
      << e;

  // An empty config is named as such (R19), not as a key that differs.
  save_at(dir, 3);
  replace_with_manifest(dir, "config.yaml", "");
  e = test::error_of([&] { load_checkpoint_config(dir); });
  EXPECT_NE(e.find("config.yaml' is empty"), std::string::npos) << e;
  // A corrupt config is a runtime error (exit 1), not a usage error (ConfigError, exit 2): R17.
  replace_with_manifest(dir, "config.yaml", "::\n");
  EXPECT_THROW(
      {
        try {
          load_checkpoint_config(dir);
        } catch (const ConfigError&) {
          ADD_FAILURE() << "a checkpoint's config error must not be a ConfigError";
        }
      },
      std::runtime_error);
  fs::remove_all(root);
}

// R4: hand-edited state.json fields are refused naming the file and the field.
TEST(Checkpoint, HandEditedStateIsRefusedNamingTheField) {
  const fs::path root = scratch("state");
  const std::string dir = (root / "checkpoint").string();
  struct Case {
    std::string key;
    json value;  // null: remove the key
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"index_in_epoch", -5, "field 'index_in_epoch' is -5, out of range (allowed: a whole number in [0, 2^53])"},
      {"step", 1e300, "field 'step' is 1e+300, out of range (allowed: a whole number in [0, 2^53])"},
      {"step", 1e18, "field 'step' is 1e+18, out of range (allowed: a whole number in [0, 2^53])"},
      {"step", int64_t{1000000000000000000}, "field 'step' is 1000000000000000000, out of range"},
      {"step", 4.7, "field 'step' is 4.7, not a whole number"},
      {"step", "4", "field 'step' is \"4\", not a whole number"},
      {"epoch", nullptr, "field 'epoch' is missing"},
      {"index_in_epoch", 1000000000, "field 'index_in_epoch' is 1000000000, above step 4"},
      {"epoch", 9, "field 'epoch' is 9, above step 4"},
      {"wall_time_s", -1, "field 'wall_time_s' is -1, not a finite number >= 0"},
      {"step", 5, "field 'step' is 5 but manifest.json records step 4"},
  };
  for (const auto& c : cases) {
    save_at(dir, 4);
    json state = json::parse(read_file(fs::path(dir) / "state.json"));
    if (c.value.is_null()) {
      state.erase(c.key);
    } else {
      state[c.key] = c.value;
    }
    replace_with_manifest(dir, "state.json", state.dump());
    const std::string e = test::error_of([&] { loaded_step(dir); });
    EXPECT_NE(e.find("checkpoint state '" + dir + "/state.json': " + c.expected), std::string::npos)
        << c.key << ": " << e;
  }
  fs::remove_all(root);
}

// R15: optimizer moments of another model shape are refused at load, naming the file and the parameter.
TEST(Checkpoint, OptimizerStateOfAnotherShapeIsRefused) {
  const fs::path root = scratch("optimizer");
  Config wide = small_config();
  wide.model.d_ff = 96;
  Transformer other(wide.model, wide.attention);
  torch::optim::AdamW stepped(other->parameters());
  for (auto& p : other->parameters()) p.mutable_grad() = torch::ones_like(p);
  stepped.step();  // moments exist only after a step
  std::ostringstream bytes;
  torch::save(stepped, bytes);

  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 2);
  replace_with_manifest(dir, "optimizer.pt", bytes.str());
  const Config cfg = small_config();
  Transformer model(cfg.model, cfg.attention);
  torch::optim::AdamW optimizer(model->parameters());
  std::string e = test::error_of([&] { load_checkpoint(dir, model, &optimizer); });
  EXPECT_NE(e.find("optimizer.pt' does not fit the model: AdamW exp_avg of parameter"), std::string::npos) << e;
  EXPECT_NE(e.find("is [96, 32] but the parameter is [64, 32]"), std::string::npos) << e;

  // NaN moments of the right shape (a checkpoint without manifest, a memory fault before the save) are refused
  // too; and a model with NaN weights is never written over the last good checkpoint.
  torch::optim::AdamW nan_moments(model->parameters());
  for (auto& p : model->parameters()) p.mutable_grad() = torch::full_like(p, std::nan(""));
  nan_moments.step();
  std::ostringstream nan_bytes;
  torch::save(nan_moments, nan_bytes);
  replace_with_manifest(dir, "optimizer.pt", nan_bytes.str());
  Transformer fresh(cfg.model, cfg.attention);
  torch::optim::AdamW reloaded(fresh->parameters());
  e = test::error_of([&] { load_checkpoint(dir, fresh, &reloaded); });
  EXPECT_NE(e.find("optimizer.pt': AdamW exp_avg of parameter"), std::string::npos) << e;
  EXPECT_NE(e.find("holds NaN or infinite values"), std::string::npos) << e;
  save_at(dir, 2);
  e = test::error_of([&] { save_checkpoint(dir, model, nan_moments, TrainState{}, cfg); });  // model is NaN now
  EXPECT_NE(e.find("not writing checkpoint '" + dir + "': parameter"), std::string::npos) << e;
  EXPECT_EQ(loaded_step(dir), 2);
  fs::remove_all(root);
}

// R1/R6: a write that fails (here: RLIMIT_FSIZE, EFBIG, the same path as ENOSPC) is an error naming the file;
// the previous checkpoint stays in place and loadable.
TEST(Checkpoint, AFailedWriteKeepsThePreviousCheckpoint) {
  const fs::path root = scratch("write_error");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 4);
  rlimit saved{};
  getrlimit(RLIMIT_FSIZE, &saved);
  auto* previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 4096;  // smaller than model.pt
  setrlimit(RLIMIT_FSIZE, &small);
  const std::string e = test::error_of([&] { save_at(dir, 5); });
  setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(e.find("writing checkpoint '" + dir + "' failed: cannot write '" + dir + ".tmp/model.pt': File too large"),
            std::string::npos)
      << e;
  EXPECT_EQ(loaded_step(dir), 4);
  fs::remove_all(root);
}

// R5: the states a crash can leave between and around the install renames all load, and a save from the state
// "only checkpoint.old is complete" does not remove it before the new checkpoint is in place (here the rename
// of checkpoint.tmp fails, as a crash there would stop it).
TEST(Checkpoint, EveryCrashWindowOfTheInstallLeavesALoadableCheckpoint) {
  const fs::path root = scratch("crash");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 4);
  // Crash after checkpoint -> checkpoint.old, before checkpoint.tmp -> checkpoint.
  fs::rename(dir, dir + ".old");
  fs::copy(dir + ".old", dir + ".tmp");
  EXPECT_EQ(checkpoint_folder(dir), dir + ".old");
  EXPECT_EQ(loaded_step(dir), 4);
  // The next save must keep checkpoint.old until the new one is installed: make its install fail.
  fs::remove_all(dir + ".tmp");
  fs::create_directories(fs::path(dir) / "debris");  // checkpoint exists, is not a checkpoint, is not empty
  std::string e = test::error_of([&] { save_at(dir, 5); });
  EXPECT_NE(e.find("writing checkpoint '" + dir + "' failed"), std::string::npos) << e;
  EXPECT_EQ(loaded_step(dir), 4) << "the only complete checkpoint was removed";
  fs::remove_all(dir);
  // From that state a save installs the new one and keeps the old one as the previous checkpoint.
  save_at(dir, 5);
  EXPECT_EQ(loaded_step(dir), 5);
  EXPECT_EQ(loaded_step(dir + ".old"), 4);
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  // The next save rotates: checkpoint.old is then step 5, the one before it is gone.
  save_at(dir, 6);
  EXPECT_EQ(loaded_step(dir), 6);
  EXPECT_EQ(loaded_step(dir + ".old"), 5);
  fs::remove_all(root);
}

// The review's open items: a flipped byte inside model.pt whose manifest entry was rewritten to match (the zip
// entry's own CRC32 catches it), the same in a checkpoint without manifest, an upper-case crc32 in the manifest.
TEST(Checkpoint, ZipEntryCrcsCatchAFlipBehindAForgedManifest) {
  const fs::path root = scratch("zip");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 3);
  const std::string flipped = test::flip_byte_in_zip_entry(read_file(fs::path(dir) / "model.pt"), "/data/");
  replace_with_manifest(dir, "model.pt", flipped);  // the manifest agrees with the flipped bytes
  std::string e = test::error_of([&] { loaded_step(dir); });
  EXPECT_NE(e.find("checkpoint file '" + dir + "/model.pt' is corrupt: zip entry '"), std::string::npos) << e;
  EXPECT_NE(e.find("CRC error"), std::string::npos) << e;
  fs::remove(fs::path(dir) / "manifest.json");  // a checkpoint from before manifests: the zip CRC32s still hold
  e = test::error_of([&] { loaded_step(dir); });
  EXPECT_NE(e.find("model.pt' is corrupt: zip entry '"), std::string::npos) << e;
  fs::remove_all(root);

  save_at(dir, 3);
  json m = json::parse(read_file(fs::path(dir) / "manifest.json"));
  for (auto& [name, f] : m["files"].items()) {
    std::string crc = f["crc32"];
    for (char& c : crc) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    f["crc32"] = crc;
  }
  write_file(fs::path(dir) / "manifest.json", m.dump());
  EXPECT_EQ(loaded_step(dir), 3);
  m["files"]["model.pt"]["crc32"] = "xyz";
  write_file(fs::path(dir) / "manifest.json", m.dump());
  e = test::error_of([&] { loaded_step(dir); });
  EXPECT_NE(e.find("records crc32 'xyz' for 'model.pt': not a CRC32"), std::string::npos) << e;
  fs::remove_all(root);
}

// A corrupt newest checkpoint falls back to checkpoint.old (the previous one); when that is bad too, both are named.
TEST(Checkpoint, ACorruptNewestCheckpointFallsBackToThePreviousOne) {
  const fs::path root = scratch("fallback");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 4);
  save_at(dir, 6);
  std::string model = read_file(fs::path(dir) / "model.pt");
  model[model.size() / 2] = static_cast<char>(model[model.size() / 2] ^ 0xFF);
  write_file(fs::path(dir) / "model.pt", model);
  const Config cfg = small_config();
  Transformer m(cfg.model, cfg.attention);
  const TrainState s = load_checkpoint(dir, m, nullptr);
  EXPECT_EQ(s.step, 4);
  EXPECT_EQ(s.loaded_from, dir + ".old");
  EXPECT_EQ(load_checkpoint_config(dir).model.d_model, 32);
  write_file(fs::path(dir + ".old") / "model.pt", model);
  const std::string e = test::error_of([&] { loaded_step(dir); });
  EXPECT_NE(e.find("checkpoint file '" + dir + "/model.pt' is corrupt"), std::string::npos) << e;
  EXPECT_NE(e.find("the previous checkpoint is refused too: checkpoint file '" + dir + ".old/model.pt'"),
            std::string::npos)
      << e;
  fs::remove_all(root);
}

// A checkpoint written before manifests (no manifest.json) still loads, unverified.
TEST(Checkpoint, ACheckpointWithoutManifestLoadsUnverified) {
  const fs::path root = scratch("legacy");
  const std::string dir = (root / "checkpoint").string();
  save_at(dir, 7);
  fs::remove(fs::path(dir) / "manifest.json");
  EXPECT_EQ(loaded_step(dir), 7);
  fs::remove_all(root);
}

// R3: the guard passes finite steps, skips up to train.nonfinite_max_skips under skip, and stops naming the
// step and the last checkpoint.
TEST(StepGuard, StopsOrSkipsNonFiniteSteps) {
  const Communicator self("self", 0, 1, nullptr);
  TrainConfig stop;
  StepGuard guard(stop, 0);
  EXPECT_TRUE(guard.admit(1, 2.5, 1.0, self, ""));
  std::string e = test::error_of([&] { guard.admit(2, std::nan(""), 1.0, self, "run/checkpoint (step 1)"); });
  EXPECT_NE(e.find("step 2: the loss is nan and the gradient norm 1"), std::string::npos) << e;
  EXPECT_NE(e.find("stopped before the optimizer step"), std::string::npos) << e;
  EXPECT_NE(e.find("the last good checkpoint is run/checkpoint (step 1)"), std::string::npos) << e;
  e = test::error_of([&] { guard.admit(3, 2.0, std::numeric_limits<double>::infinity(), self, ""); });
  EXPECT_NE(e.find("no checkpoint was written yet"), std::string::npos) << e;
  // Its kind tells `dcp launch --max-restarts` to restart it at most once (DCP_ERROR_FILE).
  EXPECT_THROW(
      {
        try {
          guard.admit(4, std::nan(""), 1.0, self, "");
        } catch (const RunFailure& f) {
          EXPECT_STREQ(f.kind, kFailureNonfinite);
          throw;
        }
      },
      RunFailure);

  // A loss above 3x the median of the recent ones is a warning, counted.
  StepGuard spiky(stop, 0);
  for (int64_t s = 1; s <= 5; ++s) EXPECT_TRUE(spiky.admit(s, 2.0, 1.0, self, ""));
  EXPECT_TRUE(spiky.admit(6, 5.9, 1.0, self, ""));
  EXPECT_EQ(spiky.spikes(), 0);
  EXPECT_TRUE(spiky.admit(7, 6.1, 1.0, self, ""));
  EXPECT_EQ(spiky.spikes(), 1);

  TrainConfig skip;
  skip.nonfinite = "skip";
  skip.nonfinite_max_skips = 2;
  StepGuard skipping(skip, 1);  // one skip in an earlier invocation
  EXPECT_FALSE(skipping.admit(4, std::nan(""), std::nan(""), self, ""));
  EXPECT_EQ(skipping.skips(), 2);
  EXPECT_TRUE(skipping.admit(5, 2.0, 1.0, self, ""));
  e = test::error_of([&] { skipping.admit(6, std::nan(""), 1.0, self, ""); });
  EXPECT_NE(e.find("2 steps skipped already, train.nonfinite_max_skips 2"), std::string::npos) << e;
}
