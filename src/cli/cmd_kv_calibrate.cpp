// `dcp kv-calibrate`: parses the options, loads the checkpoint and the calibration documents, runs the
// calibration (tools/kv_calibrate.h) and writes it beside the checkpoint.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "cli/kv_inputs.h"
#include "dcp/checkpoint.h"
#include "tools/bench_common.h"
#include "tools/kv_calibrate.h"
#include "util/file_write.h"

namespace dcp {
namespace {

struct KvCalibrateCli {
  std::string checkpoint, data_path, split = "calibration", policy = "minimax", out;
  std::string grid = "0.01,0.02,0.04,0.08,0.16,0.32", targets = "0.005,0.01,0.02";
  int64_t context = 1024, continuation = 128, max_docs = 32, chunk_tokens = 0, threads = 0;
  double coverage = 0.9;
  uint64_t seed = 0;
};

void run(const KvCalibrateCli& cli) {
  KvCalibrationOptions o;
  o.eval.context = cli.context;
  o.eval.continuation = cli.continuation;
  o.eval.max_docs = cli.max_docs;
  o.eval.seed = cli.seed;
  o.policy = cli.policy;
  o.grid = kv_parse_numbers(cli.grid, "--grid", 1e6);
  o.targets = kv_parse_numbers(cli.targets, "--targets");
  o.coverage = cli.coverage;
  const Config cfg = load_checkpoint_config(cli.checkpoint);
  o.eval.chunk_tokens = cli.chunk_tokens > 0 ? cli.chunk_tokens : cfg.kv.chunk_tokens;
  o.eval.chunk_pairs = cfg.kv.chunk_pairs;
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(e.what());
  }
  const std::string out = cli.out.empty() ? kv_calibration_path(cli.checkpoint) : cli.out;
  // The file must be writable before the calibration runs (minutes), not after.
  if (!can_create_beside(out)) {
    throw CLI::ValidationError(fmt::format("kv-calibrate: --out '{}': cannot write this file", out));
  }
  KvModel m = load_kv_model(cli.checkpoint, cfg, cli.threads, "kv-calibrate");
  Corpus corpus;
  const KvEvalSource source = kv_eval_source(cfg.data, cli.data_path, cli.split == "all" ? "" : cli.split, corpus);
  KvEvalDocuments docs;
  KvEvalOptions pick = o.eval;  // the document choice checks a whole kv-eval run: the reference's row stands in
  pick.policies = {"full"};
  pick.budgets = {1.0};
  try {
    docs = choose_kv_eval_documents(corpus, source.ids, pick);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(fmt::format("{} (split {} of {})", e.what(), source.split,
                                           source.data_path));
  }
  // Fewer documents than the conformal bound needs would make every choice "none": refused before running.
  const auto chosen = static_cast<int64_t>(docs.documents.size());
  if (chosen < kv_conformal_min_documents(o.coverage)) {
    // --max-docs helps only when it left long enough documents out.
    const std::string remedy =
        docs.not_chosen > 0 ? "raise --max-docs or lower --coverage"
                            : fmt::format("every long enough document is used ({} shorter than context + continuation "
                                          "skipped): lower --coverage, shorten --context or --continuation, or give "
                                          "more documents",
                                          docs.too_short);
    throw CLI::ValidationError(fmt::format(
        "kv-calibrate: {} documents cannot bound coverage {:g} (split conformal needs at least {}): {} (split {} of {})",
        chosen, o.coverage, kv_conformal_min_documents(o.coverage), remedy, source.split, source.data_path));
  }
  const double load_start = load_average_1min();
  KvCalibration c = run_kv_calibration(m.model, docs.documents, o, [](int64_t done, int64_t total) {
    fmt::print(stderr, "kv-calibrate: document {}/{} done\n", done, total);
  });
  c.checkpoint = cli.checkpoint;
  c.data_path = source.data_path;
  c.split = source.split;
  c.date = utc_now("%Y-%m-%d %H:%M");
  write_file_atomically(out, kv_calibration_json(c).dump(2) + "\n");
  fmt::print("# dcp kv-calibrate\n\n```sh\n{}\n```\n\n", own_command_line());
  fmt::print("Checkpoint `{}` ({}), {} documents from {} source files of `{}` (split {}), context {}, continuation "
             "{}, policy {}, intra-op threads: {}, 1-minute load average {:.2f} at the start, {:.2f} at the end.\n\n",
             cli.checkpoint, m.description, c.documents, c.source_files, c.data_path, c.split, c.context,
             c.continuation, c.policy, m.threads, load_start, load_average_1min());
  fmt::print("A target takes the largest max_rel_error whose conformal bound (rank {} from the smallest of the {} documents' "
             "increases: split conformal prediction, P(a new document's increase <= bound) >= {:g}) is within it.\n\n",
             kv_conformal_rank(c.documents, c.coverage), c.documents,
             c.coverage);
  fmt::print("| max_rel_error | mean rel bpb increase | q{:g} | conformal bound | bytes / full |\n|---|---|---|---|---|\n",
             100 * c.coverage);
  for (const auto& p : c.grid) {
    fmt::print("| {:g} | {:+.3f}% | {:+.3f}% | {} | {:.3f} |\n", p.max_rel_error, 100 * p.mean, 100 * p.q90,
               std::isfinite(p.bound) ? fmt::format("{:+.3f}%", 100 * p.bound) : std::string("+inf"), p.bytes_ratio);
  }
  fmt::print("\n| max_rel_bpb | chosen max_rel_error | its q{:g} | its bound | bytes / full |\n|---|---|---|---|---|\n",
             100 * c.coverage);
  for (const auto& ch : c.choices) {
    if (ch.max_rel_error > 0) {
      fmt::print("| {:g} | {:g} | {:+.3f}% | {:+.3f}% | {:.3f} |\n", ch.max_rel_bpb, ch.max_rel_error, 100 * ch.q90,
                 100 * ch.bound, ch.bytes_ratio);
    } else {
      fmt::print("| {:g} | none of the grid met it | - | - | - |\n", ch.max_rel_bpb);
    }
  }
  std::fflush(stdout);
  fmt::print(stderr, "kv-calibrate: wrote {}\n", out);
}

}  // namespace

void add_kv_calibrate_command(CLI::App& app) {
  auto* sub = app.add_subcommand("kv-calibrate", "Calibrate KV-cache error targets (kv.max_rel_bpb) for a trained "
                                                 "softmax model: minimax at a grid of max_rel_error values on "
                                                 "calibration documents; writes CHECKPOINT/kv_calibration.json");
  auto cli = std::make_shared<KvCalibrateCli>();
  sub->add_option("--checkpoint", cli->checkpoint, "checkpoint folder of a softmax model (run_dir/checkpoint)")
      ->required();
  sub->add_option("--data.path", cli->data_path,
                  "calibration documents (a folder of text files or a JSONL file); default: the checkpoint's "
                  "held-out split of its own corpus");
  sub->add_option("--split", cli->split,
                  "calibration (default: the half of the documents' source files that kv-eval --split evaluation "
                  "leaves out), evaluation, or all")
      ->check(CLI::IsMember({"calibration", "evaluation", "all"}))
      ->capture_default_str();
  sub->add_option("--policy", cli->policy, "the policy spec calibrated (its max_rel_error is set by the grid)")
      ->capture_default_str();
  sub->add_option("--grid", cli->grid, "comma list of max_rel_error values tried")->capture_default_str();
  sub->add_option("--targets", cli->targets, "comma list of max_rel_bpb targets (relative bits-per-byte increase)")
      ->capture_default_str();
  sub->add_option("--coverage", cli->coverage, "share of documents a target must hold on")
      ->check(CLI::Range(0.01, 0.99))
      ->capture_default_str();
  sub->add_option("--context", cli->context, "tokens prefilled per document (BOS included)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  sub->add_option("--continuation", cli->continuation, "tokens teacher-forced and scored after the context")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  sub->add_option("--max-docs", cli->max_docs, "documents at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  sub->add_option("--seed", cli->seed, "choice of documents")
      ->check(CLI::Validator(
          [](std::string& text) { return text.rfind('-', 0) == 0 ? std::string("must be >= 0") : std::string(); },
          "SEED"))
      ->capture_default_str();
  sub->add_option("--chunk-tokens", cli->chunk_tokens,
                  "prefill chunk of the KV cache, tokens (default: the checkpoint's kv.chunk_tokens)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  sub->add_option("--threads", cli->threads, "intra-op threads (default: the checkpoint's train.threads, else every core)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  sub->add_option("--out", cli->out, "the calibration file (default: CHECKPOINT/kv_calibration.json)")
      ->check(non_empty_path_validator());
  sub->callback([cli] { run(*cli); });
}

}  // namespace dcp
