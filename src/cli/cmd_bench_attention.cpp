// `dcp bench-attention`: forward and backward time, useful FLOP rate against the measured matmul peak, and peak
// memory of one layer's attention operator, the tiled softmax against its reference and the Flexformer variants,
// over sequence lengths (dcp/attention_bench.h), written as markdown, CSV and a PNG.
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "tools/attention_bench_report.h"
#include "tools/bench_common.h"
#include "cli/commands.h"
#include "tools/attention_bench.h"
#include "dcp/cpu_features.h"
#include "tools/matmul_peak.h"
#include "dcp/memory_meter.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

struct BenchAttentionOptions {
  std::string config_path;
  std::string lengths = "512,1024,2048,4096,8192,16384,32768,65536";
  std::string variants = "all";
  std::string dtype = "fp32";
  int64_t heads = 0, head_dim = 0, num_features = 0, chunk_size = 0;  // 0: from the config
  int64_t repetitions = 3;
  int64_t threads = 0;       // 0: every hardware thread
  int64_t matmul_size = 2048;  // n of the n^3 product whose rate is the peak
  double max_bytes = 0;      // 0: kDefaultMemoryShare of physical RAM
  double max_seconds = 60;
  std::string out;           // empty: bench/results/cpu<cores>_<yyyymm>_attention
  std::string note;
  bool plot = true;
};

// Softmax may use half of the RAM: the rest is for the process, the OS and whatever else shares the machine.
constexpr double kDefaultMemoryShare = 0.5;

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

std::vector<int64_t> parse_lengths(const std::string& list) {
  std::vector<int64_t> out;
  for (const auto& item : split(list)) {
    size_t used = 0;
    int64_t len = 0;
    try {
      len = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || len < 1) {
      throw CLI::ValidationError(
          fmt::format("--lengths: bad length '{}' in '{}' (allowed: comma-separated integers >= 1)", item, list));
    }
    if (std::find(out.begin(), out.end(), len) != out.end()) {
      throw CLI::ValidationError(fmt::format("--lengths: length {} is listed twice in '{}'", len, list));
    }
    out.push_back(len);
  }
  if (out.empty()) throw CLI::ValidationError(fmt::format("--lengths: no length in '{}'", list));
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> parse_variants(const std::string& list) {
  const auto& known = attention_bench_variants();
  if (list == "all") return known;
  std::vector<std::string> out;
  for (const auto& name : split(list)) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw CLI::ValidationError(
          fmt::format("--variants: unknown variant '{}' (known: {}, or all)", name, fmt::join(known, ", ")));
    }
    if (std::find(out.begin(), out.end(), name) != out.end()) {
      throw CLI::ValidationError(fmt::format("--variants: variant '{}' is listed twice in '{}'", name, list));
    }
    out.push_back(name);
  }
  if (out.empty()) throw CLI::ValidationError(fmt::format("--variants: no variant in '{}'", list));
  return out;
}

double physical_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

std::string report_markdown(const BenchAttentionOptions& cli, const AttentionBenchOptions& o,
                            const std::vector<AttentionBenchPoint>& points, const MatmulPeak& peak, int64_t threads,
                            double load_start, double load_end, double wall_s, const std::string& date,
                            const std::string& png_name) {
  const auto summaries = summarize_attention_bench(points);
  const int64_t skipped = std::count_if(points.begin(), points.end(), [](const auto& p) { return !p.measured; });
  std::string md = fmt::format("# dcp bench-attention: {}, {} heads x head_dim {}, {} variants, {} to {} tokens\n\n",
                               o.dtype, o.heads, o.head_dim, o.variants.size(), o.lengths.front(), o.lengths.back());
  md += fmt::format("Command:\n\n```\n{}\n```\n\n", own_command_line());
  // OpenMP's environment changes how intra-op threads wait, which matters on a shared machine; OPENBLAS_CORETYPE
  // overrides the fp32 kernels OpenBLAS chose (blas_description).
  std::string omp_env;
  for (const char* name : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_CORETYPE"}) {
    if (const char* value = std::getenv(name)) omp_env += fmt::format(" {}={}", name, value);
  }
  md += fmt::format(
      "Date: {} UTC. Machine: {} hardware threads, {} intra-op threads, {:.1f} GB physical RAM; CPU features: {}; "
      "LibTorch {}.{}.{}; BLAS: {}; environment:{}; 1-minute load average {:.2f} at the start, {:.2f} at the end; "
      "the run took {:.0f} s.{}\n\n",
      date, std::thread::hardware_concurrency(), threads, physical_memory_bytes() / 1e9, cpu_features().summary(),
      TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, blas_description(),
      omp_env.empty() ? " (none set)" : omp_env,
      load_start, load_end, wall_s, cli.note.empty() ? "" : " " + cli.note);
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
      "fp32). Flexformer: chunked form, chunk_size {chunk}, num_features {m}, input_norm {norm}, normalizer "
      "{normalizer}, built by make_attention_backend as the model does; it takes the {dtype} inputs and returns "
      "{dtype}, with its features and states in fp32 whatever the input dtype. Time: median of {reps} timed runs "
      "after one warm-up (std::chrono::steady_clock), forward and backward timed separately (fwd+bwd is the median "
      "of each run's sum), lengths outer and variants inner so that load drift hits all variants at a length "
      "alike.\n\n",
      fmt::arg("heads", o.heads), fmt::arg("d", o.head_dim), fmt::arg("dtype", o.dtype), fmt::arg("tq", o.tile_q),
      fmt::arg("tk", o.tile_k), fmt::arg("chunk", o.chunk_size), fmt::arg("m", o.num_features),
      fmt::arg("norm", o.input_norm), fmt::arg("normalizer", o.normalizer), fmt::arg("reps", o.repetitions));
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
      "token-linear terms; the tiled softmax and flexformer: linear in L, tiled_attention_peak_bytes and "
      "flexformer_attention_peak_bytes in dcp/attention_bench.h); a point whose allocation fails is skipped with "
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

void run_bench_attention(const BenchAttentionOptions& cli, const std::vector<std::string>& overrides) {
  const Config cfg = Config::load(cli.config_path, overrides);
  AttentionBenchOptions o;
  o.lengths = parse_lengths(cli.lengths);
  o.variants = parse_variants(cli.variants);
  o.dtype = cli.dtype;
  o.heads = cli.heads > 0 ? cli.heads : cfg.model.n_heads;
  o.head_dim = cli.head_dim > 0 ? cli.head_dim : cfg.model.d_model / cfg.model.n_heads;
  o.num_features = cli.num_features > 0 ? cli.num_features : cfg.attention.num_features;
  o.chunk_size = cli.chunk_size > 0 ? cli.chunk_size : cfg.attention.chunk_size;
  o.input_norm = cfg.attention.input_norm;
  o.normalizer = cfg.attention.normalizer;
  o.tile_q = cfg.attention.tile_q;
  o.tile_k = cfg.attention.tile_k;
  o.repetitions = cli.repetitions;
  o.max_bytes = cli.max_bytes > 0 ? cli.max_bytes : kDefaultMemoryShare * physical_memory_bytes();
  o.max_seconds = cli.max_seconds;
  o.seed = static_cast<uint64_t>(cfg.run.seed);
  if (cli.plot && !gnuplot_available()) {
    throw std::runtime_error("gnuplot not found in PATH; install it (scripts/install-deps.sh installs gnuplot-nox) "
                             "or pass --no-plot");
  }
  const fs::path prefix = cli.out.empty() ? fs::path(fmt::format("bench/results/cpu{}_{}_attention",
                                                                 std::thread::hardware_concurrency(), utc_now("%Y%m")))
                                          : fs::path(cli.out);
  if (prefix.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(prefix.parent_path(), ec);
    if (ec) {
      throw CLI::ValidationError(fmt::format("--out '{}': cannot create the folder '{}': {}", cli.out,
                                             prefix.parent_path().string(), ec.message()));
    }
  }
  const fs::path md = prefix.string() + ".md", csv = prefix.string() + ".csv", png = prefix.string() + ".png";
  {  // an unwritable --out fails now, not after the measurements (and leaves no empty file behind)
    const bool existed = fs::exists(csv);
    const bool writable = std::ofstream(csv, std::ios::app).good();
    if (!existed && writable) fs::remove(csv);
    if (!writable) throw CLI::ValidationError(fmt::format("--out '{}': cannot write '{}'", cli.out, csv.string()));
  }

  const int64_t threads = cli.threads > 0 ? cli.threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
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
  const MatmulPeak peak = measure_matmul_peak(cli.matmul_size);
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
  if (cli.plot) {
    const fs::path script = prefix.string() + ".gnuplot", log = prefix.string() + ".gnuplot.log";
    run_gnuplot(attention_bench_gnuplot_script(csv.string(), png.string(), o.variants), script, log);
    fs::remove(script);
    fs::remove(log);
  }
  write_text(md, report_markdown(cli, o, points, peak, threads, load_start, load_end, wall_s, date,
                                 cli.plot ? png.filename().string() : ""));
  fmt::print("\n{}\nwrote {}, {}{}\n",
             attention_bench_markdown_tables(points, summarize_attention_bench(points), peak), md.string(),
             csv.string(), cli.plot ? ", " + png.string() : "");
}

}  // namespace

void add_bench_attention_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench-attention", "Time and measure one attention layer's forward and backward "
                                                    "against sequence length: the tiled softmax vs its reference and "
                                                    "the flexformer variants, with GFLOP/s against the matmul peak");
  auto opt = std::make_shared<BenchAttentionOptions>();
  sub->add_option("--config", opt->config_path, "YAML config whose model.n_heads, d_model / n_heads and attention.* "
                                                "(num_features, chunk_size, input_norm, normalizer) are used")
      ->check(CLI::ExistingFile);
  sub->add_option("--lengths", opt->lengths, "comma-separated sequence lengths, tokens")->capture_default_str();
  sub->add_option("--variants", opt->variants,
                  fmt::format("comma-separated variants; all = {}", fmt::join(attention_bench_variants(), ",")))
      ->capture_default_str();
  sub->add_option("--dtype", opt->dtype, "dtype of q, k, v and the output gradient: fp32 or bf16")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& dtype) -> std::string {
            const auto& known = attention_bench_dtypes();
            if (std::find(known.begin(), known.end(), dtype) != known.end()) return "";
            return fmt::format("unknown dtype '{}' (allowed: {})", dtype, fmt::join(known, ", "));
          },
          "fp32|bf16"));
  sub->add_option("--heads", opt->heads, "attention heads (default: model.n_heads, 4)")->check(CLI::Range(1, 4096));
  sub->add_option("--head-dim", opt->head_dim, "dimension per head (default: model.d_model / model.n_heads, 32)")
      ->check(CLI::Range(1, 65536));
  sub->add_option("--num-features", opt->num_features, "flexformer frequencies per head (default: "
                                                        "attention.num_features, 64)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--chunk-size", opt->chunk_size, "flexformer chunk size, tokens (default: attention.chunk_size, 64)")
      ->check(CLI::Range(1, 1 << 30));
  sub->add_option("--repetitions", opt->repetitions, "timed runs per point after one warm-up (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  sub->add_option("--threads", opt->threads, "intra-op threads (default: every hardware thread)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--matmul-size", opt->matmul_size, "n of the n x n x n fp32 and bf16 matmuls whose median rate "
                                                     "is the peak of the % of peak columns")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  sub->add_option("--max-bytes", opt->max_bytes, "skip lengths whose predicted peak exceeds this many bytes, >= 1 "
                                                 "(default: half of the physical RAM)")
      ->check(finite_number_validator("bytes", 1));
  sub->add_option("--max-seconds", opt->max_seconds, "once a run of a variant takes longer, skip its longer lengths")
      ->capture_default_str()
      ->check(finite_number_validator("seconds"));
  sub->add_option("--out", opt->out, "path prefix of the .md, .csv and .png results, ending in a file name stem "
                                     "(default: bench/results/cpu<hardware threads>_<yyyymm>_attention)")
      ->check(CLI::Validator(
          [](std::string& out) -> std::string {
            if (out.empty() || fs::path(out).filename().empty()) {
              return fmt::format("must be a path prefix ending in a file name stem, e.g. bench/results/mine, got "
                                 "'{}'",
                                 out);
            }
            return "";
          },
          "PREFIX"));
  sub->add_option("--note", opt->note, "a sentence added to the report's machine line (e.g. what else ran)");
  sub->add_flag("!--no-plot", opt->plot, "skip the gnuplot PNG");
  sub->allow_extras();
  sub->footer("Config keys can be overridden as --section.key=value (e.g. --attention.normalizer=clamp).");
  sub->callback([sub, opt] { run_bench_attention(*opt, config_overrides(*sub)); });
}

}  // namespace dcp
