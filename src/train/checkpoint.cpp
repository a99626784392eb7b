#include "dcp/checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <zip.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "util/error_message.h"
#include "util/file_write.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestFormat = "dcp-checkpoint-1";
// JSON integers above 2^53 do not survive a round trip through a double (jq, Python's json with floats).
constexpr int64_t kMaxCount = int64_t{1} << 53;

uint32_t crc32_of(std::string_view bytes) {
  return static_cast<uint32_t>(crc32_z(crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                                       bytes.size()));
}

// A manifest's crc32: hex digits of either case (a hand-written or other tool's manifest may use upper case).
std::optional<uint32_t> parse_crc32(const std::string& text) {
  if (text.empty() || text.size() > 8) return std::nullopt;
  uint32_t value = 0;
  for (char c : text) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + static_cast<uint32_t>(digit);
  }
  return value;
}

std::string read_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw std::runtime_error(fmt::format("checkpoint file '{}' is missing (or not a file)", path.string()));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in.good() && !in.eof()) throw std::runtime_error(fmt::format("cannot read '{}'", path.string()));
  return bytes.str();
}

// A warning printed once per process and text: each load reads the folder's manifest more than once (the config,
// then the state and the weights), and a resume, generate and distill all load the same folder.
void warn_once(const std::string& text) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  if (warned.insert(text).second) spdlog::warn("{}", text);
}

// The manifest of checkpoint folder `d`, or null for a checkpoint written before manifests (warned once per folder).
json read_manifest(const fs::path& d) {
  const fs::path path = d / kManifest;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    warn_once(fmt::format("checkpoint '{}' has no {} (written before dcp checksummed its files): its files are "
                          "checked only against their own zip CRC32s",
                          d.string(), kManifest));
    return nullptr;
  }
  json m;
  try {
    m = json::parse(read_file(path));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint manifest '{}' is unreadable: {}", path.string(), error_message(e)));
  }
  if (!m.is_object() || m.value("format", "") != kManifestFormat || !m.contains("files") || !m["files"].is_object() ||
      !m.contains("step") || !m["step"].is_number_integer()) {
    throw std::runtime_error(fmt::format("checkpoint manifest '{}' is not a {} manifest (format, step and files "
                                         "expected)",
                                         path.string(), kManifestFormat));
  }
  return m;
}

// The bytes of `name` in checkpoint folder `d`, checked against the manifest's size and CRC32 when there is one.
std::string read_verified(const fs::path& d, const json& manifest, const std::string& name) {
  const fs::path path = d / name;
  std::string bytes = read_file(path);
  if (manifest.is_null()) return bytes;
  const json& files = manifest["files"];
  if (!files.contains(name)) {
    throw std::runtime_error(fmt::format("checkpoint manifest '{}' does not list '{}'", (d / kManifest).string(), name));
  }
  const json& f = files[name];
  const auto size = f.is_object() && f.contains("bytes") && f["bytes"].is_number_integer() ? f["bytes"].get<int64_t>()
                                                                                         : int64_t{-1};
  const std::string crc_text = f.is_object() && f.contains("crc32") && f["crc32"].is_string() ? f["crc32"].get<std::string>()
                                                                                          : std::string();
  const std::optional<uint32_t> crc = parse_crc32(crc_text);
  if (!crc) {
    throw std::runtime_error(fmt::format("checkpoint manifest '{}' records crc32 '{}' for '{}': not a CRC32 (1 to 8 "
                                         "hex digits)",
                                         (d / kManifest).string(), crc_text, name));
  }
  if (static_cast<int64_t>(bytes.size()) != size) {
    throw std::runtime_error(fmt::format("checkpoint file '{}' is {} bytes but {} records {} (truncated or "
                                         "replaced)",
                                         path.string(), bytes.size(), kManifest, size));
  }
  if (const uint32_t actual = crc32_of(bytes); actual != *crc) {
    throw std::runtime_error(fmt::format("checkpoint file '{}' is corrupt: its CRC32 is {:08x} but {} records {}",
                                         path.string(), actual, kManifest, crc_text));
  }
  return bytes;
}

// torch::save writes a zip archive (PyTorch's format: one stored entry per tensor, each with its own CRC32), but
// LibTorch's reader does not check those CRC32s. A flipped byte whose manifest entry was rewritten too, or a file
// of a checkpoint without manifest, is caught here: libzip checks each entry's CRC32 as it reads it to the end.
void verify_zip_entries(const std::string& bytes, const fs::path& path) {
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &error);
  zip_t* archive = source ? zip_open_from_source(source, ZIP_CHECKCONS | ZIP_RDONLY, &error) : nullptr;
  if (archive == nullptr) {
    const std::string why = zip_error_strerror(&error);
    if (source) zip_source_free(source);
    zip_error_fini(&error);
    throw std::runtime_error(fmt::format("checkpoint file '{}' is corrupt: not a readable zip archive (as "
                                         "torch::save writes): {}",
                                         path.string(), why));
  }
  zip_error_fini(&error);
  std::string problem;
  const zip_int64_t entries = zip_get_num_entries(archive, 0);
  std::vector<char> buffer(1 << 16);
  for (zip_int64_t i = 0; i < entries && problem.empty(); ++i) {
    const char* name = zip_get_name(archive, static_cast<zip_uint64_t>(i), 0);
    zip_file_t* file = zip_fopen_index(archive, static_cast<zip_uint64_t>(i), 0);
    if (file == nullptr) {
      problem = fmt::format("zip entry '{}' cannot be opened: {}", name ? name : "?", zip_strerror(archive));
      break;
    }
    zip_int64_t n = 0;
    while ((n = zip_fread(file, buffer.data(), buffer.size())) > 0) {
    }
    if (n < 0) problem = fmt::format("zip entry '{}': {} (its bytes differ from its own CRC32)", name ? name : "?",
                                     zip_file_strerror(file));
    zip_fclose(file);
  }
  zip_discard(archive);  // also frees the source
  if (!problem.empty()) {
    throw std::runtime_error(fmt::format("checkpoint file '{}' is corrupt: {}", path.string(), problem));
  }
}

// JSON has no NaN: an undefined metric (no held-out data) is stored as null.
json number_or_null(double v) { return std::isnan(v) ? json() : json(v); }

// state.json's fields, each refused naming the file and the field when missing, of the wrong type or out of range.
struct StateReader {
  const json& j;
  const fs::path& path;

  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    throw std::runtime_error(fmt::format("checkpoint state '{}': field '{}' {}", path.string(), key, what));
  }
  const json& at(const std::string& key) const {
    if (!j.contains(key)) bad(key, "is missing");
    return j[key];
  }
  int64_t count(const std::string& key, bool optional = false) const {
    if (optional && !j.contains(key)) return 0;
    const json& v = at(key);
    const std::string range = fmt::format("is {}, out of range (allowed: a whole number in [0, 2^53])", v.dump());
    if (v.is_number_float()) {  // 1e18 or 4.0: JSON writers may print a whole number in exponent form
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d)) bad(key, fmt::format("is {}, not a whole number", v.dump()));
      if (d < 0 || d > static_cast<double>(kMaxCount)) bad(key, range);
      return static_cast<int64_t>(d);
    }
    if (!v.is_number_integer()) bad(key, fmt::format("is {}, not a whole number", v.dump()));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(kMaxCount)
                               : (v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxCount)) {
      bad(key, range);
    }
    return v.get<int64_t>();
  }
  double seconds(const std::string& key, bool optional = false) const {
    if (optional && !j.contains(key)) return 0;
    const json& v = at(key);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
      bad(key, fmt::format("is {}, not a finite number >= 0", v.dump()));
    }
    return v.get<double>();
  }
};

TrainState parse_state(const std::string& text, const fs::path& path, const json& manifest) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("checkpoint state '{}' is unreadable: {}", path.string(), error_message(e)));
  }
  if (!j.is_object()) throw std::runtime_error(fmt::format("checkpoint state '{}' is not a JSON object", path.string()));
  const StateReader r{j, path};
  TrainState s;
  s.step = r.count("step");
  s.epoch = r.count("epoch");
  s.index_in_epoch = r.count("index_in_epoch");
  s.tokens_trained = r.count("tokens_trained");
  s.samples_trained = r.count("samples_trained");
  s.nonfinite_skips = r.count("nonfinite_skips", /*optional=*/true);
  s.wall_time_s = r.seconds("wall_time_s");
  s.cost_calibration = r.seconds("cost_calibration", /*optional=*/true);
  const json& bpb = r.at("heldout_bits_per_byte_initial");
  if (!bpb.is_null() && !(bpb.is_number() && std::isfinite(bpb.get<double>()))) {
    r.bad("heldout_bits_per_byte_initial", fmt::format("is {}, not a finite number or null", bpb.dump()));
  }
  s.heldout_bits_per_byte_initial = bpb.is_null() ? std::nan("") : bpb.get<double>();
  if (j.contains("data_fingerprint")) {
    if (!j["data_fingerprint"].is_string()) r.bad("data_fingerprint", "is not a string");
    s.data_fingerprint = j["data_fingerprint"].get<std::string>();
  }
  // Each epoch has at least one step, so neither the epoch nor the position in it can exceed the steps done.
  if (s.index_in_epoch > s.step) r.bad("index_in_epoch", fmt::format("is {}, above step {}", s.index_in_epoch, s.step));
  if (s.epoch > s.step) r.bad("epoch", fmt::format("is {}, above step {}", s.epoch, s.step));
  if (!manifest.is_null() && manifest["step"].get<int64_t>() != s.step) {
    r.bad("step", fmt::format("is {} but {} records step {}", s.step, kManifest, manifest["step"].dump()));
  }
  return s;
}

bool fixes_model_or_data_order(const std::string& key) {
  // The attention keys that decide which attention parameters exist and their shapes; mode and chunk_size
  // only choose how the same operator is computed.
  static const char* kPrefixes[] = {"model.", "data.", "run.seed", "train.global_batch_tokens",
                                    "train.micro_batch_tokens", "parallel.sp_size", "attention.backend",
                                    "attention.feature_map", "attention.num_features", "attention.input_norm",
                                    "attention.normalizer"};
  if (key == "parallel.sp_sizes" || key == "model.recompute_layers") return false;
  for (const char* p : kPrefixes) {
    if (key.rfind(p, 0) == 0) return true;
  }
  return false;
}

void check_shapes(Transformer& model, const std::vector<std::pair<std::string, std::vector<int64_t>>>& built,
                  const fs::path& file) {
  size_t i = 0;
  auto compare = [&](const std::string& name, const torch::Tensor& t) {
    if (t.sizes().vec() != built[i].second) {
      throw std::runtime_error(fmt::format(
          "loading checkpoint file '{}' failed: parameter '{}' is [{}] there but the config builds [{}] (is it "
          "written for this model and attention config?)",
          file.string(), name, fmt::join(t.sizes(), ", "), fmt::join(built[i].second, ", ")));
    }
    if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>()) {
      throw std::runtime_error(fmt::format("checkpoint file '{}': parameter '{}' holds NaN or infinite values",
                                           file.string(), name));
    }
    ++i;
  };
  for (const auto& p : model->named_parameters()) compare(p.key(), p.value());
  for (const auto& b : model->named_buffers()) compare(b.key(), b.value());
}

// torch::load of an optimizer takes moments of any shape; the first step would then fail naming no file.
void check_optimizer_shapes(Transformer& model, torch::optim::Optimizer& optimizer, const fs::path& file) {
  std::map<const void*, std::string> names;
  for (const auto& p : model->named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
      if (it == optimizer.state().end()) continue;  // no step taken for it yet
      const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get());
      if (adamw == nullptr) continue;
      for (const auto& [what, t] : {std::pair{"exp_avg", adamw->exp_avg()}, {"exp_avg_sq", adamw->exp_avg_sq()}}) {
        if (t.defined() && t.sizes() != p.sizes()) {
          throw std::runtime_error(fmt::format(
              "checkpoint file '{}' does not fit the model: AdamW {} of parameter '{}' is [{}] but the parameter "
              "is [{}] (an optimizer state of another model?)",
              file.string(), what, names[p.unsafeGetTensorImpl()], fmt::join(t.sizes(), ", "),
              fmt::join(p.sizes(), ", ")));
        }
        if (t.defined() && !torch::isfinite(t).all().item<bool>()) {
          throw std::runtime_error(fmt::format("checkpoint file '{}': AdamW {} of parameter '{}' holds NaN or "
                                               "infinite values",
                                               file.string(), what, names[p.unsafeGetTensorImpl()]));
        }
      }
    }
  }
}

// Every file of checkpoint folder `d`, read once and verified: sizes and CRC32s against the manifest, the zip
// entries' own CRC32s inside model.pt and optimizer.pt, and state.json's fields. Throws naming the file and the field.
struct VerifiedFolder {
  fs::path folder;
  TrainState state;
  std::string config_text, model_bytes, optimizer_bytes;
};

VerifiedFolder read_folder(const fs::path& d) {
  VerifiedFolder v;
  v.folder = d;
  const json manifest = read_manifest(d);
  v.state = parse_state(read_verified(d, manifest, "state.json"), d / "state.json", manifest);
  v.config_text = read_verified(d, manifest, "config.yaml");
  v.model_bytes = read_verified(d, manifest, "model.pt");
  verify_zip_entries(v.model_bytes, d / "model.pt");
  v.optimizer_bytes = read_verified(d, manifest, "optimizer.pt");
  verify_zip_entries(v.optimizer_bytes, d / "optimizer.pt");
  v.state.loaded_from = d.string();
  return v;
}

// The newest checkpoint of `dir` that verifies: `dir`, else `dir`.old (the previous one, kept until the next
// save is installed), with one warning per fallback. Throws RunFailure (kFailureCheckpointRefused) when neither does.
VerifiedFolder read_newest_good(const std::string& dir) {
  const fs::path newest = dir, previous = dir + ".old";
  std::error_code ec;
  const bool have_newest = fs::exists(newest / "state.json", ec), have_previous = fs::exists(previous / "state.json", ec);
  if (!have_newest && !have_previous) {
    throw RunFailure(kFailureCheckpointRefused, fmt::format("checkpoint '{}' not found (no state.json in it or in "
                                                            "{})",
                                                            dir, previous.string()));
  }
  std::string refused;
  if (have_newest) {
    try {
      return read_folder(newest);
    } catch (const std::exception& e) {
      refused = error_message(e);
    }
    if (!have_previous) throw RunFailure(kFailureCheckpointRefused, refused);
  }
  VerifiedFolder v;
  try {
    v = read_folder(previous);
  } catch (const std::exception& e) {
    throw RunFailure(kFailureCheckpointRefused,
                     refused.empty() ? error_message(e)
                                     : fmt::format("{}; the previous checkpoint is refused too: {}", refused,
                                                   error_message(e)));
  }
  warn_once(fmt::format("checkpoint '{}' {}; loading the previous checkpoint '{}' (step {}) instead", dir,
                        refused.empty() ? "is missing (a crash between the renames of a save)"
                                        : "is refused (" + refused + ")",
                        previous.string(), v.state.step));
  return v;
}

}  // namespace

std::string checkpoint_folder(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "state.json", ec)) return dir;
  const std::string old = dir + ".old";
  if (fs::exists(fs::path(old) / "state.json", ec)) return old;
  throw std::runtime_error(fmt::format("checkpoint '{}' not found (no state.json in it or in {})", dir, old));
}

void check_resumable(const std::string& dir, const Config& current) {
  Config stored = load_checkpoint_config(dir);
  auto now = current.items();
  auto then = stored.items();
  for (size_t i = 0; i < now.size(); ++i) {
    if (fixes_model_or_data_order(now[i].first) && now[i].second != then[i].second) {
      throw RunFailure(kFailureCheckpointRefused, fmt::format(
          "cannot resume from '{}': config key '{}' is '{}' there but '{}' now (it fixes the model or the data "
          "order); use the checkpoint's value or start a new run_dir",
          dir, now[i].first, then[i].second, now[i].second));
    }
  }
}

void save_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer& optimizer,
                     const TrainState& state, const Config& cfg) {
  // A checkpoint of non-finite weights would replace the last good one with one no resume accepts.
  for (const auto& p : model->named_parameters()) {
    if (!torch::isfinite(p.value()).all().item<bool>()) {
      throw std::runtime_error(fmt::format("not writing checkpoint '{}': parameter '{}' holds NaN or infinite "
                                           "values (the previous checkpoint is kept)",
                                           dir, p.key()));
    }
  }
  const fs::path tmp = dir + ".tmp", old = dir + ".old";
  json files = json::object();
  auto write = [&](const std::string& name, const std::string& bytes) {
    write_file_checked(tmp / name, bytes);
    files[name] = {{"bytes", bytes.size()}, {"crc32", fmt::format("{:08x}", crc32_of(bytes))}};
  };
  // Serialized in memory first: LibTorch's file writer reports a full disk from its destructor, which aborts.
  auto serialized = [](const auto& object) {
    std::ostringstream bytes;
    torch::save(object, bytes);
    return bytes.str();
  };
  try {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    write("model.pt", serialized(model));
    write("optimizer.pt", serialized(optimizer));
    write("state.json", json{{"step", state.step},
                             {"epoch", state.epoch},
                             {"index_in_epoch", state.index_in_epoch},
                             {"tokens_trained", state.tokens_trained},
                             {"samples_trained", state.samples_trained},
                             {"nonfinite_skips", state.nonfinite_skips},
                             {"heldout_bits_per_byte_initial", number_or_null(state.heldout_bits_per_byte_initial)},
                             {"wall_time_s", state.wall_time_s},
                             {"cost_calibration", state.cost_calibration},
                             {"data_fingerprint", state.data_fingerprint}}
                                .dump(1) +
                            "\n");
    write("config.yaml", cfg.to_yaml());
    write_file_checked(tmp / kManifest,
                       json{{"format", kManifestFormat}, {"step", state.step}, {"files", files}}.dump(1) + "\n");
    sync_folder(tmp);
    // `dir` becomes the previous checkpoint, `dir`.old, kept until the next save is installed: a corrupt newest
    // checkpoint then still has a fallback. When `dir` is not complete (a crash between these renames left only
    // `dir`.old), `dir`.old is the only good one and stays.
    std::error_code ec;
    if (fs::exists(fs::path(dir) / kManifest, ec) || fs::exists(fs::path(dir) / "state.json", ec)) {
      fs::remove_all(old);
      fs::rename(dir, old);
    }
    fs::rename(tmp, dir);
    sync_folder(fs::absolute(dir).parent_path());
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);  // frees the space; `dir` or `dir`.old still holds the last complete one
    throw std::runtime_error(fmt::format("writing checkpoint '{}' failed: {}", dir, error_message(e)));
  }
}

Config load_checkpoint_config(const std::string& dir) {
  const VerifiedFolder v = read_newest_good(dir);
  const fs::path path = v.folder / "config.yaml";
  if (v.config_text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw RunFailure(kFailureCheckpointRefused, fmt::format("checkpoint config '{}' is empty", path.string()));
  }
  try {
    return Config::load(path.string(), {});
  } catch (const std::exception& e) {
    throw RunFailure(kFailureCheckpointRefused, fmt::format("checkpoint config '{}' is not a valid dcp config: {}",
                                                            path.string(), error_message(e)));
  }
}

TrainState load_checkpoint(const std::string& dir, Transformer& model, torch::optim::Optimizer* optimizer) {
  const VerifiedFolder v = read_newest_good(dir);
  const fs::path& d = v.folder;
  // torch::load resizes a parameter to the stored tensor's shape, so a checkpoint of another model (an edited
  // config) would load silently; compare the shapes the config built with what was loaded.
  std::vector<std::pair<std::string, std::vector<int64_t>>> built;
  for (const auto& p : model->named_parameters()) built.emplace_back(p.key(), p.value().sizes().vec());
  for (const auto& b : model->named_buffers()) built.emplace_back(b.key(), b.value().sizes().vec());
  auto load = [&](auto& object, const std::string& bytes_of_file, const std::string& name) {
    std::istringstream bytes(bytes_of_file);
    try {
      torch::load(object, bytes);
    } catch (const std::exception& e) {
      throw RunFailure(kFailureCheckpointRefused, fmt::format("loading checkpoint file '{}' failed (is it complete, "
                                                              "and written for this model config?): {}",
                                                              (d / name).string(), error_message(e)));
    }
  };
  try {
    load(model, v.model_bytes, "model.pt");
    check_shapes(model, built, d / "model.pt");
    if (optimizer) {
      load(*optimizer, v.optimizer_bytes, "optimizer.pt");
      check_optimizer_shapes(model, *optimizer, d / "optimizer.pt");
    }
  } catch (const RunFailure&) {
    throw;
  } catch (const std::exception& e) {
    throw RunFailure(kFailureCheckpointRefused, error_message(e));
  }
  return v.state;
}

}  // namespace dcp
