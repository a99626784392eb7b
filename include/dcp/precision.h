// Training precision: `train.precision` resolved, on this CPU, to the dtype the model computes in.
// docs/config.md "Precision" lists what runs in which dtype.
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

/// The dtype of the model's matmuls and of the activations between them. Parameters, gradients, the gradient
/// all-reduce and AdamW's moments are fp32 in both (fp32 master weights, the Megatron / torchtitan recipe).
enum class Precision {
  kFp32,  ///< everything fp32
  kBf16,  ///< bf16 matmuls and activations; norms' statistics, rotary angles, softmax statistics, loss in fp32
};

/// "fp32" or "bf16" (the values of train.precision, summary.json and profile files).
const char* precision_name(Precision precision);

/// Bytes of one activation element: 4 (fp32) or 2 (bf16), the cost model's ModelShape::bytes_per_element.
int64_t activation_bytes(Precision precision);

/// The precision whose activations take `bytes_per_element` bytes ("bf16" for 2, "fp32" for 4), or
/// "<n>-byte elements" for any other width: how profiles and cost models name the precision of a ModelShape.
std::string precision_of_bytes(int64_t bytes_per_element);

/// A resolved train.precision and why it was chosen.
struct PrecisionChoice {
  Precision precision = Precision::kFp32;
  /// e.g. "auto: this CPU has avx512_bf16 amx_bf16", or "train.precision=fp32" when set explicitly.
  std::string reason;
  /// "bf16 (auto: this CPU has avx512_bf16 amx_bf16)": the run log's line.
  std::string describe() const;
};

/// Resolves a train.precision value: "fp32" and "bf16" as given, "auto" to bf16 exactly when bf16_is_fast()
/// (dcp/cpu_features.h: AVX512-BF16 or usable AMX-BF16), else fp32. Throws ConfigError naming the key, the
/// value and the allowed values for anything else.
PrecisionChoice resolve_precision(const std::string& setting);

}  // namespace dcp
