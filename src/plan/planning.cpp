#include "dcp/planning.h"

namespace dcp {

ModelShape model_shape_of(const ModelConfig& model, int64_t bytes_per_element) {
  ModelShape s;
  s.hidden = model.d_model;
  s.layers = model.n_layers;
  s.heads = model.n_heads;
  s.ffn = model.d_ff;
  s.mlp_matrices = 3;
  s.vocab = kVocabSize;
  s.bytes_per_element = bytes_per_element;
  return s;
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
  for (auto& id : set.skipped_ids) id = corpus_id(id);
  return set;
}

}  // namespace dcp
