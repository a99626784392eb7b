#include "train/checkpoint.h"

#include "util/error_message.h"
#include "util/file_write.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/serialize.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>

namespace dcp {
namespace fs = std::filesystem;

namespace {

// A crash between the two renames leaves only `dir`.old; loading falls back to it.
fs::path existing_dir(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "state.json")) return dir;
  fs::path old = dir + ".old";
  if (fs::exists(old / "state.json")) return old;
  throw std::runtime_error(fmt::format("checkpoint '{}' not found (no state.json)", dir));
}

// JSON has no NaN: an undefined metric (no held-out data) is stored as null.
nlohmann::json number_or_null(double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); }
double number_or_nan(const nlohmann::json& j) { return j.is_null() ? std::nan("") : j.get<double>(); }

bool fixes_model_or_data_order(const std::string& key) {
  // The attention keys that decide which attention parameters exist and their shapes; mode and chunk_size
  // only choose how the same operator is computed.
  static const char* kPrefixes[] = {"model.", "data.", "run.seed", "train.global_batch_tokens",
                                    "train.micro_batch_tokens", "parallel.sp_size", "attention.backend",
                                    "attention.feature_map", "attention.num_features", "attention.input_norm",
                                    "attention.normalizer"};
  for (const char* p : kPrefixes) {
    if (key.rfind(p, 0) == 0 && key != "parallel.sp_sizes") return true;
  }
  return false;
}

}  // namespace

void check_resumable(const std::string& dir, const Config& current) {
  Config stored = load_checkpoint_config(dir);
  auto now = current.items();
  auto then = stored.items();
  for (size_t i = 0; i < now.size(); ++i) {
    if (fixes_model_or_data_order(now[i].first) && now[i].second != then[i].second) {
      throw std::runtime_error(fmt::format(
          "cannot resume from '{}': config key '{}' is '{}' there but '{}' now (it fixes the model or the data "
          "order); use the checkpoint's value or start a new run_dir",
          dir, now[i].first, then[i].second, now[i].second));
    }
  }
}

void save_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer& optimizer,
                     const TrainState& state, const Config& cfg) {
  fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  // Serialized in memory first: LibTorch's file writer reports a full disk from its destructor, which aborts.
  auto save_to = [](const auto& object, const fs::path& path) {
    std::ostringstream bytes;
    torch::save(object, bytes);
    write_file_checked(path, bytes.str());
  };
  try {
    save_to(model, tmp / "model.pt");
    save_to(optimizer, tmp / "optimizer.pt");
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("writing checkpoint to '{}' failed: {}", tmp.string(), error_message(e)));
  }
  nlohmann::json j = {{"step", state.step},
                      {"epoch", state.epoch},
                      {"index_in_epoch", state.index_in_epoch},
                      {"tokens_trained", state.tokens_trained},
                      {"samples_trained", state.samples_trained},
                      {"heldout_bits_per_byte_initial", number_or_null(state.heldout_bits_per_byte_initial)},
                      {"wall_time_s", state.wall_time_s},
                      {"cost_calibration", state.cost_calibration}};
  write_file_checked(tmp / "state.json", j.dump(1) + "\n");
  write_file_checked(tmp / "config.yaml", cfg.to_yaml());
  fs::path old = dir + ".old";
  fs::remove_all(old);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  fs::remove_all(old);
}

Config load_checkpoint_config(const std::string& dir) {
  const std::string path = (existing_dir(dir) / "config.yaml").string();
  try {
    return Config::load(path, {});
  } catch (const ConfigError& e) {
    // The checkpoint's content is data, not usage: a corrupt config.yaml is a runtime error (exit 1).
    throw std::runtime_error(fmt::format("checkpoint '{}': its config.yaml cannot be used: {}", dir, e.what()));
  }
}

TrainState load_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer* optimizer) {
  fs::path d = existing_dir(dir);
  // torch::load resizes a parameter to the stored tensor's shape, so a checkpoint of another model (an edited
  // config) would load silently; compare the shapes the config built with what was loaded.
  auto shapes = [&] {
    std::vector<std::pair<std::string, std::vector<int64_t>>> out;
    for (const auto& p : model->named_parameters()) out.emplace_back(p.key(), p.value().sizes().vec());
    for (const auto& b : model->named_buffers()) out.emplace_back(b.key(), b.value().sizes().vec());
    return out;
  };
  const auto built = shapes();
  try {
    torch::load(model, (d / "model.pt").string());
    if (optimizer) torch::load(*optimizer, (d / "optimizer.pt").string());
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("loading checkpoint '{}' failed (is it complete, and written for this model config?): {}",
                                         d.string(), error_message(e)));
  }
  const auto loaded = shapes();
  for (size_t i = 0; i < built.size(); ++i) {
    if (loaded[i].second != built[i].second) {
      throw std::runtime_error(fmt::format(
          "loading checkpoint '{}' failed: parameter '{}' is [{}] there but the config builds [{}] (is it written "
          "for this model and attention config?)",
          d.string(), built[i].first, fmt::join(loaded[i].second, ", "), fmt::join(built[i].second, ", ")));
    }
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::ifstream(d / "state.json"));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint state '{}' is unreadable: {}", (d / "state.json").string(),
                                         error_message(e)));
  }
  TrainState s;
  s.step = j.at("step");
  s.epoch = j.at("epoch");
  s.index_in_epoch = j.at("index_in_epoch");
  s.tokens_trained = j.at("tokens_trained");
  s.samples_trained = j.at("samples_trained");
  s.heldout_bits_per_byte_initial = number_or_nan(j.at("heldout_bits_per_byte_initial"));
  s.wall_time_s = j.at("wall_time_s");
  s.cost_calibration = j.value("cost_calibration", 0.0);
  return s;
}

}  // namespace dcp
