#include "model/weight_cast.h"

#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dcp {
namespace {

thread_local int scope_depth = 0;

struct Part {
  c10::weak_intrusive_ptr<c10::TensorImpl> source;
  const void* data = nullptr;
  int64_t version = 0;
};

struct Kept {
  std::vector<Part> parts;
  torch::ScalarType dtype;
  torch::Tensor cast;
};

std::mutex mu;
// Keyed by the first part's TensorImpl (one entry per dtype and part count); a stale entry is replaced, and purge()
// drops the entries whose sources died, at each insertion and at kept_weight_casts (else a cast would outlive its
// model).
std::unordered_map<const c10::TensorImpl*, std::vector<Kept>>& kept() {
  static auto* m = new std::unordered_map<const c10::TensorImpl*, std::vector<Kept>>();
  return *m;
}

bool same(const Part& p, const torch::Tensor& t) {
  if (p.source.expired()) return false;
  const c10::intrusive_ptr<c10::TensorImpl> live = p.source.lock();
  return live.get() == t.unsafeGetTensorImpl() && p.data == t.data_ptr() && p.version == t._version();
}

// Drops every entry whose sources died (their casts with them) and the keys left empty. Called with mu held.
void purge() {
  for (auto it = kept().begin(); it != kept().end();) {
    auto& v = it->second;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [](const Kept& k) {
                             for (const Part& p : k.parts) {
                               if (p.source.expired()) return true;
                             }
                             return false;
                           }),
            v.end());
    it = v.empty() ? kept().erase(it) : std::next(it);
  }
}

torch::Tensor cast_now(std::initializer_list<torch::Tensor> parts, torch::ScalarType dtype) {
  if (parts.size() == 1) return parts.begin()->to(dtype);
  return torch::cat(std::vector<torch::Tensor>(parts)).to(dtype);
}

}  // namespace

CastWeightsScope::CastWeightsScope() { ++scope_depth; }
CastWeightsScope::~CastWeightsScope() { --scope_depth; }

torch::Tensor weights_in(std::initializer_list<torch::Tensor> parts, torch::ScalarType dtype) {
  if (scope_depth == 0 || torch::GradMode::is_enabled() || parts.size() == 0) return cast_now(parts, dtype);
  const torch::Tensor& first = *parts.begin();
  if (parts.size() == 1 && first.scalar_type() == dtype) return first;  // to() would return it as it is
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = kept()[first.unsafeGetTensorImpl()];
  for (Kept& k : slot) {
    if (k.dtype != dtype || k.parts.size() != parts.size()) continue;
    bool valid = true;
    size_t i = 0;
    for (const torch::Tensor& t : parts) valid = valid && same(k.parts[i++], t);
    if (valid) return k.cast;
  }
  Kept fresh{{}, dtype, cast_now(parts, dtype)};
  for (const torch::Tensor& t : parts) {
    fresh.parts.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), t.data_ptr(), t._version()});
  }
  // Replace what this key kept for the dtype (stale now), and drop every entry whose sources died.
  slot.erase(std::remove_if(slot.begin(), slot.end(),
                            [&](const Kept& k) { return k.dtype == dtype && k.parts.size() == parts.size(); }),
             slot.end());
  slot.push_back(fresh);
  purge();  // slot holds `fresh`, whose sources are alive: it stays
  return fresh.cast;
}

size_t kept_weight_casts() {
  std::lock_guard<std::mutex> lock(mu);
  purge();
  size_t n = 0;
  for (const auto& [key, v] : kept()) n += v.size();
  return n;
}

}  // namespace dcp
