"""The demo's figures, free of any UI: the memory readout over a run, the key heatmap of the Inside tab, and the
end-of-run summary of memory against agreement beside the eval's measured perplexity and passkey figures (read from
the committed CSVs in ``assets/``). matplotlib is imported when a figure is made.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.quant import KeyInspection
from . import demo as kd
from .demo_view import COLUMN_COLORS, agreement, eval_figures, reference_column


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display: figures go to Gradio or to files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LINE_STYLES = (
    {"lw": 6.0, "alpha": 0.45, "ls": "-"},
    {"lw": 2.6, "alpha": 0.95, "ls": "--"},
    {"lw": 1.4, "alpha": 1.0, "ls": "-"},
)


def memory_figure(snap: kd.Snapshot):
    """Stored KV MiB against cached tokens, one line per column in the column's colour (integer token ticks),
    a marker where a column packed a page, and a note naming lines that lie on top of each other."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 3.1), dpi=90)
    same = []
    for i, c in enumerate(snap.columns):
        if not c.history:
            continue
        t, b = zip(*c.history)
        mib = [x / 2**20 for x in b]
        color = COLUMN_COLORS[i % len(COLUMN_COLORS)]
        twin = next((j for j in range(i) if snap.columns[j].history == c.history), None)
        if twin is not None:
            same.append(f"{c.label} lies on {snap.columns[twin].label}")
        ax.plot(t, mib, color=color, label=c.label, **LINE_STYLES[i % len(LINE_STYLES)])
        at = dict(c.history)
        for tokens, sides in c.packs:
            ax.plot([tokens], [at[tokens] / 2**20], marker="v", ms=9, color=color, ls="none")
            ax.annotate(
                f"{sides} page packed",
                (tokens, at[tokens] / 2**20),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("KV stored (MiB)")
    top = max((b for c in snap.columns for _, b in c.history), default=0) / 2**20
    ax.set_ylim(0, 1.35 * top or 1)  # headroom above the highest line for the legend
    ax.grid(alpha=0.3)
    title = "Stored KV cache vs cached tokens (▼: a qbuffer packed into a 2-bit page)"
    ax.set_title(title + (" — " + "; ".join(same) if same else ""), fontsize=10)
    if ax.lines:
        ax.legend(loc="upper left", fontsize=9, ncol=3, frameon=False)
    fig.tight_layout()
    plt.close(fig)
    return fig


def heatmap_figure(ins: KeyInspection):
    """|K| as channels x tokens, sink and page boundaries as lines, each page's boosted channels marked."""
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    T, D = ins.abs_keys.shape
    fig, ax = plt.subplots(figsize=(12, 4.6), dpi=90)
    img = ins.abs_keys.T.numpy()
    vmax = float(ins.abs_keys.quantile(0.995)) if T * D < 2**24 else float(ins.abs_keys.max())
    im = ax.imshow(
        img,
        aspect="auto",
        origin="lower",
        cmap="magma",
        vmin=0,
        vmax=vmax,
        interpolation="nearest",
        extent=(-0.5, T - 0.5, -0.5, D - 0.5),
    )
    fig.colorbar(im, ax=ax, pad=0.01, label="|K|")
    if ins.sink:
        ax.axvline(ins.sink - 0.5, color="white", lw=1.2)
        ax.text(ins.sink / 2, D + 0.5, "sink", ha="center", va="bottom", fontsize=8)
    for pg in ins.pages:
        ax.axvline(pg.start - 0.5, color="white", lw=0.8, ls="--")
        for ch in pg.boosted:  # a hollow box around each boosted row keeps the |K| values inside visible
            ax.add_patch(
                Rectangle(
                    (pg.start - 0.5, ch - 0.5),
                    pg.end - pg.start,
                    1,
                    fill=False,
                    ec="#00e5ff",
                    lw=0.9,
                    ls="-" if pg.quantized else ":",
                )
            )
        label = f"page {ins.pages.index(pg)}" if pg.quantized else "qbuffer"
        ax.text((pg.start + pg.end) / 2, D + 0.5, label, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-0.5, T - 0.5)
    ax.set_ylim(-0.5, D + 3)
    ax.set_xlabel("token position")
    ax.set_ylabel("key channel")
    ax.set_title(
        f"|K| post-RoPE, layer {ins.layer}, KV head {ins.head} — cyan boxes: boosted channels under {ins.method} "
        "(solid: quantized page; dotted: qbuffer, if it were quantized now)",
        fontsize=9,
    )
    fig.tight_layout()
    plt.close(fig)
    return fig


def summary_figure(columns: Sequence[kd.Column]):
    """The run's end in one figure: each column's stored KV memory against its agreement with the reference
    column (this run), and beside it the eval's perplexity change and passkey share for the same presets."""
    plt = _pyplot()
    ref = reference_column(columns)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.0), dpi=90, gridspec_kw={"width_ratios": [1.1, 1]})
    for i, c in enumerate(columns):
        if c.readout is None:
            continue
        color = COLUMN_COLORS[i % len(COLUMN_COLORS)]
        rate = agreement(ref.ids, c.ids)[2]
        mib = c.readout.report.stored_bytes / 2**20
        ax.scatter([mib], [100 * rate], s=90, color=color, zorder=3)
        ax.annotate(c.label, (mib, 100 * rate), xytext=(6, 4 - 12 * (i % 2)), textcoords="offset points", fontsize=9)
    ax.set_xlabel("KV stored (MiB)")
    ax.set_ylabel("tokens as fp16 (%)")
    ax.set_ylim(-5, 112)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.set_title("This run: memory vs agreement", fontsize=10)
    figs = eval_figures()
    labels, ppl, passkey = [], [], []
    for c in columns:
        f = figs.get(c.method.split("+")[0], {})
        labels.append(c.label)
        ppl.append(100 * f.get("ppl_change", float("nan")))
        passkey.append(100 * f.get("passkey", float("nan")))
    y = range(len(labels))
    bx.barh([v + 0.2 for v in y], passkey, height=0.38, color="#16a34a", label="passkeys solved (%)")
    bx.barh([v - 0.2 for v in y], ppl, height=0.38, color="#9333ea", label="perplexity change (%)")
    for v, p, k in zip(y, ppl, passkey):
        for val, off in ((k, 0.2), (p, -0.2)):
            if val == val:  # not NaN
                bx.text(val + 1, v + off, f"{val:.0f}", va="center", fontsize=8)
    bx.set_yticks(list(y), labels, fontsize=9)
    bx.invert_yaxis()
    bx.set_xlim(0, 115)
    bx.legend(fontsize=8, loc="lower right", frameon=False)
    bx.set_title("The eval's measurements (assets/*.csv)", fontsize=10)
    fig.tight_layout()
    plt.close(fig)
    return fig
