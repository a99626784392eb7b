// Resolved run configuration: defaults < YAML file < `--section.key=value` overrides.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcp {

/// Thrown for an unknown key, an unparsable value or a value outside what is allowed.
/// The message names the key, the value and what is allowed.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RunConfig {
  std::string dir = "runs/default";  ///< run_dir: config.yaml, metrics.jsonl, summary.json, checkpoint/
  int64_t seed = 1234;
  std::string log_level = "info";
};

struct DataConfig {
  std::string path = "/usr/share/doc/python3.11/html/_sources";  ///< folder of text files or a .jsonl file
  std::string format = "auto";       ///< auto | text_dir | jsonl
  std::string glob = "*.txt";        ///< file-name pattern for text_dir (fnmatch, matched on the base name)
  int64_t max_seq_len = 512;         ///< tokens per sample; longer documents are split into chunks
  double heldout_fraction = 0.05;    ///< share of documents (by hash of path) held out for evaluation
};

struct ModelConfig {
  int64_t d_model = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  /// K/V heads (grouped-query attention, Ainslie et al. 2023): a divisor of n_heads, query head h reads K/V head
  /// h / (n_heads / n_kv_heads); 0 (the default) = n_heads, so every checkpoint without the key loads as before.
  int64_t n_kv_heads = 0;
  int64_t d_ff = 384;                ///< SwiGLU hidden width
  double rope_theta = 10000.0;
  int64_t recompute_layers = 0;      ///< the first N layers recompute activations in backward
  /// The K/V head count: n_kv_heads, or n_heads when it is 0.
  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
};

/// attention.*: the attention operator of every layer. The flexformer.* keys only matter for backend flexformer
/// (Flexformer / RFF linear attention, ../shared/specs/flexformer.md section 13; docs/flexformer.md).
struct AttentionConfig {
  std::string backend = "softmax";        ///< softmax | flexformer
  /// softmax only: tiled (FlashAttention-2 style operator, O(L) memory) | reference (per-sample [L, L] scores)
  std::string impl = "tiled";
  /// flexformer only: fused (the chunked kernel with its explicit backward, for mode chunk and decoding) |
  /// reference (the autograd forms, its twin)
  std::string linear_impl = "fused";
  int64_t tile_q = 64;                    ///< softmax tiled: queries per tile
  int64_t tile_k = 128;                   ///< softmax tiled: keys per tile
  std::string feature_map = "stationary"; ///< stationary | nonstationary | fixed (untrained RFF) | elu (elu+1)
  int64_t num_features = 64;              ///< m: random frequencies per head (features = 2m for [cos; sin])
  std::string input_norm = "l2";          ///< l2 | rms | scale: conditioning of q and k before the feature map
  std::string normalizer = "shift";       ///< shift | clamp | none (+ per-head output RMSNorm)
  std::string mode = "chunk";             ///< chunk | quadratic | recurrent: computation used in training
  int64_t chunk_size = 64;                ///< tokens per chunk of the chunked form
};

/// memory.*: the per-rank memory budget planners must respect.
struct MemoryConfig {
  /// Bytes a rank may use; 0 = memory.fraction of the cost model's device memory.
  double budget_bytes = 0;
  double fraction = 0.9;  ///< share of device memory used as the budget when budget_bytes is 0
  /// Share of the budget the planners leave free for the memory model's error, in [0, 0.5]: they plan against
  /// (1 - margin) x the budget; measured peaks are still compared with the whole budget.
  double margin = 0;
};

struct TrainConfig {
  int64_t global_batch_tokens = 16384;  ///< tokens per global step, summed over ranks
  int64_t micro_batch_tokens = 4096;    ///< packing budget of one micro-batch on one rank
  int64_t max_steps = 120;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;            ///< cosine decays to lr * min_lr_ratio
  int64_t warmup_steps = 10;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;               ///< max global gradient L2 norm; 0 disables clipping
  int64_t checkpoint_every = 50;        ///< steps between checkpoints; 0 = only at the end
  int64_t stop_after_steps = 0;         ///< end this invocation after N steps (checkpointed; --resume goes on); 0 = off
  int64_t threads = 0;                  ///< intra-op threads per rank; 0 = cores / local ranks
  /// A non-finite loss or gradient norm on any rank: stop (exit 1 before the optimizer step, the last
  /// checkpoint kept) | skip (drop that step's update, counted in summary.json's nonfinite_steps_skipped).
  std::string nonfinite = "stop";
  int64_t nonfinite_max_skips = 10;     ///< with skip: the run stops at the skip after this many (0 = never skip)
  /// auto | bf16 | fp32: the dtype of matmuls and activations (resolve_precision in dcp/precision.h; auto =
  /// bf16 where the CPU has AVX512-BF16 or AMX, else fp32). Parameters and optimizer state are fp32 in both.
  std::string precision = "auto";
  /// static (parallel.sp_size everywhere) | bucket | packed | dcp-intra | dcp-inter | dcp-inter-pac | dcp-opt
  std::string planner = "dcp-opt";
  /// dcp-opt: the most rounds a step may have (StepPlan rounds: the ranks repartitioned within a step); 0 = as
  /// many as pay in the cost model, 1 = one partition per step. The other planners plan one round.
  int64_t max_rounds = 0;
  /// Device model the planners and step predictions use: auto (this machine, profiled on first use and cached
  /// in train.profile_dir), h200 (the analytic H200 model) or a `dcp profile` JSON file.
  std::string cost_model = "auto";
  /// Folder of train.cost_model auto's cached profiles; "" = $DCP_CACHE_DIR, $XDG_CACHE_HOME/dcp or
  /// $HOME/.cache/dcp (profile_cache_dir).
  std::string profile_dir;
  /// train.cost_model auto: the longest sample the profile measures, tokens (ProfileOptions::max_length); 0 =
  /// data.max_seq_len. Longer samples are predicted by the fitted FLOP and byte rates (attention's s^2 term
  /// included): a long point takes minutes on a CPU, and the fits need only a few lengths.
  int64_t profile_max_length = 0;
};

struct ParallelConfig {
  /// The static planner's sequence-parallel size of every micro-batch (divides world_size); 0 = the smallest size
  /// of parallel.sp_sizes at which the longest training sample fits the memory budget, with the fewest
  /// recomputed layers there (model.recompute_layers is then not used), as packed and bucket size themselves.
  int64_t sp_size = 1;
  std::string sp_sizes = "pow2";    ///< SP sizes to create groups for: pow2 | all (every divisor) | "1,2,3"
  /// How the static layout's groups split attention: ulysses | ring | ulysses-ring (SpMode, dcp/plan.h).
  std::string sp_mode = "ulysses";
  /// ulysses-ring: ranks per Ulysses subgroup (divides sp_size and model.n_heads, 1 < it < sp_size); 0 = the
  /// largest such divisor. Other modes: must be 0.
  int64_t ulysses_size = 0;
};

struct EvalConfig {
  int64_t max_tokens = 131072;  ///< held-out tokens evaluated (0 = all)
};

/// kv.*: the KV cache of softmax models in `dcp generate` (docs/kv_cache.md).
struct KvConfig {
  int64_t chunk_tokens = 512;  ///< prefill chunk: tokens run per forward when the cache is (re)built
  /// > 0: also bounds a prefill chunk's attention, c (seen + c) <= chunk_pairs query-key pairs for a chunk of c
  /// tokens after `seen` (prefill_chunk_length in dcp/infer.h), so a chunk deep into a long prompt costs about what
  /// an early one does (a latency bound for the server's decoding streams). 0 = tokens only.
  int64_t chunk_pairs = 0;
  std::string policy = "full";  ///< compression policy (make_kv_policy in dcp/kv_policies.h)
  /// (0, 1]: fraction of the tokens seen each head keeps; a whole number >= 2: entries per head (a fixed cap)
  double budget = 1.0;
  /// > 0: an error target instead of a budget, the largest relative increase of bits per byte to accept (e.g.
  /// 0.01): policy minimax sizes its cache by the calibration `dcp kv-calibrate` wrote beside the checkpoint
  /// (docs/kv_cache.md "Error targets"). 0 = off.
  double max_rel_bpb = 0;
};

/// serve.*: `dcp serve`, the HTTP server (docs/serve.md).
struct ServeConfig {
  std::string host = "127.0.0.1";  ///< address to bind; 0.0.0.0 (every interface) is the user's explicit choice
  int64_t port = 8080;             ///< 0 = an ephemeral port (printed, and written to --port-file)
  int64_t threads = 0;             ///< intra-op threads of the scheduler's forwards; 0 = every core
  int64_t http_threads = 128;      ///< connections served at once (a streaming one holds its thread)
  std::string kv_policy;           ///< requests' default kv_policy; "" = the checkpoint's kv.policy
  double kv_budget = 0;            ///< requests' default kv_budget; 0 = the checkpoint's kv.budget
  double kv_memory_bytes = 1e9;    ///< KV bytes all sessions together may hold (their reservations)
  int64_t max_sessions = 64;       ///< sessions decoded at once (the batch)
  int64_t max_queue = 64;          ///< requests waiting for memory or a batch slot; beyond: 503 with Retry-After
  int64_t max_tokens = 2048;       ///< largest max_tokens a request may ask for
  int64_t default_max_tokens = 16; ///< max_tokens of a request that gives none (the OpenAI default)
  int64_t max_prompt_bytes = 65536;
  int64_t max_body_bytes = 1 << 20;  ///< larger request bodies are refused (400)
  /// Tokens a session may reach (BOS + prompt + max_tokens); 0 = the trained data.max_seq_len. Beyond the trained
  /// length the model extrapolates its positions (dcp generate would slide its window instead).
  int64_t max_context = 0;
  int64_t chunk_tokens = 0;        ///< prefill chunk; 0 = the checkpoint's kv.chunk_tokens
  int64_t prefill_chunks = 1;      ///< prefill chunks per scheduler step, beside every session's decode token
  std::string scheduler = "batched";  ///< batched (one forward per step) | sequential (one per session: the reference)
  /// CPU priority of the HTTP connections' threads: "normal" (the scheduler's priority), "low" (nice 19: they run
  /// mostly on time the scheduler's threads leave, so a stream's wake-up per token rarely preempts them; on a busy
  /// server a stream then arrives in few large pieces) or "idle" (Linux SCHED_IDLE: only on time no other thread of
  /// the machine wants; another busy process can stall the streams).
  std::string http_priority = "normal";
  /// > 0: a scheduler step that runs a prefill chunk beside decoding sessions may take about this many times a
  /// decode-only step (both measured, moving averages): the chunk is shortened to fit, down to 16 tokens, so the
  /// streams' inter-token gap stays near a decode step while a long prompt is prefilled (Sarathi-Serve's per-step
  /// token budget, here set from measured step times instead of an offline profile). A step with no decoding
  /// session runs the whole chunk. 0 (the default) = no ratio term; with prefill_step_ms 0 too the budget is off:
  /// chunks of chunk_tokens / kv.chunk_pairs only. Since prefill chunks attend 16 tokens at a time (2026-12-07),
  /// 2 with prefill_step_ms 25 met the latency target at 16 and 64 clients (p99 / p50 1.49-1.77) at 0.73x the
  /// tokens/s of the default (docs/serve.md "Prefill budget"); 1.5 with 40 ms, chosen before, no longer does.
  double prefill_step_ratio = 0;
  /// > 0: the prefill budget's floor, in milliseconds, of a step that runs a prefill chunk beside decoding sessions:
  /// the step may take max(prefill_step_ratio x a decode step, this) (Sarathi-Serve's time-between-tokens target).
  /// Few decoding sessions make a decode step short, and a budget of ratio x a short step holds the waiting prompts
  /// to a few tokens a step; the floor gives them longer chunks than that, and the steps that carry a chunk all last
  /// about the same. Either > 0 turns the budget on; both 0 = off.
  double prefill_step_ms = 0;
  double shutdown_grace_s = 10;    ///< after SIGTERM, in-flight requests may finish for this long, then are cancelled
  int64_t retry_after_s = 1;       ///< Retry-After of a 503
};

struct DistConfig {
  double timeout_s = 60.0;  ///< a collective or rendezvous that waits longer fails with an error
};

struct Config {
  RunConfig run;
  DataConfig data;
  ModelConfig model;
  AttentionConfig attention;
  MemoryConfig memory;
  TrainConfig train;
  ParallelConfig parallel;
  EvalConfig eval;
  DistConfig dist;
  KvConfig kv;
  ServeConfig serve;

  /// Loads defaults, then the YAML file (if `path` is non-empty), then `overrides` ("section.key=value").
  /// Throws ConfigError (unknown key, bad value) or std::runtime_error (unreadable file).
  static Config load(const std::string& path, const std::vector<std::string>& overrides);

  /// Applies one "section.key=value" assignment; throws ConfigError.
  void set(const std::string& key, const std::string& value);

  /// Checks cross-key constraints (e.g. d_model divisible by n_heads); throws ConfigError.
  void validate() const;

  /// The resolved configuration as YAML text (every key, sorted by section).
  std::string to_yaml() const;

  /// Every key with its current value as text, in declaration order.
  std::vector<std::pair<std::string, std::string>> items() const;
};

}  // namespace dcp
