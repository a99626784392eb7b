#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "dcp/data.h"

namespace dcp {

LengthHistogram length_histogram(const std::vector<int64_t>& lengths) {
  LengthHistogram h;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 1) {
      throw std::invalid_argument(fmt::format("length_histogram: length {} at index {} is below 1", lengths[i], i));
    }
    h.tokens += lengths[i];
  }
  h.count = static_cast<int64_t>(lengths.size());
  if (h.count == 0) return h;
  std::vector<int64_t> sorted = lengths;
  std::sort(sorted.begin(), sorted.end());
  auto rank = [&](double p) {  // nearest rank: ceil(p n), 1-based
    const auto r = static_cast<int64_t>(std::ceil(p * static_cast<double>(h.count) - 1e-9));
    return sorted[static_cast<size_t>(std::clamp<int64_t>(r, 1, h.count) - 1)];
  };
  h.min = sorted.front();
  h.max = sorted.back();
  h.p50 = rank(0.5);
  h.p90 = rank(0.9);
  // Tokens in samples longer than 2^k: walk the sorted lengths once from the longest.
  int64_t above = 0;
  auto it = sorted.rbegin();
  std::vector<std::pair<int64_t, double>> desc;
  int64_t edge = 1;
  while (edge * 2 < h.max) edge *= 2;
  for (; edge >= 1; edge /= 2) {
    for (; it != sorted.rend() && *it > edge; ++it) above += *it;
    desc.emplace_back(edge, static_cast<double>(above) / static_cast<double>(h.tokens));
  }
  if (h.max > 1) h.token_share_above.assign(desc.rbegin(), desc.rend());
  return h;
}

std::string LengthHistogram::describe() const {
  std::string out = fmt::format("{} samples, {} tokens; min {}, p50 {}, p90 {}, max {}", count, tokens, min, p50,
                                p90, max);
  const char* sep = "; tokens in samples";
  for (size_t i = 0; i < token_share_above.size(); ++i) {
    const auto& [edge, share] = token_share_above[i];
    // Of the leading edges that hold (almost) every token, only the last is worth a column.
    if (i + 1 < token_share_above.size() && token_share_above[i + 1].second >= 0.9995) continue;
    out += fmt::format("{} > {}: {:.1f}%", sep, edge, 100 * share);
    sep = ",";
  }
  return out;
}

}  // namespace dcp
