#include <stdexcept>
#include <string>

#include "dcp/model.h"

namespace dcp {

PackedBatch make_batch(const Corpus& corpus, const std::vector<int64_t>& sample_ids) {
  if (sample_ids.empty()) throw std::invalid_argument("make_batch: empty sample id list");
  const auto& samples = corpus.samples();
  std::vector<int64_t> cu{0};
  cu.reserve(sample_ids.size() + 1);
  for (int64_t id : sample_ids) {
    if (id < 0 || id >= static_cast<int64_t>(samples.size())) {
      throw std::out_of_range("make_batch: unknown sample id " + std::to_string(id));
    }
    cu.push_back(cu.back() + samples[static_cast<size_t>(id)].length);
  }
  const int64_t total = cu.back();

  PackedBatch b;
  b.tokens = torch::empty({total}, torch::kInt64);
  b.targets = torch::empty({total}, torch::kInt64);
  b.positions = torch::empty({total}, torch::kInt64);
  b.cu_seqlens = torch::tensor(cu, torch::kInt64);
  b.sample_ids = sample_ids;
  int64_t* tokens = b.tokens.data_ptr<int64_t>();
  int64_t* targets = b.targets.data_ptr<int64_t>();
  int64_t* positions = b.positions.data_ptr<int64_t>();
  for (size_t i = 0; i < sample_ids.size(); ++i) {
    corpus.tokens(sample_ids[i], tokens + cu[i], targets + cu[i]);
    for (int64_t p = 0; p < cu[i + 1] - cu[i]; ++p) positions[cu[i] + p] = p;
  }
  return b;
}

}  // namespace dcp
