// A user's own LibTorch model and training loop, trained with DCP through dcp/runtime.h.
// The model below is written the way a user would write it (learned positions, LayerNorm, GELU MLP, its own
// attention) and knows nothing of dcp except two calls: dcp::attention around its attention function and
// dcp::layer around each block. docs/integration.md shows the diff of the training loop against a plain one.
//
//   dcp launch --nproc 2 -- ./build/examples/byte_gpt --data /usr/share/doc/python3.11/html/_sources --steps 20
//   dcp launch --nproc 2 -- ./build/examples/byte_gpt --data docs --check   # DCP gradient == one-process gradient
#include <CLI/CLI.hpp>
#include <dcp/runtime.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace {

constexpr int64_t kBos = 256, kVocab = 257;

// ------------------------------------------------------------------------------------------ the user's model

// Mixed precision the user's way: the weights stay fp32 (the optimizer's master copy) and each matmul runs in
// the activations' dtype (bf16 when dcp.precision() says so), LayerNorm's statistics in fp32. In fp32 these
// are exactly Linear::forward and LayerNorm::forward.
torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
  return torch::linear(x, l->weight.to(x.scalar_type()), l->bias.to(x.scalar_type()));
}
torch::Tensor norm(torch::nn::LayerNorm& ln, const torch::Tensor& x) {
  return ln(x.to(torch::kFloat)).to(x.scalar_type());
}

// Causal softmax attention inside each sample of a packed stream. q, k, v: [T, H, D]; cu_seqlens: [n + 1].
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens) {
  auto cu = cu_seqlens.accessor<int64_t, 1>();
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i + 1 < cu.size(0); ++i) {
    const int64_t a = cu[i], b = cu[i + 1];
    auto qi = q.slice(0, a, b).transpose(0, 1), ki = k.slice(0, a, b).transpose(0, 1);
    auto vi = v.slice(0, a, b).transpose(0, 1);
    auto scores = torch::matmul(qi, ki.transpose(1, 2)) / std::sqrt(static_cast<double>(q.size(2)));
    auto mask = torch::ones({b - a, b - a}, torch::kBool).triu(1);
    auto probs = scores.masked_fill(mask, -INFINITY).softmax(-1, torch::kFloat).to(v.scalar_type());
    outs.push_back(torch::matmul(probs, vi).transpose(0, 1));
  }
  return torch::cat(outs, 0);
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        qkv(register_module("qkv", torch::nn::Linear(d, 3 * d))),
        proj(register_module("proj", torch::nn::Linear(d, d))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}

  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cu_seqlens) {
    const int64_t T = x.size(0), d = x.size(1);
    auto a = linear(qkv, norm(ln1, x)).view({T, 3, heads, d / heads}).unbind(1);
    auto o = dcp::attention(a[0], a[1], a[2], cu_seqlens, causal_attention);  // DCP line: SP all-to-all
    x = x + linear(proj, o.reshape({T, d}));
    return x + linear(fc2, torch::gelu(linear(fc1, norm(ln2, x))));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1, ln2;
  torch::nn::Linear qkv, proj, fc1, fc2;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(int64_t d, int64_t layers, int64_t heads, int64_t max_len)
      : embed(register_module("embed", torch::nn::Embedding(kVocab, d))),
        pos(register_module("pos", torch::nn::Embedding(max_len, d))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        head(register_module("head", torch::nn::Linear(d, kVocab))) {
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(d, heads)));
  }

  // Sum of next-token losses of the packed tokens (targets -100 are ignored), in fp32 whatever `dtype`.
  torch::Tensor loss_sum(const torch::Tensor& tokens, const torch::Tensor& positions, const torch::Tensor& targets,
                         const torch::Tensor& cu_seqlens) {
    auto x = (embed(tokens) + pos(positions)).to(dtype);
    for (size_t i = 0; i < blocks.size(); ++i) {
      std::shared_ptr<BlockImpl> block = blocks[i].ptr();
      x = dcp::layer(static_cast<int64_t>(i), [block, cu_seqlens](const torch::Tensor& h) {  // DCP line: recompute
        return block->forward(h, cu_seqlens);
      }, x);
    }
    return torch::nn::functional::cross_entropy(linear(head, norm(ln_f, x)).to(torch::kFloat), targets,
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  }

  torch::ScalarType dtype = torch::kFloat;  // of the matmuls and activations
  torch::nn::Embedding embed, pos;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
  std::vector<Block> blocks;
};
TORCH_MODULE(Gpt);

// ------------------------------------------------------------------------------------------- the user's data

// Every non-empty text file under `dir` (no NUL byte), cut into samples of at most max_len bytes.
std::vector<std::string> read_samples(const std::string& dir, int64_t max_len) {
  if (!std::filesystem::is_directory(dir)) throw std::runtime_error("--data '" + dir + "' is not a directory");
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> samples;
  int64_t skipped = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    if (text.empty() || text.find('\0') != std::string::npos) {
      ++skipped;
      continue;
    }
    for (size_t at = 0; at < text.size(); at += static_cast<size_t>(max_len)) {
      samples.push_back(text.substr(at, static_cast<size_t>(max_len)));
    }
  }
  if (samples.empty()) throw std::runtime_error("--data '" + dir + "' holds no non-empty text file");
  if (skipped > 0) std::cerr << "skipped " << skipped << " empty or binary file(s) under " << dir << "\n";
  return samples;
}

struct Packed {
  torch::Tensor tokens, positions, targets, cu_seqlens;
};

// This rank's pieces of the stream of `ids` (BOS then the bytes; target = the next byte); padding has target -100.
Packed pack(const std::vector<std::string>& samples, const std::vector<int64_t>& ids, const dcp::ShardRange& shard) {
  const int64_t n = shard.num_tokens();
  Packed p{torch::zeros({n}, torch::kInt64), torch::zeros({n}, torch::kInt64), torch::full({n}, -100, torch::kInt64),
           torch::tensor(shard.cu_seqlens, torch::kInt64)};
  int64_t local = 0;  // where the current piece starts among this rank's tokens
  for (const auto& [begin, end] : shard.pieces) {
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string& s = samples[static_cast<size_t>(ids[i])];
      for (int64_t t = std::max(shard.cu_seqlens[i], begin); t < std::min(shard.cu_seqlens[i + 1], end); ++t) {
        const int64_t at = t - shard.cu_seqlens[i], l = local + t - begin;
        p.tokens[l] = at == 0 ? kBos : static_cast<unsigned char>(s[static_cast<size_t>(at - 1)]);
        p.positions[l] = at;
        p.targets[l] = static_cast<unsigned char>(s[static_cast<size_t>(at)]);
      }
    }
    local += end - begin;
  }
  return p;
}

// ------------------------------------------------------------------------------------------ the training loop

// One step of DCP: this rank's micro-batches, each under its SP group and recompute setting, then the reduction.
dcp::StepStats dcp_step(dcp::Runtime& dcp, Gpt& model, const std::vector<std::string>& samples,
                        const std::vector<int64_t>& lengths, const dcp::StepPlan& step) {
  for (const auto& mb : dcp.micro_batches(step, lengths)) {
    dcp::MicroBatchScope scope(mb.context);
    Packed b = pack(samples, mb.sample_ids, mb.shard);
    dcp.backward(model->loss_sum(b.tokens, b.positions, b.targets, b.cu_seqlens), step);
  }
  return dcp.finish_step(step, model->parameters());
}

// --check: the gradient of a step under DCP (the planner's plan; the same samples as one SP group over all ranks
// with recompute; one data-parallel group per rank) against the plain one-process gradient of the same samples.
int check(dcp::Runtime& dcp, Gpt& model, const std::vector<std::string>& samples, const std::vector<int64_t>& lengths) {
  dcp::StepPlan planned = dcp.plan_epoch(lengths, 0).steps.at(0);
  dcp::StepPlan one_group = planned;
  dcp::GroupPlan g{0, dcp.world_size(), {}};
  g.micro_batches.push_back(dcp::MicroBatch{planned.sample_ids(), planned.global_num_tokens, 1});
  one_group.groups = {g};
  dcp::StepPlan data_parallel = planned;
  data_parallel.groups.clear();
  for (int64_t r = 0; r < dcp.world_size(); ++r) data_parallel.groups.push_back(dcp::GroupPlan{r, 1, {}});
  const auto ids = planned.sample_ids();
  for (size_t i = 0; i < ids.size(); ++i) {
    data_parallel.groups[i % data_parallel.groups.size()].micro_batches.push_back(
        dcp::MicroBatch{{ids[i]}, lengths[static_cast<size_t>(ids[i])], 0});
  }
  std::string planned_sizes;
  for (const auto& group : planned.groups) planned_sizes += " " + std::to_string(group.sp_size);
  const std::vector<std::pair<std::string, const dcp::StepPlan*>> cases = {
      {"planned step (sp sizes" + planned_sizes + ")", &planned},
      {"one SP group of all ranks, 1 layer recomputed", &one_group},
      {"one data-parallel group per rank", &data_parallel}};

  model->zero_grad();
  dcp::ShardRange whole = dcp::shard_range([&] {
    std::vector<int64_t> l;
    for (int64_t id : planned.sample_ids()) l.push_back(lengths[static_cast<size_t>(id)]);
    return l;
  }(), 0, dcp::SpLayout{});
  Packed all = pack(samples, planned.sample_ids(), whole);
  (model->loss_sum(all.tokens, all.positions, all.targets, all.cu_seqlens) / planned.global_num_tokens).backward();
  std::vector<torch::Tensor> reference;
  for (const auto& p : model->parameters()) reference.push_back(p.grad().clone());

  int failures = 0;
  for (const auto& [name, plan] : cases) {
    model->zero_grad();
    dcp_step(dcp, model, samples, lengths, *plan);
    double err = 0, scale = 0;
    auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      err = std::max(err, (params[i].grad() - reference[i]).abs().max().item<double>());
      scale = std::max(scale, reference[i].abs().max().item<double>());
    }
    const bool ok = err <= 1e-4 * scale;
    failures += ok ? 0 : 1;
    if (dcp.rank() == 0) {
      std::cout << name << ": max |g - g_ref| / max |g_ref| = " << err / scale << (ok ? "  ok" : "  FAIL") << "\n";
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"byte_gpt: a user-style GPT trained with DCP (dcp/runtime.h)"};
  std::string data = "/usr/share/doc/python3.11/html/_sources", planner = "dcp-opt", cost_model = "h200",
              precision = "auto";
  int64_t steps = 20, tokens_per_step = 16384, max_len = 512, layers = 2, d = 64, heads = 4;
  bool check_only = false;
  app.add_option("--data", data, "folder of text files");
  app.add_option("--steps", steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--tokens-per-step", tokens_per_step, "global batch, tokens")->check(CLI::PositiveNumber);
  app.add_option("--planner", planner, "a planner of dcp plan / dcp simulate");
  app.add_option("--cost-model", cost_model, "h200 or a dcp profile JSON file");
  app.add_option("--precision", precision, "auto, bf16 or fp32 (as dcp's train.precision)");
  app.add_flag("--check", check_only, "compare one step's DCP gradient with the one-process gradient (in fp32) "
                                      "and exit");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::manual_seed(0);  // identical weights on every rank
    Gpt model(d, layers, heads, max_len);
    const auto samples = read_samples(data, max_len);
    std::vector<int64_t> lengths;
    for (const auto& s : samples) lengths.push_back(static_cast<int64_t>(s.size()));

    dcp::RuntimeOptions options;
    options.shape = dcp::ModelShape{d, layers, heads, 4 * d, 2, kVocab};
    options.planner = planner;
    options.cost_model = cost_model;
    options.tokens_per_step = tokens_per_step;
    // The check is exact in fp32 only: bf16 rounds differently for the different shapes a plan gives matmuls.
    options.precision = check_only ? "fp32" : precision;
    dcp::Runtime dcp(options);
    model->dtype = dcp.precision().precision == dcp::Precision::kBf16 ? torch::kBFloat16 : torch::kFloat;
    if (dcp.rank() == 0) std::cout << "precision: " << dcp.precision().describe() << "\n";
    const auto local = std::max<int64_t>(1, dcp.groups().env().local_world_size);
    torch::set_num_threads(static_cast<int>(std::max<int64_t>(1, std::thread::hardware_concurrency() / local)));
    if (check_only) return check(dcp, model, samples, lengths);

    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    int64_t step_count = 0;
    for (int64_t epoch = 0; step_count < steps; ++epoch) {
      for (const auto& step : dcp.plan_epoch(lengths, epoch).steps) {
        if (step_count == steps) break;
        ++step_count;
        opt.zero_grad();
        dcp::StepStats s = dcp_step(dcp, model, samples, lengths, step);
        opt.step();
        if (dcp.rank() == 0) std::cout << "step " << step_count << " loss " << s.loss << "\n";
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "byte_gpt: " << e.what() << "\n";
    return 1;
  }
}
