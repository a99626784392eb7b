#include "train/checkpoint.h"

#include <fmt/format.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
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

}  // namespace

void save_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer& optimizer,
                     const TrainState& state, const Config& cfg) {
  fs::path tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    torch::save(model, (tmp / "model.pt").string());
    torch::save(optimizer, (tmp / "optimizer.pt").string());
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("writing checkpoint to '{}' failed: {}", tmp.string(), e.what()));
  }
  nlohmann::json j = {{"step", state.step},
                      {"epoch", state.epoch},
                      {"index_in_epoch", state.index_in_epoch},
                      {"tokens_trained", state.tokens_trained},
                      {"samples_trained", state.samples_trained},
                      {"heldout_bits_per_byte_initial", state.heldout_bits_per_byte_initial},
                      {"wall_time_s", state.wall_time_s}};
  std::ofstream(tmp / "state.json") << j.dump(1) << "\n";
  std::ofstream cfg_out(tmp / "config.yaml");
  cfg_out << cfg.to_yaml();
  if (!cfg_out) throw std::runtime_error(fmt::format("writing checkpoint to '{}' failed", tmp.string()));
  cfg_out.close();
  fs::path old = dir + ".old";
  fs::remove_all(old);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  fs::remove_all(old);
}

Config load_checkpoint_config(const std::string& dir) {
  return Config::load((existing_dir(dir) / "config.yaml").string(), {});
}

TrainState load_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer* optimizer) {
  fs::path d = existing_dir(dir);
  try {
    torch::load(model, (d / "model.pt").string());
    if (optimizer) torch::load(*optimizer, (d / "optimizer.pt").string());
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("loading checkpoint '{}' failed (does the model config match?): {}",
                                         d.string(), e.what()));
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::ifstream(d / "state.json"));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint state '{}' is unreadable: {}", (d / "state.json").string(),
                                         e.what()));
  }
  TrainState s;
  s.step = j.at("step");
  s.epoch = j.at("epoch");
  s.index_in_epoch = j.at("index_in_epoch");
  s.tokens_trained = j.at("tokens_trained");
  s.samples_trained = j.at("samples_trained");
  s.heldout_bits_per_byte_initial = j.at("heldout_bits_per_byte_initial");
  s.wall_time_s = j.at("wall_time_s");
  return s;
}

}  // namespace dcp
