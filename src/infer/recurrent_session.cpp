// Recurrent decoding of flexformer models: chunked prefill and token-by-token steps from per-layer states, alone
// or several sessions in one forward.
#include <fmt/format.h>

#include <stdexcept>

#include "dcp/flexformer.h"
#include "dcp/infer.h"
#include "infer/step_batch_check.h"
#include "model/weight_cast.h"

namespace dcp {

bool decodes_recurrently(const Transformer& model) {
  const int64_t layers = model->cfg.n_layers;
  if (layers < 1) throw std::invalid_argument("decodes_recurrently: the model has no layers");
  int64_t flex = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const AttentionBackend* a = model->blocks->ptr<BlockImpl>(static_cast<size_t>(i))->attention.get();
    if (dynamic_cast<const FlexformerAttention*>(a) != nullptr) {
      ++flex;
    } else if (dynamic_cast<const SoftmaxAttention*>(a) == nullptr) {
      throw std::invalid_argument(fmt::format("decodes_recurrently: layer {} is neither softmax nor flexformer", i));
    }
  }
  if (flex != 0 && flex != layers) {
    throw std::invalid_argument(fmt::format("decodes_recurrently: {} of {} layers are flexformer, the rest softmax; a "
                                            "model decodes one way", flex, layers));
  }
  return flex == layers;
}

RecurrentSession::RecurrentSession(Transformer model, int64_t chunk_tokens)
    : model_(std::move(model)), chunk_tokens_(chunk_tokens) {
  if (chunk_tokens < 1) {
    throw std::invalid_argument(fmt::format("RecurrentSession: chunk_tokens {} must be >= 1", chunk_tokens));
  }
  for (int64_t i = 0; i < model_->cfg.n_layers; ++i) {
    if (dynamic_cast<const FlexformerAttention*>(
            model_->blocks->ptr<BlockImpl>(static_cast<size_t>(i))->attention.get()) == nullptr) {
      throw std::invalid_argument(fmt::format(
          "RecurrentSession: layer {} does not use flexformer attention; recurrent decoding needs "
          "attention.backend: flexformer (softmax models decode through a KV cache with DecodeSession)", i));
    }
  }
  states_.resize(static_cast<size_t>(model_->cfg.n_layers));
}

void RecurrentSession::reset() {
  for (auto& s : states_) s = LinearAttentionState{};
  position_ = 0;
}

int64_t RecurrentSession::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : states_) {
    if (s.s.defined()) bytes += static_cast<int64_t>(s.s.nbytes() + s.z.nbytes());
  }
  return bytes;
}

int64_t RecurrentSession::next_chunk_length(int64_t remaining) const {
  if (remaining < 1) {
    throw std::invalid_argument(fmt::format("RecurrentSession: remaining {} must be >= 1", remaining));
  }
  return std::min(remaining, chunk_tokens_);
}

torch::Tensor RecurrentSession::prefill(const std::vector<int64_t>& tokens) {
  if (tokens.empty()) throw std::invalid_argument("RecurrentSession: no tokens to run");
  std::vector<torch::Tensor> logits;
  const auto total = static_cast<int64_t>(tokens.size());
  for (int64_t s = 0, t = 0; s < total; s += t) {
    t = next_chunk_length(total - s);
    logits.push_back(step_batch({this}, {std::vector<int64_t>(tokens.begin() + s, tokens.begin() + s + t)})[0]);
  }
  return logits.size() == 1 ? logits[0] : torch::cat(logits);
}

torch::Tensor RecurrentSession::decode(int64_t token) { return step_batch({this}, {{token}})[0][0]; }

std::vector<torch::Tensor> RecurrentSession::step_batch(const std::vector<RecurrentSession*>& sessions,
                                                        const std::vector<std::vector<int64_t>>& tokens) {
  const size_t n = sessions.size();
  if (n == 0) return {};
  if (tokens.size() != n) {
    throw std::invalid_argument(
        fmt::format("RecurrentSession::step_batch: {} sessions and {} token lists (one each)", n, tokens.size()));
  }
  infer_detail::check_step_batch(
      "RecurrentSession::step_batch", sessions, tokens, [&](size_t i) { return sessions[i]->model_.get(); },
      [&](size_t i) { return sessions[i]->chunk_tokens_; },
      [&](size_t i) { return fmt::format("a step runs 1 to chunk_tokens {}", sessions[i]->chunk_tokens_); });
  torch::NoGradGuard no_grad;
  const CastWeightsScope keep_casts;  // the weights do not change while sessions decode: cast them once
  Transformer model = sessions[0]->model_;  // a holder: the same module
  const int64_t layers = model->cfg.n_layers;
  std::vector<int64_t> flat, positions, cu{0};
  for (size_t i = 0; i < n; ++i) {
    const RecurrentSession& s = *sessions[i];
    flat.insert(flat.end(), tokens[i].begin(), tokens[i].end());
    for (int64_t p = s.position_; p < s.position_ + static_cast<int64_t>(tokens[i].size()); ++p) positions.push_back(p);
    cu.push_back(static_cast<int64_t>(flat.size()));
  }
  // The sessions' states stacked per layer (a session's first step starts from zeros of the others' shape; all
  // first steps: no state at all, the kernel's zero start).
  auto decoding = std::make_shared<FlexformerDecoding>(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const LinearAttentionState* like = nullptr;
    for (RecurrentSession* s : sessions) {
      if (s->states_[static_cast<size_t>(l)].s.defined()) {
        like = &s->states_[static_cast<size_t>(l)];
        break;
      }
    }
    if (like == nullptr) continue;
    if (n == 1) {
      decoding->set_state(l, *like);
      continue;
    }
    std::vector<torch::Tensor> s_parts, z_parts;
    for (RecurrentSession* s : sessions) {
      const LinearAttentionState& st = s->states_[static_cast<size_t>(l)];
      s_parts.push_back(st.s.defined() ? st.s : torch::zeros_like(like->s));
      z_parts.push_back(st.z.defined() ? st.z : torch::zeros_like(like->z));
    }
    decoding->set_state(l, {torch::cat(s_parts), torch::cat(z_parts)});
  }
  PackedBatch batch = infer_detail::packed_tokens(flat, positions, cu);
  batch.attention = decoding;
  const torch::Tensor logits = model->forward(batch);
  // Every session's new states first (each owns its rows: a view would keep the whole stack alive and its bytes
  // uncounted), then committed all at once: a step that throws leaves every session as it was.
  std::vector<std::vector<LinearAttentionState>> next(n, std::vector<LinearAttentionState>(static_cast<size_t>(layers)));
  for (size_t i = 0; i < n; ++i) {
    for (int64_t l = 0; l < layers; ++l) {
      const LinearAttentionState& st = decoding->state(l);
      next[i][static_cast<size_t>(l)] =
          n == 1 ? st : LinearAttentionState{st.s.narrow(0, static_cast<int64_t>(i), 1).clone(),
                                             st.z.narrow(0, static_cast<int64_t>(i), 1).clone()};
    }
  }
  std::vector<torch::Tensor> out(n);
  for (size_t i = 0; i < n; ++i) {
    RecurrentSession& s = *sessions[i];
    s.states_.swap(next[i]);
    s.position_ += static_cast<int64_t>(tokens[i].size());
    out[i] = logits.narrow(0, cu[i], cu[i + 1] - cu[i]);
  }
  return out;
}

}  // namespace dcp
