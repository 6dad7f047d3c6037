"""The figures README.md and docs/*.md quote, written from the results files they come from.

Every measured number in those pages sits in a generated block::

    <!-- quoted:NAME -->
    ...text written by BLOCKS[NAME]()...
    <!-- /quoted -->

``python docs/quoted.py`` rewrites every block from the results files; ``python docs/quoted.py --check`` exits 1
when a page is stale (``tests/test_docs.py`` runs the same check). Where a results file lives is said once, in
``RESULTS``: a moved file is a one-line change here. ``python docs/quoted.py --crop`` also rewrites the README's
picture (``assets/demo_columns.png``), cropped from the app's screenshot.
"""

from __future__ import annotations

import ast
import csv
import json
import re
import sys
import textwrap
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kitty.core.config import PRESETS, get_preset  # noqa: E402
from kitty.core.memory import asymptotic_bits  # noqa: E402

# Where each results file lives, relative to the repository root.
RESULTS = {
    "ppl_full": "assets/eval_ppl_full.csv",
    "agreement_full": "assets/eval_agreement_full.csv",
    "passkey_full": "assets/eval_passkey_full.csv",
    "ppl_beyond": "assets/eval_ppl_beyond.csv",
    "passkey_beyond": "assets/eval_passkey_beyond.csv",
    "pack_cpu": "assets/eval_pack_beyond.csv",
    "pack_h200": "benchmarks/results/h200-2026-11-29/pack_cost.csv",
    "kernels": "benchmarks/results/h200-2026-12-01/kernels_timing.json",
    "layout_check": "benchmarks/results/h200-2026-12-02/layout_check_high32cols.json",
    "layout_sweep": "benchmarks/results/h200-2026-12-02/layout_sweep.json",
    "small_4k": "benchmarks/results/h200-2026-12-04/gluon_check.json",  # the tl kernel's default launch at (1, 4K)
    "small_32k": "benchmarks/results/h200-2026-12-04/gluon_check-2.json",  # and at (1, 32K), beside the Gluon kernel
    "gluon_check": "benchmarks/results/h100-2026-12-07/gluon_check.json",  # the Gluon kernel: checks and timings
    "throughput": "benchmarks/results/h200-2026-11-29/throughput.json",
    "static_step": "benchmarks/results/h200-2026-12-05/static_throughput.json",  # the captured step, tl and Gluon
    # the captured step with today's Gluon kernel and pack, every point timed before any was profiled
    "static_step_gluon": "benchmarks/results/h100-2026-12-07/static_throughput.json",
    "boost_speed": "benchmarks/results/h200-2026-11-29/boost_profile_h200.json",
    "paper_kernels": "benchmarks/summarize.py",  # OFFICIAL_KITTY_MS: the paper's own kernels, timed once
    "kernel_history": "docs/BENCHMARKS.md",  # the "What changed, step by step" table
}
PAGES = [
    "README.md",
    "notebooks/README.md",
    *(f"docs/{p}" for p in ("RESEARCH.md", "GPU.md", "TENSOR_PARALLEL.md", "SPACE.md", "DEMO.md")),
]
SCREENSHOT, PICTURE = "assets/demo_screenshot.png", "assets/demo_columns.png"
DEFAULT_HEAD_DIM = 64  # SmolLM2-135M-Instruct, the model every assets/eval_* file was measured on
BENCH_HEAD_DIM = 128  # the layer shape of benchmarks/kernels.py and of 8B-class models


def path(key: str) -> Path:
    """The results file ``RESULTS[key]``, checked to exist."""
    p = ROOT / RESULTS[key]
    if not p.is_file():
        raise FileNotFoundError(f"results file {RESULTS[key]!r} ({key}) is missing: update RESULTS in docs/quoted.py")
    return p


def rows(key: str) -> list[dict]:
    """A CSV results file as dicts, numbers parsed."""
    out = []
    with path(key).open() as f:
        for r in csv.DictReader(f):
            for k, v in r.items():
                try:
                    r[k] = float(v)
                except ValueError:
                    pass
            out.append(r)
    return out


def by_method(key: str, **where) -> dict[str, dict]:
    return {r["method"]: r for r in rows(key) if all(r.get(k) == v for k, v in where.items())}


def load_json(key: str) -> dict:
    return json.loads(path(key).read_text())


def pct(x: float, digits: int = 1) -> str:
    """A relative change as a signed percentage: 0.103 -> '+10.3%'."""
    return f"{100 * x:+.{digits}f}%"


def table(header: list[str], body: list[list], align: str = "") -> str:
    """A markdown table; ``align`` gives one of l/r per column (default: left)."""
    align = align or "l" * len(header)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def page_bits(method: str, head_dim: int) -> float:
    """Bits per element of pages alone (the long-context limit), from kitty.core.memory."""
    return asymptotic_bits(get_preset(method), head_dim)["total"]


def passkeys(key: str) -> dict[str, dict]:
    """Per method: solved and total per length, and overall."""
    out: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in rows(key):
        for k in (int(r["length"]), "all"):
            out[r["method"]][k][0] += int(r["solved"])
            out[r["method"]][k][1] += int(r["total"])
    return out


def eval_tokens() -> int:
    """Tokens in the cache at the end of a perplexity window: kitty.tools.eval's --prefill + --scored defaults."""
    src = (ROOT / "kitty" / "tools" / "eval.py").read_text()
    get = lambda flag: int(re.search(rf'"--{flag}", type=int, default=(\d+)', src).group(1))  # noqa: E731
    return get("prefill") + get("scored")


# --------------------------------------------------------------------------------------------------- README.md


def wrap(text: str) -> str:
    """Prose paragraphs wrapped like the hand-written ones (118 columns)."""
    return "\n\n".join(textwrap.fill(p, 118, break_on_hyphens=False) for p in text.split("\n\n"))


def headline_size() -> str:
    ppl, k = by_method("ppl_full", text="all"), PRESETS["kitty"]
    b128, b64 = page_bits("kitty", BENCH_HEAD_DIM), page_bits("kitty", DEFAULT_HEAD_DIM)
    whole = ppl["kitty"]["bits_per_element"]
    return wrap(
        f'**How much smaller, counted honestly.** The paper speaks of a KV cache "nearly 8x" smaller (16 bits '
        f"against 2-bit codes). Counting everything a `kitty` page stores (the codes, the boosted channels' extra "
        f"bits, `boost_idx`, every scale and zero), pages cost **{b128:.2f} bits per element at head_dim "
        f"{BENCH_HEAD_DIM}: {16 / b128:.1f}x smaller than fp16** ({b64:.2f} bits, {16 / b64:.1f}x, at the default "
        f"model's head_dim {DEFAULT_HEAD_DIM}). The first {k.sink_tokens} tokens, the newest "
        f"{k.local_window}–{k.local_window + k.group_size - 1} values and the newest 0–{k.group_size - 1} keys stay "
        f"in full precision, so a short cache shrinks less: {whole:.2f} bits per element ({16 / whole:.1f}x) at "
        f"{eval_tokens()} tokens on the default model, and no key is quantized before token "
        f"{k.sink_tokens + k.group_size} (no value before token {k.sink_tokens + k.local_window + k.group_size})."
    )


def headline_cost() -> str:
    ppl, pk = by_method("ppl_full", text="all"), passkeys("passkey_full")
    gap = lambda m: ppl[m]["ppl_change"]  # noqa: E731
    closed = (gap("kivi-k2v2-sink") - gap("kitty")) / (gap("kivi-k2v2-sink") - gap("kivi-k4v2-sink"))
    solved = lambda m: f"{pk[m]['all'][0]}/{pk[m]['all'][1]}"  # noqa: E731
    extra = page_bits("kitty", DEFAULT_HEAD_DIM) - page_bits("kivi-k2v2", DEFAULT_HEAD_DIM)
    return wrap(
        f"**What it costs: some accuracy.** On the default model (SmolLM2-135M, `python -m kitty.eval`), decode "
        f"perplexity rises {pct(gap('kitty'))} with `kitty` and {pct(gap('kitty-pro'))} with `kitty-pro`, against "
        f"{pct(gap('kivi-k2v2'))} for plain 2-bit KIVI and {pct(gap('kivi-k4v2-sink'))} for 4-bit keys: `kitty` "
        f"closes {closed:.0%} of the gap between 2-bit and 4-bit keys (both with sinks) for {extra:.3f} more bits "
        f"per element than 2-bit KIVI. Passkeys found: `kitty` {solved('kitty')}, `kitty-pro` {solved('kitty-pro')}, "
        f"2-bit KIVI {solved('kivi-k2v2')}, fp16 {solved('fp16') if 'fp16' in pk else 'all of them'}."
    )


def captured_steps(key: str = "static_step") -> tuple[dict, dict]:
    """Tokens/s of the captured decode step (results file ``key``, equal lengths): FP16 by ``(context, batch)`` (the
    fastest FP16 variant there), and Kitty by ``(gluon, context, batch)`` for the ``tl`` and the Gluon kernel."""
    fp16, kitty = {}, {}
    for r in load_json(key)["rows"]:
        if r["ragged"]:
            continue
        point = (r["context"], r["batch"])
        if r["method"].startswith("fp16-static-captured"):
            fp16[point] = max(fp16.get(point, 0), r["tokens_per_s"])
        elif r["method"] in ("kitty-captured", "kitty/gluon-captured"):
            kitty[(r["method"].startswith("kitty/gluon"), *point)] = r["tokens_per_s"]
    return fp16, kitty


def gpu_of(key: str) -> str:
    """The GPU a results file was measured on, from its folder's name (``h200-2026-12-06`` -> ``H200``)."""
    return Path(RESULTS[key]).parent.name.split("-")[0].upper()


def fastest_fp16_batch(fp16: dict, context: int) -> int:
    """The batch of the fastest captured FP16 step at ``context``: the baseline of Kitty's largest batch."""
    return max((b for c, b in fp16 if c == context), key=lambda b: fp16[(context, b)])


def headline_speed() -> str:
    fp16, kitty = captured_steps("static_step_gluon")
    tl_fp16, tl_kitty = captured_steps("static_step")

    def vs(context: int, batch: int, fp16_batch: int | None = None, tl: bool = False) -> str:
        base, run = (tl_fp16, tl_kitty) if tl else (fp16, kitty)
        return f"{run[(not tl, context, batch)] / base[(context, fp16_batch or batch)]:.2f}x"

    def largest(run: dict, base: dict, context: int, gluon: bool) -> tuple[int, int]:  # kitty's, FP16's fastest
        return max(b for g, c, b in run if c == context and g == gluon), fastest_fp16_batch(base, context)

    (b8, f8), (b32, f32) = largest(kitty, fp16, 8192, True), largest(kitty, fp16, 32768, True)
    (t8, g8), (t32, g32) = largest(tl_kitty, tl_fp16, 8192, False), largest(tl_kitty, tl_fp16, 32768, False)
    fits = {}  # FP16's largest batch under the budget, from the run's notes
    for note in load_json("static_step_gluon").get("notes", []):
        if m := re.match(r"context (\d+): largest static batch under .*'fp16': (\d+)", note):
            fits[int(m.group(1))] = int(m.group(2))
    than = lambda c, f: f"{f}" + (f", though it fits {fits[c]}" if fits.get(c, f) != f else ", the most it fits")  # noqa: E731
    return wrap(
        "**How fast, on a GPU.** One decode step of a Qwen3-8B-shaped model with 20 GiB of KV cache, captured in a "
        "CUDA graph, against the captured FP16 step with unmasked cuDNN attention of the same run "
        f"(`benchmarks/static_h200.py`, on an {gpu_of('static_step_gluon')}): the largest batch that fits gives "
        f"{vs(8192, b8, f8)} FP16's "
        f"tokens/s at 8K context ({b8} rows against FP16's {than(8192, f8)}) and {vs(32768, b32, f32)} at 32K "
        f'({b32} against {f32}) with the Gluon kernel, which `backend="auto"` picks on Hopper GPUs; at the same '
        f"batch of 16 rows {vs(8192, 16)}, and a single row {vs(8192, 1)} (8K) and {vs(32768, 1)} (32K), the host "
        "waiting for every step. Elsewhere the portable `tl` kernel runs (on an "
        f"{gpu_of('static_step')}, an earlier run: "
        f"{vs(8192, t8, g8, tl=True)} at 8K and {vs(32768, t32, g32, tl=True)} at 32K at the largest batches). "
        "`python -m kitty`, the demo and `kitty.eval` take this captured step on CUDA (docs/GPU.md)."
    )


def accuracy_ppl() -> str:
    ppl = by_method("ppl_full", text="all")
    body = []
    for m, r in ppl.items():
        change = "–" if m == "fp16" else pct(r["ppl_change"])
        body.append([f"`{m}`", f"{r['ppl']:.2f}", change, f"{r['bits_per_element']:.2f}",
                     f"{page_bits(m, DEFAULT_HEAD_DIM):.2f}"])  # fmt: skip
    header = ["preset", "decode ppl", "change vs fp16", f"bits/element at {eval_tokens()} tokens",
              "page bits (long-context limit)"]  # fmt: skip
    return table(header, body, "lrrrr")


def accuracy_agreement() -> str:
    body = [[f"`{m}`", f"{r['mean_identical_prefix']:.1f}", f"{r['match_rate']:.0%}"]
            for m, r in by_method("agreement_full").items()]  # fmt: skip
    return table(["preset", "identical prefix (tokens, mean)", "token match rate"], body, "lrr")


def passkey_table(key: str) -> str:
    pk = passkeys(key)
    lengths = sorted({n for v in pk.values() for n in v if n != "all"})
    body = [[f"`{m}`", *(f"{v[n][0]}/{v[n][1]}" for n in lengths), f"{v['all'][0]}/{v['all'][1]}"]
            for m, v in pk.items()]  # fmt: skip
    return table(["preset", *(f"{n} tokens" for n in lengths), "all"], body, "l" + "r" * (len(lengths) + 1))


def accuracy_passkey() -> str:
    return passkey_table("passkey_full")


# ---------------------------------------------------------------------------------------------- docs/RESEARCH.md


def describe(method: str) -> list[str]:
    cfg = get_preset(method)
    keys = "fit" if cfg.key_range != "minmax" else "minmax"
    keys += " (values too)" if cfg.value_range != "minmax" else ""
    return [f"{100 * cfg.boost_fraction:.1f}%", cfg.channel_selection, keys,
            "profile" if cfg.boost_profile else "uniform"]  # fmt: skip


def research_ppl() -> str:
    per_text = defaultdict(dict)
    for r in rows("ppl_beyond"):
        per_text[r["method"]][r["text"]] = r["ppl_change"]
    texts = [t for t in next(iter(per_text.values())) if t != "all"]
    body = [[f"`{m}`", *describe(m), pct(v["all"]), *(pct(v[t]) for t in texts)]
            for m, v in per_text.items() if m != "fp16"]  # fmt: skip
    body.sort(key=lambda r: r[1])  # 12.5% rows, then 25%
    header = ["method", "boosted", "selection", "key ranges", "layers", "change, both texts", *texts]
    return table(header, body, "llllrr" + "r" * len(texts))


def best(key_rows: dict, fraction: float) -> tuple[str, float]:
    cands = {
        m: r["ppl_change"] for m, r in key_rows.items() if m != "fp16" and get_preset(m).boost_fraction == fraction
    }
    m = min(cands, key=cands.get)
    return m, cands[m]


def research_targets() -> str:
    ppl, pk = by_method("ppl_beyond", text="all"), passkeys("passkey_beyond")
    lines = []
    for name, fraction, target in (("kitty", 0.125, 0.05), ("kitty-pro", 0.25, 0.02)):
        m, v = best(ppl, fraction)
        ok = "met" if v <= target else "missed"
        base = ppl[name]["ppl_change"]
        lines.append(f"- At `{name}`'s bits ({page_bits(name, DEFAULT_HEAD_DIM):.2f} bits per element for pages, "
                     f"{ppl[name]['bits_per_element']:.3f} for the whole cache at {eval_tokens()} tokens), the paper "
                     f"rule gives {pct(base)}; the best preset is `{m}` at {pct(v)} (target {pct(target, 0)}: "
                     f"{ok}).")  # fmt: skip
        solved = {m_: v_["all"] for m_, v_ in pk.items() if get_preset(m_).boost_fraction == fraction}
        top = max(solved, key=lambda m_: solved[m_][0])
        lines.append("  Passkeys at these bits: " + ", ".join(f"`{m_}` {s[0]}/{s[1]}" for m_, s in solved.items())
                     + f"; the most found by `{top}`.")  # fmt: skip
    return "\n".join(lines)


def research_passkey() -> str:
    return passkey_table("passkey_beyond")


def fused_us(B: int, L: int, preset: str = "kitty", dtype: str = "float16") -> float:
    """The fused decode kernel's time per layer call under its default launch, from the kernel benchmark."""
    for r in load_json("kernels")["default_launch"]:
        if (r["B"], r["L"], r["preset"], r["dtype"]) == (B, L, preset, dtype):
            return r["us"]
    raise KeyError(f"no default_launch row for {(B, L, preset, dtype)} in {RESULTS['kernels']}")


def research_pack() -> str:
    cpu, gpu = by_method("pack_cpu"), by_method("pack_h200")
    B, L, heads = 64, 8192, 8  # the shape pack_cost.csv was timed at (64 rows x 8 KV heads, D=128)
    t_fused = fused_us(B, L)
    both = lambda r: r["us_per_key_page"] + r["us_per_value_page"]  # noqa: E731
    paper_rule = {f: both(cpu[m]) for f, m in ((0.125, "kitty"), (0.25, "kitty-pro"))}
    body = []
    for m, c in cpu.items():
        g = gpu.get(m)
        ratio = both(c) / paper_rule[get_preset(m).boost_fraction]
        sel = c["channel_selection"] + (", fitted key ranges" if c["key_range"] != "minmax" else "")
        sel += ", fitted value ranges" if c["value_range"] != "minmax" else ""
        h200 = share = "not timed"
        if g:
            h200 = f"{g['us_per_key_page']:.1f} + {g['us_per_value_page']:.1f}"
            pack = B * heads * (g["us_per_key_page"] + g["us_per_value_page"]) / PRESETS["kitty"].group_size
            share = f"{100 * pack / t_fused:.1f}%"
        body.append([f"`{m}`", sel, f"{c['us_per_key_page']:.0f} + {c['us_per_value_page']:.0f}",
                     f"{ratio:.1f}x", h200, share])  # fmt: skip
    header = [
        "method",
        "selection",
        "CPU µs per key + value page",
        "CPU vs the paper rule at the same boost",
        "H200 µs per key + value page",
        f"H200: share of fused decode attention at ({B}, {L // 1024}K)",
    ]
    return table(header, body, "llrrrr")


def research_boost_speed() -> str:
    s = load_json("boost_speed")["summary"]
    parts = [f"`{m}` {v['profile_over_uniform']:.3f}x" for m, v in s.items()]
    return wrap(f"A decode step under the shipped layer profiles takes {', '.join(parts)} the uniform preset's time.")


# --------------------------------------------------------------------------------------------------- docs/GPU.md


def gpu_speed() -> str:
    d = load_json("kernels")
    official = ast.literal_eval(
        re.search(r"OFFICIAL_KITTY_MS = (\{.*?\})\n", path("paper_kernels").read_text()).group(1)
    )
    body = []
    for key, f in d["fastest_fp16"].items():
        B, L = map(int, key.split(","))
        cells = []
        for preset, dtype in (("kitty", "float16"), ("kitty", "bfloat16"), ("kitty-pro", "float16")):
            try:
                cells.append(f"{f['us'] / fused_us(B, L, preset, dtype):.2f}x")
            except KeyError:
                cells.append("not timed")
        paper = official.get((B, L))
        vs = f"{1e3 * paper / fused_us(B, L):.1f}x" if paper else "not timed"
        body.append([f"({B}, {L // 1024}K)", f"{f['us']:.0f} ({f['name']})", f"{fused_us(B, L):.0f}", *cells, vs])
    header = ["(batch, context)", "fastest FP16 SDPA, µs", "`kitty` fused, µs", "`kitty` fp16 vs SDPA",
              "`kitty` bf16", "`kitty-pro` fp16", "`kitty` vs the paper's own kernels"]  # fmt: skip
    return table(header, body, "lrrrrrr")


def gpu_layout_speed() -> str:
    """The current kernel (reduction-axis layout): the target shapes from the correctness-checked run, batch 1 from
    the Gluon check runs, which time the ``tl`` kernel's default launch beside the Gluon kernel."""
    check = load_json("layout_check")
    cases = [(check, r, " default") for r in check["timing"] if r["method"].endswith(" default")]
    for key in ("small_4k", "small_32k"):
        d = load_json(key)
        cases += [(d, r, " tl default") for r in d["timing"] if r["B"] == 1 and r["method"].endswith(" tl default")]
    cells: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for d, r, suffix in cases:
        cells[(r["B"], r["L"])][r["method"].removesuffix(suffix)] = f"{r['us']:.1f} ({r['vs_fp16']:.2f}x)"
        f = d["fastest_fp16"][f"{r['B']},{r['L']}"]
        cells[(r["B"], r["L"])]["fp16"] = f"{f['us']:.1f} ({f['name']})"
    methods = ["kitty float16", "kitty bfloat16", "kitty-pro float16", "kitty-pro bfloat16"]
    body = [[f"({B}, {L // 1024}K)", c["fp16"], *(c.get(m, "not timed") for m in methods)]
            for (B, L), c in sorted(cells.items(), key=lambda x: (-x[0][0] * x[0][1], x[0][0]))]  # fmt: skip
    header = ["(batch, context)", "fastest FP16 SDPA, µs", *(f"`{m.split()[0]}` {m.split()[1]}, µs" for m in methods)]
    correct = sum(v["ok"] for v in check["check"].values())
    small = load_json("small_32k")["env"]
    note = wrap(
        f"Measured {check['env']['date']} on an {check['env']['gpu']}, triton {check['env']['triton']}; the FP16 time "
        f"is the fastest SDPA backend of the same run. Before timing, the default launch passed the tolerance rule "
        f"in {correct} of {len(check['check'])} cases (`kitty` and `kitty-pro`, fp16 and bf16, GQA 3, 4 and 8, D 64 "
        "and 128, and a high plane of 13 slots). The batch-1 rows come from the Gluon kernel's check runs "
        f"({small['date'][:10]}, `gluon_check.json` and `gluon_check-2.json`), which time this kernel's default "
        "launch beside the Gluon kernel against the fastest FP16 SDPA of the same run; that launch passes "
        "`tests/test_cuda.py` on the H200."
    )
    return table(header, body, "lrrrrr") + "\n\n" + note


def gluon_default_row(r: dict, kv_heads: int = 8, bf16_magic: bool | None = None, sms: int = 132) -> bool:
    """Whether a ``benchmarks/gluon_check.py`` timing row is the Gluon kernel's default launch: 8 programs per SM at
    the wrapper's register cap, and at small batch (at most ``SMALL_PAIRS`` row and KV-head pairs) as many programs
    for the full-precision chunks as the default gives on ``sms`` SMs (``small_tail_splits``: 8, or 4 where 8 would
    start more than 8 programs per SM; that script times 4 and 8 there); bf16 rows with the unpack form
    ``bf16_magic`` (``None``: today's default, :func:`bf16_form_timed`)."""
    from kitty.kernels.gluon_launch import SMALL_PAIRS, GluonLaunch, small_tail_splits

    if r.get("ctas_per_sm") != 8 or r.get("maxnreg") or not r.get("two_part", True):
        return False
    form = GluonLaunch(1).bf16_magic if bf16_magic is None else bf16_magic
    if "bfloat16" in r["method"] and row_bf16_magic(r) != form:
        return False
    pairs = r["B"] * kv_heads
    if pairs > SMALL_PAIRS:
        return r.get("tail_splits", 0) == 0
    tail = r.get("tail_splits", 0)
    return tail > 0 and tail == small_tail_splits(r["splits"] - tail, 8, sms, pairs)


def row_bf16_magic(r: dict) -> bool:
    """A timing row's bf16 unpack form (rows of runs before the option have none: the magic numbers)."""
    return r.get("bf16_magic", True)


def bf16_form_timed(timing: list[dict]) -> bool:
    """The bf16 unpack form whose default-launch rows a run has: today's default where it timed it, else the magic
    numbers (the default of the runs before 2026-12-07)."""
    from kitty.kernels.gluon_launch import GluonLaunch

    default = GluonLaunch(1).bf16_magic
    timed = {row_bf16_magic(r) for r in timing if "bfloat16" in r["method"] and " gluon" in r["method"]}
    return default if default in timed else True


def gpu_gluon() -> str:
    """The Gluon kernel's run: per shape the fastest FP16 SDPA, the ``tl`` kernel's default launch and the Gluon
    kernel's default launch of each variant (all timed in the same run), then its correctness counts."""
    from kitty.kernels.gluon_launch import GluonLaunch

    d = load_json("gluon_check")
    form = bf16_form_timed(d["timing"])
    sms = d["env"].get("sms", 132)  # H100 and H200 both have 132
    rows_: dict[tuple[int, int, str], dict] = {}
    for r in d["timing"]:
        parts = r["method"].split()
        default = parts[2:3] == ["gluon"] and gluon_default_row(r, bf16_magic=form, sms=sms)
        if len(parts) >= 3 and (parts[2] == "tl" or default):
            rows_[(r["B"], r["L"], " ".join(parts[:3]))] = r
    variants = ["kitty float16", "kitty bfloat16", "kitty-pro float16", "kitty-pro bfloat16"]
    body = []
    for key, f in d["fastest_fp16"].items():
        B, L = map(int, key.split(","))
        cell = lambda v, k: (  # noqa: E731
            f"{rows_[(B, L, v + ' ' + k)]['us']:.1f} ({rows_[(B, L, v + ' ' + k)]['vs_fp16']:.2f}x)"
            if (B, L, v + " " + k) in rows_
            else "not timed"
        )
        tl = cell("kitty float16", "tl")
        pct_copy = rows_.get((B, L, "kitty float16 gluon"), {}).get("pct_copy")
        gl16 = cell("kitty float16", "gluon") + (f", {pct_copy:.0f}% of copy" if pct_copy is not None else "")
        body.append([f"({B}, {L // 1024}K)", f"{f['us']:.1f} ({f['name']})", tl, gl16,
                     *(cell(v, "gluon") for v in variants[1:])])  # fmt: skip
    header = ["(batch, context)", "fastest FP16 SDPA, µs", "`tl` `kitty` fp16, µs", "Gluon `kitty` fp16, µs",
              "Gluon `kitty` bf16", "Gluon `kitty-pro` fp16", "Gluon `kitty-pro` bf16"]  # fmt: skip
    chk = d["check"].values()
    ran = [v for v in chk if "ok" in v]
    skipped = sum("skipped" in v for v in chk)
    unsupported = sum("supported" in v for v in chk)
    note = wrap(
        f"`{RESULTS['gluon_check']}` ({d['env']['gpu']}, triton {d['env']['triton']}, {d['env']['date']}): the "
        f"Gluon kernel passed the tolerance rule in {sum(bool(v['ok']) for v in ran)} of the {len(ran)} cases it "
        f"ran ({skipped} more were cut by the call's time budget; {unsupported} are configs it does not handle, "
        "which run the `tl` kernel). Each Gluon cell is the default launch (`default_gluon_launch`: 8 one-warp "
        "programs per SM, splits of equal cost; at batch 1 one page per program and 8 more programs for the "
        "full-precision chunks and the sink, 4 where 8 would start more than 8 a SM); the same file times the other "
        "launches beside it."
        + (
            " Cells marked not timed were cut by the call's time limit."
            if any("not timed" in c for r in body for c in r)
            else ""
        )
        + (
            ""
            if form == GluonLaunch(1).bf16_magic
            else " Its bf16 cells read the codes with magic numbers, that run's default; the default now reads them "
            "as exact subnormals like fp16's, 9% fewer instructions in kitty-pro's page loop, timed so far on an "
            "H100 (`benchmarks/results/h100-2026-12-07/`, `docs/GLUON.md`)."
        )
    )
    return table(header, body, "lrrrrrr") + "\n\n" + note


def gpu_gluon_step() -> str:
    """The captured decode step with the ``tl`` and the Gluon kernel against the captured FP16 step, tokens/s: at
    the same batch where FP16 ran it, Kitty's largest batch against FP16's fastest."""
    fp16, kitty = captured_steps()
    body = []
    for ctx in sorted({c for c, _ in fp16}):
        batches = sorted({b for _, c, b in kitty if c == ctx})
        for b in batches:
            base = b if (ctx, b) in fp16 else fastest_fp16_batch(fp16, ctx) if b == batches[-1] else None
            if base is None:
                continue
            cells = [
                f"{kitty[(g, ctx, b)]:.0f} ({kitty[(g, ctx, b)] / fp16[(ctx, base)]:.2f}x)" if (g, ctx, b) in kitty
                else "-"
                for g in (False, True)
            ]  # fmt: skip
            point = f"batch {b}" if base == b else f"{b} rows (FP16: {base}, its fastest)"
            body.append([f"{ctx // 1024}K", point, f"{fp16[(ctx, base)]:.0f}", *cells])
    header = ["context", "batch", "captured FP16 step, tokens/s", "`kitty`, `tl` kernel", "`kitty`, Gluon kernel"]
    return table(header, body, "llrrr")


def kernel_summary() -> dict[str, tuple[float, float]]:
    """Ranges over the shapes of the kernel benchmark, computed as notebook 05's summary computes them.

    ``copy_<m>``: % of copy bandwidth on the bytes the file counts (fp16; ``sdpa`` is the fastest FP16 SDPA at each
    shape); ``pack``: the pack launch spread over G steps, as % of the fused attention of the same shape;
    ``spike``: a page-filling step's attention + pack over an ordinary step's attention.
    """
    d = load_json("kernels")
    fastest = {tuple(map(int, k.split(","))): v["name"] for k, v in d["fastest_fp16"].items()}
    out: dict[str, tuple[float, float]] = {}
    pick = {"sdpa": lambda r: fastest.get((r["B"], r["L"])) == r["method"]}
    for m in ("kitty", "kitty-pro"):
        pick[m] = lambda r, m=m: r["method"] == f"{m} float16 fused"
    for m, keep in pick.items():
        vals = [r["pct_copy"] for r in d["timing"] if keep(r)]
        out[f"copy_{m}"] = (min(vals), max(vals))
    fused = [r for r in d["timing"] if pick["kitty"](r) or pick["kitty-pro"](r)]
    attend = {(r["B"], r["L"], r["method"].split()[0]): r["us"] for r in fused}
    G = PRESETS["kitty"].group_size
    pairs = [(attend[k], r["us"]) for r in d["pack_timing"] if (k := (r["B"], r["L"], r["preset"])) in attend]
    out["pack"] = (min(100 * p / G / a for a, p in pairs), max(100 * p / G / a for a, p in pairs))
    out["spike"] = (min((a + p) / a for a, p in pairs), max((a + p) / a for a, p in pairs))
    return out


def gpu_bandwidth() -> str:
    d, k = load_json("kernels"), kernel_summary()
    r = lambda key, f="{:.0f}": "–".join(f.format(x) for x in k[key])  # noqa: E731
    return wrap(
        f"Share of copy bandwidth ({d['copy_bw'] / 1e12:.2f} TB/s measured) on the bytes each call moves, over "
        f"{len(d['fastest_fp16'])} shapes: the fastest FP16 SDPA {r('copy_sdpa')}%, `kitty` fused (fp16) "
        f"{r('copy_kitty')}%, `kitty-pro` fused {r('copy_kitty-pro')}%. Packing pages with the Triton pack kernel, "
        f"spread over the {PRESETS['kitty'].group_size} steps between packs, costs {r('pack', '{:.2f}')}% of decode "
        f"attention; the step that packs takes {r('spike', '{:.2f}')}x an ordinary step's attention. Measured "
        f"{d['env']['date']} on an {d['env']['gpu']}, torch {d['env']['torch']}, triton {d['env']['triton']}."
    )


def notebook05() -> str:
    k = kernel_summary()
    r = lambda key, f="{:.0f}": "–".join(f.format(x) for x in k[key])  # noqa: E731
    return wrap(
        f"In `{RESULTS['kernels']}`, the newest run: the fused kernel at {r('copy_kitty')}% of copy bandwidth "
        f"(`kitty`, fp16; the fastest FP16 SDPA {r('copy_sdpa')}%), a page-boundary spike of {r('spike', '{:.2f}')}x "
        f"a step's attention, {r('pack', '{:.2f}')}% amortized."
    )


def gpu_history() -> str:
    md = path("kernel_history").read_text()

    def sass_counts(heading: str) -> list[str]:
        sec = md.split(heading, 1)[1].split("\n###", 1)[0]
        cells = [line.rsplit("|", 2)[-2] for line in sec.splitlines() if line.startswith("| ") and "---" not in line]
        return [m.group() for c in cells[1:] if (m := re.search(r"[\d.]+", c))]

    first, now = sass_counts("### What changed")[0], sass_counts("### Step by step")[-1]
    return (f"SASS instructions per cached element in the hot loop, from `{RESULTS['kernel_history']}`'s step-by-step "
            f"tables: {first.lstrip('~')} in the first kernel, {now} now.")  # fmt: skip


def gpu_throughput() -> str:
    rows_ = [r for r in load_json("throughput")["rows"] if r["batch"] == r["max_batch"]]
    ref = {r["method"]: r for r in rows_}
    body = []
    for r in rows_:
        vs = [f"{r['batch'] / ref[b]['batch']:.1f}x / {r['tokens_per_s'] / ref[b]['tokens_per_s']:.1f}x"
              for b in ("fp16-dynamic", "fp16-static")]  # fmt: skip
        body.append([f"`{r['method']}`", f"{r['context'] // 1024}K", r["batch"], f"{r['kv_gib']:.1f}",
                     f"{r['tokens_per_s']:.0f}", *vs])  # fmt: skip
    header = ["cache", "context", "largest batch that fits", "KV GiB", "decode tokens/s",
              "batch / tok/s vs dynamic fp16", "vs static fp16"]  # fmt: skip
    return table(header, body, "llrrrrr")


BLOCKS: dict[str, Callable[[], str]] = {
    "headline_size": headline_size,
    "headline_cost": headline_cost,
    "headline_speed": headline_speed,
    "accuracy_ppl": accuracy_ppl,
    "accuracy_agreement": accuracy_agreement,
    "accuracy_passkey": accuracy_passkey,
    "research_ppl": research_ppl,
    "research_targets": research_targets,
    "research_passkey": research_passkey,
    "research_pack": research_pack,
    "research_boost_speed": research_boost_speed,
    "gpu_speed": gpu_speed,
    "gpu_layout_speed": gpu_layout_speed,
    "gpu_gluon": gpu_gluon,
    "gpu_gluon_step": gpu_gluon_step,
    "gpu_bandwidth": gpu_bandwidth,
    "gpu_history": gpu_history,
    "notebook05": notebook05,
    "gpu_throughput": gpu_throughput,
}
# start marker, body (never another start marker), end marker; a rendered body ends with a newline
BLOCK_RE = re.compile(r"(<!-- quoted:([\w-]+) -->\n)((?:(?!<!-- quoted:).)*?)(<!-- /quoted -->)", re.S)


def render(text: str) -> str:
    """``text`` with every quoted block rewritten from the results files."""

    def fill(m: re.Match) -> str:
        if m.group(2) not in BLOCKS:
            raise KeyError(f"unknown quoted block {m.group(2)!r}; known: {sorted(BLOCKS)}")
        return m.group(1) + BLOCKS[m.group(2)]().rstrip("\n") + "\n" + m.group(4)

    return BLOCK_RE.sub(fill, text)


def block_names(text: str) -> list[str]:
    return [m.group(2) for m in BLOCK_RE.finditer(text)]


def crop_picture() -> None:
    """The README's picture: the three columns and their readouts, cut from the app's screenshot."""
    from PIL import Image

    im = Image.open(ROOT / SCREENSHOT).convert("RGB")
    w, h = im.size
    box = (round(0.064 * w), round(0.232 * h), round(0.936 * w), round(0.595 * h))  # verdict, columns, readouts
    part = im.crop(box)
    part = part.resize((part.width * 3 // 4, part.height * 3 // 4), Image.LANCZOS)
    part.quantize(colors=128).save(ROOT / PICTURE, optimize=True)


def main(argv: list[str]) -> int:
    if "--crop" in argv:
        crop_picture()
    stale = []
    for page in PAGES:
        p = ROOT / page
        if not p.is_file():
            continue
        old = p.read_text()
        new = render(old)
        if new != old:
            stale.append(page)
            if "--check" not in argv:
                p.write_text(new)
    if stale:
        print(("stale: " if "--check" in argv else "rewrote: ") + ", ".join(stale))
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
