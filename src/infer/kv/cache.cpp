#include <fmt/format.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "dcp/kv_cache.h"
#include "util/file_write.h"
#include "util/hash.h"

namespace dcp {
namespace {

// Smallest capacity a head grows to: decoding appends one token at a time, and doubling from 1 would copy often.
constexpr int64_t kMinCapacity = 16;

constexpr char kMagic[8] = {'D', 'C', 'P', 'K', 'V', 'C', '0', '1'};
constexpr uint32_t kByteOrderMark = 0x01020304;

std::string dtype_name(torch::ScalarType t) { return c10::toString(t); }

bool supported_dtype(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kDouble || t == torch::kBFloat16;
}

int64_t dtype_code(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return 0;
    case torch::kDouble: return 1;
    case torch::kBFloat16: return 2;
    default: throw std::invalid_argument("KvCache: dtype " + dtype_name(t) + " has no file code");
  }
}

std::optional<torch::ScalarType> dtype_of_code(int64_t code) {
  switch (code) {
    case 0: return torch::kFloat;
    case 1: return torch::kDouble;
    case 2: return torch::kBFloat16;
    default: return std::nullopt;
  }
}

std::string shape_of(const torch::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : "undefined"; }

// FNV-1a, 64 bit: detects a flipped or zeroed byte anywhere in the file; not a defence against tampering.
uint64_t fnv1a(const char* data, size_t n) { return Fnv1a64().update(data, n).value(); }

template <class T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

void put_tensor(std::string& out, const torch::Tensor& t) {
  const torch::Tensor host = t.to(torch::kCPU).contiguous();
  out.append(static_cast<const char*>(host.data_ptr()), host.numel() * host.element_size());
}

// Bounds-checked reading of a loaded file; every failure names the file.
struct Reader {
  const std::string& data;
  const std::string& path;
  size_t offset = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(fmt::format("KvCache::load '{}': {}", path, what));
  }
  const char* take(size_t n, const char* what) {
    if (n > data.size() - offset) {
      fail(fmt::format("truncated: {} needs {} bytes at offset {}, the file has {}", what, n, offset, data.size()));
    }
    const char* p = data.data() + offset;
    offset += n;
    return p;
  }
  template <class T>
  T get(const char* what) {
    T value;
    std::memcpy(&value, take(sizeof(T), what), sizeof(T));
    return value;
  }
  torch::Tensor tensor(std::vector<int64_t> shape, torch::ScalarType dtype, const char* what) {
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(dtype));
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    std::memcpy(t.data_ptr(), take(n, what), n);
    return t;
  }
};

}  // namespace

KvCache::KvCache(const KvCacheSpec& spec) : spec_(spec) {
  if (spec_.value_dim == 0) spec_.value_dim = spec_.head_dim;
  if (spec_.layers < 1 || spec_.kv_heads < 1 || spec_.head_dim < 1 || spec_.value_dim < 1) {
    throw std::invalid_argument(fmt::format("KvCache: layers {}, kv_heads {}, head_dim {} and value_dim {} must be >= 1",
                                            spec_.layers, spec_.kv_heads, spec_.head_dim, spec_.value_dim));
  }
  if (!supported_dtype(spec_.dtype)) {
    throw std::invalid_argument("KvCache: dtype " + dtype_name(spec_.dtype) + " is not supported (fp32, fp64, bf16)");
  }
  heads_.resize(static_cast<size_t>(spec_.layers * spec_.kv_heads));
  next_position_.assign(static_cast<size_t>(spec_.layers), 0);
}

void KvCache::check_layer(int64_t layer, const char* who) const {
  if (layer < 0 || layer >= spec_.layers) {
    throw std::invalid_argument(fmt::format("KvCache::{}: layer {} outside [0, {})", who, layer, spec_.layers));
  }
}

KvCache::Head& KvCache::head(int64_t layer, int64_t h) {
  return heads_[static_cast<size_t>(layer * spec_.kv_heads + h)];
}
const KvCache::Head& KvCache::head(int64_t layer, int64_t h) const {
  return heads_[static_cast<size_t>(layer * spec_.kv_heads + h)];
}

void KvCache::grow(Head& hd, int64_t entries) const {
  if (entries <= hd.capacity()) return;
  const int64_t cap = std::max({entries, 2 * hd.capacity(), kMinCapacity});
  const auto opt = torch::TensorOptions().device(spec_.device);
  Head next;
  next.keys = torch::empty({cap, spec_.head_dim}, opt.dtype(spec_.dtype));
  next.values = torch::empty({cap, spec_.value_dim}, opt.dtype(spec_.dtype));
  next.bias = torch::empty({cap}, opt.dtype(torch::kFloat));
  next.positions = torch::empty({cap}, opt.dtype(torch::kInt64));
  next.length = hd.length;
  if (hd.length > 0) {
    next.keys.narrow(0, 0, hd.length).copy_(hd.keys.narrow(0, 0, hd.length));
    next.values.narrow(0, 0, hd.length).copy_(hd.values.narrow(0, 0, hd.length));
    next.bias.narrow(0, 0, hd.length).copy_(hd.bias.narrow(0, 0, hd.length));
    next.positions.narrow(0, 0, hd.length).copy_(hd.positions.narrow(0, 0, hd.length));
  }
  hd = std::move(next);
}

void KvCache::append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions) {
  check_layer(layer, "append");
  const int64_t t = k.defined() && k.dim() == 3 ? k.size(0) : -1;
  if (t < 0 || k.size(1) != spec_.kv_heads || k.size(2) != spec_.head_dim) {
    throw std::invalid_argument(fmt::format("KvCache::append: layer {}: k must be [t, {}, {}], got {}", layer,
                                            spec_.kv_heads, spec_.head_dim, shape_of(k)));
  }
  if (!v.defined() || v.dim() != 3 || v.size(0) != t || v.size(1) != spec_.kv_heads || v.size(2) != spec_.value_dim) {
    throw std::invalid_argument(fmt::format("KvCache::append: layer {}: v must be [{}, {}, {}], got {}", layer, t,
                                            spec_.kv_heads, spec_.value_dim, shape_of(v)));
  }
  if (k.scalar_type() != spec_.dtype || v.scalar_type() != spec_.dtype) {
    throw std::invalid_argument(fmt::format("KvCache::append: layer {}: k and v must be {} (the cache dtype), got {} and {}",
                                            layer, dtype_name(spec_.dtype), dtype_name(k.scalar_type()),
                                            dtype_name(v.scalar_type())));
  }
  if (k.device() != spec_.device || v.device() != spec_.device) {
    throw std::invalid_argument(fmt::format("KvCache::append: layer {}: k and v must be on {}, got {} and {}", layer,
                                            spec_.device.str(), k.device().str(), v.device().str()));
  }
  if (!positions.defined() || positions.dim() != 1 || positions.scalar_type() != torch::kInt64 ||
      positions.numel() != t) {
    throw std::invalid_argument(fmt::format("KvCache::append: layer {}: positions must be [{}] int64, got {} {}", layer,
                                            t, shape_of(positions),
                                            positions.defined() ? dtype_name(positions.scalar_type()) : ""));
  }
  if (t == 0) return;
  const torch::Tensor host = positions.to(torch::kCPU).contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  const int64_t next = next_position_[static_cast<size_t>(layer)];
  if (p[0] < next) {
    throw std::invalid_argument(fmt::format(
        "KvCache::append: layer {}: first position {} is below the layer's next position {} (positions are never "
        "reused)", layer, p[0], next));
  }
  for (int64_t i = 1; i < t; ++i) {
    if (p[i] <= p[i - 1]) {
      throw std::invalid_argument(fmt::format("KvCache::append: layer {}: positions must increase strictly, got {} after {} at index {}",
                                              layer, p[i], p[i - 1], i));
    }
  }
  torch::NoGradGuard no_grad;  // the cache holds values, never autograd history
  if (spec_.device.is_cpu() && k.stride(2) == 1 && v.stride(2) == 1) {
    append_rows(layer, static_cast<const char*>(k.data_ptr()), k.stride(0), k.stride(1),
                static_cast<const char*>(v.data_ptr()), v.stride(0), v.stride(1), p, t);
    return;
  }
  const torch::Tensor pos = positions.to(spec_.device);
  for (int64_t h = 0; h < spec_.kv_heads; ++h) {
    Head& hd = head(layer, h);
    grow(hd, hd.length + t);
    hd.keys.narrow(0, hd.length, t).copy_(k.select(1, h));
    hd.values.narrow(0, hd.length, t).copy_(v.select(1, h));
    hd.bias.narrow(0, hd.length, t).zero_();
    hd.positions.narrow(0, hd.length, t).copy_(pos);
    hd.length += t;
  }
  next_position_[static_cast<size_t>(layer)] = p[t - 1] + 1;
}

// Row copies without a tensor per head: a decode step appends one row per head and layer, where a tensor per head
// costs more than the attention over a short cache (the same bytes land in the same places). Strides in elements.
void KvCache::append_rows(int64_t layer, const char* kp, int64_t k_token, int64_t k_head, const char* vp,
                          int64_t v_token, int64_t v_head, const int64_t* p, int64_t t) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(spec_.dtype));
  for (int64_t h = 0; h < spec_.kv_heads; ++h) {
    Head& hd = head(layer, h);
    grow(hd, hd.length + t);
    char* kd = static_cast<char*>(hd.keys.data_ptr()) + hd.length * spec_.head_dim * es;
    char* vd = static_cast<char*>(hd.values.data_ptr()) + hd.length * spec_.value_dim * es;
    for (int64_t i = 0; i < t; ++i) {
      std::memcpy(kd + i * spec_.head_dim * es, kp + (i * k_token + h * k_head) * es, spec_.head_dim * es);
      std::memcpy(vd + i * spec_.value_dim * es, vp + (i * v_token + h * v_head) * es, spec_.value_dim * es);
    }
    std::fill_n(hd.bias.data_ptr<float>() + hd.length, t, 0.0f);
    std::copy_n(p, t, hd.positions.data_ptr<int64_t>() + hd.length);
    hd.length += t;
  }
  next_position_[static_cast<size_t>(layer)] = p[t - 1] + 1;
}

void KvCache::append_tokens(const std::vector<KvCache*>& caches, int64_t layer, const torch::Tensor& k,
                            const torch::Tensor& v, const std::vector<int64_t>& positions) {
  const auto n = static_cast<int64_t>(caches.size());
  if (static_cast<int64_t>(positions.size()) != n) {
    throw std::invalid_argument(fmt::format("KvCache::append_tokens: {} caches and {} positions (one each)", n,
                                            positions.size()));
  }
  if (n == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    if (caches[static_cast<size_t>(i)] == nullptr) {
      throw std::invalid_argument(fmt::format("KvCache::append_tokens: cache {} is null", i));
    }
  }
  const KvCacheSpec& s = caches[0]->spec_;
  caches[0]->check_layer(layer, "append_tokens");
  for (int64_t i = 1; i < n; ++i) {
    const KvCacheSpec& o = caches[static_cast<size_t>(i)]->spec_;
    if (o.layers != s.layers || o.kv_heads != s.kv_heads || o.head_dim != s.head_dim || o.value_dim != s.value_dim ||
        o.dtype != s.dtype || o.device != s.device) {
      throw std::invalid_argument(fmt::format("KvCache::append_tokens: cache {} has another shape or dtype than cache 0", i));
    }
  }
  std::vector<KvCache*> sorted(caches);
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw std::invalid_argument("KvCache::append_tokens: a cache is given twice (one token per cache)");
  }
  if (!k.defined() || k.dim() != 3 || k.size(0) != n || k.size(1) != s.kv_heads || k.size(2) != s.head_dim ||
      !v.defined() || v.dim() != 3 || v.size(0) != n || v.size(1) != s.kv_heads || v.size(2) != s.value_dim) {
    throw std::invalid_argument(fmt::format("KvCache::append_tokens: layer {}: k must be [{}, {}, {}] and v [{}, {}, {}] "
                                            "(one token per cache), got {} and {}", layer, n, s.kv_heads, s.head_dim, n,
                                            s.kv_heads, s.value_dim, shape_of(k), shape_of(v)));
  }
  if (k.scalar_type() != s.dtype || v.scalar_type() != s.dtype || !s.device.is_cpu() || !k.device().is_cpu() ||
      !v.device().is_cpu()) {
    throw std::invalid_argument(fmt::format("KvCache::append_tokens: layer {}: k and v must be CPU {} tensors for CPU "
                                            "caches, got {} and {}", layer, dtype_name(s.dtype),
                                            dtype_name(k.scalar_type()), dtype_name(v.scalar_type())));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t next = caches[static_cast<size_t>(i)]->next_position_[static_cast<size_t>(layer)];
    if (positions[static_cast<size_t>(i)] < next) {
      throw std::invalid_argument(fmt::format(
          "KvCache::append_tokens: layer {}: cache {}: position {} is below its next position {} (positions are never "
          "reused)", layer, i, positions[static_cast<size_t>(i)], next));
    }
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor kd = k.stride(2) == 1 ? k : k.contiguous(), vd = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t es = static_cast<int64_t>(c10::elementSize(s.dtype));
  const char* kp = static_cast<const char*>(kd.data_ptr());
  const char* vp = static_cast<const char*>(vd.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    caches[static_cast<size_t>(i)]->append_rows(layer, kp + i * kd.stride(0) * es, kd.stride(0), kd.stride(1),
                                                vp + i * vd.stride(0) * es, vd.stride(0), vd.stride(1),
                                                &positions[static_cast<size_t>(i)], 1);
  }
}

KvHeadView KvCache::view(int64_t layer, int64_t h) const {
  check_layer(layer, "view");
  if (h < 0 || h >= spec_.kv_heads) {
    throw std::invalid_argument(fmt::format("KvCache::view: head {} outside [0, {})", h, spec_.kv_heads));
  }
  const Head& hd = head(layer, h);
  if (hd.capacity() == 0) {
    const auto opt = torch::TensorOptions().device(spec_.device);
    return {torch::empty({0, spec_.head_dim}, opt.dtype(spec_.dtype)),
            torch::empty({0, spec_.value_dim}, opt.dtype(spec_.dtype)), torch::empty({0}, opt.dtype(torch::kFloat)),
            torch::empty({0}, opt.dtype(torch::kInt64))};
  }
  return {hd.keys.narrow(0, 0, hd.length), hd.values.narrow(0, 0, hd.length), hd.bias.narrow(0, 0, hd.length),
          hd.positions.narrow(0, 0, hd.length)};
}

KvHeadData KvCache::data(int64_t layer, int64_t h) const {
  check_layer(layer, "data");
  if (h < 0 || h >= spec_.kv_heads) {
    throw std::invalid_argument(fmt::format("KvCache::data: head {} outside [0, {})", h, spec_.kv_heads));
  }
  if (!spec_.device.is_cpu()) {
    throw std::invalid_argument("KvCache::data: raw pointers need a CPU cache, this one is on " + spec_.device.str());
  }
  const Head& hd = head(layer, h);
  if (hd.length == 0) return {};
  return {hd.keys.data_ptr(), hd.values.data_ptr(), hd.bias.data_ptr<float>(), hd.positions.data_ptr<int64_t>(),
          hd.length};
}

void KvCache::commit(int64_t layer, const std::vector<KvHeadEdit>& edits) {
  check_layer(layer, "commit");
  if (static_cast<int64_t>(edits.size()) != spec_.kv_heads) {
    throw std::invalid_argument(fmt::format("KvCache::commit: layer {}: {} edits for {} kv heads (one per head; an edit "
                                            "without keep leaves its head alone)", layer, edits.size(), spec_.kv_heads));
  }
  // Everything is checked first, so that a bad edit of head 3 does not leave heads 0..2 changed.
  std::vector<torch::Tensor> keeps(edits.size());
  for (int64_t h = 0; h < spec_.kv_heads; ++h) {
    const KvHeadEdit& e = edits[static_cast<size_t>(h)];
    const auto where = fmt::format("KvCache::commit: layer {} head {}", layer, h);
    if (!e.keep.defined()) {
      if (e.new_bias || e.new_values) {
        throw std::invalid_argument(where + ": new_bias / new_values given without keep");
      }
      continue;
    }
    if (e.keep.dim() != 1 || e.keep.scalar_type() != torch::kInt64) {
      throw std::invalid_argument(fmt::format("{}: keep must be a 1-D int64 tensor, got {} {}", where,
                                              shape_of(e.keep), dtype_name(e.keep.scalar_type())));
    }
    const int64_t n = head(layer, h).length, m = e.keep.numel();
    const torch::Tensor host = e.keep.to(torch::kCPU).contiguous();
    const int64_t* p = host.data_ptr<int64_t>();
    for (int64_t i = 0; i < m; ++i) {
      if (p[i] < 0 || p[i] >= n) {
        throw std::invalid_argument(fmt::format("{}: keep[{}] = {} outside [0, {})", where, i, p[i], n));
      }
      if (i > 0 && p[i] <= p[i - 1]) {
        throw std::invalid_argument(fmt::format("{}: keep must increase strictly (sorted, no duplicates; a weight "
                                                "belongs in new_bias), got {} after {} at index {}", where, p[i],
                                                p[i - 1], i));
      }
    }
    if (e.new_bias) {
      const torch::Tensor& b = *e.new_bias;
      if (!b.defined() || b.dim() != 1 || b.numel() != m || !b.is_floating_point()) {
        throw std::invalid_argument(fmt::format("{}: new_bias must be a floating [{}] tensor, got {}", where, m,
                                                shape_of(b)));
      }
      if (m > 0 && !torch::isfinite(b).all().item<bool>()) {
        throw std::invalid_argument(fmt::format("{}: new_bias holds a NaN or infinite value (log-weights are finite; "
                                                "drop an entry instead of giving it weight 0)", where));
      }
    }
    if (e.new_values) {
      const torch::Tensor& nv = *e.new_values;
      if (!nv.defined() || nv.dim() != 2 || nv.size(0) != m || nv.size(1) != spec_.value_dim || !nv.is_floating_point()) {
        throw std::invalid_argument(fmt::format("{}: new_values must be a floating [{}, {}] tensor, got {}", where, m,
                                                spec_.value_dim, shape_of(nv)));
      }
      if (m > 0 && !torch::isfinite(nv).all().item<bool>()) {
        throw std::invalid_argument(where + ": new_values holds a NaN or infinite value");
      }
    }
    keeps[static_cast<size_t>(h)] = host;
  }
  torch::NoGradGuard no_grad;
  for (int64_t h = 0; h < spec_.kv_heads; ++h) {
    if (!keeps[static_cast<size_t>(h)].defined()) continue;
    const KvHeadEdit& e = edits[static_cast<size_t>(h)];
    Head& hd = head(layer, h);
    const int64_t m = keeps[static_cast<size_t>(h)].numel();
    if (m == 0) {
      hd = Head{};  // releases the storage
      continue;
    }
    // index_select allocates exactly m rows: the new storage, the old one freed when no view holds it.
    const torch::Tensor idx = keeps[static_cast<size_t>(h)].to(spec_.device);
    Head next;
    next.keys = hd.keys.narrow(0, 0, hd.length).index_select(0, idx);
    next.positions = hd.positions.narrow(0, 0, hd.length).index_select(0, idx);
    // copy = true: the cache never aliases a caller's tensor.
    const auto own = [&](const torch::Tensor& t, torch::ScalarType dtype) {
      return t.to(spec_.device, dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
    };
    next.values = e.new_values ? own(*e.new_values, spec_.dtype) : hd.values.narrow(0, 0, hd.length).index_select(0, idx);
    next.bias = e.new_bias ? own(*e.new_bias, torch::kFloat) : hd.bias.narrow(0, 0, hd.length).index_select(0, idx);
    next.length = m;
    hd = std::move(next);
  }
}

void KvCache::reserve(int64_t extra) {
  if (extra < 0) throw std::invalid_argument(fmt::format("KvCache::reserve: extra {} must be >= 0", extra));
  torch::NoGradGuard no_grad;
  for (Head& hd : heads_) grow(hd, hd.length + extra);
}

int64_t KvCache::length(int64_t layer, int64_t h) const {
  check_layer(layer, "length");
  if (h < 0 || h >= spec_.kv_heads) {
    throw std::invalid_argument(fmt::format("KvCache::length: head {} outside [0, {})", h, spec_.kv_heads));
  }
  return head(layer, h).length;
}

int64_t KvCache::next_position(int64_t layer) const {
  check_layer(layer, "next_position");
  return next_position_[static_cast<size_t>(layer)];
}

int64_t KvCache::next_position() const {
  return *std::max_element(next_position_.begin(), next_position_.end());
}

int64_t KvCache::entry_bytes() const {
  return (spec_.head_dim + spec_.value_dim) * static_cast<int64_t>(c10::elementSize(spec_.dtype)) +
         static_cast<int64_t>(sizeof(float) + sizeof(int64_t));
}

int64_t KvCache::bytes() const {
  int64_t n = 0;
  for (const Head& hd : heads_) n += hd.length;
  return n * entry_bytes();
}

int64_t KvCache::capacity_bytes() const {
  int64_t n = 0;
  for (const Head& hd : heads_) n += hd.capacity();
  return n * entry_bytes();
}

void KvCache::clear() {
  for (Head& hd : heads_) hd = Head{};
  std::fill(next_position_.begin(), next_position_.end(), 0);
}

// File format (docs/kv_cache.md): magic, byte-order mark, total size, spec, next positions, then per
// (layer, head) in layer-major order its length and keys, values, bias, positions as raw row-major bytes, and
// last the FNV-1a 64 checksum of everything before it.
void KvCache::save(const std::string& path) const {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kByteOrderMark);
  const size_t size_at = out.size();
  put<uint64_t>(out, 0);  // total file size, filled in below
  for (int64_t v : {spec_.layers, spec_.kv_heads, spec_.head_dim, spec_.value_dim, dtype_code(spec_.dtype)}) {
    put<int64_t>(out, v);
  }
  for (int64_t p : next_position_) put<int64_t>(out, p);
  for (const Head& hd : heads_) {
    put<int64_t>(out, hd.length);
    if (hd.length == 0) continue;
    for (const torch::Tensor* t : {&hd.keys, &hd.values, &hd.bias, &hd.positions}) put_tensor(out, t->narrow(0, 0, hd.length));
  }
  const uint64_t total = out.size() + sizeof(uint64_t);
  std::memcpy(out.data() + size_at, &total, sizeof(total));
  put<uint64_t>(out, fnv1a(out.data(), out.size()));
  write_file_atomically(path, out, "kv");
}

void KvCache::load(const std::string& path) {
  std::string data;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("KvCache::load '{}': cannot be opened", path));
    data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throw std::runtime_error(fmt::format("KvCache::load '{}': read error", path));
  }
  Reader r{data, path};
  if (data.size() < sizeof(kMagic) || std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    r.fail("not a dcp KV cache file (no DCPKVC01 header)");
  }
  r.offset = sizeof(kMagic);
  if (r.get<uint32_t>("byte-order mark") != kByteOrderMark) r.fail("written with the other byte order");
  const uint64_t total = r.get<uint64_t>("file size");
  if (data.size() < total) r.fail(fmt::format("truncated: {} of {} bytes", data.size(), total));
  if (data.size() > total) r.fail(fmt::format("{} bytes after the end of the cache ({} bytes)", data.size() - total, total));
  uint64_t stored_sum;
  std::memcpy(&stored_sum, data.data() + data.size() - sizeof(uint64_t), sizeof(uint64_t));
  if (stored_sum != fnv1a(data.data(), data.size() - sizeof(uint64_t))) r.fail("checksum mismatch: the file is corrupt");

  KvCacheSpec file = spec_;
  file.layers = r.get<int64_t>("layers");
  file.kv_heads = r.get<int64_t>("kv_heads");
  file.head_dim = r.get<int64_t>("head_dim");
  file.value_dim = r.get<int64_t>("value_dim");
  const int64_t code = r.get<int64_t>("dtype");
  const auto dtype = dtype_of_code(code);
  if (!dtype) r.fail(fmt::format("unknown dtype code {}", code));
  file.dtype = *dtype;
  if (file.layers != spec_.layers || file.kv_heads != spec_.kv_heads || file.head_dim != spec_.head_dim ||
      file.value_dim != spec_.value_dim || file.dtype != spec_.dtype) {
    r.fail(fmt::format("holds a cache of layers {}, kv_heads {}, head_dim {}, value_dim {}, {}; this cache has "
                       "layers {}, kv_heads {}, head_dim {}, value_dim {}, {}",
                       file.layers, file.kv_heads, file.head_dim, file.value_dim, dtype_name(file.dtype),
                       spec_.layers, spec_.kv_heads, spec_.head_dim, spec_.value_dim, dtype_name(spec_.dtype)));
  }
  std::vector<int64_t> next(static_cast<size_t>(spec_.layers));
  for (auto& p : next) p = r.get<int64_t>("next position");
  std::vector<Head> heads(heads_.size());
  for (size_t i = 0; i < heads.size(); ++i) {
    const int64_t layer = static_cast<int64_t>(i) / spec_.kv_heads, h = static_cast<int64_t>(i) % spec_.kv_heads;
    const int64_t n = r.get<int64_t>("head length");
    // The checksum passed, so these only fail for a file written by something else than save().
    if (n < 0 || n > static_cast<int64_t>(data.size() - r.offset) / entry_bytes()) {
      r.fail(fmt::format("layer {} head {}: length {} does not fit the file", layer, h, n));
    }
    if (n == 0) continue;
    Head& hd = heads[i];
    hd.keys = r.tensor({n, spec_.head_dim}, spec_.dtype, "keys").to(spec_.device);
    hd.values = r.tensor({n, spec_.value_dim}, spec_.dtype, "values").to(spec_.device);
    hd.bias = r.tensor({n}, torch::kFloat, "bias");
    hd.positions = r.tensor({n}, torch::kInt64, "positions");
    hd.length = n;
    const int64_t* p = hd.positions.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j) {
      if ((j > 0 && p[j] <= p[j - 1]) || p[j] < 0 || p[j] >= next[static_cast<size_t>(layer)]) {
        r.fail(fmt::format("layer {} head {}: position {} at entry {} is not increasing below the next position {}",
                           layer, h, p[j], j, next[static_cast<size_t>(layer)]));
      }
    }
    if (!torch::isfinite(hd.bias).all().item<bool>()) r.fail(fmt::format("layer {} head {}: a bias is not finite", layer, h));
    hd.bias = hd.bias.to(spec_.device);
    hd.positions = hd.positions.to(spec_.device);
  }
  if (r.offset + sizeof(uint64_t) != data.size()) {
    r.fail(fmt::format("{} unread bytes before the checksum", data.size() - sizeof(uint64_t) - r.offset));
  }
  heads_ = std::move(heads);
  next_position_ = std::move(next);
}

}  // namespace dcp
