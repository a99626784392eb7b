// Distillation of a trained softmax Transformer into a Flexformer one (`dcp distill`, docs/flexformer.md
// "Distillation"): attention transfer of the frequencies, then fine-tuning of the whole model by the trainer.
// Recipe: Hedgehog (Zhang et al., "The Hedgehog & the Porcupine", ICLR 2024, arXiv:2402.04347) and LoLCATs
// (Zhang et al., "LoLCATs: On Low-Rank Linearizing of Large Language Models", 2024, arXiv:2410.10254),
// adapted to trained random Fourier features as in shared/specs/flexformer.md section 8.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/dist.h"
#include "dcp/model.h"

namespace dcp {

/// One layer's attention as the teacher computed it on one packed batch (detached, CPU, the model's dtype).
struct AttentionCapture {
  torch::Tensor q, k, v;     ///< [T, heads, head_dim]: the attention inputs, rotary applied
  torch::Tensor out;         ///< [T, heads, head_dim]: the backend's output for them
  torch::Tensor cu_seqlens;  ///< [n + 1] int64
};

/// Passed as PackedBatch::attention, it runs every block's own backend unchanged and records its inputs and
/// output, so the model code needs no hook. Use it under torch::NoGradGuard (the records are detached).
class AttentionRecorder : public AttentionWrapper {
 public:
  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& cu_seqlens) const override;
  /// Index = layer; a layer that has not run yet holds undefined tensors.
  const std::vector<AttentionCapture>& layers() const { return layers_; }

 private:
  mutable std::vector<AttentionCapture> layers_;  // filled by forward, which the interface makes const
};

/// Runs `model` (no gradient) on `batch` and returns every layer's attention inputs and output.
std::vector<AttentionCapture> capture_attention(Transformer& model, const PackedBatch& batch);

/// The student's config: `teacher`'s with attention.backend flexformer (the other attention.* keys as the
/// teacher's config has them, by default stationary / l2 / shift), then `overrides` ("section.key=value", as
/// on the command line). input_norm scale, whose initial kernel estimates softmax itself, is not the default:
/// on trained q, k its estimate's error is far larger (docs/flexformer.md, "Distillation").
/// Throws std::invalid_argument when the teacher's attention.backend is not softmax or the result's is not
/// flexformer, or, when `fit_frequencies` (stage 1 will run), has no trained frequencies (feature_map other than
/// stationary or nonstationary), naming the value; ConfigError for a bad override.
Config student_config(const Config& teacher, const std::vector<std::string>& overrides, bool fit_frequencies = true);

/// Builds the model of `student_cfg` (initialised from run.seed, computing in its train.precision) and copies
/// every parameter of `teacher` into the parameter of the same name; only the flexformer backends' own tensors
/// ("blocks.<i>.attention.*") keep their initialisation. Throws std::invalid_argument naming a tensor whose name or shape has no match.
Transformer make_student(Transformer& teacher, const Config& student_cfg);

/// Sets each layer's key_norm_offset c (input_norm scale) per head to the largest |b|^2 / 2 = |k|^2 / (2
/// sqrt(head_dim)) over the captured keys, so the key weights exp(|b|^2/2 - c) stay <= 1 on that data instead of
/// overflowing. c is a constant from here on (it cancels in the attention average, docs/flexformer.md). No-op
/// for other input norms. Throws std::invalid_argument when `captures` does not have one entry per layer.
void calibrate_key_offsets(Transformer& student, const std::vector<AttentionCapture>& captures);

/// Per layer: mean over all elements of (student_l(q_l, k_l, v_l) - out_l)^2 in fp32, the student's backend run
/// on the teacher's captured inputs (no gradient). Throws std::invalid_argument when a block's backend is not
/// flexformer or the number of layers differs.
std::vector<double> attention_mse(Transformer& student, const std::vector<AttentionCapture>& captures);

/// Stage 1 (attention transfer) settings.
struct AttentionTransferOptions {
  int64_t steps = 100;          ///< Adam steps; 0 skips the stage
  double lr = 5e-2;             ///< Adam learning rate of the frequencies, alpha and gains
  int64_t batch_tokens = 2048;  ///< tokens per rank and step (whole training samples, packed)
  int64_t log_every = 25;       ///< steps between progress lines
};

struct AttentionTransferResult {
  std::vector<double> mse_initial;      ///< per layer, on the probe batch, before stage 1
  std::vector<double> mse_final;        ///< per layer, on the probe batch, after stage 1
  std::vector<double> output_variance;  ///< per layer: variance of the teacher's output on the probe batch
  int64_t steps = 0;
  int64_t tokens_per_step = 0;          ///< summed over ranks (the last step's)
  double seconds = 0;
};

/// Stage 1: trains only the flexformer backend tensors of `student` (omega, omega2, alpha_raw,
/// out_norm_weight) so that each layer's output on the teacher's own q, k, v matches the teacher's softmax
/// output: loss = sum over layers of attention_mse, with inputs from the teacher's stream so that layers train
/// independently (LoLCATs attention transfer, MSE loss). Rank r of the world takes batches r, r + world, ... of
/// training samples in epoch_order(train_ids, run.seed, 0) (wrapping to later epochs); the gradients are
/// averaged over the world with one SUM all-reduce per step, so every rank keeps identical weights. The probe
/// batch is the first held-out samples (training samples when there are none). All other student parameters
/// and buffers are left bit-identical. Throws std::invalid_argument for steps < 0, lr <= 0, batch_tokens < 1 or a non-flexformer
/// student.
AttentionTransferResult transfer_attention(Transformer& teacher, Transformer& student, const Corpus& corpus,
                                           const Config& cfg, const AttentionTransferOptions& opt,
                                           const Communicator& world);

/// Held-out bits per byte (heldout_bits_per_byte, the same eval.max_tokens prefix every time) at each stage.
struct DistillResult {
  double teacher_bpb = 0;
  double student_initial_bpb = 0;    ///< teacher weights copied, frequencies at their initialisation
  double student_fitted_bpb = 0;     ///< after stage 1
  double student_finetuned_bpb = 0;  ///< after stage 2 (rank 0; NaN elsewhere or without fine-tuning)
  AttentionTransferResult fit;
  int64_t finetune_steps = 0;
  double finetune_seconds = 0;
  double eval_seconds = 0;           ///< the three held-out evaluations before fine-tuning, together
};

/// `dcp distill`: loads the softmax teacher from checkpoint folder `teacher_dir` (computing, like the student,
/// in student_cfg's train.precision), builds the student of
/// `student_cfg` (see student_config; its run.dir is the output folder), calibrates its key offsets on the
/// first stage-1 training batch, runs stage 1, saves the student as
/// run.dir/checkpoint at step 0 with a fresh optimizer (`dcp train --resume` continues it), then, when
/// train.max_steps > 0, fine-tunes the whole model with train(student_cfg, groups, resume = true). Rank 0
/// writes run.dir/distill.json (every number of the result, per layer, with the steps and times) after stage 1
/// and again after stage 2; the trainer writes its usual outputs (metrics.jsonl, summary.json); stage 1 logs to
/// run.dir/distill/logs, created only once the teacher, the student and the corpus have loaded.
/// Throws std::runtime_error naming the path for a missing or unreadable teacher checkpoint or corpus, and
/// std::invalid_argument for a teacher whose attention.backend is not softmax or whose model shape differs from
/// student_cfg's.
DistillResult distill(const std::string& teacher_dir, const Config& student_cfg,
                      const AttentionTransferOptions& fit, const ProcessGroups& groups);

}  // namespace dcp
