#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "unit/error_of.h"
#include "util/file_write.h"

using namespace dcp;
namespace fs = std::filesystem;
using dcp::test::error_of;

namespace {
std::string read_all(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

TEST(FileWrite, WritesAndAppendsWholeLines) {
  const fs::path dir = fs::temp_directory_path() / "dcp_file_write_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  write_file_checked(dir / "a.txt", "hello\n");
  EXPECT_EQ(read_all(dir / "a.txt"), "hello\n");
  append_line_checked(dir / "m.jsonl", "{\"step\":1}");
  append_line_checked(dir / "m.jsonl", "{\"step\":2}");
  EXPECT_EQ(read_all(dir / "m.jsonl"), "{\"step\":1}\n{\"step\":2}\n");
  fs::remove_all(dir);
}

TEST(FileWrite, FullDiskAndMissingFolderAreNamedErrors) {
  // /dev/full answers every write with ENOSPC: what a full disk does.
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  EXPECT_NE(error_of([] { write_file_checked("/dev/full", "data"); }).find("cannot write '/dev/full': No space left"),
            std::string::npos);
  EXPECT_NE(error_of([] { append_line_checked("/dev/full", "line"); }).find("No space left on device"),
            std::string::npos);
  EXPECT_TRUE(fs::exists("/dev/full"));  // a device is never removed
  EXPECT_NE(error_of([] { write_file_checked("/nonexistent_dcp_dir/x", "data"); })
                .find("cannot write '/nonexistent_dcp_dir/x': No such file or directory"),
            std::string::npos);
}

TEST(FileWrite, FolderWriteProblemCreatesTheFolderAndNamesAnUnusableOne) {
  const fs::path dir = fs::temp_directory_path() / "dcp_folder_probe_test";
  fs::remove_all(dir);
  EXPECT_EQ(folder_write_problem(dir / "a" / "b"), "");
  EXPECT_TRUE(fs::is_directory(dir / "a" / "b"));
  EXPECT_TRUE(fs::is_empty(dir / "a" / "b"));  // the probe file is gone
  write_file_checked(dir / "file", "x");
  EXPECT_EQ(folder_write_problem(dir / "file"), "'" + (dir / "file").string() + "' is not a folder");
  EXPECT_NE(folder_write_problem(dir / "file" / "sub").find("cannot create the folder"), std::string::npos);
  // /proc exists and is a folder, but no file can be created in it, not even by root (permissions would not do).
  EXPECT_NE(folder_write_problem("/proc").find("cannot create a file in the folder '/proc'"), std::string::npos);
  fs::remove_all(dir);
}
