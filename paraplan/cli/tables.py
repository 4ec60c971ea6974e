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


def model_shape(model: dict) -> str:
    """"N layers, hidden H" for a header, or "" where the model's name already ends with it (a model
    the executor scaled down is named "<name> scaled to N layers, hidden H", executor.config)."""
    shape = f"{model['num_layers']} layers, hidden {model['hidden_size']}"
    return "" if model["name"].endswith(shape) else shape
