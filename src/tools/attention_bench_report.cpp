#include "tools/attention_bench_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

#include "tools/bench_report.h"

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

template <class T, class Format>
std::string or_na(const std::optional<T>& value, Format format) {
  return value ? format(*value) : std::string("n/a");
}

std::string gflops_text(double g) { return fmt::format("{:.1f}", g); }
std::string percent_text(double fraction) { return fmt::format("{:.1f}%", 100 * fraction); }
std::string ratio_text(double r) { return fmt::format("{:.2f}x", r); }

// GFLOP/s of one phase of a measured point; absent without a FLOP count or a time.
std::optional<double> phase_gflops(double flops, double seconds) {
  if (!(flops > 0) || !(seconds > 0)) return std::nullopt;
  return achieved_gflops(flops, seconds);
}

// The peak of everything a run held, inputs included, bytes.
double held_bytes(const AttentionBenchPoint& p) { return p.input_bytes + p.peak_bytes; }

template <class T>
std::string csv_number(const std::optional<T>& value, const char* format) {
  return value ? fmt::format(fmt::runtime(format), *value) : std::string();
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

double achieved_gflops(double flops, double seconds) {
  if (!(flops >= 0) || !std::isfinite(flops) || !(seconds > 0) || !std::isfinite(seconds)) {
    throw std::invalid_argument(fmt::format("achieved_gflops: needs flops >= 0 and seconds > 0, got {} and {}",
                                            flops, seconds));
  }
  return flops / seconds / 1e9;
}

std::optional<double> point_gflops(const AttentionBenchPoint& p) {
  if (!p.measured) return std::nullopt;
  return phase_gflops(p.flops.forward + p.flops.backward, p.seconds);
}

double peak_gflops(const MatmulPeak& peak, const std::string& dtype) {
  if (dtype == "fp32") return peak.fp32_gflops;
  if (dtype == "bf16") return peak.bf16_gflops;
  throw std::invalid_argument(fmt::format("peak_gflops: unknown dtype '{}' (known: fp32, bf16)", dtype));
}

std::optional<double> fraction_of_peak(const AttentionBenchPoint& p, const MatmulPeak& peak) {
  const auto rate = point_gflops(p);
  const double yardstick = peak_gflops(peak, p.dtype);
  if (!rate || !(yardstick > 0)) return std::nullopt;
  return *rate / yardstick;
}

std::optional<double> memory_ratio(const AttentionBenchPoint& p) {
  if (!p.measured || !(p.io_bytes > 0)) return std::nullopt;
  return held_bytes(p) / p.io_bytes;
}

std::optional<double> time_ratio_to_softmax(const std::vector<AttentionBenchPoint>& points,
                                            const AttentionBenchPoint& p) {
  const AttentionBenchPoint* base = find_point(points, "softmax", p.length);
  if (!p.measured || !base || !base->measured) return std::nullopt;
  return p.seconds / base->seconds;
}

std::optional<double> speedup_over_reference(const std::vector<AttentionBenchPoint>& points, int64_t length,
                                             const std::string& variant) {
  const AttentionBenchPoint* tiled = find_point(points, variant, length);
  const AttentionBenchPoint* reference = find_point(points, variant + "-reference", length);
  if (!tiled || !reference || !tiled->measured || !reference->measured) return std::nullopt;
  return reference->seconds / tiled->seconds;
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
    if (!measured.empty()) s.longest = *measured.back();
    std::vector<const AttentionBenchPoint*> fit;
    for (const auto* p : measured) {
      if (p->length >= slope_min_length) fit.push_back(p);
    }
    if (fit.size() < 2) fit = measured;
    if (fit.size() >= 2) {
      std::vector<double> x, time, held;
      for (const auto* p : fit) {
        x.push_back(static_cast<double>(p->length));
        time.push_back(p->seconds);
        held.push_back(held_bytes(*p));
      }
      s.slope = loglog_slope(x, time);
      if (std::all_of(held.begin(), held.end(), [](double b) { return b > 0; })) s.memory_slope = loglog_slope(x, held);
      s.slope_points = static_cast<int64_t>(fit.size());
      s.slope_from = fit.front()->length;
      s.slope_to = fit.back()->length;
    }
    if (variant != "softmax" && variant != "softmax-reference" && have_softmax) {
      s.crossover = crossover_of(points, variant);
    }
    out.push_back(s);
  }
  return out;
}

std::string attention_bench_markdown_tables(const std::vector<AttentionBenchPoint>& points,
                                            const std::vector<AttentionVariantSummary>& summaries,
                                            const MatmulPeak& peak) {
  std::string md =
      "| variant | measured | skipped | time slope (fit lengths) | memory slope | crossover vs softmax | longest "
      "measured | time there | GFLOP/s there | % of peak there | peak memory there | memory ratio there |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& s : summaries) {
    const auto& p = s.longest;
    md += fmt::format(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", s.variant, s.measured, s.skipped,
        s.slope ? fmt::format("{:.2f} ({} lengths, {}..{})", *s.slope, s.slope_points, human_length(s.slope_from),
                              human_length(s.slope_to))
                : "n/a",
        or_na(s.memory_slope, [](double m) { return fmt::format("{:.2f}", m); }), crossover_text(s),
        p ? human_length(p->length) : "none", p ? human_seconds(p->seconds) : "n/a",
        p ? or_na(point_gflops(*p), gflops_text) : "n/a", p ? or_na(fraction_of_peak(*p, peak), percent_text) : "n/a",
        p ? human_bytes(p->peak_bytes) : "n/a", p ? or_na(memory_ratio(*p), ratio_text) : "n/a");
  }
  const auto lengths = lengths_of(points);
  const auto variants = variants_of(points);
  auto cell_of = [&](const std::string& variant, int64_t len, auto&& cell) {
    const AttentionBenchPoint* p = find_point(points, variant, len);
    return !p ? std::string("-") : p->measured ? cell(*p) : "skipped: " + p->skip_reason;
  };

  const bool both = std::find(variants.begin(), variants.end(), "softmax") != variants.end() &&
                    std::find(variants.begin(), variants.end(), "softmax-reference") != variants.end();
  if (both) {
    md += "\nThe tiled softmax against its [L, L] reference (forward+backward, median; speedup = reference time / "
          "tiled time):\n\n| length | softmax | softmax-reference | speedup |\n|---|---|---|---|\n";
    const auto time = [](const AttentionBenchPoint& p) { return human_seconds(p.seconds); };
    for (int64_t len : lengths) {
      md += fmt::format("| {} | {} | {} | {} |\n", len, cell_of("softmax", len, time),
                        cell_of("softmax-reference", len, time),
                        or_na(speedup_over_reference(points, len), ratio_text));
    }
  }

  std::vector<std::string> fused_pairs;
  for (const auto& v : variants) {
    if (v != "softmax" && std::find(variants.begin(), variants.end(), v + "-reference") != variants.end()) {
      fused_pairs.push_back(v);
    }
  }
  if (!fused_pairs.empty()) {
    md += "\nFlexformer's fused kernel against its autograd twin (forward+backward, median; speedup = twin time / "
          "fused time):\n\n| length |";
    std::string rule = "|---|";
    for (const auto& v : fused_pairs) {
      md += fmt::format(" {v} | {v}-reference | speedup |", fmt::arg("v", v));
      rule += "---|---|---|";
    }
    md += "\n" + rule + "\n";
    const auto time = [](const AttentionBenchPoint& p) { return human_seconds(p.seconds); };
    for (int64_t len : lengths) {
      md += fmt::format("| {} |", len);
      for (const auto& v : fused_pairs) {
        md += fmt::format(" {} | {} | {} |", cell_of(v, len, time), cell_of(v + "-reference", len, time),
                          or_na(speedup_over_reference(points, len, v), ratio_text));
      }
      md += "\n";
    }
  }

  md += "\nPer point: median forward, backward and forward+backward seconds; the ratio to softmax at the same length "
        "(below 1 is faster); GFLOP/s of the forward+backward (of the forward, of the backward); its % of the "
        "matmul peak of the dtype; the peak memory above the inputs; the memory ratio (inputs + peak) / IO "
        "bytes:\n\n| variant | length | forward | backward | fwd+bwd | vs softmax | GFLOP/s (fwd, bwd) | % of peak "
        "| peak memory | memory ratio |\n|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& p : points) {
    if (!p.measured) {
      md += fmt::format("| {} | {} | skipped: {} | | | | | | | |\n", p.variant, p.length, p.skip_reason);
      continue;
    }
    const auto rate = point_gflops(p);
    const auto fwd = phase_gflops(p.flops.forward, p.forward_seconds);
    const auto bwd = phase_gflops(p.flops.backward, p.backward_seconds);
    const auto ratio = time_ratio_to_softmax(points, p);
    md += fmt::format("| {} | {} | {} | {} | {}{} | {} | {} | {} | {} | {} |\n", p.variant, p.length,
                      human_seconds(p.forward_seconds), human_seconds(p.backward_seconds), human_seconds(p.seconds),
                      p.runs == 0 ? " (warm-up only)" : "",
                      ratio && p.variant != "softmax" ? fmt::format("{:.2f}x", *ratio) : std::string("-"),
                      rate ? fmt::format("{} ({}, {})", gflops_text(*rate), or_na(fwd, gflops_text),
                                         or_na(bwd, gflops_text))
                           : std::string("n/a"),
                      or_na(fraction_of_peak(p, peak), percent_text), human_bytes(p.peak_bytes),
                      or_na(memory_ratio(p), ratio_text));
  }

  std::string header = "| length |", rule = "|---|";
  for (const auto& v : variants) {
    header += " " + v + " |";
    rule += "---|";
  }
  md += "\nForward+backward time, median (ratio to softmax at the same length; below 1 is faster):\n\n" + header +
        "\n" + rule + "\n";
  for (int64_t len : lengths) {
    md += fmt::format("| {} |", len);
    for (const auto& v : variants) {
      md += " " + cell_of(v, len, [&](const AttentionBenchPoint& p) {
        const auto r = time_ratio_to_softmax(points, p);
        return human_seconds(p.seconds) +
               (r && p.variant != "softmax" ? fmt::format(" ({:.2f}x)", *r) : std::string()) +
               (p.runs == 0 ? " (warm-up only)" : "");
      }) + " |";
    }
    md += "\n";
  }
  return md;
}

std::string attention_bench_csv(const std::vector<AttentionBenchPoint>& points, const MatmulPeak& peak) {
  std::string out =
      "variant,dtype,length,status,runs,forward_seconds,backward_seconds,seconds,time_ratio_to_softmax,"
      "speedup_over_reference,forward_flops,backward_flops,flops_source,gflops,fraction_of_peak,peak_bytes,"
      "input_bytes,io_bytes,memory_ratio,predicted_bytes,skip_reason\n";
  for (const auto& p : points) {
    const bool m = p.measured;
    auto measured_number = [&](double value, const char* format) {
      return m ? fmt::format(fmt::runtime(format), value) : std::string();
    };
    // softmax: softmax-reference time / its time; a flexformer map: its autograd twin's ("<map>-reference").
    const auto speedup = speedup_over_reference(points, p.length, p.variant);
    out += fmt::format(
        "{},{},{},{},{},{},{},{},{},{},{:.0f},{:.0f},{},{},{},{},{},{:.0f},{},{},{}\n", p.variant, p.dtype, p.length,
        m ? "measured" : "skipped", m ? fmt::format("{}", p.runs) : "", measured_number(p.forward_seconds, "{:.6f}"),
        measured_number(p.backward_seconds, "{:.6f}"), measured_number(p.seconds, "{:.6f}"),
        csv_number(time_ratio_to_softmax(points, p), "{:.4f}"), csv_number(speedup, "{:.4f}"), p.flops.forward,
        p.flops.backward, p.flops.source, csv_number(point_gflops(p), "{:.3f}"),
        csv_number(fraction_of_peak(p, peak), "{:.5f}"), measured_number(p.peak_bytes, "{:.0f}"),
        measured_number(p.input_bytes, "{:.0f}"), p.io_bytes, csv_number(memory_ratio(p), "{:.4f}"),
        p.predicted_bytes > 0 ? fmt::format("{:.0f}", p.predicted_bytes) : "", csv_quoted(p.skip_reason));
  }
  return out;
}

std::string attention_bench_gnuplot_script(const std::string& csv_path, const std::string& png_path,
                                           const std::vector<std::string>& variants) {
  std::string names;
  for (const auto& v : variants) names += (names.empty() ? "" : " ") + v;
  // Columns as attention_bench_csv writes them: 1 variant, 3 length, 4 status, 8 seconds, 15 fraction_of_peak,
  // 16 peak_bytes, 20 predicted_bytes. Rows of other variants and skipped rows map to NaN, which gnuplot leaves
  // out. The softmax predictions are drawn because they decide the skips of the longest lengths.
  std::string predicted;
  for (const auto& [v, dashes] : {std::pair{"softmax", 2}, std::pair{"softmax-reference", 4}}) {
    if (std::find(variants.begin(), variants.end(), v) == variants.end()) continue;
    predicted += fmt::format(", \\\n     {} skip 1 using 3:(strcol(1) eq \"{}\" ? $20/1e6 : NaN) with lines dashtype {} "
                             "linecolor rgb \"#888888\" title \"{} predicted\"",
                             gnuplot_quoted(csv_path), v, dashes, v);
  }
  const std::string series =
      "plot for [i=1:words(names)] {csv} skip 1 using 3:(strcol(1) eq word(names, i) && strcol(4) eq \"measured\" ? "
      "{column} : NaN) with linespoints linewidth 2 pointtype 7 linecolor rgb word(colors, (i - 1) % 7 + 1) "
      "title word(names, i)";
  auto plot = [&](const std::string& column) {
    return fmt::format(fmt::runtime(series), fmt::arg("csv", gnuplot_quoted(csv_path)), fmt::arg("column", column));
  };
  return fmt::format(
      "set terminal pngcairo noenhanced size 2000,560 font \",10\"\n"
      "set output {png}\n"
      "set datafile separator \",\"\n"
      "set format y \"%g\"\n"
      "set grid xtics ytics mxtics mytics\n"
      "set xlabel \"sequence length (tokens)\"\n"
      "set key top left\n"
      "names = {names}\n"
      "colors = \"#222222 #4477aa #ee6677 #228833 #aa3377 #66ccee #ee7733\"\n"
      "set multiplot layout 1,3\n"
      "set logscale x 2\n"
      "set logscale y 10\n"
      "set title \"Forward+backward time (ms)\"\n"
      "{time}\n"
      "set title \"Peak memory of the forward+backward (MB)\"\n"
      "{memory}{predicted}\n"
      "unset logscale y\n"
      "set yrange [0:*]\n"
      "set title \"Forward+backward: % of the matmul peak of its dtype\"\n"
      "{fraction}\n"
      "unset multiplot\n",
      fmt::arg("png", gnuplot_quoted(png_path)), fmt::arg("names", gnuplot_quoted(names)),
      fmt::arg("time", plot("$8*1e3")), fmt::arg("memory", plot("$16/1e6")), fmt::arg("predicted", predicted),
      fmt::arg("fraction", plot("$15*100")));
}

}  // namespace dcp
