// Chunked prefill and token-by-token decoding of one sequence through its KV cache.
#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "dcp/infer.h"
#include "infer/step_batch_check.h"
#include "model/weight_cast.h"

namespace dcp {

int64_t prefill_chunk_length(int64_t seen, int64_t remaining, int64_t chunk_tokens, int64_t chunk_pairs) {
  if (seen < 0 || remaining < 1 || chunk_tokens < 1 || chunk_pairs < 0) {
    throw std::invalid_argument(fmt::format("prefill_chunk_length: seen {} must be >= 0, remaining {} >= 1, "
                                            "chunk_tokens {} >= 1 and chunk_pairs {} >= 0",
                                            seen, remaining, chunk_tokens, chunk_pairs));
  }
  int64_t c = std::min(remaining, chunk_tokens);
  if (chunk_pairs > 0) {
    // The positive root of c^2 + seen c = chunk_pairs, then corrected to the exact integer bound (long double's
    // 64-bit mantissa is exact for every seen and chunk_pairs the config allows, but the square root rounds).
    const long double s = static_cast<long double>(seen);
    auto fits = [&](int64_t x) {
      return static_cast<long double>(x) * (s + static_cast<long double>(x)) <= static_cast<long double>(chunk_pairs);
    };
    int64_t root = static_cast<int64_t>((std::sqrt(s * s + 4.0L * static_cast<long double>(chunk_pairs)) - s) / 2);
    while (root > 0 && !fits(root)) --root;
    while (root < c && fits(root + 1)) ++root;
    c = std::max<int64_t>(1, std::min(c, root));
  }
  return c;
}

DecodeSession::DecodeSession(Transformer model, int64_t chunk_tokens, std::shared_ptr<KvPolicy> policy,
                             int64_t chunk_pairs)
    : model_(std::move(model)),
      chunk_tokens_(chunk_tokens),
      chunk_pairs_(chunk_pairs),
      policy_(policy ? std::move(policy) : std::make_shared<FullKvPolicy>()) {
  if (chunk_tokens < 1) {
    throw std::invalid_argument(fmt::format("DecodeSession: chunk_tokens {} must be >= 1", chunk_tokens));
  }
  if (chunk_pairs < 0) {
    throw std::invalid_argument(fmt::format("DecodeSession: chunk_pairs {} must be >= 0 (0 = no bound)", chunk_pairs));
  }
  for (int64_t i = 0; i < model_->cfg.n_layers; ++i) {
    if (dynamic_cast<const SoftmaxAttention*>(model_->blocks->ptr<BlockImpl>(static_cast<size_t>(i))->attention.get()) ==
        nullptr) {
      throw std::invalid_argument(fmt::format(
          "DecodeSession: layer {} does not use softmax attention; a KV cache needs attention.backend: softmax "
          "(flexformer models decode recurrently with FlexformerDecoding)", i));
    }
  }
  cache_ = std::make_shared<KvCache>(kv_cache_spec(model_));
  const KvObservationNeeds needs = policy_->needs();
  if (needs.any()) {
    observations_ = std::make_shared<KvObservations>(cache_->spec().layers, cache_->spec().kv_heads, needs,
                                                     model_->cfg.n_heads, model_->cfg.rope_theta);
  }
}

void DecodeSession::reset() {
  cache_->clear();
  if (observations_) observations_->clear();
  policy_->reset();
}

int64_t DecodeSession::next_chunk_length(int64_t remaining) const {
  return prefill_chunk_length(cache_->next_position(), remaining, chunk_tokens_, chunk_pairs_);
}

torch::Tensor DecodeSession::prefill(const std::vector<int64_t>& tokens) { return run(tokens, /*prefill=*/true); }

torch::Tensor DecodeSession::decode(int64_t token) { return run({token}, /*prefill=*/false)[0]; }

torch::Tensor DecodeSession::run(const std::vector<int64_t>& tokens, bool prefill) {
  if (tokens.empty()) throw std::invalid_argument("DecodeSession: no tokens to run");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kVocabSize) {
      throw std::invalid_argument(fmt::format("DecodeSession: token {} at index {} outside [0, {})", tokens[i], i,
                                              kVocabSize));
    }
  }
  torch::NoGradGuard no_grad;
  const CastWeightsScope keep_casts;  // the weights do not change while a session decodes: cast them once
  const int64_t total = static_cast<int64_t>(tokens.size());
  // A prompt's chunks then copy nothing (else storage would double about log2(prompt) times); one decoded token
  // leaves doubling to append.
  if (total > 1) cache_->reserve(total);
  std::vector<torch::Tensor> logits;
  for (int64_t s = 0, t = 0; s < total; s += t) {
    t = next_chunk_length(total - s);
    const int64_t first = cache_->next_position();
    PackedBatch batch;
    batch.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + s, tokens.begin() + s + t), torch::kInt64);
    batch.targets = torch::zeros({t}, torch::kInt64);
    batch.positions = torch::arange(first, first + t, torch::kInt64);
    batch.cu_seqlens = torch::tensor({int64_t{0}, t}, torch::kInt64);
    const KvStep step{prefill, first, t, observations_.get()};
    const bool by_layer = policy_->compresses_by_layer();
    batch.attention = std::make_shared<KvCacheAttention>(cache_, batch.positions, observations_,
                                                         by_layer ? policy_.get() : nullptr, step);
    logits.push_back(model_->forward(batch));
    if (!by_layer) policy_->after_step(*cache_, step);
  }
  return logits.size() == 1 ? logits[0] : torch::cat(logits);
}

}  // namespace dcp

namespace dcp {
namespace {

// The attention of a packed batch of several sessions' steps (DecodeSession::step_batch): segment i of the
// stream is session i's tokens. The one-token segments of a layer attend together through kv_decode_attention and
// are appended together by KvCache::append_tokens (no tensor per session), each longer one attends over its own
// cache and is appended alone (kv_chunk_attention_append, as a solo step's chunk); then each segment is recorded in
// its observations and compressed by its layer-by-layer policy, in the order a solo step does (attend and append,
// observe, compress).
class BatchedKvCacheAttention : public AttentionWrapper {
 public:
  struct Segment {
    KvCache* cache;
    KvObservations* observations;  // null when the session's policy asks for nothing
    int64_t begin, length;
    KvPolicy* compress;            // the session's policy when it compresses layer by layer, else null
    KvStep step;
    torch::Tensor positions;       // [length] int64; made only for a chunk or an observed session
  };
  BatchedKvCacheAttention(std::vector<Segment> segments, int64_t threads)
      : segments_(std::move(segments)), threads_(threads) {
    for (size_t i = 0; i < segments_.size(); ++i) {
      Segment& s = segments_[i];
      if (s.length > 1 || s.observations) {
        s.positions = torch::arange(s.step.first_position, s.step.first_position + s.length, torch::kInt64);
      }
      if (s.length == 1) {
        decode_rows_.push_back(s.begin);
        decode_caches_.push_back(s.cache);
        decode_writable_.push_back(s.cache);
        decode_positions_.push_back(s.step.first_position);
      }
    }
    all_decode_ = decode_rows_.size() == segments_.size();
    if (!all_decode_ && !decode_rows_.empty()) rows_ = torch::tensor(decode_rows_, torch::kInt64);
  }

  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& /*cu_seqlens*/) const override {
    const auto* softmax = dynamic_cast<const SoftmaxAttention*>(&inner);
    if (softmax == nullptr) {
      throw std::invalid_argument(fmt::format("DecodeSession::step_batch: the attention backend of layer {} is not "
                                              "softmax", layer));
    }
    const double scale = softmax->options().scale > 0 ? softmax->options().scale
                                                      : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
    torch::Tensor out, k_decode, v_decode;
    if (all_decode_) {
      out = kv_decode_attention(q, k, v, decode_caches_, layer, scale, DecodeAttentionPath::kAuto, threads_);
      k_decode = k;
      v_decode = v;
    } else {
      out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
      if (!decode_rows_.empty()) {
        k_decode = k.index_select(0, rows_);
        v_decode = v.index_select(0, rows_);
        out.index_copy_(0, rows_, kv_decode_attention(q.index_select(0, rows_), k_decode, v_decode, decode_caches_,
                                                      layer, scale, DecodeAttentionPath::kAuto, threads_));
      }
      for (const Segment& s : segments_) {
        if (s.length == 1) continue;
        out.narrow(0, s.begin, s.length)
            .copy_(kv_chunk_attention_append(q.narrow(0, s.begin, s.length), k.narrow(0, s.begin, s.length),
                                             v.narrow(0, s.begin, s.length), *s.cache, layer, s.positions,
                                             softmax->options(), threads_));
      }
    }
    if (!decode_rows_.empty()) KvCache::append_tokens(decode_writable_, layer, k_decode, v_decode, decode_positions_);
    for (const Segment& s : segments_) {
      if (s.observations) s.observations->observe(layer, q.narrow(0, s.begin, s.length), s.positions, *s.cache, scale);
      if (s.compress) s.compress->after_layer(*s.cache, layer, s.step);
    }
    return out;
  }

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> decode_rows_;        // rows of the one-token segments in the packed stream
  std::vector<const KvCache*> decode_caches_;
  std::vector<KvCache*> decode_writable_;
  std::vector<int64_t> decode_positions_;
  bool all_decode_ = false;
  torch::Tensor rows_;
  int64_t threads_;
};

}  // namespace

std::vector<torch::Tensor> DecodeSession::step_batch(const std::vector<DecodeSession*>& sessions,
                                                     const std::vector<std::vector<int64_t>>& tokens,
                                                     const std::vector<bool>& prefill, int64_t attention_threads) {
  const size_t n = sessions.size();
  if (n == 0) return {};
  if (tokens.size() != n || prefill.size() != n) {
    throw std::invalid_argument(fmt::format("DecodeSession::step_batch: {} sessions, {} token lists and {} prefill "
                                            "flags (one each)", n, tokens.size(), prefill.size()));
  }
  // A session's null check comes first: the lambdas read it only after.
  infer_detail::check_step_batch(
      "DecodeSession::step_batch", sessions, tokens, [&](size_t i) { return sessions[i]->model_.get(); },
      [&](size_t i) { return prefill[i] ? sessions[i]->chunk_tokens_ : int64_t{1}; },
      [&](size_t i) {
        return fmt::format("a prefill step runs 1 to chunk_tokens {}, a decode step 1", sessions[i]->chunk_tokens_);
      });
  torch::NoGradGuard no_grad;
  const CastWeightsScope keep_casts;
  std::vector<int64_t> flat, positions, cu{0};
  std::vector<BatchedKvCacheAttention::Segment> segments;
  std::vector<int64_t> firsts(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSession& s = *sessions[i];
    const auto t = static_cast<int64_t>(tokens[i].size());
    const int64_t first = s.cache_->next_position();
    firsts[i] = first;
    flat.insert(flat.end(), tokens[i].begin(), tokens[i].end());
    for (int64_t p = first; p < first + t; ++p) positions.push_back(p);
    segments.push_back({s.cache_.get(), s.observations_.get(), cu.back(), t,
                        s.policy_->compresses_by_layer() ? s.policy_.get() : nullptr,
                        KvStep{prefill[i], first, t, s.observations_.get()}, torch::Tensor()});
    cu.push_back(cu.back() + t);
  }
  PackedBatch batch = infer_detail::packed_tokens(flat, positions, cu);
  batch.attention = std::make_shared<BatchedKvCacheAttention>(std::move(segments), attention_threads);
  const torch::Tensor logits = sessions[0]->model_->forward(batch);
  std::vector<torch::Tensor> out(n);
  for (size_t i = 0; i < n; ++i) {
    DecodeSession& s = *sessions[i];
    const auto t = static_cast<int64_t>(tokens[i].size());
    out[i] = logits.narrow(0, cu[i], t);
    if (!s.policy_->compresses_by_layer()) {
      s.policy_->after_step(*s.cache_, KvStep{prefill[i], firsts[i], t, s.observations_.get()});
    }
  }
  return out;
}

}  // namespace dcp
