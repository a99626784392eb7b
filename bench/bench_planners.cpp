// Planning time per step (Google Benchmark): the planners run on every rank before every step, so they must
// stay far below a step's duration. Target (issue 4): <= 10 ms per step at world_size 1024, 4096 samples.
#include <benchmark/benchmark.h>

#include "dcp/planners.h"

namespace {

void plan_one_step(benchmark::State& state, const char* planner_name) {
  const int64_t world_size = state.range(0), samples_per_step = state.range(1);
  dcp::WorkloadOptions w;
  w.name = "lognormal";
  w.num_samples = samples_per_step;
  auto samples = dcp::samples_from_lengths(dcp::workload_lengths(w), "lognormal");
  dcp::CostModel cost(dcp::ModelShape{}, dcp::DeviceSpec::named("h200"));
  dcp::MemoryModel memory(dcp::ModelShape{}, dcp::DeviceSpec::named("h200"));
  dcp::PlannerOptions opt;
  opt.samples_per_step = samples_per_step;  // exactly one step
  dcp::Planner planner = dcp::planner_by_name(planner_name);
  for (auto _ : state) {
    auto plans = planner(samples, world_size, cost, memory, opt);
    benchmark::DoNotOptimize(plans);
  }
  state.SetLabel(planner_name);
}

void BM_PlanStep_DcpOpt(benchmark::State& s) { plan_one_step(s, "dcp-opt"); }
void BM_PlanStep_Packed(benchmark::State& s) { plan_one_step(s, "packed"); }
void BM_PlanStep_Bucket(benchmark::State& s) { plan_one_step(s, "bucket"); }

BENCHMARK(BM_PlanStep_DcpOpt)->ArgsProduct({{32, 256, 1024}, {4096}})->Args({32, 256})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanStep_Packed)->Args({1024, 4096})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlanStep_Bucket)->Args({1024, 4096})->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
