// KV-cache compression policies for a DecodeSession, by name: the factory and its options. Each policy is one
// class in its own file of src/infer/kv/policies/ (kvpress's presses: a scorer ranks the entries of each (layer,
// KV head), a policy turns scores into kept entries under a budget and commits them; minimax summarises). Every
// policy cuts each head for real: KvCache::commit reallocates it to what it keeps. docs/kv_cache.md "Policies"
// says what each one keeps, from which paper, its options and what it records.
//
// Budget: a ratio of the tokens seen. After a compression of layer l every head holds at most
// ceil(budget * next_position(l)) entries (adakv and minimax: the layer's heads together hold at most kv_heads times
// that), unless the scorer protects more (sinks, a recent window): protected entries are never evicted.
// Compression runs after every prefill chunk and, while decoding, after every `interval`-th token (when the next
// position is a multiple of interval), by default the same kKvDefaultInterval for every policy so that all hold
// the same bytes while decoding.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/kv_policy.h"

namespace dcp {

/// Options of make_kv_policy: name -> number (integers where the option counts something).
using KvPolicyOptions = std::map<std::string, double>;

/// The default `interval` of every policy: decoding compresses when the next position is a multiple of it (as
/// kvpress's DecodingPress compresses every compression_steps tokens); one schedule for all, equal memory.
constexpr int64_t kKvDefaultInterval = 64;

/// The policy `name` with `options` (unset ones take their defaults); every policy but full takes budget (1),
/// interval (kKvDefaultInterval = 64) and max_tokens (0 = no cap; KvBudget):
///   full                                   keeps everything (FullKvPolicy); no options
///   window              n_sink (4)
///   h2o                 recent_fraction (0.5, in [0, 1])
///   snapkv              window (64), kernel (5, odd)
///   tova                nothing more
///   expected-attention  n_future_positions (512), n_sink (4), value_norm (1: scores x ||v||; 0 or 1)
///   keydiff             nothing more
///   adakv-<scorer>      the scorer's options plus alpha_safeguard (0.2, in [0, 1]); <scorer> one of h2o,
///                       snapkv, tova, expected-attention, keydiff (not window: its scores do not compare across
///                       heads)
///   minimax             window (48), samples (48), probes (48), n_sink (4), recent_fraction (0.25),
///                       recent_tokens (0), alpha_safeguard (0.2), abstain_tail (0.5, >= 0), abstain_heldout
///                       (0 = off, >= 0), exceed_budget (0), unit_weights (0: the no-bias ablation when 1),
///                       max_rel_error (0 = off: an error target, with budget 1), refit_values (0), merge (1:
///                       binary-counter merges of summaries; 0: each entry summarised once), max_keep_fraction
///                       (0.125, in (0, 1]: screening; below 1 refused with max_rel_error > 0), seed (0)
///                       (MinimaxKvPolicy; the 0-or-1 options are flags)
/// budget in (0, 1]; interval, window, kernel >= 1; n_sink, max_tokens >= 0. Throws std::invalid_argument naming
/// the policy and the option: an unknown name (listing the valid ones), an option the policy does not take
/// (listing the ones it takes), a value out of range or not an integer.
std::shared_ptr<KvPolicy> make_kv_policy(const std::string& name, const KvPolicyOptions& options = {});

/// The policy of kv.policy / --kv.policy with kv.budget / --kv.budget: a budget in (0, 1] is the fraction of the
/// tokens seen (option budget), a whole number >= 2 a fixed number of entries per head (option max_tokens,
/// fraction 1). `options` are the policy's other options. Throws std::invalid_argument naming the budget when it
/// is neither (0, a fraction above 1, NaN), for policy full with a budget other than 1, and make_kv_policy's
/// errors.
std::shared_ptr<KvPolicy> make_kv_policy_with_budget(const std::string& name, double budget,
                                                         KvPolicyOptions options = {});
/// Adds one "KEY=VALUE" option as written on a command line (`dcp generate --kv.option`, kv-eval's policy
/// specs) to `options`. Throws std::invalid_argument naming the item: no '=' or an empty KEY, a VALUE that is not
/// a finite decimal number (util/number_text.h: no hex, inf or nan), a KEY already in `options`.
void add_kv_policy_option(const std::string& item, KvPolicyOptions& options);

/// A policy name with its options in one string: "NAME" or "NAME:KEY=VALUE[:KEY=VALUE...]", e.g.
/// "minimax:abstain_tail=0.3" (`dcp kv-eval --policies`). Only parsed here: make_kv_policy checks the name and
/// the options. Throws std::invalid_argument naming the spec for an empty name and add_kv_policy_option's errors.
struct KvPolicySpec {
  std::string name;
  KvPolicyOptions options;
};
KvPolicySpec parse_kv_policy_spec(const std::string& spec);

/// Every name make_kv_policy accepts, in the order of its list above (full first, then the baselines, then the
/// adakv-<scorer> variants): what `dcp kv-eval --policies all` runs and what its unknown-name error lists. A new
/// policy is added here and in make_kv_policy together (tests/unit/test_kv_eval.cpp builds every name).
const std::vector<std::string>& kv_policy_names();

}  // namespace dcp
