// dcp distill: softmax teacher -> Flexformer student (attention transfer, then fine-tuning by the trainer).
#include "distill/distill.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "dcp/checkpoint.h"
#include "dcp/flexformer.h"
#include "dcp/plan.h"
#include "dcp/profile.h"
#include "dcp/trainer.h"
#include "runtime/optimizer.h"
#include "train/data_fingerprint.h"
#include "train/run_dir_lock.h"
#include "util/clock.h"
#include "util/file_write.h"
#include "util/logging.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

FlexformerAttention& flexformer_of(Transformer& model, int64_t layer) {
  auto* f = dynamic_cast<FlexformerAttention*>(model->blocks->ptr<BlockImpl>(static_cast<size_t>(layer))->attention.get());
  if (!f) {
    throw std::invalid_argument(fmt::format("distill: the student's layer {} has no flexformer backend", layer));
  }
  return *f;
}

void check_layers(Transformer& model, const std::vector<AttentionCapture>& captures, const char* what) {
  if (static_cast<int64_t>(captures.size()) != model->cfg.n_layers) {
    throw std::invalid_argument(fmt::format("{}: {} captured layers for a model of {} layers", what, captures.size(),
                                            model->cfg.n_layers));
  }
}

// Stage 1's batches: whole training samples of epoch_order(train_ids, seed, e), e = 0, 1, ..., packed in order
// into batches of at most `budget` tokens (a longer sample goes alone).
class TrainingBatches {
 public:
  TrainingBatches(const Corpus& corpus, uint64_t seed, int64_t budget) : corpus_(corpus), seed_(seed), budget_(budget) {}

  std::vector<int64_t> next() {
    std::vector<int64_t> ids;
    int64_t tokens = 0;
    for (;;) {
      if (pos_ >= order_.size()) {
        order_ = epoch_order(corpus_.train_ids(), seed_, epoch_++);
        pos_ = 0;
      }
      const int64_t len = corpus_.samples()[static_cast<size_t>(order_[pos_])].length;
      if (!ids.empty() && tokens + len > budget_) return ids;
      ids.push_back(order_[pos_++]);
      tokens += len;
    }
  }

 private:
  const Corpus& corpus_;
  uint64_t seed_;
  int64_t budget_;
  int64_t epoch_ = 0;
  std::vector<int64_t> order_;
  size_t pos_ = 0;
};

// The first held-out samples that fit in `budget` tokens (training samples when there is no held-out one).
std::vector<int64_t> probe_ids(const Corpus& corpus, int64_t budget) {
  const auto& pool = corpus.heldout_ids().empty() ? corpus.train_ids() : corpus.heldout_ids();
  std::vector<int64_t> ids;
  int64_t tokens = 0;
  for (int64_t id : pool) {
    const int64_t len = corpus.samples()[static_cast<size_t>(id)].length;
    if (!ids.empty() && tokens + len > budget) break;
    ids.push_back(id);
    tokens += len;
  }
  return ids;
}

std::vector<torch::Tensor> backend_parameters(Transformer& student) {
  std::vector<torch::Tensor> out;
  for (int64_t l = 0; l < student->cfg.n_layers; ++l) {
    for (const auto& p : flexformer_of(student, l).parameters()) out.push_back(p);
  }
  return out;
}

json number_or_null(double v) { return std::isnan(v) ? json() : json(v); }

}  // namespace

torch::Tensor AttentionRecorder::forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                                         const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& cu_seqlens) const {
  torch::Tensor out = inner.forward(q, k, v, cu_seqlens);
  if (layer >= static_cast<int64_t>(layers_.size())) layers_.resize(static_cast<size_t>(layer) + 1);
  layers_[static_cast<size_t>(layer)] = {q.detach(), k.detach(), v.detach(), out.detach(), cu_seqlens};
  return out;
}

std::vector<AttentionCapture> capture_attention(Transformer& model, const PackedBatch& batch) {
  torch::NoGradGuard no_grad;
  auto recorder = std::make_shared<AttentionRecorder>();
  PackedBatch b = batch;
  b.attention = recorder;
  model->forward(b);
  return recorder->layers();
}

Config student_config(const Config& teacher, const std::vector<std::string>& overrides, bool fit_frequencies) {
  if (teacher.attention.backend != "softmax") {
    throw std::invalid_argument(fmt::format("the teacher's attention.backend is '{}'; distillation needs a softmax "
                                            "teacher",
                                            teacher.attention.backend));
  }
  Config c = teacher;
  c.set("attention.backend", "flexformer");
  for (const auto& o : overrides) {
    const std::string s = o.rfind("--", 0) == 0 ? o.substr(2) : o;
    const auto eq = s.find('=');
    if (eq == std::string::npos) throw ConfigError(fmt::format("override '{}' must have the form section.key=value", o));
    c.set(s.substr(0, eq), s.substr(eq + 1));
  }
  c.validate();
  if (c.attention.backend != "flexformer") {
    throw std::invalid_argument(fmt::format("the student's attention.backend is '{}'; it must be flexformer",
                                            c.attention.backend));
  }
  if (fit_frequencies && c.attention.feature_map != "stationary" && c.attention.feature_map != "nonstationary") {
    throw std::invalid_argument(fmt::format("the student's attention.feature_map is '{}'; attention transfer trains "
                                            "frequencies, so it must be stationary or nonstationary",
                                            c.attention.feature_map));
  }
  return c;
}

Transformer make_student(Transformer& teacher, const Config& student_cfg) {
  torch::manual_seed(static_cast<uint64_t>(student_cfg.run.seed));
  Transformer student(student_cfg.model, student_cfg.attention,
                      resolve_precision(student_cfg.train.precision).precision);
  torch::NoGradGuard no_grad;
  auto mine = student->named_parameters();
  for (const auto& item : teacher->named_parameters()) {
    torch::Tensor* target = mine.find(item.key());
    if (!target || target->sizes() != item.value().sizes()) {
      throw std::invalid_argument(fmt::format("make_student: the teacher's '{}' {} has no match of that shape in the "
                                              "student",
                                              item.key(), fmt::join(item.value().sizes(), "x")));
    }
    target->copy_(item.value());
  }
  for (const auto& item : mine) {
    if (!teacher->named_parameters().contains(item.key()) && item.key().find(".attention.") == std::string::npos) {
      throw std::invalid_argument(fmt::format("make_student: the student's '{}' is not in the teacher", item.key()));
    }
  }
  return student;
}

void calibrate_key_offsets(Transformer& student, const std::vector<AttentionCapture>& captures) {
  check_layers(student, captures, "calibrate_key_offsets");
  torch::NoGradGuard no_grad;
  for (int64_t l = 0; l < student->cfg.n_layers; ++l) {
    FlexformerAttention& f = flexformer_of(student, l);
    if (!f.key_norm_offset.defined()) continue;
    const torch::Tensor& k = captures[static_cast<size_t>(l)].k;
    auto half_sq = k.to(torch::kFloat).pow(2).sum(-1) / (2.0 * std::sqrt(static_cast<double>(k.size(-1))));
    f.key_norm_offset.copy_(std::get<0>(half_sq.max(0)));  // [heads]
  }
}

std::vector<double> attention_mse(Transformer& student, const std::vector<AttentionCapture>& captures) {
  check_layers(student, captures, "attention_mse");
  torch::NoGradGuard no_grad;
  std::vector<double> out;
  for (int64_t l = 0; l < student->cfg.n_layers; ++l) {
    const AttentionCapture& c = captures[static_cast<size_t>(l)];
    auto y = flexformer_of(student, l).forward(c.q, c.k, c.v, c.cu_seqlens);
    out.push_back(torch::mse_loss(y.to(torch::kFloat), c.out.to(torch::kFloat)).item<double>());
  }
  return out;
}

AttentionTransferResult transfer_attention(Transformer& teacher, Transformer& student, const Corpus& corpus,
                                           const Config& cfg, const AttentionTransferOptions& opt,
                                           const Communicator& world) {
  if (opt.steps < 0 || !(opt.lr > 0) || opt.batch_tokens < 1) {
    throw std::invalid_argument(fmt::format("transfer_attention: steps {} (>= 0), lr {} (> 0) and batch_tokens {} "
                                            "(>= 1) are not all allowed",
                                            opt.steps, opt.lr, opt.batch_tokens));
  }
  const auto start = std::chrono::steady_clock::now();
  AttentionTransferResult r;
  const auto probe = capture_attention(teacher, make_batch(corpus, probe_ids(corpus, opt.batch_tokens)));
  r.mse_initial = attention_mse(student, probe);
  for (const auto& c : probe) r.output_variance.push_back(c.out.to(torch::kDouble).var().item<double>());

  std::vector<torch::Tensor> params = backend_parameters(student);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(opt.lr));
  TrainingBatches batches(corpus, static_cast<uint64_t>(cfg.run.seed), opt.batch_tokens);
  for (int64_t step = 0; step < opt.steps; ++step) {
    std::vector<int64_t> mine;
    for (int64_t r_ = 0; r_ < world.size(); ++r_) {
      auto ids = batches.next();
      if (r_ == world.rank()) mine = std::move(ids);
    }
    const PackedBatch batch = make_batch(corpus, mine);
    const auto captures = capture_attention(teacher, batch);
    torch::Tensor loss = torch::zeros({}, torch::kFloat);
    for (int64_t l = 0; l < student->cfg.n_layers; ++l) {
      const AttentionCapture& c = captures[static_cast<size_t>(l)];
      // In fp32 under bf16 too: the loss sums squared errors over every element of the batch.
      const auto y = flexformer_of(student, l).forward(c.q, c.k, c.v, c.cu_seqlens);
      loss = loss + torch::mse_loss(y.to(torch::kFloat), c.out.to(torch::kFloat));
    }
    adam.zero_grad();
    loss.backward();
    // Average over ranks: one flat SUM all-reduce of the gradients and the loss, so every rank steps alike.
    std::vector<torch::Tensor> flat;
    for (const auto& p : params) flat.push_back(p.grad().defined() ? p.grad().flatten() : torch::zeros({p.numel()}));
    flat.push_back(loss.detach().reshape({1}));
    flat.push_back(torch::tensor({static_cast<float>(batch.num_tokens())}));
    torch::Tensor all = torch::cat(flat);
    world.allreduce_sum(all);
    int64_t offset = 0;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : params) {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        p.grad().copy_(all.narrow(0, offset, p.numel()).view_as(p) / static_cast<double>(world.size()));
        offset += p.numel();
      }
    }
    adam.step();
    r.tokens_per_step = static_cast<int64_t>(all[offset + 1].item<double>());
    if ((step + 1) % opt.log_every == 0 || step + 1 == opt.steps) {
      spdlog::info("attention transfer step {}/{}: sum of layer MSEs {:.3g} ({} tokens, {:.1f} s)", step + 1,
                   opt.steps, all[offset].item<double>() / static_cast<double>(world.size()), r.tokens_per_step,
                   seconds_since(start));
    }
  }
  r.steps = opt.steps;
  r.mse_final = attention_mse(student, probe);
  r.seconds = seconds_since(start);
  return r;
}

DistillResult distill(const std::string& teacher_dir, const Config& cfg, const AttentionTransferOptions& fit,
                      const ProcessGroups& groups) {
  const DistEnv& env = groups.env();
  const Communicator& world = groups.world();
  const fs::path out_dir = cfg.run.dir;
  const Config teacher_cfg = load_checkpoint_config(teacher_dir);
  if (teacher_cfg.attention.backend != "softmax") {
    throw std::invalid_argument(fmt::format("teacher '{}': attention.backend is '{}'; distillation needs a softmax "
                                            "teacher",
                                            teacher_dir, teacher_cfg.attention.backend));
  }
  const auto theirs = teacher_cfg.items(), ours = cfg.items();  // same keys, same order
  for (size_t i = 0; i < theirs.size(); ++i) {
    const std::string& key = theirs[i].first;
    if (key.rfind("model.", 0) == 0 && key != "model.recompute_layers" && theirs[i].second != ours[i].second) {
      throw std::invalid_argument(fmt::format("teacher '{}' has {} = {} but the student {}; the student keeps the "
                                              "teacher's model shape",
                                              teacher_dir, key, theirs[i].second, ours[i].second));
    }
  }
  // Teacher and student compute in the student run's precision: stage 1 fits the student to the teacher's
  // attention as this run computes it.
  const PrecisionChoice precision = resolve_precision(cfg.train.precision);
  Transformer teacher(teacher_cfg.model, teacher_cfg.attention, precision.precision);
  load_checkpoint(teacher_dir, teacher, nullptr);
  Transformer student = make_student(teacher, cfg);
  const Corpus corpus = Corpus::load(cfg.data);
  // Only now, with the teacher, the student and the corpus checked, is anything written to run.dir: a failed
  // start leaves no logs there that would make a rerun refuse a non-empty --out.
  fs::create_directories(out_dir);
  const auto run_lock = lock_run_dir(out_dir.string(), world);  // held through the fine-tuning train()
  init_logging((out_dir / "distill").string(), env.rank, cfg.run.log_level, "dcp distill");
  torch::set_num_threads(static_cast<int>(threads_per_rank(cfg.train, env)));
  spdlog::info("teacher {} ({} layers, d_model {}); student attention: {} / {} / {} / {} with {} features; "
               "precision: {}",
               teacher_dir, teacher_cfg.model.n_layers, teacher_cfg.model.d_model, cfg.attention.feature_map,
               cfg.attention.input_norm, cfg.attention.normalizer, cfg.attention.mode, cfg.attention.num_features,
               precision.describe());

  DistillResult r;
  const auto eval_start = std::chrono::steady_clock::now();
  r.teacher_bpb = heldout_bits_per_byte(teacher, corpus, cfg.eval, cfg.train.micro_batch_tokens, world);
  TrainingBatches first(corpus, static_cast<uint64_t>(cfg.run.seed), fit.batch_tokens);
  calibrate_key_offsets(student, capture_attention(teacher, make_batch(corpus, first.next())));
  r.student_initial_bpb = heldout_bits_per_byte(student, corpus, cfg.eval, cfg.train.micro_batch_tokens, world);
  spdlog::info("held-out bits per byte: teacher {:.4f}, student at init {:.4f}", r.teacher_bpb, r.student_initial_bpb);
  r.eval_seconds = seconds_since(eval_start);

  r.fit = transfer_attention(teacher, student, corpus, cfg, fit, world);
  for (size_t l = 0; l < r.fit.mse_final.size(); ++l) {
    spdlog::info("layer {}: attention-output MSE {:.3g} -> {:.3g} (relative to the output variance {:.3g} -> {:.3g})",
                 l, r.fit.mse_initial[l], r.fit.mse_final[l], r.fit.mse_initial[l] / r.fit.output_variance[l],
                 r.fit.mse_final[l] / r.fit.output_variance[l]);
  }
  const auto fitted_eval_start = std::chrono::steady_clock::now();
  r.student_fitted_bpb = heldout_bits_per_byte(student, corpus, cfg.eval, cfg.train.micro_batch_tokens, world);
  r.eval_seconds += seconds_since(fitted_eval_start);
  spdlog::info("held-out bits per byte after attention transfer: {:.4f}", r.student_fitted_bpb);

  const fs::path ckpt = out_dir / "checkpoint";
  if (env.rank == 0) {
    TrainState state;
    state.heldout_bits_per_byte_initial = r.student_fitted_bpb;
    state.data_fingerprint = corpus_fingerprint(corpus);
    save_checkpoint(ckpt.string(), student, *make_optimizer(student, cfg.train), state, cfg);
  }
  world.barrier();

  r.finetune_steps = cfg.train.max_steps;
  r.student_finetuned_bpb = std::nan("");
  auto write_report = [&] {  // rank 0; again after stage 2, so a stopped fine-tuning leaves stage 1's numbers
    json layers = json::array();
    for (size_t l = 0; l < r.fit.mse_final.size(); ++l) {
      layers.push_back({{"layer", l},
                        {"mse_initial", r.fit.mse_initial[l]},
                        {"mse_final", r.fit.mse_final[l]},
                        {"output_variance", r.fit.output_variance[l]}});
    }
    json j = {{"teacher", teacher_dir},
              {"heldout_bits_per_byte",
               {{"teacher", number_or_null(r.teacher_bpb)},
                {"student_initial", number_or_null(r.student_initial_bpb)},
                {"student_fitted", number_or_null(r.student_fitted_bpb)},
                {"student_finetuned", number_or_null(r.student_finetuned_bpb)}}},
              {"eval_max_tokens", cfg.eval.max_tokens},
              {"fit_steps", r.fit.steps},
              {"fit_lr", fit.lr},
              {"fit_tokens_per_step", r.fit.tokens_per_step},
              {"fit_seconds", r.fit.seconds},
              {"finetune_steps", r.finetune_steps},
              {"finetune_tokens_per_step", cfg.train.global_batch_tokens},
              {"finetune_seconds", r.finetune_seconds},
              {"eval_seconds", r.eval_seconds},
              {"world_size", env.world_size},
              {"attention",
               {{"feature_map", cfg.attention.feature_map},
                {"num_features", cfg.attention.num_features},
                {"input_norm", cfg.attention.input_norm},
                {"normalizer", cfg.attention.normalizer},
                {"mode", cfg.attention.mode}}},
              {"layers", layers}};
    write_file_atomically(out_dir / "distill.json", j.dump(2) + "\n");
  };
  if (env.rank == 0) write_report();
  if (r.finetune_steps > 0) {
    const auto finetune_start = std::chrono::steady_clock::now();
    TrainOptions finetune;
    finetune.resume = true;
    TrainSetup setup = open_training(cfg, groups, finetune.resume);
    RunCostModels models = resolve_cost_models(cfg, setup.shape, setup.threads, setup.lengths.max, groups);
    Trainer(cfg, groups, std::move(setup), std::move(models), finetune).train();
    r.finetune_seconds = seconds_since(finetune_start);
    if (env.rank == 0) {
      r.student_finetuned_bpb =
          json::parse(std::ifstream(out_dir / "summary.json")).at("heldout_bits_per_byte_final").get<double>();
      write_report();
    }
  }
  return r;
}

}  // namespace dcp
