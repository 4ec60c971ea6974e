"""Small helpers shared by the CLI's text tables."""
from __future__ import annotations


def elided(rows: list, largest: int, limit: int = 8) -> list:
    """Every row when there are few; else the first two, the `largest`-th and the last two, with
    None marking each gap (printed as '...')."""
    if len(rows) <= limit:
        return list(rows)
    keep = sorted({0, 1, largest, len(rows) - 2, len(rows) - 1})
    out, prev = [], -1
    for i in keep:
        if i != prev + 1:
            out.append(None)
        out.append(rows[i])
        prev = i
    return out
