// write_profile (dcp/profiler.h): the JSON file that DeviceSpec::from_profile and MemoryModel::from_profile read.
#include <nlohmann/json.hpp>

#include "dcp/precision.h"
#include "profile/profiler.h"
#include "util/file_write.h"

namespace dcp {

namespace {

// A ring fit of sequence_parallel.ring_fits (ProfileResult::ring): what DeviceSpec::from_profile reads, the
// fit's errors and its points.
nlohmann::json ring_fit_json(const SpProfile& c) {
  nlohmann::json grid = nlohmann::json::array();
  for (const CommPoint& p : c.points) {
    grid.push_back({{"local_tokens", p.local_tokens},
                    {"bytes_leaving_rank", p.bytes_leaving_rank},
                    {"measured_s", p.measured_s},
                    {"predicted_s", p.predicted_s},
                    {"held_out", p.held_out}});
  }
  return {{"sp_size", c.sp_size},
          {"latency_s", c.fit.latency_s},
          {"bytes_per_s", c.fit.bytes_per_s},
          {"bandwidth_fitted", c.bandwidth_fitted},
          {"heldout_median_rel_error", c.heldout_median_error},
          {"heldout_max_rel_error", c.heldout_max_error},
          {"fit_median_rel_error", c.fit_median_error},
          {"grid", grid}};
}

nlohmann::json sequence_parallel_json(const ProfileResult& r) {
  nlohmann::json fits = nlohmann::json::array();
  for (const SpProfile& c : r.sequence_parallel) {
    nlohmann::json grid = nlohmann::json::array();
    for (const CommPoint& p : c.points) {
      grid.push_back({{"local_tokens", p.local_tokens},
                      {"width", p.width},
                      {"bytes_leaving_rank", p.bytes_leaving_rank},
                      {"measured_s", p.measured_s},
                      {"predicted_s", p.predicted_s},
                      {"held_out", p.held_out}});
    }
    fits.push_back({{"sp_size", c.sp_size},
                    {"latency_s", c.fit.latency_s},
                    {"bytes_per_s", c.fit.bytes_per_s},
                    {"bandwidth_fitted", c.bandwidth_fitted},
                    {"overhead_s_per_byte", c.fit.overhead_s_per_byte},
                    {"heldout_median_rel_error", c.heldout_median_error},
                    {"heldout_max_rel_error", c.heldout_max_error},
                    {"fit_median_rel_error", c.fit_median_error},
                    {"validation_heldout_median_rel_error", c.validation_heldout_median_error},
                    {"validation_heldout_max_rel_error", c.validation_heldout_max_error},
                    {"validation_fit_median_rel_error", c.validation_fit_median_error},
                    {"grid", grid}});
  }
  nlohmann::json validation = nlohmann::json::array();
  for (const ValidationPoint& p : r.validation) {
    validation.push_back({{"sp_size", p.sp_size},
                          {"sample_length", p.lengths.front()},
                          {"samples", p.lengths.size()},
                          {"recompute_layers", p.recompute_layers},
                          {"measured_s", p.measured_s},
                          {"predicted_s", p.predicted_s},
                          {"rel_error", (p.predicted_s - p.measured_s) / p.measured_s},
                          {"measured_peak_bytes", p.measured_peak_bytes},
                          {"predicted_peak_bytes", p.predicted_peak_bytes},
                          {"held_out", p.held_out}});
  }
  nlohmann::json out = {
         {"formula", "seconds per all-to-all call = latency_s + bytes_leaving_rank / bytes_per_s; "
                      "bytes_leaving_rank = local_tokens * width * hidden * bytes_per_element * (sp - 1) / sp; in "
                      "a micro-batch each byte exchanged costs overhead_s_per_byte more (CostModel::all_to_all_bytes)"},
          {"weighting", "relative residuals, coefficients >= 0; every 3rd call point held out; overhead_s_per_byte "
                        "fitted to the validation points with held_out false; bandwidth_fitted false: the times did "
                        "not grow with the bytes, bytes_per_s is the fastest measured rate and latency_s was fitted "
                        "alone"},
          {"fits", fits},
          {"validation", validation}};
  if (!r.ring.empty()) {
    nlohmann::json ring = nlohmann::json::array();
    for (const SpProfile& c : r.ring) ring.push_back(ring_fit_json(c));
    out["ring_formula"] = "seconds per ring step = latency_s + bytes_leaving_rank / bytes_per_s; bytes_leaving_rank "
                          "= 2 * local_tokens * d_kv * bytes_per_element, the K, V block (CostModel::ring_block_bytes)";
    out["ring_fits"] = ring;
  }
  return out;
}

}  // namespace

void write_profile(const ProfileResult& r, const std::string& path) {
  const DeviceSpec& d = r.device;
  nlohmann::json grid = nlohmann::json::array();
  for (const ProfilePoint& p : r.points) {
    grid.push_back({{"sample_length", p.lengths.front()},
                    {"samples", p.lengths.size()},
                    {"tokens", p.tokens},
                    {"recompute_layers", p.recompute_layers},
                    {"linear_flops", p.flops.linear},
                    {"attention_flops", p.flops.attention},
                    {"measured_s", p.measured_s},
                    {"predicted_s", p.predicted_s},
                    {"measured_peak_bytes", p.measured_peak_bytes},
                    {"predicted_peak_bytes", p.predicted_peak_bytes},
                    {"held_out", p.held_out}});
  }
  nlohmann::json doc = {
      {"device",
       {{"name", d.name},
        {"memory_bytes", d.memory_bytes},
        {"peak_flops", d.peak_flops},
        {"mfu", d.mfu},
        {"attention_mfu", d.attention_mfu},
        {"intra_node_bw", d.intra_node_bw},
        {"inter_node_bw", d.inter_node_bw},
        {"gpus_per_node", d.gpus_per_node},
        {"collective_latency_s", d.collective_latency_s},
        {"micro_batch_overhead_s", d.micro_batch_overhead_s},
        {"ring_block_efficiency", d.ring_block_efficiency},
        {"round_switch_s", d.round_switch_s}}},
      {"model",
       {{"hidden", r.shape.hidden},
        {"layers", r.shape.layers},
        {"heads", r.shape.heads},
        {"ffn", r.shape.ffn},
        {"mlp_matrices", r.shape.mlp_matrices},
        {"vocab", r.shape.vocab},
        {"bytes_per_element", r.shape.bytes_per_element},
        {"precision", precision_of_bytes(r.shape.bytes_per_element)},
        {"attention", attention_kind_name(r.shape.attention)},
        {"feature_dim", r.shape.feature_dim},
        {"feature_projections", r.shape.feature_projections},
        {"chunk_size", r.shape.chunk_size}}},
      {"fit",
       {{"formula", "seconds = fixed_s + linear_flops / linear_flops_per_s + attention_flops / attention_flops_per_s"},
        {"weighting", "relative residuals (each point divided by its measured seconds), coefficients >= 0"},
        {"fixed_s", r.fixed_s},
        {"linear_flops_per_s", r.linear_flops_per_s},
        {"attention_flops_per_s", r.attention_flops_per_s},
        {"attention_separated", r.attention_separated},
        {"heldout_median_rel_error", r.heldout_median_error},
        {"heldout_max_rel_error", r.heldout_max_error},
        {"fit_median_rel_error", r.fit_median_error}}},
      {"memory",
       {{"formula", "bytes = base_bytes + t * (token_layer_bytes * (L - r) + token_recompute_bytes * r + token_bytes "
                    "+ [sp > 1] sp_token_bytes) + Q * (square_layer_bytes * (L - r) + square_bytes); t = tokens / sp, "
                    "Q = sum of squared sample lengths / sp, L layers, r recomputed"},
        {"weighting", "relative residuals (each point divided by its measured peak bytes), coefficients >= 0"},
        {"method", r.memory_method},
        {"base_bytes", r.memory.base_bytes},
        {"token_layer_bytes", r.memory.token_layer_bytes},
        {"token_recompute_bytes", r.memory.token_recompute_bytes},
        {"token_bytes", r.memory.token_bytes},
        {"square_layer_bytes", r.memory.square_layer_bytes},
        {"square_bytes", r.memory.square_bytes},
        {"sp_token_bytes", r.memory.sp_token_bytes},
        {"heldout_median_rel_error", r.memory_heldout_median_error},
        {"heldout_max_rel_error", r.memory_heldout_max_error},
        {"fit_median_rel_error", r.memory_fit_median_error}}},
      {"grid", grid},
      {"world_size", r.world_size},
      {"threads", r.threads},
      {"repeats", r.repeats},
      {"max_rss_bytes", r.max_rss_bytes},
      {"wall_s", r.wall_s},
      {"notes",
       {"memory: peak bytes of tensor storage per run (memory.method; the fallback is the process high-water "
        "mark), with weights, gradients and AdamW moments resident as in the trainer; token_bytes is 0 because it "
        "is not separable from token_layer_bytes and token_recompute_bytes; the division by sp is assumed (the grid "
        "runs sp 1); sp_token_bytes is 6 hidden bytes_per_element in one process, else the largest excess per "
        "local token of the measured SP peaks (sequence_parallel.validation) over the sp-1 fit; max_rss_bytes is the process high-water mark after the run, max over ranks",
        "time: with world_size > 1 every rank ran the grid at once and each point is the mean over the ranks",
        r.sequence_parallel.empty()
            ? "sequence parallelism is not profiled (one process): intra_node_bw, inter_node_bw and "
              "collective_latency_s are the DeviceSpec defaults; run `dcp launch --nproc N -- profile` to fit them"
            : "sequence parallelism: sequence_parallel.fits replace collective_latency_s and the bandwidths for "
              "their SP sizes (CostModel: 4 L + 2 r calls per micro-batch, (8 L + 4 r) hidden elements per local "
              "token, each byte also costing overhead_s_per_byte, fitted to the validation micro-batches not held "
              "out); the gradient all-reduce and SP sizes without a fit keep the defaults"}}};
  if (!r.sequence_parallel.empty() || !r.ring.empty()) doc["sequence_parallel"] = sequence_parallel_json(r);
  if (r.round_switch.sp_size > 0) {
    const RoundSwitchProfile& s = r.round_switch;
    doc["round_switch"] = {
        {"formula", "raw_s = both_s - first_s - second_s + barrier_s; switch_s = max(0, raw_s) (device.round_switch_s)"},
        {"sp_size", s.sp_size},     {"local_tokens", s.local_tokens}, {"repeats", s.repeats},
        {"first_s", s.first_s},     {"second_s", s.second_s},         {"both_s", s.both_s},
        {"barrier_s", s.barrier_s}, {"raw_s", s.raw_s},               {"switch_s", s.switch_s}};
  }
  write_file_checked(path, doc.dump(1) + "\n");
}

}  // namespace dcp
