// Planning time per step (Google Benchmark) next to plan quality: the planners run on every rank before every
// step, so they must stay far below a step's duration, and a faster planner is only worth having if its plans
// stay as good. Targets (issue 4): dcp-opt <= 10 ms per step at world_size 1024 with 4096 samples, and a
// lower_bound_ratio >= 0.95 in the four simulated settings (world 32 and 256, opensora-zipf and lognormal).
//
// Counters (computed once from the last plan, outside the timed loop):
//   lower_bound_ratio = sum over steps of step_lower_bound / sum of evaluate_step(...).step_s (1 = optimal);
//   predicted_s / lower_bound_s = those two sums, seconds; steps = steps planned per iteration;
//   s_per_step (BM_PlanEpoch only) = wall seconds per planned step (time per iteration / steps).
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "dcp/planners.h"

namespace {

const dcp::ModelShape kShape{};  // 1.3B decoder

// Predicted seconds and lower bound of a plan, summed over its steps; every step is validated first.
void report_quality(benchmark::State& state, const dcp::PlanSet& plans, const std::vector<dcp::Sample>& samples,
                    int64_t world_size, const dcp::CostModel& cost, const dcp::MemoryModel& memory) {
  double predicted = 0, bound = 0;
  for (const auto& step : plans.steps) {
    step.validate(world_size, samples, kShape.layers);
    predicted += dcp::evaluate_step(step, samples, world_size, cost, memory).step_s;
    bound += dcp::step_lower_bound(step.sample_ids(), samples, world_size, cost, memory);
  }
  state.counters["lower_bound_ratio"] = predicted > 0 ? bound / predicted : 0.0;
  state.counters["predicted_s"] = predicted;
  state.counters["lower_bound_s"] = bound;
  state.counters["steps"] = static_cast<double>(plans.steps.size());
}

void run_planner(benchmark::State& state, const std::string& planner_name, const std::vector<dcp::Sample>& samples,
                 int64_t world_size, const dcp::PlannerOptions& opt, const std::string& label) {
  dcp::CostModel cost(kShape, dcp::DeviceSpec::named("h200"));
  dcp::MemoryModel memory(kShape, dcp::DeviceSpec::named("h200"));
  dcp::Planner planner = dcp::planner_by_name(planner_name);
  dcp::PlanSet plans;
  for (auto _ : state) {
    plans = planner(samples, world_size, cost, memory, opt);
    benchmark::DoNotOptimize(plans);
  }
  report_quality(state, plans, samples, world_size, cost, memory);
  state.SetLabel(label);
}

// One global step of `samples_per_step` lognormal samples (median 8192, sigma 1.2, clipped to [1024, 262144]):
// the time per iteration is the time per step.
void plan_one_step(benchmark::State& state, const char* planner_name) {
  const int64_t world_size = state.range(0), samples_per_step = state.range(1);
  dcp::WorkloadOptions w;
  w.name = "lognormal";
  w.num_samples = samples_per_step;
  auto samples = dcp::samples_from_lengths(dcp::workload_lengths(w), "lognormal");
  dcp::PlannerOptions opt;
  opt.samples_per_step = samples_per_step;  // exactly one step
  run_planner(state, planner_name, samples, world_size, opt, planner_name);
}

// The epochs of `dcp simulate --workload W --world-size N --cost-model h200` (bench/results/
// h200-sim_202611_planners.md): the default workload (8000 samples), steps of world_size x 131072 tokens.
// range(1): 0 = opensora-zipf, 1 = lognormal.
void plan_epoch(benchmark::State& state, const char* planner_name) {
  const int64_t world_size = state.range(0);
  dcp::WorkloadOptions w;
  w.name = state.range(1) == 0 ? "opensora-zipf" : "lognormal";
  auto samples = dcp::samples_from_lengths(dcp::workload_lengths(w), w.name);
  dcp::PlannerOptions opt;
  opt.tokens_per_step = world_size * 131072;
  const size_t steps = dcp::split_steps(samples, opt).size();
  run_planner(state, planner_name, samples, world_size, opt, std::string(planner_name) + " " + w.name);
  state.counters["s_per_step"] = benchmark::Counter(static_cast<double>(steps),
                                                    benchmark::Counter::kIsIterationInvariantRate |
                                                        benchmark::Counter::kInvert);
}

void BM_PlanStep_DcpOpt(benchmark::State& s) { plan_one_step(s, "dcp-opt"); }
void BM_PlanStep_Packed(benchmark::State& s) { plan_one_step(s, "packed"); }
void BM_PlanStep_Bucket(benchmark::State& s) { plan_one_step(s, "bucket"); }
void BM_PlanEpoch_DcpOpt(benchmark::State& s) { plan_epoch(s, "dcp-opt"); }

BENCHMARK(BM_PlanStep_DcpOpt)->ArgsProduct({{32, 256, 1024}, {4096}})->Args({32, 256})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanStep_Packed)->Args({1024, 4096})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanStep_Bucket)->Args({1024, 4096})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanEpoch_DcpOpt)->ArgsProduct({{32, 256}, {0, 1}})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
