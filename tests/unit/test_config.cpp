#include <gtest/gtest.h>

#include "unit/error_of.h"

#include <filesystem>
#include <fstream>

#include "dcp/config.h"

using dcp::Config;
using dcp::ConfigError;

using dcp::test::error_of;

namespace {

std::string write_temp(const std::string& name, const std::string& text) {
  auto path = std::filesystem::temp_directory_path() / name;
  std::ofstream(path) << text;
  return path.string();
}

}  // namespace

TEST(Config, PrecedenceIsCliOverFileOverDefaults) {
  auto path = write_temp("dcp_cfg_prec.yaml", "model:\n  d_model: 64\n  n_heads: 2\ntrain:\n  lr: 0.01\n");
  Config c = Config::load(path, {"--train.lr=0.02"});
  EXPECT_EQ(c.model.d_model, 64);        // file
  EXPECT_EQ(c.model.n_layers, 4);        // default
  EXPECT_DOUBLE_EQ(c.train.lr, 0.02);    // CLI wins over file
}

TEST(Config, UnknownKeyNamesKeyAndValue) {
  std::string msg = error_of([] { Config::load("", {"--model.d_modle=64"}); });
  EXPECT_NE(msg.find("model.d_modle"), std::string::npos) << msg;
  EXPECT_NE(msg.find("64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.d_model"), std::string::npos) << msg;  // lists the known keys
}

TEST(Config, BadValuesNameKeyValueAndAllowed) {
  std::string msg = error_of([] { Config::load("", {"--model.n_layers=zero"}); });
  EXPECT_NE(msg.find("'model.n_layers'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'zero'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("integer"), std::string::npos) << msg;

  msg = error_of([] { Config::load("", {"--train.lr=-1"}); });
  EXPECT_NE(msg.find("train.lr"), std::string::npos) << msg;

  msg = error_of([] { Config::load("", {"--attention.backend=flash"}); });
  EXPECT_NE(msg.find("one of softmax"), std::string::npos) << msg;

  msg = error_of([] { Config::load("", {"--model.d_model=100", "--model.n_heads=3"}); });
  EXPECT_NE(msg.find("model.n_heads"), std::string::npos) << msg;

  EXPECT_THROW(Config::load("", {"--train.max_steps=12abc"}), ConfigError);
  EXPECT_THROW(Config::load("", {"--train.max_steps"}), ConfigError);
  EXPECT_THROW(Config::load("", {"--data.heldout_fraction=nan"}), ConfigError);
}

TEST(Config, NumbersAreDecimalAndFinite) {
  // std::stod would read 0x10 as 16 and inf as infinity; a byte count or a rate is written in decimal.
  for (const char* text : {"0x10", "inf", "-inf", "nan", "infinity", " 5", "5 ", "1e", ".", "1e999", "+"}) {
    const std::string msg = error_of([&] { Config::load("", {std::string("--memory.budget_bytes=") + text}); });
    EXPECT_NE(msg.find("bad value '" + std::string(text) + "' (allowed: a finite decimal number >= 0)"),
              std::string::npos)
        << msg;
  }
  EXPECT_NE(error_of([] { Config::load("", {"--train.lr=0x1"}); }).find("(allowed: a decimal number in [0, 10])"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(Config::load("", {"--memory.budget_bytes=128e6"}).memory.budget_bytes, 128e6);
  EXPECT_DOUBLE_EQ(Config::load("", {"--memory.budget_bytes=+1.5E3"}).memory.budget_bytes, 1500.0);
  EXPECT_DOUBLE_EQ(Config::load("", {"--train.lr=.5"}).train.lr, 0.5);
  EXPECT_DOUBLE_EQ(Config::load("", {"--train.lr=1."}).train.lr, 1.0);
}

TEST(Config, FileErrorsNameThePath) {
  std::string msg = error_of([] { Config::load("/nonexistent/dcp.yaml", {}); });
  EXPECT_NE(msg.find("/nonexistent/dcp.yaml"), std::string::npos) << msg;

  auto bad = write_temp("dcp_cfg_bad.yaml", "model: [1, 2\n");
  msg = error_of([&] { Config::load(bad, {}); });
  EXPECT_NE(msg.find(bad), std::string::npos) << msg;

  auto unknown = write_temp("dcp_cfg_unknown.yaml", "modle:\n  d_model: 64\n");
  msg = error_of([&] { Config::load(unknown, {}); });
  EXPECT_NE(msg.find("modle.d_model"), std::string::npos) << msg;
}

TEST(Config, YamlRoundTrip) {
  Config c = Config::load("", {"--model.d_model=96", "--model.n_heads=3", "--train.lr=0.1", "--run.dir=/tmp/x y"});
  auto path = write_temp("dcp_cfg_rt.yaml", c.to_yaml());
  Config d = Config::load(path, {});
  EXPECT_EQ(c.items(), d.items());
  EXPECT_NE(c.to_yaml().find("lr: 0.1\n"), std::string::npos) << c.to_yaml();
}
