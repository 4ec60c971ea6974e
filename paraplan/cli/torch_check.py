"""The commands that run PyTorch (launch, validate, calibrate) check for it before they start."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re

from paraplan.errors import ParaplanError

MINIMUM = (2, 11)
"""The oldest PyTorch the executor's equivalence checks (every plan of tests/test_executor.py
against a single-process reference, CPU/gloo) were run on: 2.11 has every API it calls (pipelining
schedules, FSDP2, replicate_with_fsdp, DTensor parallel styles). CI runs 2.13."""


def torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed PyTorch, read from its package metadata without importing
    it; None when it is not installed."""
    try:
        found = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", found)[:2])


def torch_problem(what: str, *, minimum: tuple[int, int] | None = MINIMUM) -> str | None:
    """Why `what` cannot run for want of PyTorch (missing, or older than `minimum`); None when it can."""
    floor = ".".join(map(str, minimum or MINIMUM))
    need = f"PyTorch >= {floor}" if minimum else "PyTorch"
    if importlib.util.find_spec("torch") is None:
        return f"{what} needs {need}, which is not installed: pip install 'torch>={floor}'"
    if minimum and torch_version() < minimum:
        return f"{what} needs {need}, found {importlib.metadata.version('torch')}"
    return None


def require_torch(what: str, *, minimum: tuple[int, int] | None = MINIMUM) -> None:
    """One-line error naming `what` needs PyTorch when it is missing (or older than `minimum`)."""
    problem = torch_problem(what, minimum=minimum)
    if problem:
        raise ParaplanError(problem)
