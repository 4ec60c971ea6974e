"""What the benchmarks return (torch-free, so fitting and building are testable without it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CollectiveSample", "Measurement"]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One single-device benchmark item."""

    kind: str
    """gemm | copy | triad | attention_fwd | attention_bwd | elementwise | elementwise_bwd | optimizer"""
    op: str
    dtype: str
    params: dict
    """the shape: m, n, k; bytes; batch, heads, q_len, kv_len, head_dim, causal; elements and kernels."""
    work: float
    """FLOPs (gemm, attention) or bytes moved (the rest; an elementwise backward: its forward's)."""
    seconds: float
    """median per-call time."""
    spread: float = 0.0
    """(p75 - p25) / median of the timed blocks: the run's noise."""
    repeats: int = 1
    inner: int = 1
    origin: str = ""
    graph: bool = False
    """timed as CUDA graph replays (calibrate.bench.Clock._time_graph), not eager launches."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class CollectiveSample:
    """One collective at one size (nccl-tests conventions, see calibrate.collectives)."""

    op: str
    tier: str
    """intra (one node's ranks) or inter (across nodes)."""
    ranks: int
    nodes: int
    backend: str
    nbytes: int
    seconds: float
    algbw: float
    busbw: float
    inner: int = 1
    repeats: int = 1

    def to_json(self) -> dict:
        return asdict(self)
