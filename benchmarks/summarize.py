"""Regenerates ``benchmarks/RESULTS.md`` from the result folders ``benchmarks/results/<gpu>-<date>/``.

    python benchmarks/summarize.py           # rewrite benchmarks/RESULTS.md
    python benchmarks/summarize.py --check   # exit 1 (and say so) when RESULTS.md is not what the folders give

Every file of every folder is rendered, newest folder first: ``kernels_*.json`` (``benchmarks/kernels.py``),
``throughput*.json`` (``benchmarks/throughput.py``), ``boost_profile_*.json`` (``benchmarks/boost_profile_speed.py``),
``pack_cost*.csv`` (``benchmarks/pack_cost.py``) and pytest logs (``*.log``: their summary line); each folder's
``COMMANDS.md`` says which command made each file. Only this script writes RESULTS.md; the hand-written analysis of
these numbers is ``docs/BENCHMARKS.md``. Needs only the standard library (no torch, no GPU).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"

# The shapes the kernel targets name (>= 4x the fastest FP16, >= 70% of copy bandwidth); kernels.py also times bf16
# there.
TARGET_SHAPES = [(8, 32768), (64, 8192)]
# The paper's own (unfused) kernels, fp16, same shapes, measured on the H200 with torch 2.11 / triton 3.6 (2026-12-01,
# before the fused kernel existed); not rerun by kernels.py.
OFFICIAL_KITTY_MS = {(1, 4096): 0.181, (1, 32768): 1.368, (16, 8192): 0.371, (64, 8192): 0.871, (8, 32768): 1.419}


def sdpa_names(res: dict) -> list[str]:
    """The SDPA backends a kernel run timed, in its order (from its rows' method names, ``sdpa-<backend> ...``)."""
    names = [r["method"].split()[0][len("sdpa-") :] for r in res["timing"] if r["method"].startswith("sdpa-")]
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------- kernels.py


def render_kernels(res: dict, name: str, correctness_file: str | None) -> list[str]:
    """The tables of one ``benchmarks/kernels.py`` run (``name``: its file)."""
    env = res["env"]
    out = [
        f"### `{name}`",
        "",
        f"Measured by `benchmarks/kernels.py` on **{env['gpu']}** ({env['sms']} SMs), driver {env['driver']}, "
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, Python {env['python']}, {env['date']}.",
        "",
        "Times: median of 30 CUDA-graph replays (many calls each, rotating inputs > 4x L2, after warm-up). "
        "Bytes: what the method must move (cache read + query/output + split workspace; unfused adds its logit/"
        "probability round trips), counted from the layout. 32 query / 8 KV heads, D=128, fp16, G=128, S=32, R=128; "
        "all rows at full length L.",
        "",
        f"Device copy bandwidth (read + write, 2 GiB D2D copy; the best of eager copy_, eager add and a graph-captured "
        f"copy {res.get('copy_detail', {})}): **{res['copy_bw'] / 1e12:.3f} TB/s**."
        if "copy_bw" in res
        else "Device copy bandwidth: not measured in this run.",
        "",
        "#### Correctness on the GPU (before timing)",
        "",
    ]
    if res["correct"] is None:
        out += [
            "Not run in this invocation (`--timing-only`)"
            + (f": the GPU correctness run before it, same day, is `{correctness_file}`." if correctness_file else "."),
            "",
        ]
    else:
        out += [
            f"- pack bit-identical to kitty.core.quant: {'yes' if res['correct']['pack_dequant'] else 'NO'} "
            + "; ".join(f"{k}: {'ok' if not any(v.values()) else v}" for k, v in res["pack"].items()),
            "- dequantization vs kitty.core.quant (differing elements / total / max ulp): "
            + "; ".join(f"{k}: key {v['key']}, value {v['value']}" for k, v in res["dequant"].items()),
            "- attention (max|out-ref| <= 2 max|pt-ref| + floor): "
            + ("all pass" if res["correct"]["attention"] else "FAILURES"),
            "",
        ]
        out += ["| case | max abs err | tolerance | ok |", "|---|---|---|---|"]
        for k, v in res["attention"].items():
            out.append(f"| {k} | {v['err']:.2e} | {v['tol']:.2e} | {'yes' if v['ok'] else 'NO'} |")
    if not res["timing"]:
        return out + ["", "Correctness only (`--check-only`): nothing timed.", ""]
    out += [
        "",
        "#### Decode attention",
        "",
        f"Baseline: the fastest FP16 attention measured in the same run at each shape, over every SDPA backend "
        f"({', '.join(sdpa_names(res))}) with GQA as `enable_gqa` or folded into the query length.",
        "",
        "| B | L | method | time (us) | MB moved | GB/s | % of copy BW | vs fastest FP16 | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["timing"]:
        sp = r.get("speedup_vs_sdpa")
        out.append(
            f"| {r['B']} | {r['L']} | {r['method']} | {r['us']:.1f} | {r['bytes'] / 1e6:.2f} | {r['gbps']:.0f} | "
            f"{r['pct_copy']:.1f} | {'' if sp is None else f'{sp:.2f}x'} | {r['extra']} |"
        )
    out += [
        "",
        "#### Fused-kernel sweep (time in us per configuration; the best is reported above)",
        "",
        "| B | L | preset | dtype | configuration | time (us) |",
        "|---|---|---|---|---|---|",
    ]
    for sw in sorted(res["sweep"], key=lambda x: (x["B"], x["L"], x["preset"], x.get("dtype", ""), x["us"])):
        out.append(
            f"| {sw['B']} | {sw['L']} | {sw['preset']} | {sw.get('dtype', '')} | {sw['config']} | {sw['us']:.1f} |"
        )
    out += [
        "",
        "#### Default launch (`decode_attention_triton(q, state, cfg)`, no tuning arguments)",
        "",
        "| B | L | preset | dtype | time (us) | vs fastest FP16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in res.get("default_launch", []):
        sp = r.get("speedup_vs_sdpa")
        out.append(
            f"| {r['B']} | {r['L']} | {r['preset']} | {r['dtype']} | {r['us']:.1f} | "
            f"{'' if sp is None else f'{sp:.2f}x'} |"
        )
    out += [
        "",
        "#### Pack (quantize + pack one full qbuffer per row and KV head, keys and values, one launch)",
        "",
        "| B | L | preset | time (us) | us per page (one head, k+v) | amortized over G steps, % of fused decode |",
        "|---|---|---|---|---|---|",
    ]
    for p in res["pack_timing"]:
        out.append(
            f"| {p['B']} | {p['L']} | {p['preset']} | {p['us']:.1f} | {p['us_per_page']:.2f} | "
            f"{p['amortized_pct_of_fused']:.2f} |"
        )
    out += ["", "#### Targets", ""]
    for r in res["timing"]:
        if "preset" not in r:
            continue
        shape, sp = (r["B"], r["L"]), r.get("speedup_vs_sdpa")
        official = OFFICIAL_KITTY_MS.get(shape)
        line = f"- {r['method']} {shape}: {'n/a' if sp is None else f'{sp:.2f}x'} the fastest FP16"
        if shape in TARGET_SHAPES:
            line += (
                f" (target >= 4x: {'met' if sp and sp >= 4 else 'missed'}); {r['pct_copy']:.0f}% of copy BW "
                f"(target >= 70%: {'met' if r['pct_copy'] >= 70 else 'missed'})"
            )
        else:
            line += f" (target >= 1x: {'met' if sp and sp >= 1 else 'missed'})"
        if official:
            faster = official * 1e3 / r["us"]
            met = "met" if faster > 1 else "missed"
            line += (
                f"; {faster:.1f}x faster than the official Kitty kernels ({official} ms, measured earlier; "
                f"target > 1x: {met})"
            )
        out.append(line)
    for p in res["pack_timing"]:
        if (p["B"], p["L"]) in TARGET_SHAPES:
            out.append(
                f"- pack {p['preset']} ({p['B']}, {p['L']}): {p['amortized_pct_of_fused']:.2f}% amortized "
                f"(target <= 2%: {'met' if p['amortized_pct_of_fused'] <= 2 else 'missed'})"
            )
    return out


# ----------------------------------------------------------------------------------- the other scripts' files


def render_throughput(d: dict, name: str) -> list[str]:
    """The tables of one ``benchmarks/throughput.py`` run: the largest batch per method, then every point."""
    rows, meta = d["rows"], d.get("meta", {})
    out = [f"### `{name}`: end-to-end decode throughput at one KV budget", ""]
    if meta:
        out += [
            f"`benchmarks/throughput.py` on {meta['gpu']}, torch {meta['torch']}, {meta['date']}. Budget "
            f"{meta['budget_gib']:g} GiB, context {meta['context']}, {meta['layers']} layers, random bf16 weights "
            f"({meta['weights_gib']:.1f} GiB); tokens/s = batch / median wall time of {meta['steps']} steps after "
            f"{meta['warmup']} warm-up.",
            "",
        ]
    else:
        out += ["The file records no device, date or budget: its folder's COMMANDS.md says how it was made.", ""]
    best = {r["method"]: r for r in rows if r["batch"] == r["max_batch"]}
    base = best.get("fp16-dynamic") or best.get("fp16-static")
    out += [
        "KV GiB: GPU memory held by the filled cache (allocated, including empty buffer slots and pool capacity).",
        "",
        "| method | max batch | batch vs fp16 | KV GiB | peak GiB | tokens/s | vs fp16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in best.items():
        rel_b = r["batch"] / base["batch"] if base else float("nan")
        rel_t = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        out.append(
            f"| {m} | {r['batch']} | {rel_b:.1f}x | {r['kv_gib']:.2f} | {r['peak_gib']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {rel_t:.2f}x |"
        )
    out += [
        "",
        "All points (batch sweep):",
        "",
        "| method | batch | KV GiB | peak GiB | tokens/s |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['method']} | {r['batch']} | {r['kv_gib']:.2f} | {r['peak_gib']:.2f} | {r['tokens_per_s']:.0f} |"
        for r in rows
    ]
    return out + [""] + [f"- {n}" for n in d.get("notes", [])]


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def render_static(files: list[Path], correctness: list[Path]) -> list[str]:
    """The static-cache, CUDA-graph-captured decode tables (``benchmarks/static_h200.py``) of one folder: every point
    of every ``static_throughput*.json``, each against the fastest captured FP16 ``StaticCache`` of the folder at
    the same context (and the same batch for batch-1 points), then the targets marked met or missed."""
    rows = [dict(r, file=f.name) for f in files for r in json.loads(f.read_text())["rows"]]
    notes = [n for f in files for n in json.loads(f.read_text()).get("notes", [])]
    fp16 = [r for r in rows if r["method"].startswith("fp16-static-captured")]

    def best_fp16(context: int, ragged: bool | None = None, batch: int | None = None) -> dict | None:
        pool = [
            r
            for r in fp16
            if r["context"] == context and (ragged is None or r["ragged"] == ragged) and batch in (None, r["batch"])
        ]
        return max(pool, key=lambda r: r["tokens_per_s"], default=None)

    out = [
        "### static caches, decode step captured in a CUDA graph (`benchmarks/static_h200.py`)",
        "",
        "Qwen3-8B shape, random bf16 weights, 20 GiB KV budget. tokens/s = batch / median step of the timed steps; "
        "KV GiB: memory the filled static cache holds; busy: sum of CUDA kernel time over 4 profiled steps / the "
        "pipelined step's time without the profiler (in brackets: / the profiled steps' own wall time, which the "
        "profiler stretches); p99 page: over the steps that complete pages. `-unmasked-<backend>`: FP16 SDPA over"
        " the whole static cache without a mask (an upper bound on FP16 speed: same bytes, not the model's "
        "outputs); `-gqa`: masked SDPA with unrepeated KV heads. vs FP16 = against the fastest captured FP16 "
        "point at that context and the "
        "same lengths (equal or ragged; equal where no ragged FP16 point exists).",
        "",
        "| method | context | lengths | batch | KV GiB | tokens/s | vs fastest FP16 captured | vs FP16 batch 1 | "
        "busy | p50 ms | p99 ms | p99 page ms | file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = best_fp16(r["context"], r["ragged"]) or best_fp16(r["context"])
        one = best_fp16(r["context"], batch=1)
        rel = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        rel1 = r["tokens_per_s"] / one["tokens_per_s"] if one and r["batch"] == 1 else None
        out.append(
            f"| {r['method']} | {r['context']} | {'ragged' if r['ragged'] else 'equal'} | {r['batch']} | "
            f"{r['kv_gib']:.2f} | {r['tokens_per_s']:.0f} | {_fmt(rel, '.2f')}x | {_fmt(rel1, '.2f')} | "
            f"{_busy(r)} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{_fmt(r['p99_page_ms'])} | `{r['file']}` |"
        )
    out += [
        "",
        "Targets (the decode-step goals; tokens/s synchronized per step, the product's pipelined loop beside):",
        "",
    ]
    for method in sorted({r["method"] for r in rows if r["method"].startswith("kitty") and "-captured" in r["method"]}):
        out += _static_targets(method, [r for r in rows if r["method"] == method and not r["ragged"]], best_fp16)
    out += [""] + [f"- {n}" for n in notes if not n.startswith("skipped")]
    for path in correctness:
        out += ["", f"Correctness (`{path.name}`):", ""]
        for k, v in json.loads(path.read_text()).items():
            text = json.dumps(v) if "error" not in json.dumps(v) else "failed: " + _first_error(v)
            out.append(f"- {k}: {text}")
    return out


def busy_unprofiled(r: dict) -> float | None:
    """The share of an unprofiled decode step the GPU spends in kernels: kernel time per step under the profiler
    over the pipelined step's time without it (the profiler stretches every replay it records, CUPTI timing each
    kernel of the graph, so its own wall, ``gpu_busy``'s denominator, counts that overhead as idle time). ``None``
    where the point was not profiled."""
    if r.get("gpu_ms_per_step") and r.get("pipelined_ms"):
        return r["gpu_ms_per_step"] / r["pipelined_ms"]
    return None


def _busy(r: dict) -> str:
    """The busy column: unprofiled share (profiled share)."""
    un, prof = busy_unprofiled(r), r.get("gpu_busy")
    if un is None:
        return f"{_fmt(prof and 100 * prof, '.0f')}%"
    return f"{100 * un:.0f}% ({_fmt(prof and 100 * prof, '.0f')}%)"


def _static_targets(method: str, rows: list[dict], best_fp16) -> list[str]:
    """One kitty method's decode-step targets, each marked met or missed: batch 1 >= 1.0x the captured FP16 step of
    batch 1, the same batch 16 >= 1.0x, the largest batch >= 2.6x the fastest captured FP16 step (>= 3.5x at 8K and
    >= 4x at 32K with the Gluon kernel), GPU busy >= 90% and p99 of the page-completing steps within 10% of p50."""

    def mark(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    out = []
    for r in sorted(rows, key=lambda r: (r["context"], r["batch"])):
        ctx, b = r["context"], r["batch"]
        same, base = best_fp16(ctx, False, b), best_fp16(ctx, False)
        if b in (1, 16) and same:
            rel = r["tokens_per_s"] / same["tokens_per_s"]
            piped = r.get("pipelined_tokens_per_s", 0) / max(same.get("pipelined_tokens_per_s", 0), 1e-9)
            out.append(
                f"- {method}, {ctx} tokens, batch {b}: {rel:.2f}x the captured FP16 step of the same batch "
                f"(pipelined {piped:.2f}x; target >= 1.0x) - {mark(rel >= 1.0)}"
            )
        elif base and b > base["batch"]:
            rel = r["tokens_per_s"] / base["tokens_per_s"]
            goal = (3.5 if ctx <= 8192 else 4.0) if "gluon" in method else 2.6
            out.append(
                f"- {method}, {ctx} tokens, largest batch {b}: {rel:.2f}x the fastest captured FP16 step "
                f"({base['tokens_per_s']:.0f} tokens/s at batch {base['batch']}; target >= {goal}x) - "
                f"{mark(rel >= goal)}"
            )
        busy, page = busy_unprofiled(r), r.get("p99_page_ms")
        if busy:
            out.append(
                f"  - busy {100 * busy:.0f}% unprofiled ({100 * r['gpu_busy']:.0f}% of the profiled wall; target "
                f">= 90%) - {mark(busy >= 0.9)}"
            )
        if page:
            out.append(
                f"  - p99 of page steps {page:.1f} ms against p50 {r['p50_ms']:.1f} ms "
                f"(+{100 * (page / r['p50_ms'] - 1):.0f}%; target <= +10%) - {mark(page <= 1.1 * r['p50_ms'])}"
            )
    return out


def _first_error(v) -> str:
    """The first exception line (``SomeError: message``) of a correctness entry's traceback(s)."""
    errs = [v["error"]] if isinstance(v, dict) and "error" in v else [e.get("error") or "" for e in v.values()]
    lines = [ln for e in errs for ln in e.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return "`" + lines[0][:200].replace("|", "/").replace("`", "'") + "`" if lines else "(no message)"


def render_boost_profile(d: dict, name: str) -> list[str]:
    """One ``benchmarks/boost_profile_speed.py`` run: fused-kernel time per boosted-channel count, then per step."""
    s = d["shape"]
    out = [
        f"### `{name}`: layer-adaptive boost against uniform boost",
        "",
        f"Fused decode attention on {d['gpu']}, torch {d['torch']}, B={d['batch']}, L={d['context']}, "
        f"{s['Hq']} query / {s['Hkv']} KV heads, D={s['D']}.",
        "",
        "| boosted channels | us per layer call | max abs err vs reference |",
        "|---|---|---|",
    ]
    out += [f"| {nb} | {v['us']:.1f} | {v['max_abs_err_vs_ref']:.2e} |" for nb, v in d["per_nb"].items()]
    out += [
        "",
        f"| preset | one decode step over {s['layers']} layers, uniform (us) | profile (us) | profile / uniform |",
    ]
    out += ["|---|---|---|---|"]
    out += [
        f"| {p} | {v['uniform']:.1f} | {v['profile']:.1f} | {v['profile_over_uniform']:.3f}x |"
        for p, v in d["summary"].items()
    ]
    return out


def render_csv(path: Path) -> list[str]:
    """A CSV as a table (floats to 2 decimals)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))

    def cell(x: str) -> str:
        return f"{float(x):.2f}" if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", x) else x

    out = [f"### `{path.name}`", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return out + ["| " + " | ".join(map(cell, r)) + " |" for r in rows[1:]]


def render_log(path: Path) -> list[str]:
    """A pytest log: its last summary line (``N passed``, ``N failed``, ...) and the tests that failed."""
    lines = path.read_text().splitlines()
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    failed = [ln.split()[1] for ln in lines if ln.startswith("FAILED ")]
    out = [f"### `{path.name}`", "", f"pytest: {summary or 'no summary line'}."]
    return out + ([""] + [f"- failed: `{t}`" for t in failed] if failed else [])


def render_layout(d: dict, name: str) -> list[str]:
    """A ``benchmarks/layout_sweep.py`` run: its correctness cases, then per shape the fastest FP16 attention, each
    preset's default launch and the sweep's best launch (the ratio is against the FP16 time of the same run)."""
    checks = d.get("check", {})
    failed = [k for k, v in checks.items() if not v["ok"]]
    out = [f"### `{name}`", "", f"{d['env']['gpu']}, {d['env']['date']}, triton {d['env']['triton']}."]
    if checks:
        out += [
            "",
            f"Correctness (max |out - ref| <= 2 max |pt - ref| + floor): {len(checks) - len(failed)} of "
            f"{len(checks)} cases pass.",
        ]
        out += [f"- FAIL `{k}`: err {checks[k]['err']:.3g} > tol {checks[k]['tol']:.3g}" for k in failed]
    if d.get("copy_bw"):
        out += ["", f"Copy bandwidth: {d['copy_bw'] / 1e12:.2f} TB/s."]
    rows = d.get("timing", [])
    shapes = sorted({(r["B"], r["L"]) for r in rows}, key=lambda x: (-x[0] * x[1], x[0]))
    if not shapes:
        return out
    out += [
        "",
        "| (B, L) | fastest FP16 | method | default launch | x FP16 | % copy | best of sweep | x FP16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for B, L in shapes:
        fp16 = d.get("fastest_fp16", {}).get(f"{B},{L}")
        for method in sorted(
            {
                r["method"].rsplit(" ", 1)[0]
                for r in rows
                if (r["B"], r["L"]) == (B, L) and not r["method"].startswith("sdpa")
            }
        ):
            mine = [r for r in rows if (r["B"], r["L"]) == (B, L) and r["method"].startswith(method + " ")]
            dflt = next((r for r in mine if r["method"].endswith(" default")), None)
            sweep = min((r for r in mine if r["method"].endswith(" sweep")), key=lambda r: r["us"], default=None)
            out.append(
                f"| ({B}, {L}) | {fp16['name']} {fp16['us']:.1f} us | {method} | "
                + (f"{dflt['us']:.1f} us | {dflt['vs_fp16']:.2f}x | {dflt['pct_copy']:.0f}% | " if dflt else "| | | ")
                + (
                    f"{sweep['us']:.1f} us `{json.dumps(sweep['launch'])}` | {sweep['vs_fp16']:.2f}x |"
                    if sweep
                    else " | |"
                )
            )
    return out


# ------------------------------------------------------------------------------------------------- the file


def kernels_sort_key(path: Path) -> str:
    return json.loads(path.read_text())["env"]["date"]


def render_folder(folder: Path) -> list[str]:
    rel = folder.relative_to(HERE.parent).as_posix()
    out = [
        f"## `{rel}/`",
        "",
        f"Commands: [`{rel}/COMMANDS.md`]({folder.relative_to(HERE).as_posix()}/COMMANDS.md).",
        "",
    ]
    kernels = sorted(folder.glob("kernels_*.json"), key=kernels_sort_key)
    for path in kernels:
        res = json.loads(path.read_text())
        earlier = [
            p
            for p in kernels
            if p != path and json.loads(p.read_text())["correct"] and kernels_sort_key(p) < res["env"]["date"]
        ]
        correctness = f"{rel}/{earlier[-1].name}" if earlier else None
        out += render_kernels(res, path.name, correctness) + [""]
    for path in sorted(folder.glob("throughput*.json")):
        out += render_throughput(json.loads(path.read_text()), path.name) + [""]
    static = sorted(folder.glob("static_throughput*.json"))
    if static:
        out += render_static(static, sorted(folder.glob("static_correctness*.json"))) + [""]
    for path in sorted(folder.glob("boost_profile_*.json")):
        out += render_boost_profile(json.loads(path.read_text()), path.name) + [""]
    for path in sorted(folder.glob("layout_*.json")):
        out += render_layout(json.loads(path.read_text()), path.name) + [""]
    for path in sorted(folder.glob("*.csv")):
        out += render_csv(path) + [""]
    for path in sorted(folder.glob("*.log")):
        out += render_log(path) + [""]
    return out


def summarize(results_dir: Path = RESULTS_DIR) -> str:
    """The text of RESULTS.md for every folder under ``results_dir`` (newest date first)."""
    folders = sorted(
        (p for p in results_dir.iterdir() if p.is_dir()), key=lambda p: (p.name[-10:], p.name), reverse=True
    )
    out = [
        "# Kitty benchmark results",
        "",
        "Generated by `python benchmarks/summarize.py` from `benchmarks/results/<gpu>-<date>/` (do not edit: a test "
        "checks that this file is what the folders give). What the numbers mean, and why: "
        "[docs/BENCHMARKS.md](../docs/BENCHMARKS.md).",
        "",
    ]
    for folder in folders:
        out += render_folder(folder)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that RESULTS.md is up to date")
    a = ap.parse_args(argv)
    text = summarize()
    if a.check:
        if not RESULTS_MD.exists() or RESULTS_MD.read_text() != text:
            print(f"{RESULTS_MD} is out of date: run python benchmarks/summarize.py", file=sys.stderr)
            return 1
        return 0
    RESULTS_MD.write_text(text)
    print("wrote", RESULTS_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
