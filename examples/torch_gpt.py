"""A tiny GPT trained twice from the same weights on the same batches: once with
``ejkernel_torch.nn.MultiHeadAttention`` (flash-attention kernels, GQA, causal) and once with the
same layer running plain PyTorch attention. Prints both loss curves and fails if they differ.

    python examples/torch_gpt.py [--steps 50] [--device cpu]

On CPU the kernels run in the Triton interpreter (well under a minute for 50 steps).
"""
from __future__ import annotations

import argparse
import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

from ejkernel_torch import flash_attention
from ejkernel_torch.nn import MultiHeadAttention
from examples.loss_curves import TOLERANCE, judge

# Small on purpose: on CPU every kernel program runs in the (slow) Triton interpreter.
VOCAB, SEQ, BATCH, EMBED, HEADS, KV_HEADS, LAYERS = 32, 32, 4, 32, 2, 1, 2


def plain_attention(q, k, v, *, causal, dropout_p, **_):
    """[b, s, h, d] attention with torch's SDPA, k/v repeated for GQA (dropout off)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, attention_fn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attn = MultiHeadAttention(EMBED, HEADS, KV_HEADS, causal=True, attention_fn=attention_fn)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, attention_fn):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, EMBED), nn.Embedding(SEQ, EMBED)
        self.blocks = nn.Sequential(*(Block(attention_fn) for _ in range(LAYERS)))
        self.ln, self.head = nn.LayerNorm(EMBED), nn.Linear(EMBED, VOCAB)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln(self.blocks(x)))


def corpus(n_tokens: int, seed: int = 0) -> torch.Tensor:
    """Text from a random sparse Markov chain: learnable, so the loss falls within 50 steps."""
    gen = torch.Generator().manual_seed(seed)
    cdf = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3, 1).cumsum(1).tolist()
    draws = torch.rand(n_tokens, generator=gen).tolist()
    tokens = [0]
    for u in draws[1:]:
        tokens.append(min(bisect.bisect(cdf[tokens[-1]], u), VOCAB - 1))
    return torch.tensor(tokens)


def batches(data: torch.Tensor, steps: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
        window = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(model: GPT, data: torch.Tensor, steps: int, device) -> list[float]:
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches(data, steps):
        loss = nn.functional.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = GPT(attention_fn=plain_attention)
    ours = GPT(attention_fn=flash_attention)
    ours.load_state_dict(plain.state_dict())  # same start
    data = corpus(20_000)
    curves = {name: train(model, data, args.steps, args.device) for name, model in (("ejkernel", ours),
                                                                                     ("plain", plain))}
    print(f"{'step':>4}  {'ejkernel':>9}  {'plain':>9}")
    for i, (a, b) in enumerate(zip(*curves.values())):
        print(f"{i:4d}  {a:9.5f}  {b:9.5f}")
    diff, ok = judge(curves, args.steps)
    print(f"max |loss difference| = {diff:.2e} (tolerance {TOLERANCE:g})")
    if not ok:
        sys.exit("loss curves disagree or the model did not learn")


if __name__ == "__main__":
    main()
