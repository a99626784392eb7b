#!/usr/bin/env python3
"""Golden values for tests/unit/test_attention_kernels.cpp (MatchesGoldenValuesFromPyTorch).

Plain PyTorch (Debian's python3-torch 1.13), fp64: per sample of a packed stream, causal softmax attention with
scores q.k / sqrt(head_dim), its logsumexp, and the gradients of sum(out * g) by autograd. Writes
attention_golden.json next to this script; run with /usr/bin/python3 tests/golden/attention_golden.py.
"""
import json
import math
import pathlib

import torch

torch.manual_seed(20261201)
lengths = [5, 12, 1, 22]
heads, head_dim = 2, 8
cu = [0]
for n in lengths:
    cu.append(cu[-1] + n)
T = cu[-1]
q = (torch.randn(T, heads, head_dim, dtype=torch.float64) * 1.5).requires_grad_()
k = (torch.randn(T, heads, head_dim, dtype=torch.float64) * 1.5).requires_grad_()
v = torch.randn(T, heads, head_dim, dtype=torch.float64).requires_grad_()
g = torch.randn(T, heads, head_dim, dtype=torch.float64)

outs, lses = [], []
for s in range(len(lengths)):
    a, b = cu[s], cu[s + 1]
    qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    scores = qs @ ks.transpose(-1, -2) / math.sqrt(head_dim)
    future = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
    outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
out, lse = torch.cat(outs), torch.cat(lses)
(out * g).sum().backward()


def pack(t):
    return {"shape": list(t.shape), "values": t.detach().reshape(-1).tolist()}


result = {"cu_seqlens": cu, "q": pack(q), "k": pack(k), "v": pack(v), "g": pack(g), "out": pack(out),
          "lse": pack(lse), "dq": pack(q.grad), "dk": pack(k.grad), "dv": pack(v.grad),
          "torch_version": torch.__version__}
path = pathlib.Path(__file__).with_name("attention_golden.json")
path.write_text(json.dumps(result))
print(f"wrote {path} (torch {torch.__version__})")
