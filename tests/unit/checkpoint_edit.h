// Test helpers that edit a checkpoint as a user or a failing disk would: whole-file reads and writes, and a
// careful hand-edit that also fixes the file's entry in manifest.json, so that only content checks can catch it.
#pragma once

#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

namespace dcp::test {

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

/// Replaces checkpoint file `name` in folder `ckpt` with `bytes` and records their size and CRC32 in its
/// manifest.json.
inline void replace_with_manifest(const std::filesystem::path& ckpt, const std::string& name, const std::string& bytes) {
  write_file(ckpt / name, bytes);
  nlohmann::json m = nlohmann::json::parse(read_file(ckpt / "manifest.json"));
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08x",
                static_cast<unsigned>(crc32_z(crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(bytes.data()),
                                              bytes.size())));
  m["files"][name] = {{"bytes", bytes.size()}, {"crc32", hex}};
  write_file(ckpt / "manifest.json", m.dump());
}

/// `zip` (a torch::save archive) with one byte flipped in the middle of the data of its first entry whose name
/// contains `entry` (e.g. "/data/"): the entry's own CRC32 no longer matches. The sizes come from the central
/// directory: torch::save's local headers carry zeros (general-purpose flag bit 3, a data descriptor follows).
/// Throws when there is no such entry.
inline std::string flip_byte_in_zip_entry(std::string zip, const std::string& entry) {
  auto u16 = [&](size_t at) { return static_cast<size_t>(static_cast<unsigned char>(zip[at])) |
                                     static_cast<size_t>(static_cast<unsigned char>(zip[at + 1])) << 8; };
  auto u32 = [&](size_t at) { return u16(at) | u16(at + 2) << 16; };
  const std::string central("PK\x01\x02", 4);
  for (size_t at = zip.find(central); at != std::string::npos && at + 46 <= zip.size(); at = zip.find(central, at + 4)) {
    const size_t size = u32(at + 20), name_len = u16(at + 28), local = u32(at + 42);
    const std::string name = zip.substr(at + 46, name_len);
    if (name.find(entry) == std::string::npos || size < 4 || local + 30 > zip.size()) continue;
    const size_t data = local + 30 + u16(local + 26) + u16(local + 28);
    if (data + size > zip.size()) continue;
    zip[data + size / 2] = static_cast<char>(zip[data + size / 2] ^ 0x5A);
    return zip;
  }
  throw std::runtime_error("no zip entry named like '" + entry + "'");
}

}  // namespace dcp::test
