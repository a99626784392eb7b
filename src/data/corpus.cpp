#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fnmatch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>

#include "dcp/data.h"
#include "util/hash.h"

namespace dcp {
namespace {

namespace fs = std::filesystem;

const char kDefaultCorpusPrefix[] = "/usr/share/doc/python3.11";

struct Candidate {
  std::string path;
  bool regular = false;  // false: matched the glob (or is a folder) but cannot be read as a file
};

// Depth-first walk over `root`, each folder's entries in sorted order so that when two symlinked names lead
// to the same folder, the same name wins on every run. Directory symlinks are followed, but a folder is
// entered once (by canonical path), which also ends symlink loops. Matching entries that are not regular
// files (dangling symlinks, FIFOs, sockets) are never opened: opening a FIFO would block.
std::vector<Candidate> list_text_files(const fs::path& root, const std::string& glob) {
  std::vector<Candidate> out;
  std::set<fs::path> visited;
  std::vector<fs::path> pending{root};
  while (!pending.empty()) {
    const fs::path dir = pending.back();
    pending.pop_back();
    std::error_code ec;
    const fs::path real = fs::canonical(dir, ec);
    if (ec) {
      out.push_back({dir.string(), false});
      continue;
    }
    if (!visited.insert(real).second) continue;

    std::vector<fs::directory_entry> entries;
    fs::directory_iterator it(dir, ec);
    for (const fs::directory_iterator end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
    if (ec) {  // a folder that cannot be listed may hold documents: report it rather than drop it silently
      out.push_back({dir.string(), false});
      continue;
    }
    std::sort(entries.begin(), entries.end(),
              [](const fs::directory_entry& a, const fs::directory_entry& b) { return a.path() < b.path(); });

    std::vector<fs::path> subdirs;
    for (const auto& e : entries) {
      std::error_code sec;
      const fs::file_status st = e.status(sec);  // follows symlinks; a dangling one reads as not_found
      if (fs::is_directory(st)) {
        subdirs.push_back(e.path());
      } else if (fnmatch(glob.c_str(), e.path().filename().c_str(), 0) == 0) {
        out.push_back({e.path().string(), fs::is_regular_file(st)});
      }
    }
    // Reversed onto the stack so the smallest name is visited first.
    pending.insert(pending.end(), subdirs.rbegin(), subdirs.rend());
  }
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.path < b.path; });
  return out;
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  out.clear();
  char buf[1 << 16];
  while (f.read(buf, sizeof buf) || f.gcount() > 0) out.append(buf, static_cast<size_t>(f.gcount()));
  return !f.bad();
}

bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Length of the well-formed UTF-8 sequence starting at s[i] (Unicode Table 3-7: no overlongs, no
// surrogates, nothing above U+10FFFF), or 0 when it is ill-formed.
size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

std::string describe_skips(const SkipReport& skipped) {
  if (skipped.by_reason.empty()) return "nothing skipped";
  std::string s = fmt::format("skipped {}:", skipped.total());
  for (const auto& [reason, count] : skipped.by_reason) {
    s += fmt::format(" {}={}", reason, count);
    const auto ex = skipped.examples.find(reason);
    if (ex != skipped.examples.end() && !ex->second.empty()) {
      s += fmt::format(" (e.g. {})", fmt::join(ex->second, ", "));
    }
  }
  return s;
}

void check_max_seq_len(int64_t max_seq_len) {
  if (max_seq_len < 1) throw std::runtime_error(fmt::format("data.max_seq_len must be >= 1, got {}", max_seq_len));
}

}  // namespace

int64_t SkipReport::total() const {
  int64_t n = 0;
  for (const auto& [reason, count] : by_reason) n += count;
  return n;
}

void SkipReport::add(const std::string& reason, const std::string& source) {
  ++by_reason[reason];
  auto& ex = examples[reason];
  if (ex.size() < 3) ex.push_back(source);
}

std::string classify_document(std::string_view text) {
  if (text.empty()) return "empty";
  if (std::memchr(text.data(), '\0', text.size()) != nullptr) return "binary";
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence_length(text, i);
    if (n == 0) return "binary";
    i += n;
  }
  return "";
}

uint64_t fnv1a64(std::string_view s) { return Fnv1a64().update(s).value(); }

void Corpus::add_document(const std::string& source, std::string_view split_key, std::string_view text,
                          int64_t max_seq_len, double heldout_fraction) {
  const std::string reason = classify_document(text);
  if (!reason.empty()) {
    skipped_.add(reason, source);
    return;
  }
  ++num_documents_;
  const bool heldout = static_cast<double>(fnv1a64(split_key) % 1000000) < heldout_fraction * 1e6;
  auto& split = heldout ? heldout_ids_ : train_ids_;
  const auto base = static_cast<int64_t>(text_.size());
  const auto n = static_cast<int64_t>(text.size());
  text_.append(text);
  for (int64_t start = 0, chunk = 0; start < n; start += max_seq_len, ++chunk) {
    const auto id = static_cast<int64_t>(samples_.size());
    offsets_.push_back(base + start);
    samples_.push_back(Sample{id, std::min(max_seq_len, n - start), fmt::format("{}#{}", source, chunk)});
    split.push_back(id);
  }
}

Corpus Corpus::from_documents(const std::vector<std::pair<std::string, std::string>>& docs, const DataConfig& cfg) {
  check_max_seq_len(cfg.max_seq_len);
  Corpus c;
  for (const auto& [name, text] : docs) c.add_document(name, name, text, cfg.max_seq_len, cfg.heldout_fraction);
  return c;
}

Corpus Corpus::load(const DataConfig& cfg) {
  check_max_seq_len(cfg.max_seq_len);
  const fs::path path(cfg.path);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    std::string msg = fmt::format("data.path '{}' does not exist", cfg.path);
    if (ec && ec != std::errc::no_such_file_or_directory) msg += fmt::format(" ({})", ec.message());
    if (cfg.path.rfind(kDefaultCorpusPrefix, 0) == 0) {
      msg += "; this corpus is provided by the Debian package `python3.11-doc` (apt-get install python3.11-doc)";
    }
    throw std::runtime_error(msg);
  }

  const bool is_dir = fs::is_directory(st);
  const bool is_file = fs::is_regular_file(st);
  std::string format = cfg.format;
  if (format == "auto") {
    if (is_dir) {
      format = "text_dir";
    } else if (is_file && (ends_with(cfg.path, ".jsonl") || ends_with(cfg.path, ".json"))) {
      format = "jsonl";
    } else {
      throw std::runtime_error(fmt::format(
          "data.path '{}' is neither a folder (format text_dir) nor a .jsonl/.json file (format jsonl); "
          "for a JSONL file with another name set data.format=jsonl",
          cfg.path));
    }
  } else if (format == "text_dir") {
    if (!is_dir) {
      throw std::runtime_error(
          fmt::format("data.format 'text_dir' needs a folder, but data.path '{}' is not one", cfg.path));
    }
  } else if (format == "jsonl") {
    if (!is_file) {
      throw std::runtime_error(
          fmt::format("data.format 'jsonl' needs a regular file, but data.path '{}' is not one", cfg.path));
    }
  } else {
    throw std::runtime_error(
        fmt::format("data.format '{}' is not one of auto, text_dir, jsonl (data.path '{}')", format, cfg.path));
  }

  Corpus c;
  std::string text;
  if (format == "text_dir") {
    for (const auto& f : list_text_files(path, cfg.glob)) {
      if (!f.regular || !read_file(f.path, text)) {
        c.skipped_.add("unreadable", f.path);
        continue;
      }
      c.add_document(f.path, fs::path(f.path).lexically_relative(path).string(), text, cfg.max_seq_len, cfg.heldout_fraction);
    }
  } else if (!read_file(cfg.path, text)) {
    c.skipped_.add("unreadable", cfg.path);
  } else {
    const std::string_view all(text);
    int64_t line_no = 0;
    for (size_t pos = 0; pos < all.size();) {
      const size_t eol = std::min(all.find('\n', pos), all.size());
      const std::string_view line = all.substr(pos, eol - pos);
      pos = eol + 1;
      ++line_no;
      if (is_blank(line)) continue;
      const std::string source = fmt::format("{}:{}", cfg.path, line_no);
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) {
        c.skipped_.add("jsonl_bad_line", source);
        continue;
      }
      const auto field = j.find("text");  // end() for non-objects too
      if (field == j.end() || !field->is_string()) {
        c.skipped_.add("jsonl_no_text", source);
        continue;
      }
      c.add_document(source, std::to_string(line_no), field->get_ref<const std::string&>(), cfg.max_seq_len, cfg.heldout_fraction);
    }
  }

  if (c.train_ids_.empty()) {
    throw std::runtime_error(fmt::format(
        "data.path '{}' (format {}{}) gave no training sample: {} documents kept, {} held-out samples "
        "(data.heldout_fraction={}); {}",
        cfg.path, format, format == "text_dir" ? fmt::format(", glob '{}'", cfg.glob) : "", c.num_documents_, c.heldout_ids_.size(), cfg.heldout_fraction, describe_skips(c.skipped_)));
  }
  return c;
}

std::string_view Corpus::bytes(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(samples_.size())) {
    throw std::out_of_range(fmt::format("sample id {} is not in [0, {})", id, samples_.size()));
  }
  const auto i = static_cast<size_t>(id);
  return std::string_view(text_).substr(static_cast<size_t>(offsets_[i]), static_cast<size_t>(samples_[i].length));
}

void Corpus::tokens(int64_t id, int64_t* inputs, int64_t* targets) const {
  const std::string_view b = bytes(id);
  inputs[0] = kBosToken;
  for (size_t i = 0; i < b.size(); ++i) {
    const auto t = static_cast<int64_t>(static_cast<unsigned char>(b[i]));
    targets[i] = t;
    if (i + 1 < b.size()) inputs[i + 1] = t;
  }
}

}  // namespace dcp
