"""Timeline PNG of a simulated iteration (matplotlib, imported only when a plot is asked for)."""
from __future__ import annotations

import io

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "forward_backward": "#937860", "weight_grad": "#CCB974",
          "optimizer": "#55A868", "dp_comm": "#C44E52", "pp_comm": "#8172B3"}


def timeline_png(result) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(result.stages)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * pp))
    rows = {}
    for s in range(pp):
        rows[(s, "compute")] = 2 * (pp - 1 - s) + 1
        rows[(s, "comm")] = 2 * (pp - 1 - s)
    # one collection per category and row (a collection per span took 40 s for 7,500 spans)
    bars: dict[str, dict[int, list]] = {}
    for sp in result.spans:
        row = rows[(sp.stage, "compute" if sp.stream == "compute" else "comm")]
        bars.setdefault(sp.category, {}).setdefault(row, []).append((sp.start * 1e3, (sp.end - sp.start) * 1e3))
    for cat, by_row in bars.items():
        for row, xranges in by_row.items():
            ax.broken_barh(xranges, (row + 0.1, 0.8), facecolors=COLORS.get(cat, "gray"), edgecolors="white",
                           linewidth=0.3)
        ax.barh(0, 0, color=COLORS.get(cat, "gray"), label=cat)
    ax.set_yticks([rows[(s, "compute")] + 0.5 for s in range(pp)] + [rows[(s, "comm")] + 0.5 for s in range(pp)])
    ax.set_yticklabels([f"stage {s}" for s in range(pp)] + [f"stage {s} comm" for s in range(pp)], fontsize=7)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{result.scenario}: step {result.step_time_s * 1e3:.1f} ms, MFU {result.mfu * 100:.1f}%", pad=26)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=len(bars), frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
