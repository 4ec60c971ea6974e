"""Synthetic training data: a fixed function of (seed, step), identical on every rank.

Each sequence repeats a random motif of 4 to 16 tokens (from a random offset), so a model can
lower its loss by copying from context and a few steps show training working; the batch does not
depend on the plan, so every plan sees the same tokens as the single-process reference.
"""
from __future__ import annotations

import torch


def global_batch(*, seed: int, step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Token ids [batch, seq + 1] (inputs are [:, :-1], targets [:, 1:]), on the CPU."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    periods = torch.randint(4, 17, (batch,), generator=g)
    motifs = torch.randint(0, vocab, (batch, 16), generator=g)
    offsets = torch.randint(0, 16, (batch,), generator=g)
    pos = torch.arange(seq + 1)[None, :] + offsets[:, None]
    return torch.gather(motifs, 1, pos % periods[:, None])


def local_batch(tokens: torch.Tensor, *, dp: int, dp_rank: int, positions: torch.Tensor):
    """This data-parallel rank's rows and this CP rank's positions: (inputs, targets)."""
    rows = tokens.shape[0] // dp
    mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
    positions = positions.cpu()
    return mine[:, :-1][:, positions].contiguous(), mine[:, 1:][:, positions].contiguous()
