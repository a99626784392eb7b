#include "dcp/precision.h"

#include <fmt/format.h>

#include "dcp/config.h"
#include "dcp/cpu_features.h"

namespace dcp {

const char* precision_name(Precision precision) { return precision == Precision::kBf16 ? "bf16" : "fp32"; }

int64_t activation_bytes(Precision precision) { return precision == Precision::kBf16 ? 2 : 4; }

std::string precision_of_bytes(int64_t bytes_per_element) {
  for (Precision p : {Precision::kFp32, Precision::kBf16}) {
    if (activation_bytes(p) == bytes_per_element) return precision_name(p);
  }
  return fmt::format("{}-byte elements", bytes_per_element);
}

std::string PrecisionChoice::describe() const { return fmt::format("{} ({})", precision_name(precision), reason); }

PrecisionChoice resolve_precision(const std::string& setting) {
  if (setting == "fp32") return {Precision::kFp32, "train.precision=fp32"};
  if (setting == "bf16") return {Precision::kBf16, "train.precision=bf16"};
  if (setting != "auto") {
    throw ConfigError(
        fmt::format("config key 'train.precision': bad value '{}' (allowed: one of auto, bf16, fp32)", setting));
  }
  if (!bf16_is_fast()) {
    return {Precision::kFp32, fmt::format("auto: this CPU has neither avx512_bf16 nor usable amx_bf16 (it has {})",
                                          cpu_features().summary())};
  }
  // Name only the extensions that made the choice: bf16_is_fast() is avx512_bf16 or AMX with the tile permission.
  std::string has = cpu_features().avx512_bf16 ? "avx512_bf16" : "";
  if (amx_usable()) has += has.empty() ? "amx_bf16" : " amx_bf16";
  return {Precision::kBf16, fmt::format("auto: this CPU has {}", has)};
}

}  // namespace dcp
