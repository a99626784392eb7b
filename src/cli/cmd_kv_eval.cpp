// `dcp kv-eval`: parses the options, loads the checkpoint and the documents, and calls the driver
// (dcp/kv_eval.h) and its report writers (dcp/kv_eval_report.h).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "cli/kv_inputs.h"
#include "dcp/checkpoint.h"
#include "dcp/data.h"
#include "dcp/kv_policies.h"
#include "tools/bench_common.h"
#include "tools/kv_calibrate.h"
#include "tools/kv_eval.h"
#include "tools/kv_eval_report.h"
#include "util/number_text.h"

namespace dcp {
namespace {

struct KvEvalCli {
  std::string checkpoint, data_path, policies = "all", budgets = "0.05,0.1,0.25,0.5", out;
  std::string split, max_rel_bpb, calibration, paired_against;
  bool max_rel_bpb_given = false;  // --max-rel-bpb on the command line (an empty list is then an error)
  int64_t context = 1024, continuation = 128, max_docs = 32, chunk_tokens = 0, threads = 0;
  uint64_t seed = 0;
  bool json = false, head_ablation = false, allow_overlap = false;
};

std::vector<std::string> parse_policies(const std::string& text) {
  if (text == "all") return kv_policy_names();
  return kv_split_list(text, "--policies");
}

std::vector<double> parse_budgets(const std::string& text) {
  for (const auto& item : kv_split_list(text, "--budgets")) {
    const std::optional<double> v = parse_decimal(item);
    // parse_decimal takes no nan or inf; the range check also refuses 0 and anything above 1.
    if (!v || !(*v > 0 && *v <= 1)) {
      throw CLI::ValidationError(fmt::format("--budgets: '{}' is not a fraction in (0, 1] (a budget is the share of "
                                             "the tokens seen that each head keeps)",
                                             item));
    }
  }
  return kv_parse_numbers(text, "--budgets");
}

// A held-out check of error targets must not reuse the calibration's source files (issue 27 item 5). Returns what
// the report says about it ("" when the documents are held out; a warning when the file records no sources; "Not
// held out" with --allow-calibration-overlap); throws CLI::ValidationError (exit 2) on an overlap without it.
std::string held_out_note(const KvCalibration& cal, const std::string& path,
                          const std::vector<KvEvalDocument>& documents, bool allow_overlap) {
  if (cal.sources.empty()) {
    const std::string w = fmt::format("KV calibration '{}' records no source files (written before 2026-12-06): "
                                      "its overlap with the evaluated documents is not checked", path);
    fmt::print(stderr, "kv-eval: warning: {}\n", w);
    return "**Warning:** " + w + ". ";
  }
  const std::vector<std::string> overlap = kv_calibration_overlap(cal, documents);
  if (overlap.empty()) return "";
  if (allow_overlap) {
    return fmt::format("**Not held out** (--allow-calibration-overlap): {} of the evaluated documents' source files "
                       "were calibration documents. ",
                       overlap.size());
  }
  const std::string hint = cal.split == "calibration"  ? "evaluate --split evaluation, its complement"
                           : cal.split == "evaluation" ? "evaluate --split calibration, its complement"
                                                       : fmt::format("the calibration used split '{}': calibrate again "
                                                                     "with --split calibration and evaluate --split "
                                                                     "evaluation",
                                                                     cal.split);
  throw CLI::ValidationError(fmt::format(
      "--max-rel-bpb: {} of the evaluated documents' source files {} calibration documents of '{}' (first: '{}'), so "
      "the check would not be held out: {}, or pass --allow-calibration-overlap",
      overlap.size(), overlap.size() == 1 ? "was one of the" : "were", path, overlap.front(), hint));
}

void run(const KvEvalCli& cli) {
  KvEvalOptions o;
  o.policies = parse_policies(cli.policies);
  o.budgets = parse_budgets(cli.budgets);
  o.context = cli.context;
  o.continuation = cli.continuation;
  o.max_docs = cli.max_docs;
  o.seed = cli.seed;
  o.head_ablation = cli.head_ablation;
  o.paired_against = cli.paired_against;
  const Config cfg = load_checkpoint_config(cli.checkpoint);
  check_kv_checkpoint(cli.checkpoint, cfg, "kv-eval");  // before the calibration and the corpus are read
  o.chunk_tokens = cli.chunk_tokens > 0 ? cli.chunk_tokens : cfg.kv.chunk_tokens;
  o.chunk_pairs = cfg.kv.chunk_pairs;  // the checkpoint's, as dcp generate and dcp serve use it
  std::string calibration_note;
  KvCalibration cal;
  const std::string path = cli.calibration.empty() ? kv_calibration_path(cli.checkpoint) : cli.calibration;
  if (cli.max_rel_bpb_given) {
    // Error targets: minimax sized by the checkpoint's calibration (dcp kv-calibrate).
    const std::vector<double> targets = kv_parse_numbers(cli.max_rel_bpb, "--max-rel-bpb");
    if (const auto t = kv_first_repeat(targets); t != targets.end()) {
      throw CLI::ValidationError(fmt::format("--max-rel-bpb: target {} is given twice", *t));
    }
    cal = read_kv_calibration(path);  // a missing or bad file: exit 1 with its name
    for (double t : targets) {
      try {
        o.targets.push_back(kv_calibrated_target(cal, t));
      } catch (const std::invalid_argument& e) {
        throw CLI::ValidationError(fmt::format("--max-rel-bpb: {} ({})", e.what(), path));
      }
    }
    // The file's policy spec must run with an error target: a file that names one that cannot is a bad file (exit
    // 1, naming it), not a usage error.
    for (const auto& t : o.targets) kv_check_calibration_policy(t, path);
    calibration_note = fmt::format(
        "`{}` (policy {}, {} documents from {} source files of `{}`, split {}, context {}, continuation {}, {}; "
        "coverage {:g}): ",
        path, cal.policy, cal.documents, cal.source_files, cal.data_path, cal.split, cal.context, cal.continuation,
        cal.date, cal.coverage);
    for (const auto& t : o.targets) {
      calibration_note += fmt::format("max_rel_bpb {:g} -> max_rel_error {:g} (q{:g} {:+.2f}%, conformal bound "
                                      "{:+.2f}%, bytes {:.3f}); ",
                                      t.max_rel_bpb, t.max_rel_error, 100 * cal.coverage, 100 * t.calibrated_q90,
                                      100 * t.calibrated_bound, t.calibrated_bytes_ratio);
    }
  }
  // Usage errors (a policy name or option, a count) exit 2 before the model and the corpus are loaded.
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(e.what());
  }
  if (!cli.out.empty()) check_kv_out_prefix(cli.out);

  // The checkpoint's data config (max_seq_len cuts documents as in training); --data.path is read whole.
  Corpus corpus;
  const KvEvalSource source = kv_eval_source(cfg.data, cli.data_path, cli.split == "all" ? "" : cli.split, corpus);
  KvEvalReportInfo info;
  try {
    info.documents = choose_kv_eval_documents(corpus, source.ids, o);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(fmt::format("{} (split {} of {})", e.what(), source.split, source.data_path));
  }
  if (cli.max_rel_bpb_given) calibration_note += held_out_note(cal, path, info.documents.documents, cli.allow_overlap);
  KvModel m = load_kv_model(cli.checkpoint, cfg, cli.threads, "kv-eval");
  if (cli.max_rel_bpb_given) {
    // The calibration must be of these weights (exit 1, naming both fingerprints, when it is not).
    const std::string w = kv_check_calibration_weights(cal, kv_weights_fingerprint(m.model), path);
    if (!w.empty()) {
      fmt::print(stderr, "kv-eval: warning: {}\n", w);
      calibration_note += "**Warning:** " + w + ". ";
    }
  }
  info.command = own_command_line();
  info.checkpoint = cli.checkpoint;
  info.data_path = source.data_path;
  info.split = source.split;
  info.calibration = calibration_note;
  info.threads = m.threads;
  info.parameters = m.parameters;
  info.model = m.description;
  run_and_report_kv_eval(m.model, o, std::move(info), cli.json, cli.out);
}

}  // namespace

void add_kv_eval_command(CLI::App& app) {
  auto* sub = app.add_subcommand("kv-eval", "Measure KV-cache compression policies on a trained softmax model: "
                                            "bits per byte of teacher-forced continuations, attention error, bytes");
  auto cli = std::make_shared<KvEvalCli>();
  sub->add_option("--checkpoint", cli->checkpoint, "checkpoint folder of a softmax model (run_dir/checkpoint)")
      ->required();
  sub->add_option("--data.path", cli->data_path,
                  "documents to evaluate (a folder of text files or a JSONL file; every sample is used); default: "
                  "the held-out split of the checkpoint's own corpus");
  sub->add_option("--policies", cli->policies,
                  fmt::format("comma list of policies or 'all' ({}); a policy may carry options as "
                              "NAME:KEY=VALUE[:KEY=VALUE], e.g. minimax:abstain_tail=0.3 (the budget comes from "
                              "--budgets)",
                              fmt::join(kv_policy_names(), ", ")))
      ->capture_default_str();
  sub->add_option("--budgets", cli->budgets, "comma list of budgets, each a fraction in (0, 1] of the tokens kept")
      ->capture_default_str();
  sub->add_option("--context", cli->context, "tokens prefilled per document (BOS included)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  sub->add_option("--continuation", cli->continuation, "tokens teacher-forced and scored after the context")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  sub->add_option("--max-docs", cli->max_docs, "documents evaluated at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  sub->add_option("--seed", cli->seed, "choice of documents and bootstrap resamples")
      ->check(CLI::Validator(
          [](std::string& text) { return text.rfind('-', 0) == 0 ? std::string("must be >= 0") : std::string(); },
          "SEED"))
      ->capture_default_str();
  sub->add_option("--chunk-tokens", cli->chunk_tokens,
                  "prefill chunk of the KV cache, tokens (default: the checkpoint's kv.chunk_tokens)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  // One token's forward is many small operations: on a machine shared with other jobs, fewer threads can be
  // faster (bench-attention has the same option).
  sub->add_option("--threads", cli->threads,
                  "intra-op threads (default: the checkpoint's train.threads, else every core)")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}));
  sub->add_flag("--head-ablation", cli->head_ablation,
                fmt::format("also run every document once per (layer, head) with only that head's cache cut after "
                            "prefill to its first {} and newest {} entries: which heads need the distant context",
                            kKvAblationSinks, kKvAblationRecent));
  sub->add_option("--split", cli->split,
                  "calibration or evaluation: one half of the documents by source file (disjoint halves; kv-calibrate "
                  "uses calibration), or all (the default)")
      ->check(CLI::IsMember({"calibration", "evaluation", "all"}));
  auto* max_rel_bpb = sub->add_option("--max-rel-bpb", cli->max_rel_bpb,
                  "comma list of error targets (relative bits-per-byte increase, e.g. 0.005,0.01,0.02): one minimax "
                  "row each, sized by the checkpoint's calibration (dcp kv-calibrate)");
  sub->add_option("--calibration", cli->calibration,
                  "the calibration file of --max-rel-bpb (default: CHECKPOINT/kv_calibration.json)")
      ->check(non_empty_path_validator())
      ->needs(max_rel_bpb);
  sub->add_flag("--allow-calibration-overlap", cli->allow_overlap,
                "evaluate error targets on documents whose source files the calibration used (refused by default: "
                "the check is then not held out; the report says so)")
      ->needs(max_rel_bpb);
  sub->add_option("--paired-against", cli->paired_against,
                  "the policy compared per document with every other at each budget (default: minimax when run)");
  sub->add_flag("--json", cli->json, "print the results as one JSON object instead of the markdown report");
  sub->add_option("--out", cli->out, "write PREFIX.md, PREFIX.csv and PREFIX.png (gnuplot)")
      ->check(non_empty_path_validator());
  sub->callback([cli, max_rel_bpb] {
    cli->max_rel_bpb_given = max_rel_bpb->count() > 0;
    run(*cli);
  });
}

}  // namespace dcp
