#include "dcp/planning.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

#include "dcp/precision.h"

namespace dcp {

namespace {

std::string describe(const ModelShape& s) {
  const std::string attention =
      s.attention == AttentionKind::kLinear
          ? fmt::format("linear attention (feature_dim {}, feature_projections {}, chunk_size {})", s.feature_dim,
                        s.feature_projections, s.chunk_size)
          : std::string(s.attention == AttentionKind::kSoftmaxReference ? "softmax attention (reference: [L, L] scores)"
                                                                         : "softmax attention");
  return fmt::format("hidden {}, layers {}, heads {}, ffn {}, mlp_matrices {}, vocab {}, bytes_per_element {}, {}",
                     s.hidden, s.layers, s.heads, s.ffn, s.mlp_matrices, s.vocab, s.bytes_per_element, attention);
}

}  // namespace

double memory_budget_bytes(const MemoryConfig& memory, const DeviceSpec& device) {
  return memory.budget_bytes > 0 ? memory.budget_bytes : memory.fraction * device.memory_bytes;
}

MemoryModel memory_model_for(const std::string& cost_model, const ModelShape& shape, const DeviceSpec& device,
                             const MemoryConfig& memory, int64_t longest_sample_tokens) {
  const double budget = memory_budget_bytes(memory, device) * (1.0 - memory.margin);
  if (cost_model == "h200") return MemoryModel::analytic(shape, budget);
  MemoryModel fitted = MemoryModel::from_profile(cost_model, budget, longest_sample_tokens);
  const int64_t measured_bytes = fitted.shape().bytes_per_element;
  if (measured_bytes != shape.bytes_per_element) {
    throw std::invalid_argument(fmt::format(
        "profile '{}' was measured in precision {}, but this run computes in {}: its time and memory fits do not "
        "carry over; rerun `dcp profile` with --train.precision={} (or train with --train.precision={})",
        cost_model, precision_of_bytes(measured_bytes), precision_of_bytes(shape.bytes_per_element),
        precision_of_bytes(shape.bytes_per_element), precision_of_bytes(measured_bytes)));
  }
  if (describe(fitted.shape()) != describe(shape)) {
    throw std::invalid_argument(fmt::format(
        "memory profile '{}' was measured for the model ({}); this model is ({}): its memory fit (and, for "
        "another attention kind, its attention rate) does not carry over, rerun `dcp profile` with this model's "
        "config",
        cost_model, describe(fitted.shape()), describe(shape)));
  }
  return fitted;
}

ModelShape model_shape_of(const Config& cfg, int64_t bytes_per_element) {
  ModelShape s;
  s.hidden = cfg.model.d_model;
  s.layers = cfg.model.n_layers;
  s.heads = cfg.model.n_heads;
  s.kv_heads = cfg.model.kv_heads() != cfg.model.n_heads ? cfg.model.kv_heads() : 0;  // 0 = heads, as before
  s.ffn = cfg.model.d_ff;
  s.mlp_matrices = 3;
  s.vocab = kVocabSize;
  s.bytes_per_element = bytes_per_element;
  return with_attention(s, cfg.attention);
}

ModelShape with_attention(ModelShape shape, const AttentionConfig& a) {
  auto unknown = [](const char* key, const std::string& value) {
    return std::invalid_argument(fmt::format("cost model: unknown {} '{}'", key, value));
  };
  if (a.backend == "softmax") {
    if (a.impl != "tiled" && a.impl != "reference") throw unknown("attention.impl", a.impl);
    shape.attention = a.impl == "reference" ? AttentionKind::kSoftmaxReference : AttentionKind::kSoftmax;
    shape.feature_dim = shape.feature_projections = shape.chunk_size = 0;
    return shape;
  }
  if (a.backend != "flexformer") throw unknown("attention.backend", a.backend);
  shape.attention = AttentionKind::kLinear;
  const int64_t m = a.num_features;
  if (a.feature_map == "stationary" || a.feature_map == "fixed") {
    shape.feature_dim = 2 * m, shape.feature_projections = m;
  } else if (a.feature_map == "nonstationary") {
    shape.feature_dim = 2 * m, shape.feature_projections = 2 * m;
  } else if (a.feature_map == "elu") {
    shape.feature_dim = shape.hidden / shape.heads, shape.feature_projections = 0;
  } else {
    throw unknown("attention.feature_map", a.feature_map);
  }
  if (a.normalizer == "shift") shape.feature_dim += 1;
  if (a.mode == "chunk") {
    shape.chunk_size = a.chunk_size;
  } else if (a.mode == "recurrent") {
    shape.chunk_size = 1;
  } else if (a.mode == "quadratic") {
    shape.chunk_size = 0;
  } else {
    throw unknown("attention.mode", a.mode);
  }
  return shape;
}

std::vector<LengthNeed> memory_needs(const MemoryModel& memory, const std::vector<int64_t>& sp_sizes,
                                     int64_t longest) {
  if (sp_sizes.empty() || longest < 1) {
    throw std::invalid_argument(fmt::format("memory_needs: {} SP sizes, longest {} tokens (need both positive)",
                                            sp_sizes.size(), longest));
  }
  std::vector<int64_t> lengths;
  for (int64_t len = 256; len < longest; len *= 2) lengths.push_back(len);
  lengths.push_back(longest);
  std::vector<LengthNeed> out;
  for (int64_t len : lengths) out.push_back(length_need(memory, sp_sizes, len));
  return out;
}

LengthNeed length_need(const MemoryModel& memory, const std::vector<int64_t>& sp_sizes, int64_t length) {
  if (sp_sizes.empty() || length < 1) {
    throw std::invalid_argument(fmt::format("length_need: {} SP sizes, length {} tokens (need both positive)",
                                            sp_sizes.size(), length));
  }
  for (int64_t sp : sp_sizes) {
    for (int64_t r = 0; r <= memory.shape().layers; ++r) {
      const double bytes = memory.bytes(std::vector<int64_t>{length}, sp, r);
      if (bytes <= memory.budget_bytes()) return {length, sp, r, bytes};
    }
  }
  const int64_t all = memory.shape().layers;
  return {length, 0, all, memory.bytes(std::vector<int64_t>{length}, sp_sizes.back(), all)};
}

StaticSizing size_static_planner(const DataParallelOptions& options, const MemoryModel& memory,
                                 const std::vector<int64_t>& sp_sizes, std::vector<int64_t> lengths) {
  if (lengths.empty() || sp_sizes.empty()) {
    throw std::invalid_argument(fmt::format("size_static_planner: {} lengths, {} SP sizes (need both)",
                                            lengths.size(), sp_sizes.size()));
  }
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  // A longer sample needs more bytes at every size: the lengths that fit are a prefix.
  const auto unfit = std::partition_point(lengths.begin(), lengths.end(), [&](int64_t len) {
    return length_need(memory, sp_sizes, len).sp_size > 0;
  });
  if (unfit == lengths.begin()) {
    const LengthNeed shortest = length_need(memory, sp_sizes, lengths.front());
    throw ConfigError(fmt::format(
        "parallel.sp_size 0: no training sample fits SP sizes {} (parallel.sp_sizes dividing model.n_heads) within "
        "the per-rank memory budget of {:.0f} bytes (memory.budget_bytes / memory.fraction): the shortest ({} "
        "tokens) needs {:.0f} bytes at sp {} with every layer recomputed",
        fmt::join(sp_sizes, ", "), memory.budget_bytes(), shortest.length, shortest.bytes, sp_sizes.back()));
  }
  StaticSizing out;
  out.longest = length_need(memory, sp_sizes, *(unfit - 1));
  out.options = options;
  out.options.sp_size = out.longest.sp_size;
  out.options.recompute_layers = out.longest.recompute_layers;
  const int64_t sp = out.options.sp_size;
  out.options.micro_batch_tokens =
      std::min(options.micro_batch_tokens, memory.max_tokens(sp, out.options.recompute_layers) / sp);
  out.max_sample_tokens = std::min(out.longest.length, out.options.micro_batch_tokens * out.options.sp_size);
  return out;
}

std::string describe_memory_needs(const std::vector<LengthNeed>& needs) {
  auto same = [](const LengthNeed& a, const LengthNeed& b) {
    return a.sp_size == b.sp_size && a.recompute_layers == b.recompute_layers;
  };
  std::string out;
  for (size_t first = 0; first < needs.size();) {
    size_t last = first;
    while (last + 1 < needs.size() && same(needs[last + 1], needs[first])) ++last;
    const LengthNeed& n = needs[first];
    const std::string lengths = first == last  ? fmt::format("{}", n.length)
                                : first == 0   ? fmt::format("<= {}", needs[last].length)
                                               : fmt::format("{}..{}", n.length, needs[last].length);
    const std::string what =
        n.sp_size == 0            ? "fit no SP size even with every layer recomputed (skipped)"
        : n.recompute_layers == 0 ? fmt::format("sp {}", n.sp_size)
                                  : fmt::format("sp {}, recompute {} layers", n.sp_size, n.recompute_layers);
    out += fmt::format("{}{} tokens: {}", out.empty() ? "" : "; ", lengths, what);
    first = last + 1;
  }
  return out;
}

PlanSet plan_training_epoch(const std::string& planner, const std::vector<Sample>& samples,
                            const std::vector<int64_t>& train_ids, int64_t epoch, int64_t world_size,
                            const CostModel& cost, const MemoryModel& memory, const PlannerOptions& options) {
  // Planners require dense ids 0..n-1; the training samples are a subset of the corpus.
  std::vector<Sample> dense;
  dense.reserve(train_ids.size());
  for (size_t i = 0; i < train_ids.size(); ++i) {
    Sample s = samples.at(static_cast<size_t>(train_ids[i]));
    s.id = static_cast<int64_t>(i);
    dense.push_back(std::move(s));
  }
  PlannerOptions opt = options;
  opt.epoch = epoch;
  PlanSet set = planner_by_name(planner)(dense, world_size, cost, memory, opt);
  auto corpus_id = [&](int64_t dense_id) { return train_ids[static_cast<size_t>(dense_id)]; };
  for (auto& step : set.steps) {
    step.epoch = epoch;
    for (auto& g : step.groups)
      for (auto& mb : g.micro_batches)
        for (auto& id : mb.sample_ids) id = corpus_id(id);
  }
  if (set.steps.empty() && !dense.empty()) {
    const auto shortest = std::min_element(dense.begin(), dense.end(), [](const Sample& a, const Sample& b) {
      return a.length < b.length;
    });
    throw ConfigError(fmt::format(
        "planner {}: no training sample fits the per-rank memory budget of {:.0f} bytes (memory.budget_bytes / "
        "memory.fraction): the shortest sample ({} tokens) needs {:.0f} bytes on one rank with every layer "
        "recomputed, the model's state alone {:.0f} bytes",
        planner, memory.budget_bytes(), shortest->length, memory.bytes(shortest->length, 1, memory.shape().layers),
        memory.coefficients().base_bytes));
  }
  for (auto& id : set.skipped_ids) id = corpus_id(id);
  return set;
}

}  // namespace dcp
