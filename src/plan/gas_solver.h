// The reference's gradient-accumulation solver (dcp-reference.md section 3.5 step 4,
// `_calculate_grad_accumulation_num`). Internal to dcp_base.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dcp::planner_detail {

/// How many micro-batches dcp-inter lets groups accumulate in one wave (the reference's inter config:
/// max_grad_accumulation_steps 5, min_grad_accumulation_steps 2; its PAC config's min of 15 is not used, so
/// dcp-inter-pac gets no extra accumulation that the other planners lack, section 7 "benchmark fairness").
constexpr int64_t kMaxGradAccumSteps = 5;
constexpr int64_t kMinGradAccumSteps = 2;

/// The asymmetric error of a group whose micro-batch takes `seconds` running g of them against target tau:
/// 1.2 (seconds * g - tau) when over the target, tau - seconds * g when under (over-running delays the step,
/// under-running only idles the group, hence the reference's 1.2 over-penalty).
double gas_error(double seconds, int64_t g, double tau);

/// Upper bound of a group's grad_accum_steps: floor(max_gas * max(seconds) / seconds_i), at least 1 (the
/// slowest group gets max_gas). A relative 1e-9 guards exact ratios against rounding.
int64_t gas_upper_bound(const std::vector<double>& seconds, size_t i, int64_t max_gas);

/// grad_accum_steps per group, the reference's rule: every target tau = seconds_o * m (o over the groups in
/// order, m = 1 .. hi_o) is tried; each group independently takes the g in [1, hi_i] of least gas_error
/// (ties: the smaller g); the tau with the least summed error wins (ties: the first tried). Then, when the
/// largest g is below min_gas, every g is multiplied by ceil(min_gas / largest g) and clamped to its cap.
/// hi_i = gas_upper_bound(seconds, i, max_gas), lowered to caps[i] when caps is not empty. Caps are ours:
/// a step has only so many samples, and the reference, which assumes endless buckets, instead drops a group
/// whose bucket cannot supply its gas (its drop_last prune, section 3.5 step 2).
/// `seconds` are the groups' micro-batch times (seconds). Each group's best g is one of two integers around
/// tau / seconds_i (the error is convex in g), so the cost is O(n * sum_o hi_o) instead of the reference's
/// O(n^2 M^2); repeated times are tried once (a repeat finds the same totals and would lose the tie).
/// Throws std::invalid_argument when a time is not positive and finite, max_gas or min_gas is below 1, caps
/// has another size than seconds, or a cap is below 1. Returns an empty vector for no groups.
std::vector<int64_t> solve_grad_accum_steps(const std::vector<double>& seconds, int64_t max_gas, int64_t min_gas,
                                            const std::vector<int64_t>& caps = {});

}  // namespace dcp::planner_detail
