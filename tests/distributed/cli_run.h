// What the end-to-end tests of the dcp binary share: a scratch folder with a small JSONL corpus, the arguments
// of a tiny training run, the launcher's command line and readers of metrics.jsonl.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dcp::test::cli {

namespace fs = std::filesystem;

// A JSONL corpus of a few hundred short documents in a fresh folder.
inline fs::path make_workdir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("dcp_cli_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream out(dir / "corpus.jsonl");
  for (int i = 0; i < 300; ++i) {
    std::string text = "Document " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog. ";
    for (int j = 0; j < i % 7; ++j) text += "Lorem ipsum dolor sit amet " + std::to_string(j) + ". ";
    out << nlohmann::json({{"text", text}}).dump() << "\n";
  }
  return dir;
}

inline std::vector<std::string> train_args(const fs::path& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"train",
                                "--data.path=" + (dir / "corpus.jsonl").string(),
                                "--run.dir=" + (dir / "run").string(),
                                "--model.d_model=32",
                                "--model.n_layers=2",
                                "--model.n_heads=2",
                                "--model.d_ff=64",
                                "--data.max_seq_len=128",
                                "--train.micro_batch_tokens=512",
                                "--train.global_batch_tokens=1024",
                                "--train.threads=1",
                                "--eval.max_tokens=2048",
                                "--dist.timeout_s=8",
                                // The planner-independent baseline and a model that needs no profiling; the
                                // tests of planners and of train.cost_model auto set their own.
                                "--train.planner=static",
                                "--train.cost_model=h200"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

inline std::vector<std::string> launch(int nproc, const std::vector<std::string>& cmd) {
  std::vector<std::string> a = {DCP_BINARY, "launch", "--nproc", std::to_string(nproc), "--grace", "3", "--"};
  a.insert(a.end(), cmd.begin(), cmd.end());
  return a;
}

inline std::vector<double> losses(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss"));
  return out;
}

inline int count_lines(const fs::path& p) {
  std::ifstream in(p);
  int n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

}  // namespace dcp::test::cli
