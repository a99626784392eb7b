#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <stdexcept>

#include "dcp/planners.h"

namespace dcp {
namespace {

// Counts of the reference's zipf rule (dcp-reference.md section 1.4): banker's rounding of the share of
// bucket i, remainder to bucket 0.
std::vector<int64_t> zipf_counts(int64_t n, size_t buckets, double alpha, int64_t offset) {
  std::vector<double> w(buckets);
  double sum = 0;
  for (size_t i = 0; i < buckets; ++i) {
    sum += w[i] = std::pow(static_cast<double>(i + 1) + static_cast<double>(offset), -alpha);
  }
  std::vector<int64_t> c(buckets);
  int64_t total = 0;
  for (size_t i = 0; i < buckets; ++i) {
    c[i] = static_cast<int64_t>(std::nearbyint(static_cast<double>(n) * w[i] / sum));  // round half to even
    total += c[i];
  }
  c[0] += n - total;
  return c;
}

std::vector<int64_t> opensora_zipf(const WorkloadOptions& o) {
  struct Res {
    int64_t height, tokens_per_frame;
  };
  // dcp-reference.md section 1.2: 144p..720p at aspect ratio 0.56, patch tokens per latent frame.
  const Res res[] = {{144, 144}, {240, 405}, {360, 920}, {480, 1590}, {720, 3600}};
  const int64_t frames[] = {51, 102, 204, 408};
  const int64_t latent_frames[] = {15, 30, 60, 120};  // floor(T * 5 / 17)
  struct Bucket {
    int64_t sort_key, tokens;
  };
  std::vector<Bucket> videos, images;
  for (const auto& r : res) {
    for (size_t f = 0; f < 4; ++f) videos.push_back({frames[f] * r.height, latent_frames[f] * r.tokens_per_frame});
    images.push_back({r.height, r.tokens_per_frame});
  }
  auto by_key = [](const Bucket& a, const Bucket& b) { return a.sort_key < b.sort_key; };
  std::stable_sort(videos.begin(), videos.end(), by_key);
  std::stable_sort(images.begin(), images.end(), by_key);
  std::vector<int64_t> out;
  auto emit = [&](const std::vector<Bucket>& b, int64_t n) {
    const auto c = zipf_counts(n, b.size(), o.zipf_alpha, o.zipf_offset);
    for (size_t i = 0; i < b.size(); ++i) out.insert(out.end(), static_cast<size_t>(c[i]), b[i].tokens);
  };
  emit(videos, o.zipf_data_size);
  emit(images, o.zipf_image_frac * o.zipf_data_size);
  return out;
}

// Uniform double in (0, 1) from the i-th value of the stream `seed`.
double unit(uint64_t seed, uint64_t i) {
  return (static_cast<double>(sample_seed(seed, 0, i) >> 11) + 0.5) * 0x1.0p-53;
}

}  // namespace

// Megatron-Core's dynamic-CP benchmark: a rank holds at most max_seqlen_per_dp_cp_rank = 2048 tokens in a
// micro-batch; a step packs 8 such micro-batches per rank (gradient accumulation over the global batch).
constexpr int64_t kMegatronRankCapacity = 2048;
constexpr int64_t kMegatronMicroBatchesPerStep = 8;

int64_t workload_tokens_per_rank(const std::string& name) {
  return name == "megatron-lognormal" ? kMegatronRankCapacity * kMegatronMicroBatchesPerStep : 131072;
}

int64_t workload_rank_capacity_tokens(const std::string& name) {
  return name == "megatron-lognormal" ? kMegatronRankCapacity : 0;
}

std::vector<int64_t> workload_lengths(const WorkloadOptions& options) {
  WorkloadOptions o = options;
  if (o.name == "megatron-lognormal") {
    // Megatron-Core's dynamic-CP benchmark lengths: lognormal, clipped to [128, 8192], mean 1024. sigma 1 and
    // the median solved so that the clipped mean is 1024 (E[clip(X)] = a Phi(za) + b (1 - Phi(zb)) +
    // e^(mu + s^2/2) (Phi(zb - s) - Phi(za - s)), za = (ln a - mu) / s, zb likewise).
    o.name = "lognormal";
    o.min_tokens = 128;
    o.max_tokens = 8192;
    o.lognormal_sigma = 1.0;
    o.lognormal_median = 631.2553867;
  }
  if (o.name == "opensora-zipf") {
    if (o.zipf_data_size < 1 || o.zipf_image_frac < 0) {
      throw std::invalid_argument(fmt::format("opensora-zipf: data size {} must be positive and image frac {} "
                                              "non-negative",
                                              o.zipf_data_size, o.zipf_image_frac));
    }
    return opensora_zipf(o);
  }
  if (o.name != "lognormal" && o.name != "uniform") {
    throw std::invalid_argument(
        fmt::format("unknown workload '{}' (known: opensora-zipf, lognormal, megatron-lognormal, uniform)", o.name));
  }
  if (o.num_samples < 1 || o.min_tokens < 1 || o.max_tokens < o.min_tokens) {
    throw std::invalid_argument(fmt::format("workload {}: num_samples {} and min_tokens {} must be positive and "
                                            "max_tokens {} >= min_tokens",
                                            o.name, o.num_samples, o.min_tokens, o.max_tokens));
  }
  std::vector<int64_t> out;
  const auto n = static_cast<uint64_t>(o.num_samples);
  for (uint64_t i = 0; i < n; ++i) {
    if (o.name == "uniform") {
      const auto span = static_cast<uint64_t>(o.max_tokens - o.min_tokens + 1);
      out.push_back(o.min_tokens + static_cast<int64_t>(sample_seed(o.seed, 0, i) % span));
    } else {
      // Box-Muller on two values of the stream per sample.
      const double z = std::sqrt(-2.0 * std::log(unit(o.seed, 2 * i))) * std::cos(2.0 * M_PI * unit(o.seed, 2 * i + 1));
      const double len = std::exp(std::log(o.lognormal_median) + o.lognormal_sigma * z);
      out.push_back(std::clamp(static_cast<int64_t>(std::llround(std::min(len, 1e18))), o.min_tokens, o.max_tokens));
    }
  }
  return out;
}

std::vector<int64_t> read_lengths_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("lengths file '{}' cannot be opened", path));
  std::vector<int64_t> out;
  std::string line;
  for (int64_t no = 1; std::getline(in, line); ++no) {
    const auto b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos) continue;
    const auto e = line.find_last_not_of(" \t\r");
    int64_t v = 0;
    const char* first = line.data() + b;
    const char* last = line.data() + e + 1;
    auto [p, ec] = std::from_chars(first, last, v);
    if (ec != std::errc() || p != last || v < 1) {
      std::string shown = line.substr(b, std::min<size_t>(e - b + 1, 80));
      for (char& ch : shown) {
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';  // a NUL would end the message
      }
      throw std::runtime_error(fmt::format("lengths file '{}' line {}: '{}{}' is not a positive integer", path, no,
                                           shown, e - b + 1 > 80 ? "..." : ""));
    }
    out.push_back(v);
  }
  if (out.empty()) throw std::runtime_error(fmt::format("lengths file '{}' holds no length", path));
  return out;
}

std::vector<Sample> samples_from_lengths(const std::vector<int64_t>& lengths, const std::string& prefix) {
  std::vector<Sample> out;
  out.reserve(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    out.push_back(Sample{static_cast<int64_t>(i), lengths[i], fmt::format("{}#{}", prefix, i)});
  }
  return out;
}

}  // namespace dcp
