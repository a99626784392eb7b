#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "dcp/dist.h"
#include "dcp/planning.h"
#include "profile/cache.h"
#include "profile/profiler.h"
#include "error_of.h"
#include "profile/over_ranks.h"
#include "profile/comm.h"
#include "profile/validation.h"
#include "util/stats.h"

namespace dcp {
namespace {

namespace fs = std::filesystem;

// A per-process scratch folder, removed when the test binary exits.
struct TempDir {
  fs::path path = fs::temp_directory_path() / fmt::format("dcp_test_profile_{}", ::getpid());
  TempDir() { fs::create_directories(path); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

fs::path temp_file(const std::string& name) {
  static const TempDir dir;
  return dir.path / name;
}

// A cached profile's file name is pinned (computed by hand from the offset basis and FNV-1a's prime): a change would
// make every profile cached before it be measured again.
TEST(ProfileCache, FileNameOfAKeyIsPinned) {
  EXPECT_EQ(profile_cache_path("d", nlohmann::json{{"a", 1}}), "d/profile-32e51dac937672f3.json");
}

TEST(ProfileFit, RecoversKnownCoefficientsFromExactData) {
  // Profile-like magnitudes: a constant column, ~1e9 linear FLOPs, ~1e8 attention FLOPs.
  const std::vector<double> truth = {2e-3, 1.0 / 40e9, 1.0 / 5e9};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> lin(1e8, 2e10), att(1e6, 5e9);
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (int i = 0; i < 12; ++i) {
    rows.push_back({1.0, lin(rng), att(rng)});
    y.push_back(truth[0] + truth[1] * rows.back()[1] + truth[2] * rows.back()[2]);
  }
  const std::vector<double> x = fit_nonnegative_least_squares(rows, y);
  ASSERT_EQ(x.size(), 3u);
  for (size_t c = 0; c < 3; ++c) EXPECT_NEAR(x[c], truth[c], 1e-8 * truth[c]) << "column " << c;
}

TEST(ProfileFit, NegativeCoefficientIsDroppedAndTheRestRefitted) {
  // y = 2 a - 0.5 b with a and b positive and correlated: the unconstrained fit needs a negative b.
  std::vector<std::vector<double>> rows;
  std::vector<double> y;
  for (int i = 1; i <= 10; ++i) {
    const double a = i, b = i + 0.3 * (i % 3);
    rows.push_back({a, b});
    y.push_back(2.0 * a - 0.5 * b);
  }
  const std::vector<double> x = fit_nonnegative_least_squares(rows, y);
  EXPECT_EQ(x[1], 0.0);
  double ay = 0, aa = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    ay += rows[i][0] * y[i];
    aa += rows[i][0] * rows[i][0];
  }
  EXPECT_NEAR(x[0], ay / aa, 1e-12);  // the one-column least-squares solution
  // All coefficients would be negative: the best non-negative answer is 0.
  const std::vector<double> zero = fit_nonnegative_least_squares({{1.0}, {2.0}}, {-1.0, -2.0});
  EXPECT_EQ(zero, std::vector<double>{0.0});
  EXPECT_THROW(fit_nonnegative_least_squares({}, {}), std::invalid_argument);
  EXPECT_THROW(fit_nonnegative_least_squares({{1.0, 2.0}, {1.0}}, {1.0, 2.0}), std::invalid_argument);
  EXPECT_THROW(fit_nonnegative_least_squares({{1.0}}, {1.0, 2.0}), std::invalid_argument);
}

ProfileResult handmade_result() {
  ProfileResult r;
  r.device.name = "cpu-profile";
  r.device.memory_bytes = 24e9;
  r.device.peak_flops = 3.5e10;
  r.device.mfu = 1.0;
  r.device.attention_mfu = 0.25;
  r.device.gpus_per_node = 1;
  r.device.micro_batch_overhead_s = 1.5e-3;
  ProfilePoint p;
  p.lengths = {64, 64};
  p.tokens = 128;
  r.points.push_back(p);
  return r;
}

TEST(ProfileFile, RoundTripsThroughFromProfileAndNamed) {
  const ProfileResult r = handmade_result();
  const std::string path = temp_file("roundtrip.json").string();
  write_profile(r, path);
  for (const DeviceSpec& d : {DeviceSpec::from_profile(path), DeviceSpec::named(path)}) {
    EXPECT_EQ(d.name, "cpu-profile");
    EXPECT_DOUBLE_EQ(d.memory_bytes, 24e9);
    EXPECT_DOUBLE_EQ(d.peak_flops, 3.5e10);
    EXPECT_DOUBLE_EQ(d.mfu, 1.0);
    EXPECT_DOUBLE_EQ(d.attention_mfu, 0.25);
    EXPECT_EQ(d.gpus_per_node, 1);
    EXPECT_DOUBLE_EQ(d.micro_batch_overhead_s, 1.5e-3);
    EXPECT_DOUBLE_EQ(d.intra_node_bw, DeviceSpec{}.intra_node_bw);
    EXPECT_DOUBLE_EQ(d.inter_node_bw, DeviceSpec{}.inter_node_bw);
    EXPECT_DOUBLE_EQ(d.collective_latency_s, DeviceSpec{}.collective_latency_s);
  }
  const std::string unknown = test::error_of([] { DeviceSpec::named("no-such-device"); });
  EXPECT_NE(unknown.find("'no-such-device'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("h200"), std::string::npos) << unknown;
  EXPECT_THROW(DeviceSpec::named("no-such-device"), std::invalid_argument);
}

TEST(ProfileFile, MissingOrMistypedFieldIsNamedWithTheFile) {
  const std::string good = temp_file("good.json").string();
  write_profile(handmade_result(), good);
  nlohmann::json doc;
  std::ifstream(good) >> doc;

  const std::string missing = temp_file("missing.json").string();
  nlohmann::json without = doc;
  without["device"].erase("attention_mfu");
  std::ofstream(missing) << without.dump();
  const std::string m = test::error_of([&] { DeviceSpec::from_profile(missing); });
  EXPECT_NE(m.find(missing), std::string::npos) << m;
  EXPECT_NE(m.find("device.attention_mfu"), std::string::npos) << m;
  EXPECT_THROW(DeviceSpec::from_profile(missing), std::invalid_argument);

  const std::string mistyped = temp_file("mistyped.json").string();
  nlohmann::json wrong = doc;
  wrong["device"]["peak_flops"] = "fast";
  std::ofstream(mistyped) << wrong.dump();
  const std::string t = test::error_of([&] { DeviceSpec::from_profile(mistyped); });
  EXPECT_NE(t.find("device.peak_flops"), std::string::npos) << t;

  const std::string garbage = temp_file("garbage.json").string();
  std::ofstream(garbage) << "{not json";
  EXPECT_NE(test::error_of([&] { DeviceSpec::from_profile(garbage); }).find(garbage), std::string::npos);
  EXPECT_THROW(DeviceSpec::from_profile(temp_file("absent.json").string()), std::runtime_error);

  // Values no device has would make the planners' times 0 or inf (the review found dcp-opt's bisection looping
  // forever on them): refused, naming the file, the field and the value.
  for (const auto& [field, value] : std::vector<std::pair<std::string, double>>{
           {"peak_flops", 1e-300}, {"micro_batch_overhead_s", 1e300}, {"intra_node_bw", -1}}) {
    nlohmann::json odd = doc;
    odd["device"][field] = value;
    const std::string path = temp_file("odd_" + field + ".json").string();
    std::ofstream(path) << odd.dump();
    const std::string e = test::error_of([&] { DeviceSpec::from_profile(path); });
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(field), std::string::npos) << e;
    EXPECT_THROW(DeviceSpec::from_profile(path), std::invalid_argument);
  }
}

ProfileResult with_sequence_parallel(ProfileResult r) {
  SpProfile c;
  c.sp_size = 2;
  c.fit = CommFit{80e-6, 1.5e9, 5e-9};
  c.points.push_back(CommPoint{1024, 3, 393216.0, 3.4e-4, 3.42e-4, false});
  r.sequence_parallel.push_back(c);
  c.sp_size = 4;
  c.fit = CommFit{120e-6, 1.1e9};
  r.sequence_parallel.push_back(c);
  ValidationPoint v;
  v.sp_size = 2;
  v.lengths = {4096};
  v.measured_s = 0.5;
  v.predicted_s = 0.55;
  r.validation.push_back(v);
  return r;
}

TEST(ProfileFile, SequenceParallelFitsRoundTripIntoTheDevice) {
  const std::string path = temp_file("sp.json").string();
  write_profile(with_sequence_parallel(handmade_result()), path);
  const DeviceSpec d = DeviceSpec::from_profile(path);
  ASSERT_EQ(d.all_to_all.size(), 2u);
  EXPECT_DOUBLE_EQ(d.all_to_all.at(2).latency_s, 80e-6);
  EXPECT_DOUBLE_EQ(d.all_to_all.at(2).bytes_per_s, 1.5e9);
  EXPECT_DOUBLE_EQ(d.all_to_all.at(2).overhead_s_per_byte, 5e-9);
  EXPECT_DOUBLE_EQ(d.all_to_all.at(4).overhead_s_per_byte, 0.0);
  EXPECT_DOUBLE_EQ(d.all_to_all.at(4).bytes_per_s, 1.1e9);
  nlohmann::json doc;
  std::ifstream(path) >> doc;
  const auto& v = doc.at("sequence_parallel").at("validation").at(0);
  EXPECT_EQ(v.at("sample_length"), 4096);
  EXPECT_NEAR(v.at("rel_error").get<double>(), 0.1, 1e-12);
  EXPECT_EQ(doc.at("sequence_parallel").at("fits").at(0).at("grid").size(), 1u);
  // A single-process profile, and one written before SP was profiled, have none: the defaults stay.
  const std::string single = temp_file("single.json").string();
  write_profile(handmade_result(), single);
  std::ifstream(single) >> doc;
  EXPECT_FALSE(doc.contains("sequence_parallel"));
  EXPECT_TRUE(DeviceSpec::from_profile(single).all_to_all.empty());
}

// The ring fits next to the all-to-all fits: written as sequence_parallel.ring_fits, read back into
// DeviceSpec::ring with the device's ring_block_efficiency; a profile with all-to-alls only (written before the
// ring was profiled) leaves the ring to the defaults (tested above).
TEST(ProfileFile, RingFitsRoundTripIntoTheDevice) {
  ProfileResult r = with_sequence_parallel(handmade_result());
  r.device.ring_block_efficiency = 0.8;
  SpProfile ring;
  ring.sp_size = 2;
  ring.fit = CommFit{30e-6, 2.5e9, 0};
  ring.points.push_back(CommPoint{1024, 2, 524288.0, 2.4e-4, 2.4e-4, false});
  r.ring.push_back(ring);
  ring.sp_size = 4;
  ring.fit = CommFit{45e-6, 1.2e9, 0};
  r.ring.push_back(ring);
  const std::string path = temp_file("ring.json").string();
  write_profile(r, path);
  const DeviceSpec d = DeviceSpec::from_profile(path);
  ASSERT_EQ(d.ring.size(), 2u);
  EXPECT_DOUBLE_EQ(d.ring.at(2).latency_s, 30e-6);
  EXPECT_DOUBLE_EQ(d.ring.at(4).bytes_per_s, 1.2e9);
  EXPECT_DOUBLE_EQ(d.ring_block_efficiency, 0.8);
  EXPECT_EQ(d.all_to_all.size(), 2u);
  nlohmann::json doc;
  std::ifstream(path) >> doc;
  EXPECT_EQ(doc.at("sequence_parallel").at("ring_fits").at(0).at("grid").at(0).at("bytes_leaving_rank"), 524288.0);
  // Without ring fits there is no ring_fits array, and DeviceSpec::ring stays empty.
  const std::string plain = temp_file("no_ring.json").string();
  write_profile(with_sequence_parallel(handmade_result()), plain);
  std::ifstream(plain) >> doc;
  EXPECT_FALSE(doc.at("sequence_parallel").contains("ring_fits"));
  EXPECT_TRUE(DeviceSpec::from_profile(plain).ring.empty());
}

TEST(ProfileFile, MalformedSequenceParallelIsNamedWithTheFileAndField) {
  const std::string good = temp_file("sp_good.json").string();
  write_profile(with_sequence_parallel(handmade_result()), good);
  nlohmann::json doc;
  std::ifstream(good) >> doc;
  int n = 0;
  auto expect_refused = [&](const std::function<void(nlohmann::json&)>& spoil, const std::string& field) {
    nlohmann::json bad = doc;
    spoil(bad);
    const std::string path = temp_file(fmt::format("sp_bad{}.json", n++)).string();
    std::ofstream(path) << bad.dump();
    const std::string m = test::error_of([&] { DeviceSpec::from_profile(path); });
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("'" + field + "'"), std::string::npos) << m;
    EXPECT_THROW(DeviceSpec::from_profile(path), std::invalid_argument) << field;
  };
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"] = 3; }, "sequence_parallel");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"].erase("fits"); }, "sequence_parallel.fits");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"] = "none"; }, "sequence_parallel.fits");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][1] = 7; }, "sequence_parallel.fits[1]");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0]["bytes_per_s"] = "fast"; },
                 "sequence_parallel.fits[0].bytes_per_s");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0]["bytes_per_s"] = 0; },
                 "sequence_parallel.fits[0].bytes_per_s");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][1].erase("latency_s"); },
                 "sequence_parallel.fits[1].latency_s");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0]["latency_s"] = -1e-6; },
                 "sequence_parallel.fits[0].latency_s");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0].erase("overhead_s_per_byte"); },
                 "sequence_parallel.fits[0].overhead_s_per_byte");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][1]["overhead_s_per_byte"] = -1e-9; },
                 "sequence_parallel.fits[1].overhead_s_per_byte");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0]["sp_size"] = 1; },
                 "sequence_parallel.fits[0].sp_size");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][0]["sp_size"] = 2.5; },
                 "sequence_parallel.fits[0].sp_size");
  expect_refused([](nlohmann::json& j) { j["sequence_parallel"]["fits"][1]["sp_size"] = 2; },
                 "sequence_parallel.fits[1].sp_size");
}

// Call points of an all-to-all profile: `seconds` per call for calls of 1, 2, 4, ... MB, every 3rd held out.
SpProfile comm_points(const std::vector<double>& seconds) {
  SpProfile sp;
  sp.sp_size = 2;
  for (size_t i = 0; i < seconds.size(); ++i) {
    CommPoint p;
    p.bytes_leaving_rank = 1e6 * static_cast<double>(1 << i);
    p.measured_s = seconds[i];
    p.held_out = i % 3 == 2;
    sp.points.push_back(p);
  }
  return sp;
}

TEST(ProfileComm, AllToAllFitRecoversLatencyAndBandwidth) {
  std::vector<double> seconds;
  for (int i = 0; i < 6; ++i) seconds.push_back(50e-6 + 1e6 * (1 << i) / 2e9);
  SpProfile sp = comm_points(seconds);
  fit_all_to_all(sp);
  EXPECT_TRUE(sp.bandwidth_fitted);
  EXPECT_NEAR(sp.fit.latency_s, 50e-6, 1e-9);
  EXPECT_NEAR(sp.fit.bytes_per_s, 2e9, 1e3);
  EXPECT_LT(sp.heldout_max_error, 1e-9);
}

TEST(ProfileComm, TimesThatDoNotGrowWithTheBytesFallBackToALatencyOnlyFit) {
  // Noise: the larger calls measured faster than the small ones. The two-term fit finds no cost per byte; the
  // fallback keeps the fastest rate measured (16 MB in 2 ms among the fitted points) and fits the latency alone.
  SpProfile sp = comm_points({4e-3, 3e-3, 99.0, 3e-3, 2e-3, 99.0});
  fit_all_to_all(sp);
  EXPECT_FALSE(sp.bandwidth_fitted);
  EXPECT_DOUBLE_EQ(sp.fit.bytes_per_s, 16e6 / 2e-3);
  EXPECT_GE(sp.fit.latency_s, 0.0);
  for (const CommPoint& p : sp.points) {
    // the bytes term alone never exceeds a fitted measurement
    if (!p.held_out) EXPECT_GE(p.measured_s * (1 + 1e-12), p.bytes_leaving_rank / sp.fit.bytes_per_s);
    EXPECT_DOUBLE_EQ(p.predicted_s, sp.fit.latency_s + p.bytes_leaving_rank / sp.fit.bytes_per_s);
  }
  // What the cost model reads back accepts it (finite, positive bandwidth).
  EXPECT_TRUE(std::isfinite(sp.fit.bytes_per_s) && sp.fit.bytes_per_s > 0);
  SpProfile empty = comm_points({1e-3});
  empty.points[0].held_out = true;
  EXPECT_THROW(fit_all_to_all(empty), std::invalid_argument);
}

TEST(ProfileStats, OverRanksOfOneProcessAndSplitErrors) {
  const Communicator self("self", 0, 1, nullptr);
  const OverRanks r = over_ranks(self, {1.5, 0.0, 2.0});
  EXPECT_EQ(r.mean, (std::vector<double>{1.5, 0.0, 2.0}));
  EXPECT_EQ(r.max, r.mean);
  EXPECT_THROW(over_ranks(self, {-1.0}), std::invalid_argument);
  const SplitErrors e = split_errors({0.1, 0.3, 0.2, 0.05}, {false, true, true, false});
  EXPECT_DOUBLE_EQ(e.heldout_median, 0.25);
  EXPECT_DOUBLE_EQ(e.heldout_max, 0.3);
  EXPECT_DOUBLE_EQ(e.fit_median, 0.075);
}

// The SP token bytes come from the large micro-batches, where the budget binds: a small point's fixed slack
// (here 1 MB on 1024 local tokens) does not set them, and no point with at least half the largest's local
// tokens is under-predicted.
TEST(ProfileFit, SpTokenBytesFollowTheLargeMicroBatches) {
  ModelShape shape;
  shape.hidden = 64, shape.layers = 2, shape.heads = 2, shape.ffn = 128, shape.vocab = 257;
  MemoryCoefficients c;
  c.base_bytes = 1e6;
  c.token_layer_bytes = 3000;
  c.token_recompute_bytes = 800;
  const MemoryModel sp1(shape, c, 1.0);
  auto point = [&](int64_t length, int64_t r, double extra_per_local_token, double slack) {
    ValidationPoint p;
    p.sp_size = 2;
    p.lengths = {length};
    p.recompute_layers = r;
    p.measured_peak_bytes = sp1.bytes(p.lengths, 2, r) + extra_per_local_token * length / 2 + slack;
    return p;
  };
  std::vector<ValidationPoint> points{point(2048, 0, 500, 1e6), point(8192, 0, 700, 0), point(16384, 0, 600, 0),
                                      point(16384, 2, 150, 0)};
  EXPECT_DOUBLE_EQ(fit_sp_token_bytes(points, shape, c), 700);
  for (const auto& p : points) {
    if (p.lengths[0] >= 8192) EXPECT_GE(p.predicted_peak_bytes, p.measured_peak_bytes * (1 - 1e-12));
  }
  EXPECT_LT(points[0].predicted_peak_bytes, points[0].measured_peak_bytes);
  std::vector<ValidationPoint> none;
  EXPECT_THROW(fit_sp_token_bytes(none, shape, c), std::invalid_argument);
}

TEST(Profile, TimeFitFallsBackToOneRateWhenEitherCoefficientIsZero) {
  // Times that only the attention column explains (attention FLOPs grow slightly faster than the linear ones,
  // as a linear-attention model's nearly collinear columns can): the separate fit puts 0 on the linear rate.
  // That is one rate for all FLOPs, not a failure (it was "no cost per FLOP" before).
  ProfileResult r;
  Config cfg;
  r.shape = model_shape_of(cfg, 4);
  const double lin[] = {1e9, 2e9, 4e9, 8e9, 16e9}, att[] = {1e9, 2.2e9, 4.6e9, 9.5e9, 19.5e9};
  for (int i = 0; i < 5; ++i) {
    ProfilePoint p;
    p.lengths = {128};
    p.tokens = 128;
    p.flops.linear = lin[i];
    p.flops.attention = att[i];
    p.measured_s = 0.01 + att[i] * 1e-10;
    p.held_out = i == 2;
    r.points.push_back(p);
  }
  fit_profile_time(r);
  EXPECT_FALSE(r.attention_separated);
  EXPECT_GT(r.linear_flops_per_s, 0);
  EXPECT_EQ(r.linear_flops_per_s, r.attention_flops_per_s);
  EXPECT_GE(r.fixed_s, 0.0);
  // A linear rate that carries a negligible share of the time (here 1e-15 s per FLOP, under 0.001% of any point)
  // is no separation either: one rate.
  for (int i = 0; i < 5; ++i) r.points[static_cast<size_t>(i)].measured_s = 0.01 + att[i] * 1e-10 + lin[i] * 1e-15;
  fit_profile_time(r);
  EXPECT_FALSE(r.attention_separated);
  EXPECT_EQ(r.linear_flops_per_s, r.attention_flops_per_s);
  // Times that do not grow with FLOPs at all still fail, naming the cause.
  for (ProfilePoint& p : r.points) p.measured_s = 0.05;
  r.points.back().measured_s = 0.049;
  try {
    fit_profile_time(r);
    ADD_FAILURE() << "times that do not grow with FLOPs were fitted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no cost per FLOP"), std::string::npos) << e.what();
  }
}

TEST(Profile, TinyModelGivesAFinitePositiveFitThatTheCostModelReproduces) {
  Config cfg;
  cfg.model.d_model = 32;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 2;
  cfg.model.d_ff = 64;
  cfg.data.max_seq_len = 128;
  // One thread and medians of 3: the time fit refuses times that do not grow with FLOPs, and on a loaded
  // machine one 2-thread sample per point was noisy enough to fail it.
  cfg.train.threads = 1;
  ProfileOptions opt;
  opt.repeats = 3;
  // Short points only (the defaults would be the one length 128): the grid this test was written for.
  opt.sample_lengths = {64, 128};
  opt.micro_batch_tokens = {1024, 4096};
  const ProfileResult r = profile_model(cfg, nullptr, opt);

  ASSERT_EQ(r.points.size(), 8u);  // lengths 64, 128 x tokens 1024, 4096 x recompute 0, 2
  int held_out = 0;
  for (const ProfilePoint& p : r.points) {
    held_out += p.held_out;
    EXPECT_TRUE(p.lengths.front() == 64 || p.lengths.front() == 128);
    EXPECT_TRUE(p.recompute_layers == 0 || p.recompute_layers == 2);
    EXPECT_GT(p.measured_s, 0.0);
    EXPECT_TRUE(std::isfinite(p.predicted_s) && p.predicted_s > 0);
  }
  EXPECT_EQ(held_out, 2);
  EXPECT_TRUE(std::isfinite(r.linear_flops_per_s) && r.linear_flops_per_s > 0);
  EXPECT_TRUE(std::isfinite(r.attention_flops_per_s) && r.attention_flops_per_s > 0);
  EXPECT_GE(r.fixed_s, 0.0);
  EXPECT_TRUE(std::isfinite(r.heldout_median_error) && std::isfinite(r.heldout_max_error));
  EXPECT_LE(r.heldout_median_error, r.heldout_max_error);
  EXPECT_GT(r.max_rss_bytes, 0.0);

  // The written device reproduces every prediction through the planners' CostModel.
  const std::string path = temp_file("tiny.json").string();
  write_profile(r, path);
  const CostModel cost(r.shape, DeviceSpec::named(path));
  for (const ProfilePoint& p : r.points) {
    const double by_formula = r.fixed_s + p.flops.linear / r.linear_flops_per_s +
                              p.flops.attention / r.attention_flops_per_s;
    EXPECT_NEAR(cost.seconds(p.lengths, 1, p.recompute_layers), p.predicted_s, 1e-9 * p.predicted_s);
    EXPECT_NEAR(by_formula, p.predicted_s, 1e-9 * p.predicted_s);
  }
  EXPECT_TRUE(r.sequence_parallel.empty());  // one process: SP is not profiled
  EXPECT_TRUE(r.validation.empty());
  EXPECT_EQ(r.world_size, 1);
  opt.repeats = 0;
  EXPECT_THROW(profile_model(cfg, nullptr, opt), std::invalid_argument);
  opt.repeats = 1;
  opt.long_point_s = 0;
  EXPECT_THROW(profile_model(cfg, nullptr, opt), std::invalid_argument);
  opt.long_point_s = 1;
  cfg.data.max_seq_len = 32;
  EXPECT_THROW(profile_model(cfg, nullptr, opt), std::invalid_argument);
}

}  // namespace
}  // namespace dcp
