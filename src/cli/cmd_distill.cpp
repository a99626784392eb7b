// `dcp distill`: convert a trained softmax checkpoint into a Flexformer model (attention transfer, fine-tuning).
#include <fmt/format.h>

#include <cmath>
#include <filesystem>

#include "cli/commands.h"
#include "dcp/checkpoint.h"
#include "distill/distill.h"

namespace dcp {
namespace fs = std::filesystem;

namespace {

std::string bpb(double v) { return std::isnan(v) ? "-" : fmt::format("{:.4f}", v); }

}  // namespace

void add_distill_command(CLI::App& app) {
  auto* sub = app.add_subcommand("distill", "Convert a trained softmax checkpoint into a Flexformer (linear "
                                            "attention) model: fit the frequencies, then fine-tune");
  auto teacher = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto fit = std::make_shared<AttentionTransferOptions>();
  auto finetune_steps = std::make_shared<int64_t>(40);
  auto force = std::make_shared<bool>(false);
  sub->add_option("--teacher", *teacher, "checkpoint folder of a softmax model (run_dir/checkpoint)")
      ->required()
      ->check(CLI::ExistingDirectory);
  sub->add_option("--out", *out, "run folder of the student: distill.json, checkpoint/, the trainer's outputs")
      ->required();
  sub->add_option("--fit-steps", fit->steps, "stage 1: Adam steps of attention transfer (0 skips it)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  sub->add_option("--fit-lr", fit->lr, "stage 1: Adam learning rate")
      ->check(finite_number_validator(""))
      ->capture_default_str();
  // Stage 1 keeps every layer's q, k, v and output of the batch (plus the student's activations): about 2 KB
  // per token and layer at d_model 64, so 2^20 tokens is already gigabytes.
  sub->add_option("--fit-batch-tokens", fit->batch_tokens,
                  "stage 1: tokens per rank and step, 1 to 1048576 (every layer's attention inputs and outputs of "
                  "the batch are held in memory)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  sub->add_option("--finetune-steps", *finetune_steps,
                  "stage 2: optimizer steps of the trainer on the whole model (train.max_steps; 0 skips it)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  sub->add_flag("--force", *force, "write into a non-empty --out (files of an earlier run there are replaced)");
  sub->allow_extras();
  sub->footer("The student is the teacher's config with attention.backend=flexformer (attention.* defaults: "
              "stationary, l2, shift); --section.key=value overrides apply to it (e.g. --attention.num_features=128 "
              "--train.lr=0.001). Continue fine-tuning later with `dcp train --config OUT/config.yaml --resume`.");
  sub->callback([sub, teacher, out, fit, finetune_steps, force] {
    std::vector<std::string> overrides = config_overrides(*sub);
    for (const auto& o : overrides) {
      for (const char* taken : {"--run.dir=", "--train.max_steps="}) {
        if (o.rfind(taken, 0) == 0) {
          throw CLI::ValidationError(fmt::format("'{}': dcp distill sets this key itself (use --out and "
                                                 "--finetune-steps)",
                                                 o));
        }
      }
      if (o.rfind("--model.", 0) == 0 && o.rfind("--model.recompute_layers=", 0) != 0) {
        throw CLI::ValidationError(fmt::format("'{}': the student keeps the teacher's model shape, so model.* "
                                               "keys cannot be overridden (model.recompute_layers can)",
                                               o));
      }
    }
    const fs::path checkpoint_below = fs::path(*teacher) / "checkpoint";
    if (!fs::exists(fs::path(*teacher) / "state.json") && fs::exists(checkpoint_below / "state.json")) {
      throw CLI::ValidationError(fmt::format("--teacher '{}' is a run folder, not a checkpoint; did you mean '{}'?",
                                             *teacher, checkpoint_below.string()));
    }
    std::error_code ec;
    if (fs::exists(*out) && !fs::is_directory(*out)) {
      throw CLI::ValidationError(fmt::format("--out '{}' exists and is not a folder", *out));
    }
    if (fs::is_directory(*out) && !fs::is_empty(*out, ec) && !*force) {
      throw CLI::ValidationError(fmt::format("--out '{}' is not empty (--force writes into it anyway)", *out));
    }
    overrides.push_back("run.dir=" + *out);
    overrides.push_back("train.max_steps=" + std::to_string(*finetune_steps));
    Config cfg;
    try {
      cfg = student_config(load_checkpoint_config(*teacher), overrides, /*fit_frequencies=*/fit->steps > 0);
    } catch (const std::invalid_argument& e) {  // a student the options describe wrongly: a usage error
      throw CLI::ValidationError(e.what());
    }
    // An unusable --out fails now, with its name; an empty folder left behind does not block a rerun.
    if (fs::create_directories(*out, ec), ec) {
      throw CLI::ValidationError(fmt::format("--out '{}': cannot create the folder: {}", *out, ec.message()));
    }
    DistEnv env = DistEnv::from_environment();
    ProcessGroups groups(env, cfg.dist.timeout_s, sp_sizes_for(cfg, env.world_size, {}));
    const DistillResult r = distill(*teacher, cfg, *fit, groups);
    if (env.rank != 0) return;
    fmt::print("\nheld-out bits per byte ({} tokens of the held-out split):\n\n", cfg.eval.max_tokens);
    fmt::print("| model | bits/byte |\n|---|---|\n");
    fmt::print("| teacher (softmax) | {} |\n", bpb(r.teacher_bpb));
    fmt::print("| student, teacher weights + initial frequencies | {} |\n", bpb(r.student_initial_bpb));
    fmt::print("| student after attention transfer ({} steps) | {} |\n", r.fit.steps, bpb(r.student_fitted_bpb));
    fmt::print("| student after fine-tuning ({} steps) | {} |\n", r.finetune_steps, bpb(r.student_finetuned_bpb));
    fmt::print("\n| layer | attention MSE before | after | relative before | after |\n|---|---|---|---|---|\n");
    for (size_t l = 0; l < r.fit.mse_final.size(); ++l) {
      const double var = r.fit.output_variance[l];
      fmt::print("| {} | {:.3g} | {:.3g} | {:.3g} | {:.3g} |\n", l, r.fit.mse_initial[l], r.fit.mse_final[l],
                 r.fit.mse_initial[l] / var, r.fit.mse_final[l] / var);
    }
    fmt::print("\nstage 1 {:.1f} s, stage 2 {:.1f} s, evaluations {:.1f} s; wrote {}/distill.json\n", r.fit.seconds,
               r.finetune_seconds, r.eval_seconds, *out);
  });
}

}  // namespace dcp
