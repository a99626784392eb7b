#include "dcp/data.h"

namespace dcp {
namespace {

// SplitMix64 finalizer (Steele, Lea, Flood 2014): a bijection with full avalanche, so inputs that differ
// in any bit give outputs that look unrelated.
uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t sample_seed(uint64_t seed, uint64_t epoch, uint64_t sample_id) {
  // Chained rather than summed: with any two arguments fixed the map from the third is a bijection, and
  // swapping arguments (seed 1, epoch 2 vs seed 2, epoch 1) does not collide.
  return splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ sample_id);
}

}  // namespace dcp
