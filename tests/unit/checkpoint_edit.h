// Test helpers that edit a checkpoint as a user or a failing disk would: whole-file reads and writes, and a
// careful hand-edit that also fixes the file's entry in manifest.json, so that only content checks can catch it.
#pragma once

#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
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

}  // namespace dcp::test
