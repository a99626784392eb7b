// Numbers in user text (config values, command-line options): decimal only, so that "0x10", "inf" and "nan"
// are refused instead of read as 16, infinity or NaN.
#pragma once

#include <optional>
#include <string>

namespace dcp {

/// `text` as a double when the whole text is a decimal number: an optional sign, digits with an optional
/// fraction (at least one digit), an optional exponent (e or E, optional sign, digits), nothing else (no
/// spaces, no hex, no inf or nan). nullopt otherwise. A magnitude beyond double's range reads as +-infinity
/// (std::strtod), so callers that need a finite number check std::isfinite.
std::optional<double> parse_decimal(const std::string& text);

}  // namespace dcp
