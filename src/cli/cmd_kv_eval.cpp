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
#include "dcp/checkpoint.h"
#include "dcp/data.h"
#include "dcp/kv_policies.h"
#include "dcp/precision.h"
#include "runtime/optimizer.h"
#include "tools/bench_common.h"
#include "tools/kv_eval.h"
#include "tools/kv_eval_report.h"
#include "util/number_text.h"

namespace dcp {
namespace fs = std::filesystem;

namespace {

struct KvEvalCli {
  std::string checkpoint, data_path, policies = "all", budgets = "0.05,0.1,0.25,0.5", out;
  int64_t context = 1024, continuation = 128, max_docs = 32, chunk_tokens = 0, threads = 0;
  uint64_t seed = 0;
  bool json = false, head_ablation = false;
};

std::vector<std::string> split_list(const std::string& text, const std::string& option) {
  std::vector<std::string> items;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) items.push_back(item);
  if (!text.empty() && text.back() == ',') items.emplace_back();
  for (const auto& i : items) {
    if (i.empty()) throw CLI::ValidationError(fmt::format("{} '{}': empty entry in the comma list", option, text));
  }
  if (items.empty()) throw CLI::ValidationError(fmt::format("{}: empty list", option));
  return items;
}

std::vector<std::string> parse_policies(const std::string& text) {
  if (text == "all") return kv_policy_names();
  return split_list(text, "--policies");
}

std::vector<double> parse_budgets(const std::string& text) {
  std::vector<double> out;
  for (const auto& item : split_list(text, "--budgets")) {
    const std::optional<double> v = parse_decimal(item);
    // parse_decimal takes no nan or inf; the range check also refuses 0 and anything above 1.
    if (!v || !(*v > 0 && *v <= 1)) {
      throw CLI::ValidationError(fmt::format("--budgets: '{}' is not a fraction in (0, 1] (a budget is the share of "
                                             "the tokens seen that each head keeps)",
                                             item));
    }
    out.push_back(*v);
  }
  return out;
}

// --out PREFIX must be writable before the evaluation runs (it can take minutes): exit 2 naming it otherwise.
void check_out_prefix(const std::string& prefix) {
  const fs::path md = prefix + ".md";
  std::error_code ec;
  if (!md.parent_path().empty()) fs::create_directories(md.parent_path(), ec);
  // A probe file beside the report, removed again: a failed evaluation leaves no empty report behind.
  const fs::path probe_path = md.string() + ".probe";
  const bool ok = !ec && static_cast<bool>(std::ofstream(probe_path));
  fs::remove(probe_path, ec);
  if (!ok) {
    throw CLI::ValidationError(fmt::format("--out '{}': cannot write a file in '{}'", prefix,
                                           md.parent_path().empty() ? "." : md.parent_path().string()));
  }
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
  o.chunk_tokens = cli.chunk_tokens;
  Config cfg = load_checkpoint_config(cli.checkpoint);
  o.chunk_tokens = cli.chunk_tokens > 0 ? cli.chunk_tokens : cfg.kv.chunk_tokens;
  // Usage errors (a policy name or option, a count) exit 2 before the model and the corpus are loaded.
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(e.what());
  }
  if (!cli.out.empty()) check_out_prefix(cli.out);

  if (cfg.attention.backend != "softmax") {
    throw CLI::ValidationError(fmt::format("--checkpoint '{}': attention.backend is '{}'; kv-eval needs a softmax "
                                           "model (flexformer models decode from recurrent states, with no KV "
                                           "cache to compress)",
                                           cli.checkpoint, cfg.attention.backend));
  }
  // --threads, else the trainer's rule (train.threads, else every core of this one process).
  const int64_t threads = cli.threads > 0 ? cli.threads : threads_per_rank(cfg.train, DistEnv{});
  torch::set_num_threads(static_cast<int>(threads));
  Transformer model(cfg.model, cfg.attention, resolve_precision(cfg.train.precision).precision);
  load_checkpoint(cli.checkpoint, model, nullptr);
  model->eval();

  // The checkpoint's data config (max_seq_len cuts documents as in training). Another path is read whole: its
  // format detected, every sample evaluated (its split would say nothing about what the model trained on).
  DataConfig data = cfg.data;
  const bool own_corpus = cli.data_path.empty();
  if (!own_corpus) {
    data.path = cli.data_path;
    data.format = "auto";
    data.heldout_fraction = 0;
  }
  const Corpus corpus = Corpus::load(data);
  std::vector<int64_t> ids = own_corpus ? corpus.heldout_ids() : corpus.train_ids();
  KvEvalReportInfo info;
  try {
    info.documents = choose_kv_eval_documents(corpus, ids, o);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(fmt::format("{} ({})", e.what(),
                                           own_corpus ? "the checkpoint's held-out split of " + data.path
                                                      : "--data.path " + data.path));
  }
  info.command = own_command_line();
  info.checkpoint = cli.checkpoint;
  info.data_path = data.path;
  info.split = own_corpus ? "heldout" : "all";
  info.threads = threads;
  for (const auto& p : model->parameters()) info.parameters += p.numel();
  info.model = fmt::format("d_model {}, {} layers, {} heads, {}", cfg.model.d_model, cfg.model.n_layers,
                           cfg.model.n_heads, resolve_precision(cfg.train.precision).precision == Precision::kBf16
                                                  ? "bf16" : "fp32");
  run_and_report_kv_eval(model, o, std::move(info), cli.json, cli.out);
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
  sub->add_flag("--json", cli->json, "print the results as one JSON object instead of the markdown report");
  sub->add_option("--out", cli->out, "write PREFIX.md, PREFIX.csv and PREFIX.png (gnuplot)");
  sub->callback([cli] { run(*cli); });
}

}  // namespace dcp
