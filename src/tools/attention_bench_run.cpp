// `dcp bench-attention`'s driver and report: the matmul peak, every point measured (tools/attention_bench.h),
// progress lines, then the markdown report, the CSV and the PNG (tools/attention_bench_report.h).
#include "tools/attention_bench_run.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "dcp/cpu_features.h"
#include "dcp/memory_meter.h"
#include "tools/attention_bench_report.h"
#include "tools/bench_common.h"
#include "tools/matmul_peak.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

std::string report_markdown(const AttentionBenchRun& run, const AttentionBenchOptions& o,
                            const std::vector<AttentionBenchPoint>& points, const MatmulPeak& peak, int64_t threads,
                            double load_start, double load_end, double wall_s, const std::string& date,
                            const std::string& png_name) {
  const auto summaries = summarize_attention_bench(points);
  const int64_t skipped = std::count_if(points.begin(), points.end(), [](const auto& p) { return !p.measured; });
  std::string md = fmt::format("# dcp bench-attention: {}, {} heads x head_dim {}, {} variants, {} to {} tokens\n\n",
                               o.dtype, o.heads, o.head_dim, o.variants.size(), o.lengths.front(), o.lengths.back());
  md += fmt::format("Command:\n\n```\n{}\n```\n\n", own_command_line());
  // OpenMP's environment changes how intra-op threads wait, which matters on a shared machine; OPENBLAS_CORETYPE
  // overrides the fp32 kernels OpenBLAS chose (blas_description); the MALLOC_ variables replace the dcp binary's
  // malloc settings (src/cli/host_memory.h), which decide whether fresh output tensors fault their pages in.
  std::string omp_env;
  for (const char* name : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_CORETYPE"}) {
    if (const char* value = std::getenv(name)) omp_env += fmt::format(" {}={}", name, value);
  }
  std::string malloc_env;
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"}) {
    if (const char* value = std::getenv(name)) malloc_env += fmt::format(" {}={}", name, value);
  }
  md += fmt::format(
      "Date: {} UTC. Machine: {} hardware threads, {} intra-op threads, {:.1f} GB physical RAM; CPU features: {}; "
      "LibTorch {}.{}.{}; BLAS: {}; environment:{}; malloc:{}; 1-minute load average {:.2f} at the start, {:.2f} at "
      "the end; the run took {:.0f} s.{}\n\n",
      date, std::thread::hardware_concurrency(), threads, physical_memory_bytes() / 1e9, cpu_features().summary(),
      TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, blas_description(),
      omp_env.empty() ? " (none set)" : omp_env,
      malloc_env.empty() ? " freed blocks up to 1 GiB stay in the heap (src/cli/host_memory.h)" : malloc_env,
      load_start, load_end, wall_s, run.note.empty() ? "" : " " + run.note);
  md += fmt::format(
      "Matmul peak (measured by this run before the points, intra-op threads: {threads}): torch::matmul of two "
      "random [{n}, {n}] matrices, 2 x {n}^3 FLOPs, median of {runs} runs after one warm-up: **fp32 {fp32:.1f} "
      "GFLOP/s, bf16 {bf16:.1f} GFLOP/s**. Each point's % of peak is against the peak of its dtype ({dtype}).\n\n",
      fmt::arg("threads", peak.threads), fmt::arg("n", peak.size), fmt::arg("runs", peak.runs),
      fmt::arg("fp32", peak.fp32_gflops), fmt::arg("bf16", peak.bf16_gflops), fmt::arg("dtype", o.dtype));
  md += fmt::format(
      "Setup: one sequence of L tokens (cu_seqlens {{0, L}}), q, k, v [L, {heads}, {d}] {dtype} ~ N(0, 1) requiring "
      "grad; one run = the operator's forward, then torch::autograd::backward({{out}}, {{g}}) with a fixed random "
      "g [L, {heads}, {d}] {dtype} (the flexformer variants also get their fp32 parameters' gradients). softmax: "
      "the tiled operator (tiles {tq} x {tk}); softmax-reference: its per-sample [L, L] twin (which upcasts bf16 to "
      "fp32). Flexformer (stationary, nonstationary, fixed, elu): the fused chunked kernel on path {path} "
      "(attention.linear_impl fused); <map>-reference: its autograd twin, the chunked form (linear_impl reference); "
      "chunk_size {chunk}, num_features {m}, input_norm {norm}, normalizer {normalizer}, built by "
      "make_attention_backend as the model does; both take the {dtype} inputs and return {dtype}, with states and "
      "accumulators in fp32 whatever the input dtype (the fused kernel's bf16 path rounds the scan's product operands "
      "to bf16). Time: median of {reps} timed runs "
      "after one warm-up (std::chrono::steady_clock), forward and backward timed separately (fwd+bwd is the median "
      "of each run's sum), lengths outer and variants inner so that load drift hits all variants at a length "
      "alike.\n\n",
      fmt::arg("heads", o.heads), fmt::arg("d", o.head_dim), fmt::arg("dtype", o.dtype), fmt::arg("tq", o.tile_q),
      fmt::arg("tk", o.tile_k), fmt::arg("chunk", o.chunk_size), fmt::arg("m", o.num_features),
      fmt::arg("norm", o.input_norm), fmt::arg("normalizer", o.normalizer), fmt::arg("reps", o.repetitions),
      fmt::arg("path", to_string(resolve_linear_attention_path(o.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat,
                                                               LinearAttentionPath::kAuto))));
  md += "FLOPs: softmax and softmax-reference alike are credited with the causal products only, forward "
        "4 x (L^2 / 2) x head_dim x heads (QK^T and PV over the lower triangle) and backward 2.5x that, so "
        "fwd+bwd = 3.5 x 2 L^2 x head_dim x heads; the reference multiplies the whole square, so its rate is "
        "useful work, as the tiled operator's is. The flexformer variants are credited with the cost model's FLOPs "
        "of the chunked form (CostModel, dcp/cost_model.h: forward A(L) = heads L (2 C F + 2 C D' + 4 F D' + 4 P "
        "head_dim), backward 2 A(L)). GFLOP/s = FLOPs / median seconds.\n\n";
  md += fmt::format(
      "Memory: MemoryMeter (dcp/memory_meter.h, method {meter}): peak memory is the most bytes of tensor storage "
      "alive during a run minus those alive before it (the inputs and parameters). The memory ratio is (inputs + "
      "peak) / IO bytes, where the inputs are q, k, v, g and the parameters, and the IO bytes are those of q, k, v, "
      "out, g, dq, dk, dv ({e} B per element) and the [L, heads] fp32 logsumexp: an exact operator cannot hold "
      "less than 1 (issue 10's target for the tiled softmax: within 1.2x).\n\n",
      fmt::arg("meter", MemoryMeter::method()), fmt::arg("e", attention_bench_element_bytes(o.dtype)));
  md += fmt::format(
      "Skips (never silent; {} of {} points): a length is skipped when its predicted peak exceeds --max-bytes = "
      "{:.1f} GB (softmax-reference keeps [heads, L, L] fp32 scores: 3 x heads x L^2 x 4 B + 2 x L^2 B of masks + "
      "token-linear terms; the tiled softmax and flexformer: linear in L, tiled_attention_peak_bytes, "
      "fused_flexformer_peak_bytes (the fused kernel) and flexformer_attention_peak_bytes (its autograd twins) in "
      "dcp/attention_bench.h); a point whose allocation fails is skipped with "
      "LibTorch's message and so are the variant's longer lengths; once one run of a variant takes more than "
      "--max-seconds = {:g} s, its remaining runs at that length and its longer lengths are skipped (a warm-up past "
      "the cap is that length's only time, marked \"warm-up only\").\n\n",
      skipped, points.size(), o.max_bytes / 1e9, o.max_seconds);
  md += "Slopes: least-squares slope of log(time), and of log(inputs + peak memory), against log(length) over the "
        "measured lengths >= 4K (all measured lengths when fewer than 2 are that long); 1 is linear, 2 quadratic. "
        "Crossover (flexformer variants): the shortest length from which the variant is faster than the tiled "
        "softmax at every longer length where both were measured; the interpolated value is where the log time "
        "ratio, linear in log length between the two bracketing measured lengths, crosses 0 (geometric "
        "interpolation).\n\n";
  md += attention_bench_markdown_tables(points, summaries, peak);
  if (!png_name.empty()) md += fmt::format("\n![time, peak memory and % of peak against length]({})\n", png_name);
  return md;
}

}  // namespace

void run_attention_bench(const AttentionBenchRun& run) {
  const AttentionBenchOptions& o = run.options;
  const fs::path prefix(run.prefix);
  const fs::path md = prefix.string() + ".md", csv = prefix.string() + ".csv", png = prefix.string() + ".png";
  const int64_t threads = run.threads > 0 ? run.threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  torch::set_num_threads(static_cast<int>(threads));
  MemoryMeter::install();
  const std::string date = utc_now("%Y-%m-%d %H:%M");
  fmt::print("dcp bench-attention: {} at {} tokens; {}, heads {}, head_dim {}, {} threads, median of {} runs\n",
             fmt::join(o.variants, ", "), fmt::join(o.lengths, ","), o.dtype, o.heads, o.head_dim, threads,
             o.repetitions);
  std::fflush(stdout);
  const double load_start = load_average_1min();
  const auto start = std::chrono::steady_clock::now();
  // Once per run, before the points, with the points' thread count: the yardstick of their % of peak.
  const MatmulPeak peak = measure_matmul_peak(run.matmul_size);
  fmt::print("matmul peak ({}^3, {} threads): fp32 {:.1f} GFLOP/s, bf16 {:.1f} GFLOP/s\n", peak.size, peak.threads,
             peak.fp32_gflops, peak.bf16_gflops);
  std::fflush(stdout);
  const auto points = bench_attention(o, [&peak](const AttentionBenchPoint& p) {
    if (p.measured) {
      const auto fraction = fraction_of_peak(p, peak);
      const auto ratio = memory_ratio(p);
      fmt::print("{:>6} {:<17} fwd {:9.1f} ms  bwd {:9.1f} ms  {:7.1f} GFLOP/s {:5.1f}% of peak  peak {:9.1f} MB "
                 "(x{:.2f} of IO)  ({})\n",
                 p.length, p.variant, 1e3 * p.forward_seconds, 1e3 * p.backward_seconds, point_gflops(p).value_or(0),
                 100 * fraction.value_or(0), p.peak_bytes / 1e6, ratio.value_or(0),
                 p.runs ? fmt::format("median of {}", p.runs) : std::string("warm-up only"));
    } else {
      fmt::print("{:>6} {:<17} skipped: {}\n", p.length, p.variant, p.skip_reason);
    }
    std::fflush(stdout);
  });
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double load_end = load_average_1min();

  write_text(csv, attention_bench_csv(points, peak));
  if (run.plot) {
    const fs::path script = prefix.string() + ".gnuplot", log = prefix.string() + ".gnuplot.log";
    run_gnuplot(attention_bench_gnuplot_script(csv.string(), png.string(), o.variants), script, log);
    fs::remove(script);
    fs::remove(log);
  }
  write_text(md, report_markdown(run, o, points, peak, threads, load_start, load_end, wall_s, date,
                                 run.plot ? png.filename().string() : ""));
  fmt::print("\n{}\nwrote {}, {}{}\n",
             attention_bench_markdown_tables(points, summarize_attention_bench(points), peak), md.string(),
             csv.string(), run.plot ? ", " + png.string() : "");
}

}  // namespace dcp
