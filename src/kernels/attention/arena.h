// Per-thread scratch for the tile kernels' drivers (the tiled softmax, the fused linear attention): one byte tensor
// allocated through LibTorch's allocator before the parallel region (so that the memory meter sees it and no
// allocation can fail inside the region), cut into one bump allocator per thread.
#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dcp::tiles {

/// A bump allocator over one thread's share of the scratch; every block is 64-byte aligned.
class Arena {
 public:
  Arena(uint8_t* base, int64_t bytes) : base_(base), bytes_(bytes) {}
  template <class X>
  X* take(int64_t count) {
    const int64_t at = align(used_);
    used_ = at + count * static_cast<int64_t>(sizeof(X));
    if (used_ > bytes_) {
      throw std::logic_error("tile kernel workspace too small: " + std::to_string(used_) + " > " +
                             std::to_string(bytes_) + " bytes");
    }
    return reinterpret_cast<X*>(base_ + at);
  }
  int64_t used() const { return used_; }
  void reset() { used_ = 0; }
  static int64_t align(int64_t x) { return (x + 63) / 64 * 64; }

 private:
  uint8_t* base_;
  int64_t bytes_, used_ = 0;
};

/// Runs `body(thread, arena)` on every thread with its own arena of `per_thread` bytes (add 64 per block taken for
/// the alignment).
template <class Body>
void parallel_with_arenas(int64_t threads, int64_t per_thread, Body body) {
  const int64_t stride = Arena::align(per_thread) + 64;
  torch::Tensor storage = torch::empty({threads * stride + 64}, torch::kUInt8);
  uint8_t* base = reinterpret_cast<uint8_t*>(Arena::align(reinterpret_cast<intptr_t>(storage.data_ptr())));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Arena arena(base + t * stride, stride - 64);
      body(t, arena);
    }
  });
}

}  // namespace dcp::tiles
