"""The evaluation's results as files: markdown tables, CSV and plots (matplotlib, imported only when a plot is
drawn); the rows are the dataclasses of :mod:`kitty.tools.eval_metrics`."""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path

from .eval_metrics import PasskeyResult, PerplexityResult


def markdown_table(rows: list, floatfmt: str = ".3f") -> str:
    """A markdown table from a list of dataclass rows."""
    if not rows:
        return ""
    d = [asdict(r) for r in rows]
    head = list(d[0])
    fmt = lambda v: format(v, floatfmt) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in head) + " |" for r in d]
    return "\n".join(lines)


def ppl_markdown(rows: list[PerplexityResult]) -> str:
    """Perplexity rows as one markdown table: bits, ppl and change over all windows, then the change per text."""
    texts = list(dict.fromkeys(r.text for r in rows if r.text != "all"))
    by = {(r.method, r.text): r for r in rows}
    lines = [
        "| method | bits/element | ppl | change | " + " | ".join(f"change ({t})" for t in texts) + " |",
        "|---" * (4 + len(texts)) + "|",
    ]
    for r in rows:
        if r.text == "all":
            per = " | ".join(f"{100 * by[(r.method, t)].ppl_change:+.1f}%" for t in texts)
            lines.append(
                f"| {r.method} | {r.bits_per_element:.3f} | {r.ppl:.2f} | {100 * r.ppl_change:+.1f}% | {per} |"
            )
    return "\n".join(lines)


def write_csv(rows: list, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)


def _markers(n: int) -> list[tuple]:
    """``n`` distinct (colour, marker) pairs: tab20 colours, cycling through markers past 20."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    marks = "osD^vP*Xh<>"
    return [(colours[i % 20], marks[(i // 20 + i) % len(marks)]) for i in range(n)]


def plot_pareto(ppl: list[PerplexityResult], path: Path) -> None:
    """Perplexity change against bits per element, one point per preset: every preset on a log-2 bits axis with
    whole-number ticks, and the quantized presets alone (they cluster at 2-5 bits), named in one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    quantized = [r for r in ppl if r.bits_per_element < 16]
    panels = 2 if quantized and len(quantized) < len(ppl) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels + 2.6, 4.2), squeeze=False)
    style = dict(zip((r.method for r in ppl), _markers(len(ppl))))
    for ax, rows in zip(axes[0], [ppl, quantized][:panels]):
        for r in rows:
            colour, marker = style[r.method]
            ax.scatter(r.bits_per_element, 100 * r.ppl_change, color=colour, marker=marker, s=40, label=r.method)
        ax.set_ylabel("decode perplexity change vs fp16 (%)")
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    bits = [r.bits_per_element for r in ppl]
    ax.set_xscale("log", base=2)
    lo, hi = min(bits) / 1.15, max(bits) * 1.15
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(
        FixedLocator([t for t in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 32) if lo <= t <= hi])
    )
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("KV bits per element (whole cache, log scale)")
    ax.set_title("all presets", fontsize=10)
    if panels == 2:
        axes[0][1].set_xlabel("KV bits per element (whole cache)")
        axes[0][1].set_title("quantized presets (fp16 left out)", fontsize=10)
    fig.legend(
        *axes[0][0].get_legend_handles_labels(),
        loc="center left",
        bbox_to_anchor=(0.995, 0.5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_passkey(results: list[PasskeyResult], path: Path, per_row: int = 4) -> None:
    """One heatmap of accuracy per (length, depth) for each preset, ``per_row`` presets per row of panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    methods = list(dict.fromkeys(r.method for r in results))
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    cols = min(per_row, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(0.9 * len(lengths) * cols + 1.2, 0.45 * len(depths) * rows + 1.1 * rows), squeeze=False
    )
    for i, ax in enumerate(axes.flat):
        if i >= len(methods):
            ax.axis("off")
            continue
        m = methods[i]
        grid = [
            [
                next(
                    (r.solved / r.total if r.total else float("nan"))
                    for r in results
                    if r.method == m and r.length == n and r.depth == d
                )
                for n in lengths
            ]
            for d in depths
        ]
        sns.heatmap(
            grid,
            ax=ax,
            vmin=0,
            vmax=1,
            cmap="viridis",
            cbar=False,
            annot=True,
            fmt=".1f",
            xticklabels=lengths,
            yticklabels=depths if i % cols == 0 else False,
        )
        ax.set_title(m, fontsize=8)
        ax.tick_params(axis="y", rotation=0)
        ax.set_xlabel("context (tokens)", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("key depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
