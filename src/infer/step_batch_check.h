// What both batched steps share (DecodeSession::step_batch, RecurrentSession::step_batch): the argument checks and
// the packed batch of the sessions' tokens.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "dcp/data.h"
#include "dcp/model.h"

namespace dcp::infer_detail {

/// Throws std::invalid_argument naming `who`, the session's index and the value for: a null session, a session of
/// another model than session 0's (model_of(i) differs), a session given twice, a token count outside
/// [1, most_tokens(i)] (limits(i), a string, says what the bound is), a token outside [0, kVocabSize). tokens.size()
/// must equal sessions.size() (checked by the caller, whose message names its other lists).
template <class Session, class ModelOf, class MostTokens, class Limits>
void check_step_batch(const char* who, const std::vector<Session*>& sessions,
                      const std::vector<std::vector<int64_t>>& tokens, const ModelOf& model_of,
                      const MostTokens& most_tokens, const Limits& limits) {
  for (size_t i = 0; i < sessions.size(); ++i) {
    if (sessions[i] == nullptr) throw std::invalid_argument(fmt::format("{}: session {} is null", who, i));
    if (model_of(i) != model_of(0)) {
      throw std::invalid_argument(fmt::format("{}: session {} has another model than session 0", who, i));
    }
    for (size_t j = 0; j < i; ++j) {
      if (sessions[j] == sessions[i]) throw std::invalid_argument(fmt::format("{}: session {} is also session {}", who, i, j));
    }
    const auto t = static_cast<int64_t>(tokens[i].size());
    if (t < 1 || t > most_tokens(i)) {
      throw std::invalid_argument(fmt::format("{}: session {} has {} tokens ({})", who, i, t, limits(i)));
    }
    for (size_t j = 0; j < tokens[i].size(); ++j) {
      if (tokens[i][j] < 0 || tokens[i][j] >= kVocabSize) {
        throw std::invalid_argument(fmt::format("{}: session {}: token {} at index {} outside [0, {})", who, i,
                                                tokens[i][j], j, kVocabSize));
      }
    }
  }
}

/// The packed batch of several sessions' tokens: `flat` the tokens in session order, `positions` each token's
/// position in its session, `cu` the sessions' offsets into `flat` ([sessions + 1], from 0); targets are zeros (a
/// step scores nothing) and the attention wrapper is the caller's to set.
inline PackedBatch packed_tokens(const std::vector<int64_t>& flat, const std::vector<int64_t>& positions,
                                 const std::vector<int64_t>& cu) {
  PackedBatch batch;
  batch.tokens = torch::tensor(flat, torch::kInt64);
  batch.targets = torch::zeros({static_cast<int64_t>(flat.size())}, torch::kInt64);
  batch.positions = torch::tensor(positions, torch::kInt64);
  batch.cu_seqlens = torch::tensor(cu, torch::kInt64);
  return batch;
}

}  // namespace dcp::infer_detail
