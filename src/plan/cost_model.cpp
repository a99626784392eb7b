#include "dcp/cost_model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>

#include "dcp/precision.h"

namespace dcp {

double ModelShape::params_per_layer() const {
  const double h = static_cast<double>(hidden);
  return 2.0 * h * h + 2.0 * h * kv_dim() + static_cast<double>(mlp_matrices) * h * static_cast<double>(ffn);
}

double ModelShape::params() const {
  return static_cast<double>(layers) * params_per_layer() + static_cast<double>(vocab) * static_cast<double>(hidden);
}

const char* attention_kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kSoftmax: return "softmax";
    case AttentionKind::kSoftmaxReference: return "softmax-reference";
    case AttentionKind::kLinear: return "linear";
  }
  return "unknown";
}

void ModelShape::validate() const {
  const std::pair<const char*, int64_t> fields[] = {{"hidden", hidden}, {"layers", layers},
                                                    {"heads", heads},   {"ffn", ffn},
                                                    {"mlp_matrices", mlp_matrices}, {"vocab", vocab},
                                                    {"bytes_per_element", bytes_per_element}};
  for (const auto& [name, value] : fields) {
    if (value < 1) throw std::invalid_argument(fmt::format("model shape: {} = {} must be positive", name, value));
  }
  if (kv_heads < 0 || (kv_heads > 0 && heads % kv_heads != 0)) {
    throw std::invalid_argument(
        fmt::format("model shape: kv_heads = {} must be 0 (= heads) or divide heads = {}", kv_heads, heads));
  }
  if (attention == AttentionKind::kLinear && (feature_dim < 1 || feature_projections < 0 || chunk_size < 0)) {
    throw std::invalid_argument(fmt::format("model shape: linear attention needs feature_dim >= 1 (got {}), "
                                            "feature_projections >= 0 (got {}) and chunk_size >= 0 (got {})",
                                            feature_dim, feature_projections, chunk_size));
  }
}

DeviceSpec DeviceSpec::named(const std::string& name) {
  if (name == "h200") return DeviceSpec{};
  std::error_code ec;
  const auto status = std::filesystem::status(name, ec);  // stat only: a FIFO is never opened
  if (std::filesystem::is_regular_file(status)) return from_profile(name);
  if (std::filesystem::exists(status)) {
    throw std::invalid_argument(fmt::format("device profile '{}': is {}, not the JSON file `dcp profile` writes", name,
                                            std::filesystem::is_directory(status) ? "a folder"
                                                                                  : "not a regular file (a FIFO, "
                                                                                    "device or socket)"));
  }
  if (name.find('/') != std::string::npos || std::filesystem::path(name).extension() == ".json") {
    throw std::invalid_argument(fmt::format("device profile '{}': no such file", name));
  }
  throw std::invalid_argument(
      fmt::format("unknown device '{}' (known: h200, or the path of a JSON file written by `dcp profile`)", name));
}

namespace {

// An array of per-SP-size fits in the "sequence_parallel" object of a profile (DeviceSpec::from_profile): "fits"
// (the all-to-alls, required when the object is there, with overhead_s_per_byte) or "ring_fits" (optional,
// without it).
std::map<int64_t, CommFit> read_comm_fits(const nlohmann::json& doc, const std::string& path, const char* key,
                                          bool with_overhead) {
  std::map<int64_t, CommFit> fits;
  if (!doc.contains("sequence_parallel")) return fits;
  auto bad = [&](const std::string& field, const std::string& what) {
    return std::invalid_argument(fmt::format("device profile '{}': field '{}' {}", path, field, what));
  };
  const nlohmann::json& sp = doc["sequence_parallel"];
  if (!sp.is_object()) throw bad("sequence_parallel", "must be an object, got " + sp.dump());
  const std::string name = std::string("sequence_parallel.") + key;
  if (!with_overhead && !sp.contains(key)) return fits;  // profiles written before the ring was profiled
  if (!sp.contains(key) || !sp[key].is_array()) {
    throw bad(name, sp.contains(key) ? "must be an array, got " + sp[key].dump()
                                     : "is missing (an array of per-SP-size fits)");
  }
  const nlohmann::json& list = sp[key];
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string at = fmt::format("{}[{}]", name, i);
    const nlohmann::json& f = list[i];
    if (!f.is_object()) throw bad(at, "must be an object, got " + f.dump());
    auto number = [&](const char* key) {
      if (!f.contains(key) || !f[key].is_number()) {
        throw bad(at + "." + key, f.contains(key) ? "must be a number, got " + f[key].dump() : "is missing");
      }
      return f[key].get<double>();
    };
    const double size = number("sp_size");
    if (!f["sp_size"].is_number_integer() || size < 2) {
      throw bad(at + ".sp_size", "must be an integer >= 2, got " + f["sp_size"].dump());
    }
    const auto sp_size = static_cast<int64_t>(size);
    if (fits.count(sp_size)) throw bad(at + ".sp_size", fmt::format("repeats sp_size {}", sp_size));
    CommFit fit;
    fit.latency_s = number("latency_s");
    fit.bytes_per_s = number("bytes_per_s");
    if (with_overhead) fit.overhead_s_per_byte = number("overhead_s_per_byte");
    for (const auto& [key, value] : {std::pair<const char*, double>{"latency_s", fit.latency_s},
                                     {"overhead_s_per_byte", fit.overhead_s_per_byte}}) {
      if (!(value >= 0) || !std::isfinite(value)) {
        throw bad(at + "." + key, fmt::format("must be finite and >= 0, got {}", value));
      }
    }
    if (!(fit.bytes_per_s > 0) || !std::isfinite(fit.bytes_per_s)) {
      throw bad(at + ".bytes_per_s", fmt::format("must be finite and > 0, got {}", fit.bytes_per_s));
    }
    fits[sp_size] = fit;
  }
  return fits;
}

}  // namespace

DeviceSpec DeviceSpec::from_profile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("device profile '{}': cannot open the file", path));
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("device profile '{}': not valid JSON ({})", path, e.what()));
  }
  if (!doc.is_object() || !doc.contains("device") || !doc["device"].is_object()) {
    throw std::invalid_argument(fmt::format("device profile '{}': missing object field 'device'", path));
  }
  const nlohmann::json& d = doc["device"];
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!d.contains(key)) {
      throw std::invalid_argument(fmt::format("device profile '{}': missing field 'device.{}'", path, key));
    }
    const nlohmann::json& v = d[key];
    if (!v.is_number()) {
      throw std::invalid_argument(fmt::format("device profile '{}': field 'device.{}' must be a number, got {}", path,
                                              key, v.dump()));
    }
    return v;
  };
  DeviceSpec spec;
  if (!d.contains("name") || !d["name"].is_string()) {
    throw std::invalid_argument(fmt::format("device profile '{}': missing string field 'device.name'", path));
  }
  spec.name = d["name"].get<std::string>();
  spec.memory_bytes = field("memory_bytes").get<double>();
  spec.peak_flops = field("peak_flops").get<double>();
  spec.mfu = field("mfu").get<double>();
  spec.attention_mfu = field("attention_mfu").get<double>();
  spec.intra_node_bw = field("intra_node_bw").get<double>();
  spec.inter_node_bw = field("inter_node_bw").get<double>();
  const nlohmann::json& gpus = field("gpus_per_node");
  if (!gpus.is_number_integer()) {
    throw std::invalid_argument(
        fmt::format("device profile '{}': field 'device.gpus_per_node' must be an integer, got {}", path, gpus.dump()));
  }
  spec.gpus_per_node = gpus.get<int64_t>();
  spec.collective_latency_s = field("collective_latency_s").get<double>();
  spec.micro_batch_overhead_s = field("micro_batch_overhead_s").get<double>();
  if (d.contains("ring_block_efficiency")) spec.ring_block_efficiency = field("ring_block_efficiency").get<double>();
  if (d.contains("round_switch_s")) spec.round_switch_s = field("round_switch_s").get<double>();
  spec.all_to_all = read_comm_fits(doc, path, "fits", true);
  spec.ring = read_comm_fits(doc, path, "ring_fits", false);
  try {
    spec.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("device profile '{}': {}", path, e.what()));
  }
  return spec;
}

void DeviceSpec::validate() const {
  auto check = [&](const std::string& field, double value, double lo, double hi, bool lo_open = false) {
    if (!(lo_open ? value > lo : value >= lo) || !(value <= hi)) {
      throw std::invalid_argument(fmt::format("device '{}': {} = {} is outside {}{}, {}]", name, field, value,
                                              lo_open ? "(" : "[", lo, hi));
    }
  };
  check("memory_bytes", memory_bytes, 0, 1e18, true);
  check("mfu", mfu, 0, 10, true);
  // A profile's attention_mfu is attention's measured rate over the linear layers' (profiler.cpp), which exceeds
  // 10 on tiny models whose matmuls run far below peak (11.9 measured for d_model 32 with one head): the
  // product check below is the physical bound.
  check("attention_mfu", attention_mfu, 0, 1e6);
  check("peak_flops x mfu", peak_flops * mfu, 1e3, 1e21);
  if (attention_mfu > 0) check("peak_flops x attention_mfu", peak_flops * attention_mfu, 1e3, 1e21);
  check("intra_node_bw", intra_node_bw, 1e3, 1e15);
  check("inter_node_bw", inter_node_bw, 1e3, 1e15);
  check("gpus_per_node", static_cast<double>(gpus_per_node), 1, 1e6);
  check("collective_latency_s", collective_latency_s, 0, 3600);
  check("micro_batch_overhead_s", micro_batch_overhead_s, 0, 3600);
  check("ring_block_efficiency", ring_block_efficiency, 0, 1, true);
  check("round_switch_s", round_switch_s, 0, 3600);
  for (const auto& [fits, what] : {std::pair<const std::map<int64_t, CommFit>*, const char*>{&all_to_all, "all_to_all"},
                                    {&ring, "ring"}}) {
    for (const auto& [sp, fit] : *fits) {
      const std::string f = fmt::format("{}[sp {}].", what, sp);
      check(f + "sp_size", static_cast<double>(sp), 2, 1e9);
      check(f + "latency_s", fit.latency_s, 0, 3600);
      check(f + "bytes_per_s", fit.bytes_per_s, 1e3, 1e15);
      check(f + "overhead_s_per_byte", fit.overhead_s_per_byte, 0, 1);
    }
  }
}

CostModel::CostModel(ModelShape shape, DeviceSpec device) : shape_(shape), device_(std::move(device)) {
  shape_.validate();
  device_.validate();
}

void CostModel::check(int64_t sp_size, int64_t recompute_layers) const {
  if (sp_size < 1) throw std::invalid_argument(fmt::format("cost model: sp_size {} must be positive", sp_size));
  if (recompute_layers < 0 || recompute_layers > shape_.layers) {
    throw std::invalid_argument(
        fmt::format("cost model: recompute_layers {} outside [0, {}]", recompute_layers, shape_.layers));
  }
}

double CostModel::all_to_all_bandwidth(int64_t sp_size) const {
  const auto fit = device_.all_to_all.find(sp_size);
  if (fit != device_.all_to_all.end()) return fit->second.bytes_per_s;
  return sp_size <= device_.gpus_per_node ? device_.intra_node_bw : device_.inter_node_bw;
}

double CostModel::all_to_all_latency(int64_t sp_size) const {
  const auto fit = device_.all_to_all.find(sp_size);
  return fit != device_.all_to_all.end() ? fit->second.latency_s : device_.collective_latency_s;
}

int64_t CostModel::all_to_all_calls(int64_t sp_size, int64_t recompute_layers) const {
  check(sp_size, recompute_layers);
  return sp_size > 1 ? 4 * shape_.layers + 2 * recompute_layers : 0;
}

double CostModel::all_to_all_bytes(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const {
  check(sp_size, recompute_layers);
  return all_to_all_bytes(tokens, SpLayout{sp_size, sp_size}, recompute_layers);
}

double CostModel::all_to_all_bytes(int64_t tokens, const SpLayout& layout, int64_t recompute_layers) const {
  if (layout.ulysses_size == 1) return 0.0;
  // Per local token (class comment): h + 2 d_kv (q, k, v) and h (output) elements per layer forward and
  // backward, per recomputed layer once more.
  const double L = static_cast<double>(shape_.layers), r = static_cast<double>(recompute_layers);
  return (2.0 * L + r) * 2.0 * (static_cast<double>(shape_.hidden) + shape_.kv_dim()) * static_cast<double>(tokens) /
         static_cast<double>(layout.sp_size) * static_cast<double>(shape_.bytes_per_element);
}

bool CostModel::supports(const SpLayout& layout) const {
  if (layout.ulysses_size > 1 && !layout_fits_heads(layout, shape_.kv_head_count())) return false;
  return layout.ring_size() == 1 || shape_.attention != AttentionKind::kLinear;
}

void CostModel::check(const SpLayout& layout, int64_t recompute_layers) const {
  check(layout.sp_size, recompute_layers);
  if (layout.ulysses_size < 1 || layout.sp_size % layout.ulysses_size != 0) {
    throw std::invalid_argument(fmt::format("cost model: ulysses_size {} must divide sp_size {}",
                                            layout.ulysses_size, layout.sp_size));
  }
  if (!supports(layout)) {
    throw std::invalid_argument(fmt::format(
        "cost model: a group of sp_size {} with ulysses_size {} does not run on {} KV heads with {} attention "
        "(the Ulysses part must divide the KV heads; a ring needs softmax attention)",
        layout.sp_size, layout.ulysses_size, shape_.kv_head_count(), attention_kind_name(shape_.attention)));
  }
}

double CostModel::ring_bandwidth(int64_t sp_size) const {
  const auto fit = device_.ring.find(sp_size);
  if (fit != device_.ring.end()) return fit->second.bytes_per_s;
  return sp_size <= device_.gpus_per_node ? device_.intra_node_bw : device_.inter_node_bw;
}

double CostModel::ring_latency(int64_t sp_size) const {
  const auto fit = device_.ring.find(sp_size);
  return fit != device_.ring.end() ? fit->second.latency_s : device_.collective_latency_s;
}

double CostModel::ring_block_bytes(int64_t tokens, const SpLayout& layout) const {
  if (layout.ring_size() == 1) return 0.0;
  return 2.0 * static_cast<double>(tokens) / static_cast<double>(layout.sp_size) * shape_.kv_dim() *
         static_cast<double>(shape_.bytes_per_element);
}

int64_t CostModel::ring_steps(const SpLayout& layout, int64_t recompute_layers) const {
  const int64_t R = layout.ring_size();
  if (R == 1) return 0;
  // Forward (and a recomputed layer's): R - 1 K, V hops; backward: R - 1 K, V + dK, dV hops, one dK, dV home.
  return (shape_.layers + recompute_layers) * (R - 1) + shape_.layers * R;
}

namespace {

// Forward FLOPs of one layer's attention operator on a sample of s tokens, all heads (CostModel class comment).
double attention_forward_flops(const ModelShape& m, double s) {
  if (m.attention == AttentionKind::kSoftmax) return 2.0 * static_cast<double>(m.hidden) * s * s;
  // The reference multiplies the whole square and masks afterwards.
  if (m.attention == AttentionKind::kSoftmaxReference) return 4.0 * static_cast<double>(m.hidden) * s * s;
  const double H = static_cast<double>(m.heads), D = m.head_dim(), Dv = D + 1.0;
  const double F = static_cast<double>(m.feature_dim), P = static_cast<double>(m.feature_projections);
  const double features = 4.0 * P * D * s;
  if (m.chunk_size == 0) return H * (2.0 * s * s * (F + Dv) + features);
  const double C = static_cast<double>(m.chunk_size);
  return H * (s * (2.0 * C * (F + Dv) + 4.0 * F * Dv) + features);
}

// FLOPs of one sample of s tokens with r of the L layers recomputed (CostModel class comment): backward is twice
// the forward, a recomputed layer repeats its forward.
FlopCount sample_flops(const ModelShape& m, int64_t length, int64_t recompute_layers) {
  const double s = static_cast<double>(length), h = static_cast<double>(m.hidden);
  const double L = static_cast<double>(m.layers), r = static_cast<double>(recompute_layers);
  const double pl = m.params_per_layer();
  return {L * 6.0 * pl * s + r * 2.0 * pl * s + 6.0 * h * static_cast<double>(m.vocab) * s,
          (3.0 * L + r) * attention_forward_flops(m, s)};
}

}  // namespace

FlopCount CostModel::flops(const std::vector<int64_t>& lengths, int64_t recompute_layers) const {
  if (lengths.empty()) throw std::invalid_argument("cost model: a micro-batch needs at least one sample");
  check(1, recompute_layers);
  FlopCount total;
  for (int64_t len : lengths) {
    if (len < 1) throw std::invalid_argument(fmt::format("cost model: length {} must be positive", len));
    const FlopCount f = sample_flops(shape_, len, recompute_layers);
    total.linear += f.linear;
    total.attention += f.attention;
  }
  return total;
}

double CostModel::ring_exposed_seconds(int64_t length, const SpLayout& layout, int64_t recompute_layers) const {
  check(layout, recompute_layers);
  if (length < 1) throw std::invalid_argument(fmt::format("cost model: length {} must be positive", length));
  return ring_exposed(length, layout, recompute_layers);
}

double CostModel::ring_exposed(int64_t length, const SpLayout& layout, int64_t recompute_layers) const {
  if (layout.ring_size() == 1) return 0.0;
  return ring_exposed(length, layout, recompute_layers, attention_forward_flops(shape_, static_cast<double>(length)),
                      layout_terms(layout));
}

CostModel::LayoutTerms CostModel::layout_terms(const SpLayout& layout) const {
  LayoutTerms terms;
  const int64_t R = layout.ring_size();
  terms.attention_rate = device_.effective_attention_mfu() * (R > 1 ? device_.ring_block_efficiency : 1.0);
  terms.sp_peak = static_cast<double>(layout.sp_size) * device_.peak_flops;
  // The all-to-alls run inside subgroups of u ranks (all of the group for Ulysses).
  const int64_t u = layout.ulysses_size;
  const auto fit = device_.all_to_all.find(u);
  const double overhead = fit != device_.all_to_all.end() ? fit->second.overhead_s_per_byte : 0.0;
  const double leaving = static_cast<double>(u - 1) / static_cast<double>(u);
  terms.a2a_per_byte = leaving / all_to_all_bandwidth(u) + overhead;
  if (R > 1) {
    terms.ring_rate = static_cast<double>(layout.sp_size * R) * device_.peak_flops * device_.effective_attention_mfu() *
                      device_.ring_block_efficiency;
    terms.ring_bandwidth = ring_bandwidth(layout.sp_size);
  }
  return terms;
}

double CostModel::ring_exposed(int64_t length, const SpLayout& layout, int64_t recompute_layers,
                               double attention_forward, const LayoutTerms& terms) const {
  const int64_t R = layout.ring_size();
  if (R == 1) return 0.0;
  // Per layer forward (class comment): a step's block attention t_c against its block's transfer t_x.
  const double t_c = attention_forward / terms.ring_rate;
  const double t_x = ring_block_bytes(length, layout) / terms.ring_bandwidth;
  const double L = static_cast<double>(shape_.layers), r = static_cast<double>(recompute_layers);
  return (3.0 * L + r) * static_cast<double>(R - 1) * std::max(0.0, t_x - t_c) + L * t_x;
}

double CostModel::work(int64_t length, const SpLayout& layout, int64_t recompute_layers) const {
  if (length < 1) throw std::invalid_argument(fmt::format("cost model: length {} must be positive", length));
  return work(length, layout, recompute_layers, sample_flops(shape_, length, recompute_layers),
              attention_forward_flops(shape_, static_cast<double>(length)), layout_terms(layout));
}

double CostModel::work(int64_t length, const SpLayout& layout, int64_t recompute_layers, const FlopCount& f,
                       double attention_forward, const LayoutTerms& terms) const {
  const double compute = (f.linear / device_.mfu + f.attention / terms.attention_rate) / terms.sp_peak;
  const double comm = all_to_all_bytes(length, layout, recompute_layers) * terms.a2a_per_byte;
  return compute + comm + ring_exposed(length, layout, recompute_layers, attention_forward, terms);
}

double CostModel::fixed(const SpLayout& layout, int64_t recompute_layers) const {
  return device_.micro_batch_overhead_s +
         static_cast<double>(all_to_all_calls(layout.ulysses_size, recompute_layers)) *
             all_to_all_latency(layout.ulysses_size) +
         static_cast<double>(ring_steps(layout, recompute_layers)) * ring_latency(layout.sp_size);
}

double CostModel::work_seconds(int64_t length, const SpLayout& layout, int64_t recompute_layers) const {
  check(layout, recompute_layers);
  return work(length, layout, recompute_layers);
}

void CostModel::work_seconds(const std::vector<int64_t>& lengths, const std::vector<SpLayout>& layouts,
                             const int64_t* recompute_layers, double* out) const {
  const size_t n = lengths.size(), K = layouts.size();
  for (int64_t len : lengths) {
    if (len < 1) throw std::invalid_argument(fmt::format("cost model: length {} must be positive", len));
  }
  // work() written out over the table, sample by sample: every factor that does not change along a sample's row
  // is computed once for the row (its FLOPs, their quotient by the MFU, per recompute count) or once for a run of
  // layouts of one SP size (the all-to-all and ring-block bytes), and each value is the same expression as in
  // work(), all_to_all_bytes(), ring_block_bytes() and ring_exposed(), operation by operation, so the same bits
  // (test_ring_cost: WorkSecondsTableMatchesSingleCalls).
  std::vector<LayoutTerms> terms(K);
  for (size_t k = 0; k < K; ++k) terms[k] = layout_terms(layouts[k]);
  std::vector<int64_t> checked(K, -1);  // the recompute count last checked at each layout
  const double L = static_cast<double>(shape_.layers), kv_dim = shape_.kv_dim();
  const double width = static_cast<double>(shape_.hidden) + kv_dim;  // all_to_all_bytes' (hidden + d_kv)
  const double element = static_cast<double>(shape_.bytes_per_element);
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = lengths[i];
    const double tokens = static_cast<double>(len);
    const double attention = attention_forward_flops(shape_, tokens);
    int64_t flops_r = -1;  // the recompute count of the FLOPs below
    double linear_per_mfu = 0, attention_flops = 0;
    int64_t bytes_r = -1, bytes_sp = -1, block_sp = -1;  // the (r, sp) of the all-to-all bytes, the sp of the block
    double a2a_bytes = 0, block_bytes = 0;
    for (size_t k = 0; k < K; ++k) {
      const int64_t r = recompute_layers[i * K + k];
      if (r < 0) continue;
      const SpLayout& layout = layouts[k];
      if (checked[k] != r) check(layout, r), checked[k] = r;
      const LayoutTerms& t = terms[k];
      const double rd = static_cast<double>(r);
      if (r != flops_r) {
        const FlopCount f = sample_flops(shape_, len, r);
        linear_per_mfu = f.linear / device_.mfu, attention_flops = f.attention, flops_r = r;
      }
      const double compute = (linear_per_mfu + attention_flops / t.attention_rate) / t.sp_peak;
      double bytes = 0.0;  // all_to_all_bytes
      if (layout.ulysses_size != 1) {
        if (r != bytes_r || layout.sp_size != bytes_sp) {
          a2a_bytes = (2.0 * L + rd) * 2.0 * width * tokens / static_cast<double>(layout.sp_size) * element;
          bytes_r = r, bytes_sp = layout.sp_size;
        }
        bytes = a2a_bytes;
      }
      const double comm = bytes * t.a2a_per_byte;
      double ring = 0.0;  // ring_exposed
      const int64_t R = layout.ring_size();
      if (R != 1) {
        if (layout.sp_size != block_sp) {  // ring_block_bytes
          block_bytes = 2.0 * tokens / static_cast<double>(layout.sp_size) * kv_dim * element;
          block_sp = layout.sp_size;
        }
        const double t_c = attention / t.ring_rate;
        const double t_x = block_bytes / t.ring_bandwidth;
        ring = (3.0 * L + rd) * static_cast<double>(R - 1) * std::max(0.0, t_x - t_c) + L * t_x;
      }
      out[i * K + k] = compute + comm + ring;
    }
  }
}

double CostModel::fixed_seconds(const SpLayout& layout, int64_t recompute_layers) const {
  check(layout, recompute_layers);
  return fixed(layout, recompute_layers);
}

double CostModel::seconds(const std::vector<int64_t>& lengths, const SpLayout& layout,
                          int64_t recompute_layers) const {
  if (lengths.empty()) throw std::invalid_argument("cost model: a micro-batch needs at least one sample");
  check(layout, recompute_layers);
  double t = fixed(layout, recompute_layers);
  for (int64_t len : lengths) t += work(len, layout, recompute_layers);
  return t;
}

// The Ulysses overloads, SpLayout{sp, sp}: they check sp and r only, not the heads (profiles and callers that
// predate the layouts price Ulysses groups of any size).
double CostModel::work_seconds(int64_t length, int64_t sp_size, int64_t recompute_layers) const {
  check(sp_size, recompute_layers);
  return work(length, SpLayout{sp_size, sp_size}, recompute_layers);
}

double CostModel::fixed_seconds(int64_t sp_size, int64_t recompute_layers) const {
  check(sp_size, recompute_layers);
  return fixed(SpLayout{sp_size, sp_size}, recompute_layers);
}

double CostModel::seconds(const std::vector<int64_t>& lengths, int64_t sp_size, int64_t recompute_layers) const {
  if (lengths.empty()) throw std::invalid_argument("cost model: a micro-batch needs at least one sample");
  check(sp_size, recompute_layers);
  const SpLayout layout{sp_size, sp_size};
  double t = fixed(layout, recompute_layers);
  for (int64_t len : lengths) t += work(len, layout, recompute_layers);
  return t;
}

double CostModel::round_seconds(int64_t rounds) const {
  if (rounds < 1) throw std::invalid_argument(fmt::format("cost model: a step has {} rounds (at least 1)", rounds));
  return static_cast<double>(rounds - 1) * device_.round_switch_s;
}

double CostModel::step_seconds(int64_t world_size) const {
  if (world_size <= 1) return 0.0;
  const double w = static_cast<double>(world_size);
  const double bytes = 2.0 * (w - 1.0) / w * shape_.params() * static_cast<double>(shape_.bytes_per_element);
  const double bw = world_size <= device_.gpus_per_node ? device_.intra_node_bw : device_.inter_node_bw;
  return bytes / bw + 2.0 * device_.collective_latency_s;
}

namespace {

// The analytic coefficients (MemoryModel class comment), bytes.
MemoryCoefficients analytic_coefficients(const ModelShape& m, double workspace_bytes) {
  const double h = static_cast<double>(m.hidden), b = static_cast<double>(m.bytes_per_element);
  double full = (10.0 * h + 6.0 * static_cast<double>(m.ffn)) * b / 2.0;
  double square = 0;
  if (m.attention == AttentionKind::kLinear) {
    constexpr double kFp32 = 4.0;  // the operator's features, states and scores, whatever the activations' dtype
    const double H = static_cast<double>(m.heads), Dv = m.head_dim() + 1.0;
    const double F = static_cast<double>(m.feature_dim), P = static_cast<double>(m.feature_projections);
    const double C = static_cast<double>(m.chunk_size);
    const double chunked = m.chunk_size > 0 ? C + F * Dv / C : 0.0;  // scores and carried states per token
    full += kFp32 * H * (2.0 * F + Dv + chunked + 2.0 * P);
    if (m.chunk_size == 0) square = kFp32 * H;  // the quadratic form's [H, s, s] scores
  } else if (m.attention == AttentionKind::kSoftmaxReference) {
    // Kept for backward per layer: the fp32 scores, their masked copy and the probabilities, [H, s, s] each.
    square = 3.0 * 4.0 * static_cast<double>(m.heads);
  }
  MemoryCoefficients c;
  c.base_bytes = 16.0 * m.params() + workspace_bytes;
  c.token_layer_bytes = full;
  c.token_recompute_bytes = h * b;
  c.token_bytes = full + static_cast<double>(m.vocab) * (b + 4.0);
  c.square_layer_bytes = square;
  c.square_bytes = square;
  return c;
}

void check_budget(double budget_bytes) {
  if (!(budget_bytes > 0) || !std::isfinite(budget_bytes)) {
    throw std::invalid_argument(
        fmt::format("memory model: budget_bytes {} must be positive and finite", budget_bytes));
  }
}

}  // namespace

MemoryModel::MemoryModel(ModelShape shape, DeviceSpec device, double memory_fraction, double workspace_bytes)
    : shape_(shape) {
  shape_.validate();
  if (!(memory_fraction > 0 && memory_fraction <= 1) || !(device.memory_bytes > 0) || !(workspace_bytes >= 0)) {
    throw std::invalid_argument(fmt::format("memory model: memory_fraction {} must be in (0, 1], memory_bytes {} "
                                            "positive and workspace_bytes {} non-negative",
                                            memory_fraction, device.memory_bytes, workspace_bytes));
  }
  c_ = analytic_coefficients(shape_, workspace_bytes);
  budget_ = memory_fraction * device.memory_bytes;
}

MemoryModel MemoryModel::analytic(ModelShape shape, double budget_bytes, double workspace_bytes) {
  shape.validate();
  if (!(workspace_bytes >= 0)) {
    throw std::invalid_argument(fmt::format("memory model: workspace_bytes {} must be non-negative", workspace_bytes));
  }
  return MemoryModel(shape, analytic_coefficients(shape, workspace_bytes), budget_bytes);
}

MemoryModel::MemoryModel(ModelShape shape, MemoryCoefficients coefficients, double budget_bytes,
                         int64_t longest_sample_tokens)
    : shape_(shape), c_(coefficients), budget_(budget_bytes), longest_(longest_sample_tokens) {
  shape_.validate();
  check_budget(budget_bytes);
  const std::pair<const char*, double> fields[] = {{"base_bytes", c_.base_bytes},
                                                   {"token_layer_bytes", c_.token_layer_bytes},
                                                   {"token_recompute_bytes", c_.token_recompute_bytes},
                                                   {"token_bytes", c_.token_bytes},
                                                   {"square_layer_bytes", c_.square_layer_bytes},
                                                   {"square_bytes", c_.square_bytes},
                                                   {"sp_token_bytes", c_.sp_token_bytes}};
  for (const auto& [name, value] : fields) {
    if (!(value >= 0) || !std::isfinite(value)) {
      throw std::invalid_argument(fmt::format("memory model: {} = {} must be non-negative and finite", name, value));
    }
  }
  if (longest_sample_tokens < 0) {
    throw std::invalid_argument(
        fmt::format("memory model: longest_sample_tokens {} must be >= 0 (0 = no bound)", longest_sample_tokens));
  }
}

MemoryModel MemoryModel::from_profile(const std::string& path, double budget_bytes, int64_t longest_sample_tokens) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("memory profile '{}': cannot open the file", path));
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("memory profile '{}': not valid JSON ({})", path, e.what()));
  }
  auto object = [&](const char* key) -> const nlohmann::json& {
    if (!doc.is_object() || !doc.contains(key) || !doc[key].is_object()) {
      throw std::invalid_argument(fmt::format("memory profile '{}': missing object field '{}'{}", path, key,
                                              std::string(key) == "memory"
                                                  ? " (written before `dcp profile` fitted memory: rerun it)"
                                                  : ""));
    }
    return doc[key];
  };
  auto number = [&](const char* section, const char* key) {
    const nlohmann::json& o = object(section);
    if (!o.contains(key) || !o[key].is_number()) {
      throw std::invalid_argument(fmt::format("memory profile '{}': field '{}.{}' must be a number{}", path, section,
                                              key, o.contains(key) ? ", got " + o[key].dump() : " (missing)"));
    }
    return o[key].get<double>();
  };
  auto integer = [&](const char* key) {
    const double v = number("model", key);
    if (v != std::floor(v)) {
      throw std::invalid_argument(fmt::format("memory profile '{}': field 'model.{}' must be an integer, got {}",
                                              path, key, v));
    }
    return static_cast<int64_t>(v);
  };
  ModelShape shape;
  const nlohmann::json& model = object("model");
  if (model.contains("attention")) {  // absent: written before the kind was recorded, a softmax model
    const nlohmann::json& kind = model["attention"];
    if (kind == "linear") {
      shape.attention = AttentionKind::kLinear;
      shape.feature_dim = integer("feature_dim");
      shape.feature_projections = integer("feature_projections");
      shape.chunk_size = integer("chunk_size");
    } else if (kind == "softmax-reference") {
      shape.attention = AttentionKind::kSoftmaxReference;
    } else if (kind != "softmax") {
      throw std::invalid_argument(
          fmt::format("memory profile '{}': field 'model.attention' must be \"softmax\", \"softmax-reference\" or "
                      "\"linear\", got {}",
                      path, kind.dump()));
    }
  }
  shape.hidden = integer("hidden");
  shape.layers = integer("layers");
  shape.heads = integer("heads");
  shape.ffn = integer("ffn");
  shape.mlp_matrices = integer("mlp_matrices");
  shape.vocab = integer("vocab");
  shape.bytes_per_element = integer("bytes_per_element");
  // Absent: written before the precision was recorded, when profiles measured fp32 (bytes_per_element 4).
  if (model.contains("precision") && model["precision"] != precision_of_bytes(shape.bytes_per_element)) {
    throw std::invalid_argument(fmt::format(
        "memory profile '{}': field 'model.precision' is {} but bytes_per_element {} is {}", path,
        model["precision"].dump(), shape.bytes_per_element, precision_of_bytes(shape.bytes_per_element)));
  }
  MemoryCoefficients c;
  c.base_bytes = number("memory", "base_bytes");
  c.token_layer_bytes = number("memory", "token_layer_bytes");
  c.token_recompute_bytes = number("memory", "token_recompute_bytes");
  c.token_bytes = number("memory", "token_bytes");
  c.square_layer_bytes = number("memory", "square_layer_bytes");
  c.square_bytes = number("memory", "square_bytes");
  // Assumed, not measured (MemoryCoefficients): profiles written before the field existed get the same 6 h b.
  c.sp_token_bytes = object("memory").contains("sp_token_bytes")
                         ? number("memory", "sp_token_bytes")
                         : 6.0 * static_cast<double>(shape.hidden * shape.bytes_per_element);
  MemoryModel m(shape, c, budget_bytes, longest_sample_tokens);
  m.source_ = "profile";
  return m;
}

void MemoryModel::check(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const {
  if (tokens < 1 || sp_size < 1 || recompute_layers < 0 || recompute_layers > shape_.layers) {
    throw std::invalid_argument(fmt::format("memory model: tokens {} and sp_size {} must be positive and "
                                            "recompute_layers {} within [0, {}]",
                                            tokens, sp_size, recompute_layers, shape_.layers));
  }
}

double MemoryModel::bytes_of(double local_tokens, double local_squares, int64_t sp_size,
                             int64_t recompute_layers) const {
  const double L = static_cast<double>(shape_.layers), r = static_cast<double>(recompute_layers);
  const double sp_bytes = sp_size > 1 ? c_.sp_token_bytes : 0.0;
  return c_.base_bytes +
         local_tokens * (c_.token_layer_bytes * (L - r) + c_.token_recompute_bytes * r + c_.token_bytes + sp_bytes) +
         local_squares * (c_.square_layer_bytes * (L - r) + c_.square_bytes);
}

double MemoryModel::bytes(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const {
  check(tokens, sp_size, recompute_layers);
  const double t = static_cast<double>(tokens), sp = static_cast<double>(sp_size);
  const double longest = longest_ > 0 ? std::min(t, static_cast<double>(longest_)) : t;
  return bytes_of(t / sp, t * longest / sp, sp_size, recompute_layers);
}

double MemoryModel::bytes(const std::vector<int64_t>& lengths, int64_t sp_size, int64_t recompute_layers) const {
  if (lengths.empty()) throw std::invalid_argument("memory model: a micro-batch needs at least one sample");
  double t = 0, squares = 0;
  for (int64_t len : lengths) {
    if (len < 1) throw std::invalid_argument(fmt::format("memory model: length {} must be positive", len));
    t += static_cast<double>(len);
    squares += static_cast<double>(len) * static_cast<double>(len);
  }
  check(1, sp_size, recompute_layers);
  const double sp = static_cast<double>(sp_size);
  return bytes_of(t / sp, squares / sp, sp_size, recompute_layers);
}

std::optional<int64_t> MemoryModel::min_recompute_layers(int64_t tokens, int64_t sp_size) const {
  const int64_t L = shape_.layers;
  if (bytes(tokens, sp_size, L) > budget_) return std::nullopt;
  const double at0 = bytes(tokens, sp_size, 0);
  if (at0 <= budget_) return int64_t{0};
  // Bytes are linear in r, and bytes(L) <= budget < bytes(0), so each recomputed layer saves a positive amount.
  const double saved_per_layer = at0 - bytes(tokens, sp_size, 1);
  int64_t r = std::min<int64_t>(L, static_cast<int64_t>(std::ceil((at0 - budget_) / saved_per_layer)));
  // Guard the rounding of the closed form against the exact test.
  while (r > 0 && bytes(tokens, sp_size, r - 1) <= budget_) --r;
  while (r < L && bytes(tokens, sp_size, r) > budget_) ++r;
  return r;
}

int64_t MemoryModel::max_tokens(int64_t sp_size, int64_t recompute_layers) const {
  // The answer is capped at kMax (1.1e15 tokens, more than any step holds): a huge budget (memory.budget_bytes
  // 1e25) must neither overflow int64 in the closed form nor count up to its true capacity.
  constexpr int64_t kMax = int64_t{1} << 50;
  // bytes() grows with tokens (linearly, or quadratically up to the longest sample): bisect on it.
  if (bytes(1, sp_size, recompute_layers) > budget_) return 0;
  if (c_.square_layer_bytes == 0 && c_.square_bytes == 0) {
    // Linear in tokens (the analytic model): closed form, guarded against rounding. Planners call this often.
    const double base = bytes(1, sp_size, recompute_layers);
    const double per_token = bytes(2, sp_size, recompute_layers) - base;
    if (!(per_token > 0)) return kMax;
    const double closed = std::floor((budget_ - base) / per_token) + 1;  // in double: no overflow
    if (closed >= static_cast<double>(kMax)) return kMax;
    auto n = static_cast<int64_t>(closed);
    while (n > 1 && bytes(n, sp_size, recompute_layers) > budget_) --n;
    while (n < kMax && bytes(n + 1, sp_size, recompute_layers) <= budget_) ++n;
    return n;
  }
  int64_t lo = 1, hi = 2;
  while (hi < kMax && bytes(hi, sp_size, recompute_layers) <= budget_) {
    lo = hi;
    hi *= 2;
  }
  if (hi >= kMax) return lo;
  while (hi - lo > 1) {  // bytes(lo) <= budget < bytes(hi)
    const int64_t mid = lo + (hi - lo) / 2;
    (bytes(mid, sp_size, recompute_layers) <= budget_ ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace dcp
