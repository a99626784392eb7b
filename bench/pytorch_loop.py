#!/usr/bin/env python3
"""The default dcp model as a plain PyTorch training loop: the side-by-side anchor of bench/default_job.sh.

Same shape as configs/default.yaml (byte-level decoder, d_model 128, 4 layers, 4 heads, SwiGLU d_ff 384, RMSNorm,
rotary, no biases), the same corpus cut into 512-byte samples, 16384 tokens per optimizer step over the ranks in
micro-batches of 4096 tokens per rank, AdamW at lr 3e-3, Gloo DDP with one intra-op thread per rank. Attention is
per sample: a [B, H, L, L] masked softmax ("full") or query blocks of 128 rows that attend only the keys up to
their block ("blocked", which skips most of the masked upper triangle). --autocast runs forward under
torch.autocast('cpu', dtype=torch.bfloat16).

Run with Debian's python3-torch: /usr/bin/python3 bench/pytorch_loop.py --steps 20 [--autocast] [--attention blocked]
Prints one JSON line: tokens_per_s (steps after the first 2), loss at the last step and the settings.
"""
import argparse
import glob
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rotary(x, cos, sin):  # x [B, H, L, D]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(q, k, v, mode):  # [B, H, L, D], causal
    L, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    if mode == "full":
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s.float(), -1).to(v.dtype) @ v
    outs = []
    for a in range(0, L, 128):
        b = min(L, a + 128)
        s = (q[..., a:b, :] @ k[..., :b, :].transpose(-1, -2)) * scale
        mask = torch.ones(b - a, b, dtype=torch.bool).triu(a + 1)
        s = s.masked_fill(mask, float("-inf"))
        outs.append(torch.softmax(s.float(), -1).to(v.dtype) @ v[..., :b, :])
    return torch.cat(outs, -2)


class Block(nn.Module):
    def __init__(self, d, h, ff, mode):
        super().__init__()
        self.h, self.mode = h, mode
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w_gate = nn.Linear(d, ff, bias=False)
        self.w_up = nn.Linear(d, ff, bias=False)
        self.w_down = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):  # x [B, L, d]
        B, L, d = x.shape
        qkv = self.wqkv(self.attn_norm(x)).view(B, L, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        q, k, v = rotary(qkv[0], cos, sin), rotary(qkv[1], cos, sin), qkv[2]
        a = attention(q, k, v, self.mode).transpose(1, 2).reshape(B, L, d)
        x = x + self.wo(a)
        m = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(m)) * self.w_up(m))


class Model(nn.Module):
    def __init__(self, mode, d=128, layers=4, h=4, ff=384, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h, ff, mode) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head_dim = d // h

    def forward(self, tokens):  # [B, L]
        L, D = tokens.shape[1], self.head_dim
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.arange(L, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def samples(path, length):
    data = bytearray()
    for f in sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True)):
        with open(f, "rb") as fh:
            data += fh.read()
    t = torch.tensor(list(data[: len(data) // (length + 1) * (length + 1)]), dtype=torch.long)
    return t.view(-1, length + 1)


def run(rank, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    torch.set_num_threads(args.threads)
    torch.manual_seed(1234)
    model = nn.parallel.DistributedDataParallel(Model(args.attention))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = samples(args.data, args.seq_len)
    per_micro = args.micro_batch_tokens // args.seq_len
    micro_per_rank = args.global_batch_tokens // (args.micro_batch_tokens * args.nproc)
    g = torch.Generator().manual_seed(rank)
    times, loss = [], float("nan")
    for step in range(args.steps):
        start = time.time()
        opt.zero_grad(set_to_none=True)
        for m in range(micro_per_rank):
            idx = torch.randint(0, data.shape[0], (per_micro,), generator=g)
            batch = data[idx]
            ctx = model.no_sync() if m + 1 < micro_per_rank else torch.enable_grad()
            with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                logits = model(batch[:, :-1])
                loss_t = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
            (loss_t / micro_per_rank).backward()
            loss = loss_t.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.time() - start)
    if rank == 0:
        measured = times[2:]
        print(json.dumps({"tokens_per_s": args.global_batch_tokens * len(measured) / sum(measured),
                          "loss": loss, "steps": args.steps, "autocast": args.autocast,
                          "attention": args.attention, "nproc": args.nproc, "threads": args.threads,
                          "torch": torch.__version__}))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--attention", choices=["full", "blocked"], default="full")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() // 2))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--global-batch-tokens", type=int, default=16384)
    p.add_argument("--data", default="/usr/share/doc/python3.11/html/_sources")
    p.add_argument("--port", type=int, default=29571)
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first 2 are warm-up)")
    mp.spawn(run, args=(args,), nprocs=args.nproc)


if __name__ == "__main__":
    main()
