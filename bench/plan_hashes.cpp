// dcp-opt's plans over many cases, one line per case with a hash of its plans: the check that a change meant
// to make dcp-opt faster leaves every plan byte for byte as it was (bench/results/cpu1_202612_plan_time.md).
// Run it before and after the change and diff the lines without the last column (planning ms).
//
// usage: plan_hashes [GROUP] [--corpus DIR] [--profile FILE]
//   GROUP: step | epoch | budget | main | random (default: all). Per case: steps planned, steps with rounds,
//   samples skipped, the predicted epoch seconds (evaluate_step summed), the 64-bit FNV-1a hash of every
//   step's canonical JSON (StepPlan::to_json) and the skipped ids, and the planning wall time in ms.
//   Cases: one lognormal step of 4096 samples at world 32, 256 and 1024 with max_rounds 0-3; epochs of
//   lognormal, opensora-zipf, megatron-lognormal (also at 2048 tokens per rank) and uniform at world 2, 4, 8,
//   12, 16, 24, 64, 256 and 1024 with max_rounds 0 and 1; a 20 GB budget and Ulysses only; the main job's
//   lengths (every *.txt under --corpus, default the CPython docs of configs/default.yaml, cut at 16 KiB and
//   64 KiB) under h200 at its default and a 60 GB budget and under the CPU profile --profile (default
//   bench/results/cpu2_202612_sp_profile.json, 128 MB); 30 random small steps.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dcp/planners.h"

using namespace dcp;

namespace {

uint64_t fnv(uint64_t h, const std::string& s) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void run_case(const std::string& name, const std::vector<Sample>& samples, int64_t world, const CostModel& cost,
              const MemoryModel& memory, const PlannerOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const PlanSet set = plan_dcp_opt(samples, world, cost, memory, opt);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  uint64_t h = 1469598103934665603ull;
  double predicted = 0;
  int rounds = 0;
  for (const auto& step : set.steps) {
    h = fnv(h, step.to_json());
    predicted += evaluate_step(step, samples, world, cost, memory).step_s;
    if (step.num_rounds() > 1) ++rounds;
  }
  for (int64_t id : set.skipped_ids) h = fnv(h, std::to_string(id) + ",");
  std::printf("%-34s steps %4zu rounds %4d skipped %4zu predicted_s %.9e hash %016llx ms %.1f\n", name.c_str(),
              set.steps.size(), rounds, set.skipped_ids.size(), predicted, static_cast<unsigned long long>(h), ms);
  std::fflush(stdout);
}

// Sizes of the non-empty *.txt files under `dir`, ascending, each cut into pieces of at most max_len (the lengths
// bench/rounds_sweep.sh gives the main job); empty when the folder is missing.
std::vector<int64_t> corpus_lengths(const std::string& dir, int64_t max_len) {
  std::vector<int64_t> sizes;
  std::vector<std::string> stack{dir};
  while (!stack.empty()) {
    const std::string d = stack.back();
    stack.pop_back();
    DIR* handle = opendir(d.c_str());
    if (handle == nullptr) continue;
    while (const dirent* e = readdir(handle)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string path = d + "/" + name;
      struct stat st {};
      if (stat(path.c_str(), &st) != 0) continue;
      if (S_ISDIR(st.st_mode)) {
        stack.push_back(path);
      } else if (name.size() > 4 && name.compare(name.size() - 4, 4, ".txt") == 0 && st.st_size > 0) {
        sizes.push_back(st.st_size);
      }
    }
    closedir(handle);
  }
  std::sort(sizes.begin(), sizes.end());
  std::vector<int64_t> out;
  for (int64_t s : sizes) {
    for (int64_t left = s; left > 0; left -= max_len) out.push_back(std::min(left, max_len));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string only, corpus = "/usr/share/doc/python3.11/html/_sources",
                    profile = "bench/results/cpu2_202612_sp_profile.json";
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if ((arg == "--corpus" || arg == "--profile") && a + 1 < argc) {
      (arg == "--corpus" ? corpus : profile) = argv[++a];
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "plan_hashes: unknown option %s (usage: plan_hashes [GROUP] [--corpus DIR] "
                           "[--profile FILE])\n", arg.c_str());
      return 2;
    } else {
      only = arg;
    }
  }
  auto want = [&](const char* group) { return only.empty() || only == group; };
  const ModelShape shape{};
  const DeviceSpec h200 = DeviceSpec::named("h200");
  const CostModel cost(shape, h200);
  const MemoryModel memory(shape, h200);
  const MemoryModel mem20 = MemoryModel::analytic(shape, 20e9);
  const std::string w = " w", r = " r";

  if (want("step")) {
    WorkloadOptions wl;
    wl.name = "lognormal";
    wl.num_samples = 4096;
    const auto samples = samples_from_lengths(workload_lengths(wl), "lognormal");
    for (int64_t world : {32, 256, 1024}) {
      for (int64_t rounds : {0, 1, 2, 3}) {
        PlannerOptions o;
        o.samples_per_step = 4096;
        o.max_rounds = rounds;
        run_case("step4096" + w + std::to_string(world) + r + std::to_string(rounds), samples, world, cost, memory, o);
      }
    }
  }
  if (want("epoch")) {
    for (const char* name : {"lognormal", "opensora-zipf", "megatron-lognormal", "uniform"}) {
      WorkloadOptions wl;
      wl.name = name;
      const auto samples = samples_from_lengths(workload_lengths(wl), name);
      for (int64_t world : {2, 4, 8, 12, 16, 24, 64, 256, 1024}) {
        for (int64_t rounds : {0, 1}) {
          PlannerOptions o;
          o.tokens_per_step = world * 131072;
          o.max_rounds = rounds;
          const std::string tag = std::string(name) + w + std::to_string(world) + r + std::to_string(rounds);
          run_case("epoch " + tag, samples, world, cost, memory, o);
          if (std::string(name) == "megatron-lognormal") {
            o.tokens_per_step = world * 2048;
            run_case("epoch2048 " + tag, samples, world, cost, memory, o);
          }
        }
      }
    }
  }
  if (want("budget")) {
    for (const char* name : {"lognormal", "opensora-zipf"}) {
      WorkloadOptions wl;
      wl.name = name;
      const auto samples = samples_from_lengths(workload_lengths(wl), name);
      for (int64_t world : {8, 24, 256}) {
        for (int64_t rounds : {0, 1}) {
          PlannerOptions o;
          o.tokens_per_step = world * 131072;
          o.max_rounds = rounds;
          const std::string tag = std::string(name) + w + std::to_string(world) + r + std::to_string(rounds);
          run_case("20GB " + tag, samples, world, cost, mem20, o);
          o.sp_modes = {SpMode::kUlysses};
          run_case("ulysses " + tag, samples, world, cost, memory, o);
        }
      }
    }
  }
  if (want("main")) {
    const MemoryModel mem60 = MemoryModel::analytic(shape, 60e9);
    ModelShape small;  // configs/default.yaml's model, as profiled in `profile`
    small.hidden = 128, small.layers = 4, small.heads = 4, small.ffn = 384, small.mlp_matrices = 3, small.vocab = 257;
    const CostModel profiled(small, DeviceSpec::named(profile));
    for (int64_t len : {16384, 65536}) {
      const auto lengths = corpus_lengths(corpus, len);
      if (lengths.empty()) {
        std::fprintf(stderr, "plan_hashes: no *.txt under %s: the main job's cases are left out\n", corpus.c_str());
        break;
      }
      const auto samples = samples_from_lengths(lengths, "main");
      const MemoryModel profiled_memory = MemoryModel::from_profile(profile, 128e6, len);
      for (int64_t world : {2, 4, 8, 16, 64}) {
        for (int64_t rounds : {0, 1}) {
          const std::string tag = "main" + std::to_string(len) + w + std::to_string(world) + r + std::to_string(rounds);
          PlannerOptions o;
          o.tokens_per_step = world * 131072;
          o.max_rounds = rounds;
          run_case(tag + " h200", samples, world, cost, memory, o);
          run_case(tag + " 60GB", samples, world, cost, mem60, o);
          if (world <= 8) {
            PlannerOptions p;
            p.tokens_per_step = 65536 * world / 2;
            p.max_rounds = rounds;
            run_case(tag + " cpu-profile", samples, world, profiled, profiled_memory, p);
          }
        }
      }
    }
  }
  if (want("random")) {
    std::mt19937_64 rng(7);
    for (int c = 0; c < 30; ++c) {
      const int64_t world = std::vector<int64_t>{1, 2, 3, 4, 6, 8, 12, 16}[rng() % 8];
      const int64_t n = 1 + static_cast<int64_t>(rng() % 24);
      std::vector<int64_t> lengths;
      for (int64_t i = 0; i < n; ++i) {
        lengths.push_back(1 + static_cast<int64_t>(std::exp(std::uniform_real_distribution<double>(0, 12.5)(rng))));
      }
      PlannerOptions o;
      o.samples_per_step = n;
      o.max_rounds = static_cast<int64_t>(rng() % 3);
      run_case("random " + std::to_string(c) + w + std::to_string(world) + r + std::to_string(o.max_rounds),
               samples_from_lengths(lengths, "rand"), world, cost, c % 2 ? memory : mem20, o);
    }
  }
  return 0;
}
