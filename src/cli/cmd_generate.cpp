#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <optional>

#include "cli/commands.h"
#include "dcp/checkpoint.h"
#include "dcp/infer.h"
#include "dcp/kv_policies.h"
#include "tools/kv_calibrate.h"
#include "tools/kv_eval.h"
#include "util/number_text.h"

namespace dcp {
namespace {

struct KvChoice {
  std::string policy;
  double budget = 0;  // 0 = not given
  double max_rel_bpb = -1;  // < 0 = not given
  std::vector<std::string> options;
};

// kv.max_rel_bpb: the calibrated policy (minimax with max_rel_error, CHECKPOINT/kv_calibration.json) plus the
// --kv.option options. A missing calibration, or one whose policy makes no error-target policy, is a runtime error
// (exit 1, naming the file), a target it cannot serve a usage error.
std::shared_ptr<KvPolicy> kv_target_policy(const KvCalibration& cal, const std::string& path, double max_rel_bpb,
                                           const std::vector<std::string>& options) {
  KvEvalTarget t;
  try {
    t = kv_calibrated_target(cal, max_rel_bpb);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("{} ({})", e.what(), path));
  }
  kv_check_calibration_policy(t, path);
  try {
    KvPolicySpec spec = parse_kv_policy_spec(t.policy);
    // The file's spec sets none of the target's options (kv_check_calibration_policy): any now is a --kv.option.
    for (const std::string& item : options) add_kv_policy_option(item, spec.options);
    if (const char* key = kv_target_set_option(spec.options)) {
      throw std::invalid_argument(fmt::format("--kv.option {}: the error target sets it", key));
    }
    spec.options["max_rel_error"] = t.max_rel_error;
    auto policy = make_kv_policy(spec.name, spec.options);
    spdlog::info("kv.max_rel_bpb {:g}: {} at max_rel_error {:g} (calibration '{}': conformal bound {:+.3f}%, "
                 "bytes {:.3f} of the full cache on its documents)",
                 max_rel_bpb, spec.name, t.max_rel_error, path, 100 * t.calibrated_bound, t.calibrated_bytes_ratio);
    return policy;
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("--kv.max_rel_bpb {}: {}", max_rel_bpb, e.what()));
  }
}

// make_kv_policy_with_budget with KEY=VALUE options; a bad name, option or value is a usage error (exit 2).
std::shared_ptr<KvPolicy> kv_policy_from_cli(const std::string& policy, double budget,
                                                 const std::vector<std::string>& options) {
  KvPolicyOptions parsed;
  try {
    for (const std::string& item : options) add_kv_policy_option(item, parsed);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("--kv.option: {}", e.what()));
  }
  try {
    return make_kv_policy_with_budget(policy, budget, parsed);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("--kv.policy {} / --kv.budget / --kv.option: {}", policy, e.what()));
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "Print text sampled from a trained checkpoint");
  auto checkpoint = std::make_shared<std::string>();
  auto prompt = std::make_shared<std::string>();
  auto opt = std::make_shared<GenerateOptions>();
  sub->add_option("--checkpoint", *checkpoint, "checkpoint folder (run_dir/checkpoint)")->required();
  sub->add_option("--prompt", *prompt, "text the sample continues");
  sub->add_option("--max-new-tokens", opt->max_new_tokens, "bytes to generate")->check(CLI::Range(0, 1 << 20));
  sub->add_option("--temperature", opt->temperature, "softmax temperature; 0 = greedy")
      ->check(finite_number_validator("", 0, true, 100));
  sub->add_option("--top-k", opt->top_k, "sample among the k most likely bytes; 0 = all")->check(CLI::Range(0, 256));
  sub->add_option("--top-p", opt->top_p, "nucleus sampling: the most likely bytes up to this probability; 1 = all")
      ->check(finite_number_validator("", 0, false, 1));
  auto chunk_tokens = std::make_shared<int64_t>(0);
  sub->add_option("--kv.chunk_tokens,--chunk-tokens", *chunk_tokens,
                  "prefill chunk, tokens: of the KV cache (softmax) or the recurrent states (flexformer) (default: the "
                  "checkpoint's kv.chunk_tokens)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  auto chunk_pairs = std::make_shared<int64_t>(-1);
  sub->add_option("--kv.chunk_pairs", *chunk_pairs,
                  "softmax models: most query-key pairs a prefill chunk attends, 0 = no bound (default: the "
                  "checkpoint's kv.chunk_pairs; docs/serve.md \"Prefill chunks\")")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 48));
  auto kv = std::make_shared<KvChoice>();
  sub->add_option("--kv.policy", kv->policy,
                  "softmax models: KV cache compression policy (default: the checkpoint's kv.policy; docs/kv_cache.md)");
  sub->add_option("--kv.budget", kv->budget,
                  "fraction in (0, 1] of the tokens seen, or entries per head (a whole number >= 2); default: the "
                  "checkpoint's kv.budget")
      ->check(finite_number_validator("", 0, false));
  sub->add_option("--kv.option", kv->options, "KEY=VALUE: another option of the policy (repeatable)");
  sub->add_option("--kv.max_rel_bpb", kv->max_rel_bpb,
                  "an error target instead of a budget (relative bits-per-byte increase, e.g. 0.01): minimax sized by "
                  "the checkpoint's calibration (dcp kv-calibrate); 0 = off; default: the checkpoint's kv.max_rel_bpb")
      ->check(finite_number_validator("", 0, true, 1));
  sub->add_option("--seed", opt->seed, "sampling seed")->check(CLI::Validator(
      [](std::string& text) { return text.rfind('-', 0) == 0 ? std::string("must be >= 0") : std::string(); }, "SEED"));
  sub->callback([checkpoint, prompt, opt, chunk_tokens, chunk_pairs, kv] {
    // Warnings (a fallback to checkpoint.old, a checkpoint without manifest) go to stderr: stdout is the text.
    spdlog::set_default_logger(spdlog::stderr_color_mt("generate"));
    Config cfg = load_checkpoint_config(*checkpoint);
    KvCalibration calibration;
    std::string calibration_path;  // set when an error target reads the calibration
    if (!kv->policy.empty()) cfg.kv.policy = kv->policy;
    if (kv->budget > 0) {
      cfg.kv.budget = kv->budget;
    } else if (kv->policy == "full") {
      cfg.kv.budget = 1;  // --kv.policy full turns off a compression the checkpoint's config sets
    }
    if (kv->max_rel_bpb >= 0) cfg.kv.max_rel_bpb = kv->max_rel_bpb;
    if (cfg.attention.backend == "softmax" && cfg.kv.max_rel_bpb > 0) {
      // The target sizes minimax's cache itself: a policy or budget beside it would be silently dropped.
      if (!kv->policy.empty() || kv->budget > 0) {
        throw ConfigError(fmt::format("kv.max_rel_bpb {} ({}) is an error target: minimax sizes the cache itself, so "
                                      "--kv.policy and --kv.budget cannot be given with it (--kv.max_rel_bpb 0 "
                                      "turns it off)",
                                      cfg.kv.max_rel_bpb,
                                      kv->max_rel_bpb >= 0 ? "--kv.max_rel_bpb" : "the checkpoint's config"));
      }
      if (kv->max_rel_bpb < 0 && (cfg.kv.policy != "full" || cfg.kv.budget != 1)) {
        spdlog::warn("the checkpoint's config sets kv.max_rel_bpb {}: minimax sized by its calibration serves, not "
                     "its kv.policy {} at kv.budget {} (--kv.max_rel_bpb 0 turns the target off)",
                     cfg.kv.max_rel_bpb, cfg.kv.policy, cfg.kv.budget);
      }
      calibration_path = kv_calibration_path(*checkpoint);
      calibration = read_kv_calibration(calibration_path);
      opt->kv_policy = kv_target_policy(calibration, calibration_path, cfg.kv.max_rel_bpb, kv->options);
    } else if (cfg.attention.backend == "softmax") {
      opt->kv_policy = kv_policy_from_cli(cfg.kv.policy, cfg.kv.budget, kv->options);
    } else if (!kv->policy.empty() || kv->budget > 0 || !kv->options.empty() || kv->max_rel_bpb > 0) {
      throw ConfigError(fmt::format("--kv.policy, --kv.budget, --kv.option and --kv.max_rel_bpb need a softmax "
                                    "checkpoint ({} is "
                                    "attention.backend {})", *checkpoint, cfg.attention.backend));
    }
    // The run's train.precision, resolved on this CPU (auto may differ from the machine that trained).
    Transformer model(cfg.model, cfg.attention, resolve_precision(cfg.train.precision).precision);
    load_checkpoint(*checkpoint, model, nullptr);
    if (!calibration_path.empty()) {
      // The calibration must be of these weights (exit 1, naming both fingerprints, when it is not).
      const std::string w = kv_check_calibration_weights(calibration, kv_weights_fingerprint(model), calibration_path);
      if (!w.empty()) spdlog::warn("{}", w);
    }
    opt->context = cfg.data.max_seq_len;
    opt->chunk_tokens = *chunk_tokens > 0 ? *chunk_tokens : cfg.kv.chunk_tokens;
    opt->chunk_pairs = *chunk_pairs >= 0 ? *chunk_pairs : cfg.kv.chunk_pairs;
    // Bytes are printed as they come: a long or interrupted generation shows what it made so far.
    fmt::print("{}", *prompt);
    std::fflush(stdout);
    opt->on_byte = [](char c) {
      std::fputc(c, stdout);
      std::fflush(stdout);
    };
    generate(model, *prompt, *opt);
    fmt::print("\n");
  });
}

}  // namespace dcp
