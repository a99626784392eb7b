// The KV cache (storage, the one mutator, save/load), attention through it against its plain twin, chunked
// prefill and decoding against the model's full forward, and dcp generate against recomputing the window.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/flexformer.h"
#include "dcp/infer.h"
#include "dcp/kv_cache.h"
#include "unit/error_of.h"
#include "unit/kv_test_model.h"

using namespace dcp;
using dcp::test::error_of;
using dcp::test::full_forward;
using dcp::test::random_tokens;
using dcp::test::sharp_model;

namespace {


// Prefill of the first `prompt` tokens in chunks, then every further token decoded: all logits, [n, vocab].
torch::Tensor cached_logits(Transformer& model, const std::vector<int64_t>& tokens, int64_t prompt, int64_t chunk) {
  DecodeSession session(model, chunk);
  std::vector<torch::Tensor> rows{session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt))};
  for (size_t i = static_cast<size_t>(prompt); i < tokens.size(); ++i) rows.push_back(session.decode(tokens[i]).unsqueeze(0));
  return torch::cat(rows);
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

KvCacheSpec small_spec(torch::ScalarType dtype = torch::kFloat, int64_t heads = 3, int64_t dim = 8) {
  KvCacheSpec s;
  s.layers = 2;
  s.kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  return s;
}

// Appends `n` random tokens at positions first, first + 1, ... to every layer.
void fill(KvCache& cache, int64_t n, int64_t first = 0) {
  const auto& s = cache.spec();
  for (int64_t layer = 0; layer < s.layers; ++layer) {
    cache.append(layer, torch::randn({n, s.kv_heads, s.head_dim}).to(s.dtype),
                 torch::randn({n, s.kv_heads, s.value_dim}).to(s.dtype), torch::arange(first, first + n, torch::kInt64));
  }
}

torch::Tensor idx(std::vector<int64_t> v) { return torch::tensor(v, torch::kInt64); }

std::string temp_path(const std::string& name) { return (std::filesystem::temp_directory_path() / name).string(); }

void expect_same_views(const KvCache& a, const KvCache& b) {
  ASSERT_EQ(a.next_position(), b.next_position());
  for (int64_t layer = 0; layer < a.spec().layers; ++layer) {
    for (int64_t h = 0; h < a.spec().kv_heads; ++h) {
      const KvHeadView x = a.view(layer, h), y = b.view(layer, h);
      EXPECT_TRUE(torch::equal(x.keys, y.keys)) << layer << " " << h;
      EXPECT_TRUE(torch::equal(x.values, y.values)) << layer << " " << h;
      EXPECT_TRUE(torch::equal(x.bias, y.bias)) << layer << " " << h;
      EXPECT_TRUE(torch::equal(x.positions, y.positions)) << layer << " " << h;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Storage, commit, validation

TEST(KvCache, AppendStoresEveryHeadWithPositionsAndZeroBias) {
  torch::manual_seed(1);
  KvCache cache(small_spec());
  auto k = torch::randn({5, 3, 8}), v = torch::randn({5, 3, 8});
  cache.append(0, k, v, idx({3, 4, 7, 8, 9}));  // positions may have gaps (e.g. a cache restored after eviction)
  for (int64_t h = 0; h < 3; ++h) {
    const KvHeadView view = cache.view(0, h);
    EXPECT_TRUE(torch::equal(view.keys, k.select(1, h)));
    EXPECT_TRUE(torch::equal(view.values, v.select(1, h)));
    EXPECT_TRUE(torch::equal(view.positions, idx({3, 4, 7, 8, 9})));
    EXPECT_TRUE(torch::equal(view.bias, torch::zeros({5})));
    EXPECT_EQ(view.bias.scalar_type(), torch::kFloat);
    EXPECT_EQ(cache.length(0, h), 5);
    EXPECT_EQ(cache.length(1, h), 0);
    EXPECT_EQ(cache.view(1, h).keys.sizes(), (std::vector<int64_t>{0, 8}));
  }
  EXPECT_EQ(cache.next_position(0), 10);
  EXPECT_EQ(cache.next_position(1), 0);
  EXPECT_EQ(cache.next_position(), 10);
  // keys + values fp32, bias fp32, position int64.
  EXPECT_EQ(cache.entry_bytes(), 8 * 4 + 8 * 4 + 4 + 8);
  EXPECT_EQ(cache.bytes(), 3 * 5 * cache.entry_bytes());
  EXPECT_GE(cache.capacity_bytes(), cache.bytes());
}

TEST(KvCache, ViewsStayValidAfterLaterAppendsAndCommits) {
  torch::manual_seed(2);
  KvCache cache(small_spec());
  fill(cache, 4);
  const KvHeadView before = cache.view(0, 1);
  const torch::Tensor keys = before.keys.clone();
  fill(cache, 40, 4);  // grows past the first capacity: new storage
  EXPECT_TRUE(torch::equal(before.keys, keys));
  cache.commit(0, {KvHeadEdit{}, KvHeadEdit{idx({0})}, KvHeadEdit{}});
  EXPECT_TRUE(torch::equal(before.keys, keys));
  EXPECT_EQ(cache.length(0, 1), 1);
}

TEST(KvCache, CommitKeepsExactlyTheGivenEntriesAndReleasesMemory) {
  torch::manual_seed(3);
  KvCache cache(small_spec());
  fill(cache, 10, 5);  // positions 5..14
  std::vector<KvHeadView> old;
  for (int64_t h = 0; h < 3; ++h) old.push_back(cache.view(0, h));
  const KvHeadView other_layer = cache.view(1, 0);
  const int64_t bytes = cache.bytes(), capacity = cache.capacity_bytes();
  const auto keep0 = idx({0, 2, 5, 9});
  cache.commit(0, {KvHeadEdit{keep0}, KvHeadEdit{idx({})}, KvHeadEdit{}});
  const KvHeadView h0 = cache.view(0, 0);
  EXPECT_TRUE(torch::equal(h0.keys, old[0].keys.index_select(0, keep0)));
  EXPECT_TRUE(torch::equal(h0.values, old[0].values.index_select(0, keep0)));
  EXPECT_TRUE(torch::equal(h0.positions, idx({5, 7, 10, 14})));  // true positions survive, never renumbered
  EXPECT_TRUE(torch::equal(h0.bias, torch::zeros({4})));
  EXPECT_EQ(cache.length(0, 1), 0);
  EXPECT_EQ(cache.length(0, 2), 10);  // an edit without keep leaves its head alone
  EXPECT_TRUE(torch::equal(cache.view(0, 2).keys, old[2].keys));
  EXPECT_TRUE(torch::equal(cache.view(1, 0).keys, other_layer.keys));
  EXPECT_EQ(cache.next_position(0), 15);  // positions are never reused after a commit
  EXPECT_EQ(cache.bytes(), bytes - (6 + 10) * cache.entry_bytes());
  EXPECT_LT(cache.capacity_bytes(), capacity);
  // Head 0 holds exactly its 4 entries now, head 1 nothing; head 2 and layer 1 keep their capacity.
  EXPECT_EQ(cache.capacity_bytes(), capacity - (capacity / 6) * 2 + 4 * cache.entry_bytes());

  // New biases and values replace those of the kept entries; the next append continues after the old positions.
  const auto bias = torch::tensor({0.5f, std::log(2.0f)});
  const auto values = torch::randn({2, 8}, torch::kDouble);  // cast to the cache dtype
  cache.commit(0, {KvHeadEdit{idx({1, 3}), bias, values}, KvHeadEdit{}, KvHeadEdit{}});
  EXPECT_TRUE(torch::equal(cache.view(0, 0).bias, bias));
  EXPECT_TRUE(torch::equal(cache.view(0, 0).values, values.to(torch::kFloat)));
  EXPECT_TRUE(torch::equal(cache.view(0, 0).positions, idx({7, 14})));
  EXPECT_NE(error_of([&] { cache.append(0, torch::randn({1, 3, 8}), torch::randn({1, 3, 8}), idx({14})); })
                .find("below the layer's next position 15"), std::string::npos);
  cache.append(0, torch::randn({1, 3, 8}), torch::randn({1, 3, 8}), idx({15}));
  EXPECT_TRUE(torch::equal(cache.view(0, 0).positions, idx({7, 14, 15})));
  EXPECT_TRUE(torch::equal(cache.view(0, 1).positions, idx({15})));
  EXPECT_FLOAT_EQ(cache.view(0, 0).bias[2].item<float>(), 0.0f);
}

TEST(KvCache, CommitRejectsBadEditsAndChangesNothing) {
  torch::manual_seed(4);
  KvCache cache(small_spec());
  fill(cache, 6);
  const KvHeadView h0 = cache.view(0, 0);
  auto with = [&](int64_t head, KvHeadEdit e) {
    std::vector<KvHeadEdit> edits(3);
    edits[0] = KvHeadEdit{idx({0, 1})};  // valid: must not be applied when another head's edit is bad
    edits[static_cast<size_t>(head)] = std::move(e);
    return error_of([&] { cache.commit(0, edits); });
  };
  EXPECT_NE(with(2, {idx({2, 1})}).find("layer 0 head 2: keep must increase strictly"), std::string::npos);
  EXPECT_NE(with(2, {idx({1, 1})}).find("increase strictly"), std::string::npos);
  EXPECT_NE(with(1, {idx({0, 6})}).find("keep[1] = 6 outside [0, 6)"), std::string::npos);
  EXPECT_NE(with(1, {idx({-1})}).find("keep[0] = -1"), std::string::npos);
  EXPECT_NE(with(1, {torch::tensor({0.0f})}).find("1-D int64"), std::string::npos);
  EXPECT_NE(with(1, {idx({0}), torch::tensor({NAN})}).find("NaN"), std::string::npos);
  EXPECT_NE(with(1, {idx({0}), torch::tensor({INFINITY})}).find("NaN or infinite"), std::string::npos);
  EXPECT_NE(with(1, {idx({0, 1}), torch::zeros({3})}).find("new_bias must be a floating [2]"), std::string::npos);
  EXPECT_NE(with(1, {idx({0}), std::nullopt, torch::zeros({1, 7})}).find("new_values must be a floating [1, 8]"),
            std::string::npos);
  EXPECT_NE(with(1, {torch::Tensor(), torch::zeros({1})}).find("without keep"), std::string::npos);
  EXPECT_NE(error_of([&] { cache.commit(0, std::vector<KvHeadEdit>(2)); }).find("2 edits for 3 kv heads"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cache.commit(2, std::vector<KvHeadEdit>(3)); }).find("layer 2 outside [0, 2)"),
            std::string::npos);
  EXPECT_EQ(cache.length(0, 0), 6);
  EXPECT_TRUE(torch::equal(cache.view(0, 0).keys, h0.keys));
}

TEST(KvCache, AppendRejectsBadInputs) {
  KvCache cache(small_spec());
  auto k = torch::randn({2, 3, 8}), v = torch::randn({2, 3, 8});
  auto pos = idx({0, 1});
  EXPECT_NE(error_of([&] { cache.append(5, k, v, pos); }).find("layer 5 outside [0, 2)"), std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, torch::randn({2, 2, 8}), v, pos); }).find("k must be [t, 3, 8], got [2, 2, 8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, k, torch::randn({2, 3, 4}), pos); }).find("v must be [2, 3, 8]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, k.to(torch::kBFloat16), v.to(torch::kBFloat16), pos); }).find("cache dtype"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, k, v, idx({0})); }).find("positions must be [2] int64"), std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, k, v, pos.to(torch::kInt32)); }).find("int64"), std::string::npos);
  EXPECT_NE(error_of([&] { cache.append(0, k, v, idx({1, 1})); }).find("increase strictly"), std::string::npos);
  EXPECT_EQ(cache.length(0, 0), 0);
  EXPECT_NE(error_of([] { KvCache c{KvCacheSpec{}}; }).find("must be >= 1"), std::string::npos);
  EXPECT_NE(error_of([] { KvCache c{small_spec(torch::kHalf)}; }).find("not supported"), std::string::npos);
  EXPECT_NE(error_of([&] { cache.view(0, 3); }).find("head 3 outside [0, 3)"), std::string::npos);
}

TEST(KvCache, ClearReleasesEverything) {
  KvCache cache(small_spec());
  fill(cache, 20);
  cache.clear();
  EXPECT_EQ(cache.bytes(), 0);
  EXPECT_EQ(cache.capacity_bytes(), 0);
  EXPECT_EQ(cache.next_position(), 0);
  fill(cache, 2);  // positions from 0 again
  EXPECT_EQ(cache.next_position(), 2);
}

// ---------------------------------------------------------------------------------------------------------------
// Save and load

TEST(KvCache, SaveLoadRoundTripsHeadsOfDifferentLengthsAndBiases) {
  torch::manual_seed(5);
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
    KvCache cache(small_spec(dtype));
    fill(cache, 12);
    cache.commit(1, {KvHeadEdit{idx({1, 4, 11}), torch::tensor({0.1f, -2.0f, 3.0f})}, KvHeadEdit{idx({})}, KvHeadEdit{}});
    const auto path = temp_path("dcp_test_kv_roundtrip.kv");
    cache.save(path);
    KvCache loaded(small_spec(dtype));
    fill(loaded, 3);  // replaced by the file's state
    loaded.load(path);
    std::filesystem::remove(path);
    expect_same_views(cache, loaded);
    EXPECT_EQ(loaded.bytes(), cache.bytes());
    EXPECT_EQ(loaded.next_position(1), 12);
  }
}

TEST(KvCache, LoadNamesTheFileAndWhatIsWrong) {
  torch::manual_seed(6);
  KvCache cache(small_spec());
  fill(cache, 8);
  const auto path = temp_path("dcp_test_kv_errors.kv");
  cache.save(path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write = [&](const std::string& data) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << data;
  };
  KvCache target(small_spec());
  fill(target, 2);
  const KvHeadView before = target.view(0, 0);
  auto load_error = [&] { return error_of([&] { target.load(path); }); };

  write(bytes.substr(0, bytes.size() / 2));
  std::string e = load_error();
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;

  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;
  write(flipped);
  EXPECT_NE(load_error().find("checksum mismatch: the file is corrupt"), std::string::npos) << load_error();

  write(bytes + "x");
  EXPECT_NE(load_error().find("1 bytes after the end"), std::string::npos) << load_error();

  write("hello, not a cache");
  EXPECT_NE(load_error().find("not a dcp KV cache file"), std::string::npos) << load_error();

  std::filesystem::remove(path);
  EXPECT_NE(load_error().find("cannot be opened"), std::string::npos) << load_error();

  // A cache of another shape or dtype.
  write(bytes);
  for (const KvCacheSpec& other : {small_spec(torch::kFloat, 2), small_spec(torch::kFloat, 3, 4), small_spec(torch::kBFloat16)}) {
    KvCache wrong(other);
    e = error_of([&] { wrong.load(path); });
    EXPECT_NE(e.find("holds a cache of layers 2, kv_heads 3, head_dim 8, value_dim 8, Float; this cache has"),
              std::string::npos) << e;
  }
  std::filesystem::remove(path);
  // A failed load changes nothing.
  EXPECT_EQ(target.length(0, 0), 2);
  EXPECT_TRUE(torch::equal(target.view(0, 0).keys, before.keys));
  EXPECT_NE(error_of([&] { cache.save("/nonexistent_dir/x.kv"); }).find("cannot write"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// Attention through the cache

// bias log 2 on one entry == that entry stored twice (spec section 2: a summary entry of weight w counts like w
// copies; the identity). Also weight 3 == three copies.
TEST(KvCacheAttention, LogWeightBiasEqualsDuplicatedEntries) {
  torch::manual_seed(7);
  const int64_t n = 6, T = 4, dim = 8;
  for (double w : {2.0, 3.0}) {
    const int64_t copies = static_cast<int64_t>(w);
    auto keys = torch::randn({n, 1, dim}) * 2, values = torch::randn({n, 1, dim});
    KvCacheSpec spec = small_spec(torch::kFloat, 1, dim);
    spec.layers = 1;
    KvCache weighted(spec), duplicated(spec);
    weighted.append(0, keys, values, torch::arange(n, torch::kInt64));
    auto bias = torch::zeros({n});
    bias[3].fill_(std::log(w));
    weighted.commit(0, {KvHeadEdit{torch::arange(n, torch::kInt64), bias}});
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < n; ++i) rows.insert(rows.end(), i == 3 ? copies : 1, i);
    auto dup = idx(rows);
    duplicated.append(0, keys.index_select(0, dup), values.index_select(0, dup),
                      torch::arange(static_cast<int64_t>(rows.size()), torch::kInt64));
    auto q = torch::randn({T, 1, dim}) * 2, k = torch::randn({T, 1, dim}), v = torch::randn({T, 1, dim});
    const AttentionResult a = kv_cache_attention(q, k, v, weighted, 0);
    const AttentionResult b = kv_cache_attention(q, k, v, duplicated, 0);
    // fp32: the two differ only by rounding of exp(log w) against a sum of w equal terms, ~1e-7 relative.
    EXPECT_TRUE(torch::allclose(a.out, b.out, 1e-5, 1e-6)) << max_abs_diff(a.out, b.out);
    EXPECT_TRUE(torch::allclose(a.lse, b.lse, 1e-5, 1e-6)) << max_abs_diff(a.lse, b.lse);
    const AttentionResult ra = reference_kv_cache_attention(q, k, v, weighted, 0);
    EXPECT_TRUE(torch::allclose(a.out, ra.out, 1e-5, 1e-6)) << max_abs_diff(a.out, ra.out);
  }
}

// Heads of different lengths with biases, including one head longer than a key block (4096) and one empty, in
// each dtype, against the fp64 reference twin.
TEST(KvCacheAttention, PerHeadLengthsAndBiasesMatchTheReferenceTwin) {
  torch::manual_seed(8);
  const int64_t dim = 16, n = 5000, T = 7;
  // Tolerances (outputs are O(1), up to ~2): fp64 is the twin's own arithmetic in another order (measured 9e-16);
  // fp32 sums up to 5000 terms of the cache part in fp32 (relative error ~ sqrt(n) * 6e-8 ~ 4e-6; measured 7e-7);
  // bf16 rounds the chunk part's probabilities and output to bf16 and the merged output once more, a bf16 step
  // being 2^-7 = 7.8e-3 in [1, 2) (measured one step, 7.8e-3), so 4 steps.
  for (auto [dtype, tol] : {std::pair{torch::kDouble, 1e-12}, std::pair{torch::kFloat, 5e-6}, std::pair{torch::kBFloat16, 3e-2}}) {
    KvCache cache(small_spec(dtype, 4, dim));
    fill(cache, n);
    const auto keep1 = torch::arange(0, n, 3, torch::kInt64);
    const auto keep3 = idx({0, 17, 4999});
    cache.commit(1, {KvHeadEdit{}, KvHeadEdit{keep1, torch::randn({keep1.numel()})}, KvHeadEdit{idx({})},
                     KvHeadEdit{keep3, torch::tensor({1.5f, -0.5f, 0.0f})}});
    ASSERT_EQ(cache.length(1, 0), n);
    ASSERT_EQ(cache.length(1, 2), 0);
    auto q = (torch::randn({T, 4, dim}) * 1.5).to(dtype), k = torch::randn({T, 4, dim}).to(dtype),
         v = torch::randn({T, 4, dim}).to(dtype);
    const AttentionResult fast = kv_cache_attention(q, k, v, cache, 1);
    const AttentionResult ref = reference_kv_cache_attention(q, k, v, cache, 1);
    EXPECT_EQ(fast.out.scalar_type(), dtype);
    EXPECT_EQ(fast.lse.scalar_type(), dtype == torch::kDouble ? torch::kDouble : torch::kFloat);
    EXPECT_LE(max_abs_diff(fast.out, ref.out), tol) << c10::toString(dtype);
    EXPECT_LE(max_abs_diff(fast.lse, ref.lse), tol) << c10::toString(dtype);
    // An empty cache is plain causal attention over the chunk.
    KvCache empty(small_spec(dtype, 4, dim));
    const auto cu = torch::tensor({int64_t{0}, T}, torch::kInt64);
    const AttentionResult plain = reference_attention(q, k, v, cu, cu, /*causal=*/true);
    EXPECT_LE(max_abs_diff(kv_cache_attention(q, k, v, empty, 0).out, plain.out), tol);
  }
}

TEST(KvCacheAttention, GroupedQueryHeadsReadTheirKvHeadLikeExpandedHeads) {
  // 4 query heads over a cache of 2 KV heads (of different lengths, with biases) equal the same queries over a
  // cache of 4 heads where each KV head is stored twice (fp64: the same sums; the twin agrees to 1e-12).
  torch::manual_seed(30);
  const int64_t dim = 8, n = 40, T = 5;
  KvCache grouped(small_spec(torch::kDouble, 2, dim));
  KvCache expanded(small_spec(torch::kDouble, 4, dim));
  const torch::Tensor ck = torch::randn({n, 2, dim}, torch::kDouble), cv = torch::randn({n, 2, dim}, torch::kDouble);
  for (int64_t layer = 0; layer < 2; ++layer) {
    grouped.append(layer, ck, cv, torch::arange(n, torch::kInt64));
    expanded.append(layer, ck.repeat_interleave(2, 1), cv.repeat_interleave(2, 1), torch::arange(n, torch::kInt64));
  }
  const torch::Tensor keep = idx({0, 3, 9, 20, 39}), bias = torch::randn({5});
  grouped.commit(1, {KvHeadEdit{keep, bias}, KvHeadEdit{}});
  expanded.commit(1, {KvHeadEdit{keep, bias}, KvHeadEdit{keep, bias}, KvHeadEdit{}, KvHeadEdit{}});
  const torch::Tensor q = torch::randn({T, 4, dim}, torch::kDouble) * 1.5, k = torch::randn({T, 2, dim}, torch::kDouble),
                      v = torch::randn({T, 2, dim}, torch::kDouble);
  const AttentionResult got = kv_cache_attention(q, k, v, grouped, 1);
  const AttentionResult want = kv_cache_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), expanded, 1);
  EXPECT_LE(max_abs_diff(got.out, want.out), 1e-12);
  EXPECT_LE(max_abs_diff(got.lse, want.lse), 1e-12);
  EXPECT_LE(max_abs_diff(reference_kv_cache_attention(q, k, v, grouped, 1).out, got.out), 1e-12);
  EXPECT_NE(error_of([&] { kv_cache_attention(torch::randn({T, 3, dim}, torch::kDouble), k, v, grouped, 1); })
                .find("a multiple of 2"),
            std::string::npos);
}

TEST(KvCacheAttention, WrapperAttendsBeforeAppendingAndNeedsSoftmax) {
  torch::manual_seed(9);
  auto cache = std::make_shared<KvCache>(small_spec(torch::kFloat, 4, 16));
  fill(*cache, 9);
  auto q = torch::randn({3, 4, 16}), k = torch::randn({3, 4, 16}), v = torch::randn({3, 4, 16});
  const AttentionResult expected = reference_kv_cache_attention(q, k, v, *cache, 0);
  KvCacheAttention wrapper(cache, idx({9, 10, 11}));
  const auto cu = torch::tensor({int64_t{0}, int64_t{3}}, torch::kInt64);
  const torch::Tensor out = wrapper.forward(SoftmaxAttention(), 0, q, k, v, cu);
  EXPECT_LE(max_abs_diff(out, expected.out), 1e-5);
  EXPECT_EQ(cache->length(0, 2), 12);
  EXPECT_EQ(cache->length(1, 2), 9);
  EXPECT_TRUE(torch::equal(cache->view(0, 2).keys.narrow(0, 9, 3), k.select(1, 2)));
  EXPECT_TRUE(torch::equal(cache->view(0, 2).positions.narrow(0, 9, 3), idx({9, 10, 11})));

  FlexformerAttention flex(FlexformerOptions{}, 4, 16);
  EXPECT_NE(error_of([&] { wrapper.forward(flex, 1, q, k, v, cu); }).find("layer 1 is not softmax"), std::string::npos);
  const auto two = torch::tensor({int64_t{0}, int64_t{1}, int64_t{3}}, torch::kInt64);
  EXPECT_NE(error_of([&] { wrapper.forward(SoftmaxAttention(), 1, q, k, v, two); }).find("one sequence"), std::string::npos);
  AttentionConfig flex_cfg;
  flex_cfg.backend = "flexformer";
  Transformer flex_model(dcp::test::kv_tiny_config(), flex_cfg);
  EXPECT_NE(error_of([&] { DecodeSession s(flex_model); }).find("layer 0 does not use softmax attention"),
            std::string::npos);
  EXPECT_NE(error_of([&] { DecodeSession s(sharp_model(1), 0); }).find("chunk_tokens 0"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// Chunked prefill and decoding against the full forward

// 300 prompt tokens in chunks of 64, then 800 decoded one by one: every row of logits against one causal forward
// over all 1100 tokens.
TEST(DecodeSession, CachedDecodingEqualsTheFullForwardOver1100TokensFp32) {
  Transformer model = sharp_model(10);
  const auto tokens = random_tokens(1100, 11);
  const torch::Tensor full = full_forward(model, tokens);
  const torch::Tensor cached = cached_logits(model, tokens, 300, 64);
  ASSERT_EQ(cached.sizes(), full.sizes());
  // The two paths sum the same softmax terms in another order (cache part in fp32 matmuls and merged in (out,
  // lse) form, instead of one tiled pass): a few fp32 roundings (6e-8 relative each) per attention output,
  // carried through 3 blocks, the norms and the head onto logits of size ~0.7 here. Measured max difference
  // 3.6e-7; 5e-6 leaves room for other BLAS kernels and thread counts, while a wrong mask, position or entry
  // moves logits by 1e-2 or more (a sliding window of 8 moves them by 0.2, see the policy test).
  const double scale = full.abs().max().item<double>();
  EXPECT_LE(max_abs_diff(cached, full), 5e-6 * std::max(1.0, scale)) << "logit scale " << scale;
}

TEST(DecodeSession, GroupedQueryCachedDecodingEqualsTheFullForward) {
  // A GQA model (4 query heads, 2 K/V heads): the cache holds 2 heads per layer, and decoding through it equals
  // the full forward as for MHA (same tolerance and reasoning as the 1100-token test).
  Transformer model = sharp_model(20, Precision::kFp32, 3, 2);
  EXPECT_EQ(kv_cache_spec(model).kv_heads, 2);
  const auto tokens = random_tokens(300, 21);
  const torch::Tensor full = full_forward(model, tokens);
  const torch::Tensor cached = cached_logits(model, tokens, 100, 32);
  const double scale = full.abs().max().item<double>();
  EXPECT_LE(max_abs_diff(cached, full), 5e-6 * std::max(1.0, scale)) << "logit scale " << scale;
}

TEST(DecodeSession, CachedDecodingEqualsTheFullForwardOver1030TokensBf16) {
  Transformer model = sharp_model(12, Precision::kBf16);
  const auto tokens = random_tokens(1030, 13);
  const torch::Tensor full = full_forward(model, tokens);
  const torch::Tensor cached = cached_logits(model, tokens, 200, 64);
  // bf16 keeps 8 mantissa bits (relative step 2^-8 = 3.9e-3): both paths round q, k, v, every activation and the
  // logits to bf16, but at different points (the cached path rounds the chunk's partial output before the merge
  // and computes the cache part from fp32 products), so single roundings of the residual stream differ and
  // propagate. Measured: max 3.9e-3 (one bf16 step at the largest logit, 0.66), mean 3.8e-4. Bound: 4 bf16 steps
  // of the largest logit; a wrong entry or position moves logits by far more (checked in fp32 above).
  const double scale = full.abs().max().item<double>();
  const double diff = max_abs_diff(cached, full);
  EXPECT_LE(diff, 4 * std::ldexp(1.0, -8) * scale) << "logit scale " << scale;
  // And on average far below that: the paths agree except for rounding.
  EXPECT_LE((cached - full).abs().mean().item<double>(), std::ldexp(1.0, -8) * scale);
}

TEST(DecodeSession, ChunkSizeDoesNotChangeTheResult) {
  Transformer model = sharp_model(14);
  const auto tokens = random_tokens(150, 15);
  const torch::Tensor full = full_forward(model, tokens);
  // One chunk over an empty cache is the model's own forward: bitwise.
  const torch::Tensor whole = cached_logits(model, tokens, 150, 150);
  EXPECT_TRUE(torch::equal(whole, full)) << max_abs_diff(whole, full);
  for (int64_t chunk : {1, 7, 64, 149}) {
    // Same tolerance argument as the 1100-token test (measured 1.5e-7 .. 3e-7).
    EXPECT_LE(max_abs_diff(cached_logits(model, tokens, 150, chunk), full), 5e-6) << "chunk " << chunk;
  }
}

// Hand-computed lengths: the largest c <= remaining and chunk_tokens with c (seen + c) <= chunk_pairs, at least 1.
TEST(DecodeSession, PrefillChunkLengthBoundsTheChunksAttention) {
  EXPECT_EQ(prefill_chunk_length(0, 1025, 512, 0), 512);     // no bound: tokens only
  EXPECT_EQ(prefill_chunk_length(600, 5, 512, 0), 5);
  EXPECT_EQ(prefill_chunk_length(0, 1025, 512, 262144), 512);  // 512 x 512 = 262144 exactly
  EXPECT_EQ(prefill_chunk_length(512, 513, 512, 262144), 316);  // 316 x 828 = 261648; 317 x 829 = 262793
  EXPECT_EQ(prefill_chunk_length(828, 197, 512, 262144), 197);  // 244 would fit: the prompt's end binds
  EXPECT_EQ(prefill_chunk_length(8000, 1000, 512, 262144), 32);  // 32 x 8032 = 257024; 33 x 8033 = 265089
  EXPECT_EQ(prefill_chunk_length(1000000, 5, 512, 100), 1);     // nothing fits: one token, as decoding
  // Near the config's largest values, where the square root alone would round: 255 (2^40 + 255) <= 2^48 < 256 (...).
  EXPECT_EQ(prefill_chunk_length(int64_t{1} << 40, 1000, 512, int64_t{1} << 48), 255);
  EXPECT_THROW(prefill_chunk_length(-1, 5, 512, 0), std::invalid_argument);
  EXPECT_THROW(prefill_chunk_length(0, 0, 512, 0), std::invalid_argument);
  EXPECT_THROW(prefill_chunk_length(0, 5, 0, 0), std::invalid_argument);
  EXPECT_THROW(prefill_chunk_length(0, 5, 512, -1), std::invalid_argument);
}

// A session bounded by chunk_pairs runs the shrinking chunks prefill_chunk_length gives (seen by the policy) and,
// with nothing evicted, the same logits as the whole forward (the tolerance of ChunkSizeDoesNotChangeTheResult).
TEST(DecodeSession, ChunkPairsShrinkTheChunksAndKeepTheResult) {
  struct Steps : KvPolicy {
    std::vector<int64_t> tokens;
    void after_step(KvCache&, const KvStep& step) override { tokens.push_back(step.tokens); }
  };
  Transformer model = sharp_model(14);
  const auto tokens = random_tokens(150, 15);
  const torch::Tensor full = full_forward(model, tokens);
  auto steps = std::make_shared<Steps>();
  DecodeSession session(model, 64, steps, 2000);
  EXPECT_EQ(session.chunk_pairs(), 2000);
  const torch::Tensor logits = session.prefill(tokens);
  // 44 (44^2 = 1936), 27 (27 x 71), 21 (21 x 92), 18 (18 x 110), 15 (15 x 125), 14 (14 x 139), then the 11 left.
  EXPECT_EQ(steps->tokens, (std::vector<int64_t>{44, 27, 21, 18, 15, 14, 11}));
  EXPECT_LE(max_abs_diff(logits, full), 5e-6);
  EXPECT_THROW(DecodeSession(model, 64, nullptr, -1), std::invalid_argument);
}

TEST(DecodeSession, SavedCacheGivesTheSameNextLogits) {
  Transformer model = sharp_model(16);
  const auto tokens = random_tokens(90, 17);
  DecodeSession a(model, 32);
  a.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 80));
  for (int64_t i = 80; i < 85; ++i) a.decode(tokens[static_cast<size_t>(i)]);
  // Heads of different lengths with biases: the state of a compressed cache.
  a.cache().commit(1, {KvHeadEdit{torch::arange(0, 85, 2, torch::kInt64)}, KvHeadEdit{},
                       KvHeadEdit{idx({0, 84}), torch::tensor({0.7f, 0.0f})}, KvHeadEdit{}});
  const auto path = temp_path("dcp_test_kv_session.kv");
  a.cache().save(path);
  DecodeSession b(model, 32);
  b.cache().load(path);
  std::filesystem::remove(path);
  expect_same_views(a.cache(), b.cache());
  for (int64_t i = 85; i < 90; ++i) {
    EXPECT_TRUE(torch::equal(a.decode(tokens[static_cast<size_t>(i)]), b.decode(tokens[static_cast<size_t>(i)]))) << i;
  }
  EXPECT_EQ(b.cache().next_position(), 90);
}

// The compression seam: called after every chunk and token with what ran; a commit there changes what the next
// chunk attends to, and positions stay absolute.
TEST(DecodeSession, PolicyIsCalledAfterEveryStepAndMayCommit) {
  struct KeepLast : KvPolicy {
    int64_t window;
    std::vector<KvStep> steps;
    explicit KeepLast(int64_t w) : window(w) {}
    void after_step(KvCache& cache, const KvStep& step) override {
      steps.push_back(step);
      for (int64_t layer = 0; layer < cache.spec().layers; ++layer) {
        const int64_t n = cache.length(layer, 0);
        if (n <= window) continue;
        cache.commit(layer, std::vector<KvHeadEdit>(static_cast<size_t>(cache.spec().kv_heads),
                                                    KvHeadEdit{torch::arange(n - window, n, torch::kInt64)}));
      }
    }
  };
  Transformer model = sharp_model(18);
  const auto tokens = random_tokens(40, 19);
  auto policy = std::make_shared<KeepLast>(8);
  DecodeSession session(model, 16, policy);
  session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 37));
  session.decode(tokens[37]);
  ASSERT_EQ(policy->steps.size(), 4u);  // chunks 16, 16, 5, then one token
  EXPECT_TRUE(policy->steps[1].prefill);
  EXPECT_EQ(policy->steps[1].first_position, 16);
  EXPECT_EQ(policy->steps[2].tokens, 5);
  EXPECT_FALSE(policy->steps[3].prefill);
  EXPECT_EQ(policy->steps[3].first_position, 37);
  EXPECT_EQ(session.cache().length(2, 3), 8);
  EXPECT_TRUE(torch::equal(session.cache().view(2, 3).positions, torch::arange(30, 38, torch::kInt64)));
  // A sliding window of 8 is no longer the full forward: the seam really changes what is attended to.
  const torch::Tensor full = full_forward(model, std::vector<int64_t>(tokens.begin(), tokens.begin() + 39));
  EXPECT_GT(max_abs_diff(session.decode(tokens[38]), full[38]), 1e-4);
}

// ---------------------------------------------------------------------------------------------------------------
// dcp generate

TEST(Generate, CachedGreedyDecodingEqualsRecomputingTheWindow) {
  Transformer model = sharp_model(20);
  const std::string prompt = "The KV cache keeps keys after rotary; ";
  // The previous implementation of generate for softmax models: the whole window recomputed for every token.
  auto recompute = [&](int64_t context, int64_t count) {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> tokens{kBosToken};
    for (unsigned char c : prompt) tokens.push_back(c);
    std::string out;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
      const torch::Tensor logits = full_forward(model, std::vector<int64_t>(tokens.begin() + start, tokens.end()));
      const int64_t next = logits[logits.size(0) - 1].slice(0, 0, 256).argmax().item<int64_t>();
      tokens.push_back(next);
      out.push_back(static_cast<char>(next));
    }
    return out;
  };
  // The window never slides / slides from token 10 on (cache rebuilt from each new window), in chunks of 512
  // (one chunk) and 7.
  for (auto [context, count] : {std::pair<int64_t, int64_t>{1024, 300}, std::pair<int64_t, int64_t>{48, 40}}) {
    const std::string expected = recompute(context, count);
    for (int64_t chunk : {512, 7}) {
      GenerateOptions opt;
      opt.max_new_tokens = count;
      opt.temperature = 0;
      opt.context = context;
      opt.chunk_tokens = chunk;
      EXPECT_EQ(generate(model, prompt, opt), expected) << "context " << context << " chunk " << chunk;
    }
  }
  GenerateOptions bad;
  bad.chunk_tokens = 0;
  EXPECT_NE(error_of([&] { generate(model, prompt, bad); }).find("chunk_tokens 0"), std::string::npos);
}

TEST(Generate, StreamsBytesAndRefusesNonFiniteLogits) {
  Transformer model = sharp_model(21);
  GenerateOptions opt;
  opt.max_new_tokens = 12;
  opt.seed = 3;
  std::string streamed;
  opt.on_byte = [&](char c) { streamed.push_back(c); };
  EXPECT_EQ(generate(model, "abc", opt), streamed);
  // A temperature this small overflows logits / temperature: a named error, not torch's "probability tensor".
  opt.temperature = 5e-324;
  EXPECT_NE(error_of([&] { generate(model, "abc", opt); }).find("temperature"), std::string::npos);
  // NaN weights would make greedy decoding print byte 0 forever.
  {
    torch::NoGradGuard no_grad;
    model->embed->weight.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  opt.temperature = 0;
  EXPECT_THROW(generate(model, "abc", opt), std::runtime_error);
}

TEST(KvConfig, ChunkTokensIsAConfigKey) {
  EXPECT_EQ(Config::load("", {}).kv.chunk_tokens, 512);
  EXPECT_EQ(Config::load("", {"--kv.chunk_tokens=64"}).kv.chunk_tokens, 64);
  EXPECT_THROW(Config::load("", {"--kv.chunk_tokens=0"}), ConfigError);
  EXPECT_EQ(Config::load("", {}).kv.chunk_pairs, 0);
  EXPECT_EQ(Config::load("", {"--kv.chunk_pairs=262144"}).kv.chunk_pairs, 262144);
  EXPECT_THROW(Config::load("", {"--kv.chunk_pairs=-1"}), ConfigError);
}
