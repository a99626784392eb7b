// Held-out bits per byte, sharded over the ranks (include/dcp/trainer.h).
#include <cmath>

#include "dcp/trainer.h"

namespace dcp {

double heldout_bits_per_byte(Transformer& model, const Corpus& corpus, const EvalConfig& eval, int64_t batch_tokens,
                             const Communicator& world) {
  torch::NoGradGuard no_grad;
  // The same prefix of held-out samples on every rank, sharded round-robin.
  std::vector<int64_t> mine;
  int64_t taken = 0;
  const auto& ids = corpus.heldout_ids();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (eval.max_tokens > 0 && taken >= eval.max_tokens) break;
    taken += corpus.samples()[static_cast<size_t>(ids[i])].length;
    if (static_cast<int64_t>(i) % world.size() == world.rank()) mine.push_back(ids[i]);
  }
  double loss = 0, tokens = 0;
  std::vector<int64_t> chunk;
  int64_t chunk_tokens = 0;
  auto flush = [&] {
    if (chunk.empty()) return;
    PackedBatch batch = make_batch(corpus, chunk);
    loss += model->loss_sum(batch).item<double>();
    tokens += static_cast<double>(batch.num_tokens());
    chunk.clear();
    chunk_tokens = 0;
  };
  for (int64_t id : mine) {
    int64_t len = corpus.samples()[static_cast<size_t>(id)].length;
    if (chunk_tokens + len > batch_tokens) flush();
    chunk.push_back(id);
    chunk_tokens += len;
  }
  flush();
  auto t = torch::tensor({loss, tokens}, torch::kFloat64);
  world.allreduce_sum(t);
  double total_tokens = t[1].item<double>();
  if (total_tokens == 0) return std::nan("");
  return t[0].item<double>() / total_tokens / std::log(2.0);
}

}  // namespace dcp
