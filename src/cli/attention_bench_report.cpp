#include "cli/attention_bench_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

#include "cli/bench_report.h"

namespace dcp {
namespace {

const AttentionBenchPoint* find_point(const std::vector<AttentionBenchPoint>& points, const std::string& variant,
                                      int64_t length) {
  for (const auto& p : points) {
    if (p.variant == variant && p.length == length) return &p;
  }
  return nullptr;
}

std::vector<std::string> variants_of(const std::vector<AttentionBenchPoint>& points) {
  std::vector<std::string> out;
  for (const auto& p : points) {
    if (std::find(out.begin(), out.end(), p.variant) == out.end()) out.push_back(p.variant);
  }
  return out;
}

std::vector<int64_t> lengths_of(const std::vector<AttentionBenchPoint>& points) {
  std::vector<int64_t> out;
  for (const auto& p : points) out.push_back(p.length);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string human_seconds(double s) { return s < 1 ? fmt::format("{:.1f} ms", 1e3 * s) : fmt::format("{:.2f} s", s); }

std::string human_bytes(double b) { return b < 1e9 ? fmt::format("{:.1f} MB", b / 1e6) : fmt::format("{:.2f} GB", b / 1e9); }

std::string human_length(int64_t len) {
  return len % 1024 == 0 ? fmt::format("{}K", len / 1024) : fmt::format("{}", len);
}

AttentionCrossover crossover_of(const std::vector<AttentionBenchPoint>& points, const std::string& variant) {
  std::vector<std::pair<int64_t, double>> ratios;  // (length, ratio) where both were measured, ascending
  for (const auto& p : points) {
    if (p.variant != variant) continue;
    if (auto r = time_ratio_to_softmax(points, p)) ratios.emplace_back(p.length, *r);
  }
  std::sort(ratios.begin(), ratios.end());
  AttentionCrossover c;
  c.compared = static_cast<int64_t>(ratios.size());
  if (ratios.empty()) return c;
  c.shortest_compared = ratios.front().first;
  c.longest_compared = ratios.back().first;
  size_t from = ratios.size();
  while (from > 0 && ratios[from - 1].second < 1) --from;
  if (from == ratios.size()) return c;
  c.from_length = ratios[from].first;
  if (from > 0) {
    const double la = std::log(static_cast<double>(ratios[from - 1].first));
    const double lb = std::log(static_cast<double>(ratios[from].first));
    const double ra = std::log(ratios[from - 1].second), rb = std::log(ratios[from].second);
    c.interpolated = std::exp(la + (lb - la) * ra / (ra - rb));  // ra >= 0 > rb, so ra - rb > 0
  }
  return c;
}

std::string crossover_text(const AttentionVariantSummary& s) {
  if (!s.crossover) return "n/a";
  const AttentionCrossover& c = *s.crossover;
  if (c.compared == 0) return "n/a (no length measured for both)";
  if (!c.from_length) return fmt::format("none up to {}", human_length(c.longest_compared));
  if (!c.interpolated) {
    return fmt::format("<= {} (faster at every compared length, {}..{})", human_length(*c.from_length),
                       human_length(c.shortest_compared), human_length(c.longest_compared));
  }
  return fmt::format("{} (interpolated {:.0f})", human_length(*c.from_length), *c.interpolated);
}

std::string csv_quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

double loglog_slope(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.size() < 2) {
    throw std::invalid_argument(fmt::format("loglog_slope: needs at least 2 points of x and y, got {} and {}",
                                            x.size(), y.size()));
  }
  const double n = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!(x[i] > 0) || !(y[i] > 0)) {
      throw std::invalid_argument(fmt::format("loglog_slope: point ({}, {}) is not positive", x[i], y[i]));
    }
    const double lx = std::log(x[i]), ly = std::log(y[i]);
    sx += lx;
    sy += ly;
    sxx += lx * lx;
    sxy += lx * ly;
  }
  const double var = sxx - sx * sx / n;
  if (!(var > 0)) throw std::invalid_argument("loglog_slope: all x are equal");
  return (sxy - sx * sy / n) / var;
}

std::optional<double> time_ratio_to_softmax(const std::vector<AttentionBenchPoint>& points,
                                            const AttentionBenchPoint& p) {
  const AttentionBenchPoint* base = find_point(points, "softmax", p.length);
  if (!p.measured || !base || !base->measured) return std::nullopt;
  return p.seconds / base->seconds;
}

std::vector<AttentionVariantSummary> summarize_attention_bench(const std::vector<AttentionBenchPoint>& points,
                                                               int64_t slope_min_length) {
  std::vector<AttentionVariantSummary> out;
  const bool have_softmax = std::any_of(points.begin(), points.end(),
                                        [](const auto& p) { return p.variant == "softmax" && p.measured; });
  for (const auto& variant : variants_of(points)) {
    AttentionVariantSummary s;
    s.variant = variant;
    std::vector<const AttentionBenchPoint*> measured;
    for (const auto& p : points) {
      if (p.variant != variant) continue;
      if (p.measured) {
        measured.push_back(&p);
      } else {
        ++s.skipped;
      }
    }
    std::sort(measured.begin(), measured.end(), [](auto* a, auto* b) { return a->length < b->length; });
    s.measured = static_cast<int64_t>(measured.size());
    if (!measured.empty()) {
      s.longest = measured.back()->length;
      s.longest_seconds = measured.back()->seconds;
      s.longest_peak_bytes = measured.back()->peak_bytes;
    }
    std::vector<double> x, y;
    for (const auto* p : measured) {
      if (p->length >= slope_min_length) {
        x.push_back(static_cast<double>(p->length));
        y.push_back(p->seconds);
      }
    }
    if (x.size() < 2) {
      x.clear();
      y.clear();
      for (const auto* p : measured) {
        x.push_back(static_cast<double>(p->length));
        y.push_back(p->seconds);
      }
    }
    if (x.size() >= 2) {
      s.slope = loglog_slope(x, y);
      s.slope_points = static_cast<int64_t>(x.size());
      s.slope_from = static_cast<int64_t>(x.front());
      s.slope_to = static_cast<int64_t>(x.back());
    }
    if (variant != "softmax" && have_softmax) s.crossover = crossover_of(points, variant);
    out.push_back(s);
  }
  return out;
}

std::string attention_bench_markdown_tables(const std::vector<AttentionBenchPoint>& points,
                                            const std::vector<AttentionVariantSummary>& summaries) {
  std::string md =
      "| variant | measured | skipped | time slope (fit lengths) | crossover vs softmax | longest measured | "
      "time there | peak memory there |\n|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : summaries) {
    md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", s.variant, s.measured, s.skipped,
                      s.slope ? fmt::format("{:.2f} ({} lengths, {}..{})", *s.slope, s.slope_points,
                                            human_length(s.slope_from), human_length(s.slope_to))
                              : "n/a",
                      crossover_text(s), s.longest ? human_length(s.longest) : "none",
                      s.longest ? human_seconds(s.longest_seconds) : "n/a",
                      s.longest ? human_bytes(s.longest_peak_bytes) : "n/a");
  }
  const auto variants = variants_of(points);
  std::string header = "| length |", rule = "|---|";
  for (const auto& v : variants) {
    header += " " + v + " |";
    rule += "---|";
  }
  auto table = [&](const std::string& title, auto&& cell) {
    std::string t = "\n" + title + "\n\n" + header + "\n" + rule + "\n";
    for (int64_t len : lengths_of(points)) {
      t += fmt::format("| {} |", len);
      for (const auto& v : variants) {
        const AttentionBenchPoint* p = find_point(points, v, len);
        t += " " + (!p ? std::string("-") : p->measured ? cell(*p) : "skipped: " + p->skip_reason) + " |";
      }
      t += "\n";
    }
    return t;
  };
  md += table("Forward+backward time, median (ratio to softmax at the same length; below 1 is faster):",
              [&](const AttentionBenchPoint& p) {
                const auto r = time_ratio_to_softmax(points, p);
                return human_seconds(p.seconds) +
                       (r && p.variant != "softmax" ? fmt::format(" ({:.2f}x)", *r) : std::string()) +
                       (p.runs == 0 ? " (warm-up only)" : "");
              });
  md += table("Peak memory of the forward+backward (tensor storage above the inputs):",
              [&](const AttentionBenchPoint& p) { return human_bytes(p.peak_bytes); });
  return md;
}

std::string attention_bench_csv(const std::vector<AttentionBenchPoint>& points) {
  std::string out =
      "variant,length,status,seconds,runs,peak_bytes,predicted_bytes,time_ratio_to_softmax,skip_reason\n";
  for (const auto& p : points) {
    const auto r = time_ratio_to_softmax(points, p);
    out += fmt::format("{},{},{},{},{},{},{},{},{}\n", p.variant, p.length, p.measured ? "measured" : "skipped",
                       p.measured ? fmt::format("{:.6f}", p.seconds) : "", p.measured ? fmt::format("{}", p.runs) : "",
                       p.measured ? fmt::format("{:.0f}", p.peak_bytes) : "",
                       p.predicted_bytes > 0 ? fmt::format("{:.0f}", p.predicted_bytes) : "",
                       r ? fmt::format("{:.4f}", *r) : "", csv_quoted(p.skip_reason));
  }
  return out;
}

std::string attention_bench_gnuplot_script(const std::string& csv_path, const std::string& png_path,
                                           const std::vector<std::string>& variants) {
  std::string names;
  for (const auto& v : variants) names += (names.empty() ? "" : " ") + v;
  const bool softmax = std::find(variants.begin(), variants.end(), "softmax") != variants.end();
  const std::string predicted =
      softmax ? fmt::format(", \\\n     {} skip 1 using 2:(strcol(1) eq \"softmax\" ? $7/1e6 : NaN) with lines "
                            "dashtype 2 linecolor rgb \"#888888\" title \"softmax predicted\"",
                            gnuplot_quoted(csv_path))
              : "";
  // Columns as attention_bench_csv writes them: 1 variant, 2 length, 3 status, 4 seconds, 6 peak_bytes,
  // 7 predicted_bytes. Rows of other variants and skipped rows map to NaN, which gnuplot leaves out.
  return fmt::format(
      "set terminal pngcairo size 1400,560 font \",10\"\n"
      "set output {png}\n"
      "set datafile separator \",\"\n"
      "set logscale xy 2\n"
      "set format y \"%g\"\n"
      "set grid xtics ytics mxtics mytics\n"
      "set xlabel \"sequence length (tokens)\"\n"
      "set key top left\n"
      "names = {names}\n"
      "colors = \"#222222 #4477aa #ee6677 #228833 #aa3377 #66ccee #ee7733\"\n"
      "set multiplot layout 1,2\n"
      "set title \"Forward+backward time (ms)\"\n"
      "set logscale y 10\n"
      "plot for [i=1:words(names)] {csv} skip 1 using 2:(strcol(1) eq word(names, i) && strcol(3) eq \"measured\" ? "
      "$4*1e3 : NaN) with linespoints linewidth 2 pointtype 7 linecolor rgb word(colors, (i - 1) % 7 + 1) "
      "title word(names, i)\n"
      "set title \"Peak memory of the forward+backward (MB)\"\n"
      "plot for [i=1:words(names)] {csv} skip 1 using 2:(strcol(1) eq word(names, i) && strcol(3) eq \"measured\" ? "
      "$6/1e6 : NaN) with linespoints linewidth 2 pointtype 7 linecolor rgb word(colors, (i - 1) % 7 + 1) "
      "title word(names, i){predicted}\n"
      "unset multiplot\n",
      fmt::arg("png", gnuplot_quoted(png_path)), fmt::arg("csv", gnuplot_quoted(csv_path)),
      fmt::arg("names", gnuplot_quoted(names)), fmt::arg("predicted", predicted));
}

}  // namespace dcp
