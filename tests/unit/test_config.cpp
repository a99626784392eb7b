#include <gtest/gtest.h>

#include "unit/error_of.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
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
  EXPECT_DOUBLE_EQ(Config::load("", {"--memory.margin=0.05"}).memory.margin, 0.05);
  EXPECT_NE(error_of([] { Config::load("", {"--memory.margin=0.6"}); }).find("(allowed: a decimal number in [0, 0.5])"),
            std::string::npos);
  EXPECT_THROW(Config::load("", {"--memory.margin=-0.01"}), ConfigError);
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

// Keys whose values reach float32 tensors are bounded below FLT_MAX: 1e39 passed and failed deep in the run.
TEST(Config, FloatKeysAreBoundedBelowFloatMax) {
  for (const char* key : {"train.grad_clip"}) {
    const std::string msg = error_of([&] { Config::load("", {std::string("--") + key + "=1e39"}); });
    EXPECT_NE(msg.find(std::string("config key '") + key + "': bad value '1e39' (allowed: a decimal number in ["),
              std::string::npos)
        << msg;
    EXPECT_NO_THROW(Config::load("", {std::string("--") + key + "=1e30"}));
  }
}

// A denormal is a number in range: 1e-320 parses, prints and reads back (std::stod threw out_of_range for it).
TEST(Config, DenormalsParsePrintAndReadBack) {
  const Config c = Config::load("", {"--train.lr=1e-320"});
  EXPECT_GT(c.train.lr, 0);
  EXPECT_LT(c.train.lr, 1e-300);
  const Config d = Config::load(write_temp("dcp_cfg_denormal.yaml", c.to_yaml()), {});
  EXPECT_EQ(d.train.lr, c.train.lr);
}

// yaml-cpp keeps both pairs of a key given twice and the last won silently; now it is refused with both lines.
TEST(Config, DuplicateKeysNameTheKeyAndBothLines) {
  auto path = write_temp("dcp_cfg_dup.yaml", "train:\n  max_steps: 2\n  max_steps: 3\n");
  EXPECT_EQ(error_of([&] { Config::load(path, {}); }),
            "config file '" + path + "': key 'train.max_steps' is given twice (lines 2 and 3)");
  path = write_temp("dcp_cfg_dup_section.yaml", "train:\n  max_steps: 2\nmodel:\n  d_model: 64\ntrain:\n  lr: 0.1\n");
  EXPECT_EQ(error_of([&] { Config::load(path, {}); }),
            "config file '" + path + "': key 'train' is given twice (lines 1 and 5)");
  EXPECT_THROW(Config::load(path, {}), ConfigError);
}

// A config file is a regular file or a pipe that has something to read: a FIFO nobody writes to is refused
// after 2 s (opening it blocked forever), and so are a device, a folder and a pipe that gives no data.
TEST(Config, FifosDevicesAndFoldersAreRefusedPipesWithDataRead) {
  const auto dir = std::filesystem::temp_directory_path() / ("dcp_cfg_fifo_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string fifo = (dir / "f.yaml").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  std::string msg = error_of([&] { Config::load(fifo, {}); });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
  EXPECT_EQ(msg, "config file '" + fifo +
                     "' is a pipe with nothing to read after 2 s (a FIFO that no process writes to?): give a "
                     "regular file");
  EXPECT_THROW(Config::load(fifo, {}), ConfigError);
  EXPECT_EQ(error_of([] { Config::load("/dev/null", {}); }),
            "config file '/dev/null' is not a regular file (a device or a socket): give a YAML file");
  EXPECT_EQ(error_of([&] { Config::load(dir.string(), {}); }),
            "config file '" + dir.string() + "' is a folder, not a YAML file");
  // `--config <(cat x.yaml)`: a pipe with a writer is read.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const std::string text = "train:\n  max_steps: 7\n";
  ASSERT_EQ(write(fds[1], text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fds[1]);
  const std::string piped = "/dev/fd/" + std::to_string(fds[0]);
  EXPECT_EQ(Config::load(piped, {}).train.max_steps, 7);
  // The pipe is drained now (as when another rank read it first): refused, not read as an empty config.
  msg = error_of([&] { Config::load(piped, {}); });
  EXPECT_EQ(msg.rfind("config file '" + piped + "' is a pipe ", 0), 0u) << msg;
  close(fds[0]);
  std::filesystem::remove_all(dir);
}

TEST(Config, KvHeadsDivideTheHeadsBoundUlyssesAndNeedSoftmax) {
  EXPECT_EQ(Config::load("", {}).model.kv_heads(), Config::load("", {}).model.n_heads);  // default 0 = n_heads
  EXPECT_EQ(Config::load("", {"--model.n_kv_heads=2"}).model.kv_heads(), 2);
  std::string msg = error_of([] { Config::load("", {"--model.n_kv_heads=3"}); });
  EXPECT_NE(msg.find("'model.n_kv_heads': bad value '3'"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--model.n_kv_heads=2", "--attention.backend=flexformer"}); });
  EXPECT_NE(msg.find("softmax backend only"), std::string::npos) << msg;
  // Ulysses shards K/V heads too: sp_size 4 divides the 4 query heads but not 2 K/V heads; a ring is free.
  msg = error_of([] { Config::load("", {"--model.n_kv_heads=2", "--parallel.sp_size=4"}); });
  EXPECT_NE(msg.find("a divisor of the K/V heads, 2"), std::string::npos) << msg;
  EXPECT_NO_THROW(Config::load("", {"--model.n_kv_heads=2", "--parallel.sp_size=2"}));
  EXPECT_NO_THROW(Config::load("", {"--model.n_kv_heads=2", "--parallel.sp_size=4", "--parallel.sp_mode=ring"}));
  EXPECT_NO_THROW(Config::load("", {"--model.n_kv_heads=1", "--parallel.sp_size=4", "--parallel.sp_mode=ring"}));
  msg = error_of([] { Config::load("", {"--kv.max_rel_bpb=2"}); });
  EXPECT_NE(msg.find("kv.max_rel_bpb"), std::string::npos) << msg;
}

TEST(Config, SpModesLiftTheHeadBoundAndNeedSoftmax) {
  // Ulysses: sp_size must divide the heads; a ring need not; ulysses-ring's subgroup must.
  EXPECT_NE(error_of([] { Config::load("", {"--model.n_heads=4", "--parallel.sp_size=8"}); }).find("parallel.sp_size"),
            std::string::npos);
  EXPECT_NO_THROW(Config::load("", {"--model.n_heads=4", "--parallel.sp_size=8", "--parallel.sp_mode=ring"}));
  EXPECT_NO_THROW(Config::load("", {"--model.n_heads=4", "--parallel.sp_size=8", "--parallel.sp_mode=ulysses-ring"}));
  EXPECT_NO_THROW(Config::load("", {"--model.n_heads=4", "--parallel.sp_size=8", "--parallel.sp_mode=ulysses-ring",
                                    "--parallel.ulysses_size=2"}));
  std::string msg = error_of([] {
    Config::load("", {"--model.n_heads=4", "--parallel.sp_size=8", "--parallel.sp_mode=ulysses-ring",
                      "--parallel.ulysses_size=8"});
  });
  EXPECT_NE(msg.find("'parallel.ulysses_size': bad value '8'"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--parallel.sp_size=4", "--parallel.ulysses_size=2"}); });
  EXPECT_NE(msg.find("unless parallel.sp_mode is ulysses-ring"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--parallel.sp_mode=ulysses-ring", "--parallel.sp_size=0"}); });
  EXPECT_NE(msg.find("parallel.sp_size"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--parallel.sp_mode=ring", "--attention.backend=flexformer"}); });
  EXPECT_NE(msg.find("need attention.backend softmax"), std::string::npos) << msg;
  msg = error_of([] { Config::load("", {"--parallel.sp_mode=star"}); });
  EXPECT_NE(msg.find("ulysses, ring, ulysses-ring"), std::string::npos) << msg;
}
