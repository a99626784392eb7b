#include <stdexcept>
#include <string>

#include "dcp/model.h"

namespace dcp {

PackedBatch make_batch(const Corpus& corpus, const std::vector<int64_t>& sample_ids) {
  return make_shard(corpus, sample_ids, 0, 1);
}

PackedBatch make_shard(const Corpus& corpus, const std::vector<int64_t>& sample_ids, int64_t sp_rank,
                       int64_t sp_size) {
  return make_shard(corpus, sample_ids, sp_rank, SpLayout{sp_size, sp_size});
}

PackedBatch make_shard(const Corpus& corpus, const std::vector<int64_t>& sample_ids, int64_t sp_rank,
                       const SpLayout& layout) {
  if (sample_ids.empty()) throw std::invalid_argument("make_batch: empty sample id list");
  if (layout.sp_size < 1 || sp_rank < 0 || sp_rank >= layout.sp_size) {
    throw std::invalid_argument("make_shard: sp_rank " + std::to_string(sp_rank) + " outside [0, sp_size " +
                                std::to_string(layout.sp_size) + ")");
  }
  const auto& samples = corpus.samples();
  std::vector<int64_t> cu{0};
  cu.reserve(sample_ids.size() + 2);
  for (int64_t id : sample_ids) {
    if (id < 0 || id >= static_cast<int64_t>(samples.size())) {
      throw std::out_of_range("make_batch: unknown sample id " + std::to_string(id));
    }
    cu.push_back(cu.back() + samples[static_cast<size_t>(id)].length);
  }
  const int64_t total = cu.back();
  const int64_t padded = layout.padded_length(total);
  if (padded > total) cu.push_back(padded);  // the padding is a segment of its own: nothing attends across it
  const int64_t local = padded / layout.sp_size;

  PackedBatch b;
  b.tokens = torch::zeros({local}, torch::kInt64);
  b.targets = torch::full({local}, int64_t{-100}, torch::kInt64);
  b.positions = torch::zeros({local}, torch::kInt64);
  b.cu_seqlens = torch::tensor(cu, torch::kInt64);
  b.sample_ids = sample_ids;
  int64_t* tokens = b.tokens.data_ptr<int64_t>();
  int64_t* targets = b.targets.data_ptr<int64_t>();
  int64_t* positions = b.positions.data_ptr<int64_t>();
  // Only the overlap of each sample with this rank's pieces is read: a rank never loads its peers' shards.
  int64_t at = 0;  // local index of the current piece's first token
  for (const auto& [begin, end] : layout.shard(padded, sp_rank)) {
    for (size_t i = 0; i < sample_ids.size(); ++i) {
      const int64_t lo = std::max(cu[i], begin), hi = std::min(cu[i + 1], end);
      if (lo >= hi) continue;
      std::string_view bytes = corpus.bytes(sample_ids[i]);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t p = t - cu[i], l = at + t - begin;
        tokens[l] = p == 0 ? kBosToken : static_cast<unsigned char>(bytes[static_cast<size_t>(p - 1)]);
        targets[l] = static_cast<unsigned char>(bytes[static_cast<size_t>(p)]);
        positions[l] = p;
      }
    }
    at += end - begin;
  }
  return b;
}

}  // namespace dcp
