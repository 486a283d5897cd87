"""A tiny mixture-of-experts MLP (top-2 routing) trained three times from the same weights on the
same batches: with ``ejkernel_torch.grouped_matmul`` for the experts, the same layer under
``torch.compile(fullgraph=True)``, and with a plain loop of per-expert matmuls. Prints the loss
curves and fails if they differ.

    python examples/torch_moe.py [--steps 30] [--device cpu]

On CPU the kernels run in the Triton interpreter (about half a minute for 30 steps, the compile included).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn
from torch.nn import functional as F

from ejkernel_torch import grouped_matmul

# Small on purpose: on CPU every kernel program runs in the (slow) Triton interpreter.
TOKENS, DIM, HIDDEN, EXPERTS, TOP_K = 32, 16, 32, 4, 2
# max |loss difference| over the run (float32). The curves differ by 3e-8 to 6e-8 over 30 steps;
# at 1e-4 an expert output scaled by 1 + 5e-5 passed (its curve 5e-5 off).
TOLERANCE = 1e-5


def grouped_experts(x, group_sizes, w_up, w_down):
    """Rows of ``x`` sorted by expert, ``group_sizes[e]`` of them for expert ``e``: two grouped matmuls.
    The sizes come from ``bincount``, so they are valid: skip reading them back to check."""
    h = F.gelu(grouped_matmul(x, w_up, group_sizes, check_values=False))
    return grouped_matmul(h, w_down, group_sizes, check_values=False)


def looped_experts(x, group_sizes, w_up, w_down):
    """The reference: one pair of matmuls per expert over its slice of rows."""
    chunks = x.split(group_sizes.tolist())
    return torch.cat([F.gelu(rows @ w_up[e]) @ w_down[e] for e, rows in enumerate(chunks)])


class MoE(nn.Module):
    """``y = sum_k weight_k * expert_k(x)`` over each token's top-k experts."""

    def __init__(self, experts_fn=grouped_experts):
        super().__init__()
        self.experts_fn = experts_fn
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_up = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM ** 0.5)
        self.w_down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN ** 0.5)

    def forward(self, x):  # [tokens, dim]
        probs = self.router(x).softmax(-1)
        weights, experts = probs.topk(TOP_K, dim=-1)  # [tokens, k] each
        weights = weights / weights.sum(-1, keepdim=True)
        experts = experts.flatten()  # token t's choices at rows t * k ... t * k + k - 1
        order = experts.argsort(stable=True)  # rows grouped by expert
        group_sizes = torch.bincount(experts, minlength=EXPERTS).to(torch.int32)
        y = self.experts_fn(x[order // TOP_K], group_sizes, self.w_up, self.w_down)
        y = torch.empty_like(y).index_copy_(0, order, y)  # back to token order
        return (y.view(-1, TOP_K, DIM) * weights.unsqueeze(-1)).sum(1)


def batches(steps: int, seed: int = 1):
    """Regression onto a fixed random smooth map of the input."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(DIM, DIM, generator=gen) / DIM ** 0.5
    for _ in range(steps):
        x = torch.randn(TOKENS, DIM, generator=gen)
        yield x, torch.sin(x @ teacher)


def train(model: nn.Module, steps: int, device) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(steps):
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def max_difference(a: list[float], b: list[float]) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()  # NaN if either has one


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = MoE(looped_experts).to(args.device)
    ours, compiled = MoE().to(args.device), MoE().to(args.device)
    ours.load_state_dict(plain.state_dict())  # same start
    compiled.load_state_dict(plain.state_dict())
    curves = {
        "ejkernel": train(ours, args.steps, args.device),
        # Forward and backward run compiled; the optimizer step and loss.backward() stay eager
        # (dynamo refuses both inside a fullgraph region).
        "compiled": train(torch.compile(compiled, fullgraph=True), args.steps, args.device),
        "plain": train(plain, args.steps, args.device),
    }
    print(f"{'step':>4}" + "".join(f"  {name:>9}" for name in curves))
    for i, losses in enumerate(zip(*curves.values())):
        print(f"{i:4d}" + "".join(f"  {loss:9.6f}" for loss in losses))
    vs_plain = max_difference(curves["ejkernel"], curves["plain"])
    vs_eager = max_difference(curves["compiled"], curves["ejkernel"])
    print(f"max |loss difference|: ejkernel vs plain {vs_plain:.2e}, compiled vs eager {vs_eager:.2e} "
          f"(tolerance {TOLERANCE:g})")
    learned = args.steps < 20 or curves["ejkernel"][-1] < 0.5 * curves["ejkernel"][0]
    if not (vs_plain <= TOLERANCE and vs_eager <= TOLERANCE and learned):
        sys.exit("loss curves disagree or the model did not learn")


if __name__ == "__main__":
    main()
