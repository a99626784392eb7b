#include <fmt/format.h>

#include <cstdio>

#include "cli/commands.h"
#include "dcp/infer.h"
#include "train/checkpoint.h"

namespace dcp {

void add_generate_command(CLI::App& app) {
  auto* sub = app.add_subcommand("generate", "Print text sampled from a trained checkpoint");
  auto checkpoint = std::make_shared<std::string>();
  auto prompt = std::make_shared<std::string>();
  auto opt = std::make_shared<GenerateOptions>();
  sub->add_option("--checkpoint", *checkpoint, "checkpoint folder (run_dir/checkpoint)")->required();
  sub->add_option("--prompt", *prompt, "text the sample continues");
  sub->add_option("--max-new-tokens", opt->max_new_tokens, "bytes to generate")->check(CLI::Range(0, 1 << 20));
  sub->add_option("--temperature", opt->temperature, "softmax temperature; 0 = greedy")
      ->check(finite_number_validator("", 0, true))
      ->check(CLI::Range(0.0, 100.0));
  sub->add_option("--top-k", opt->top_k, "sample among the k most likely bytes; 0 = all")->check(CLI::Range(0, 256));
  auto chunk_tokens = std::make_shared<int64_t>(0);
  sub->add_option("--chunk-tokens", *chunk_tokens,
                  "softmax models: prefill chunk of the KV cache, tokens (default: the checkpoint's kv.chunk_tokens)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  sub->add_option("--seed", opt->seed, "sampling seed")->check(CLI::Validator(
      [](std::string& text) { return text.rfind('-', 0) == 0 ? std::string("must be >= 0") : std::string(); }, "SEED"));
  sub->callback([checkpoint, prompt, opt, chunk_tokens] {
    Config cfg = load_checkpoint_config(*checkpoint);
    // The run's train.precision, resolved on this CPU (auto may differ from the machine that trained).
    Transformer model(cfg.model, cfg.attention, resolve_precision(cfg.train.precision).precision);
    load_checkpoint(*checkpoint, model, nullptr);
    opt->context = cfg.data.max_seq_len;
    opt->chunk_tokens = *chunk_tokens > 0 ? *chunk_tokens : cfg.kv.chunk_tokens;
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
