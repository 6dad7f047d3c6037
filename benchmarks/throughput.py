"""End-to-end decode throughput at one KV-memory budget (paper Fig. 5 / Table 4 analogue), for an NVIDIA H200.

A model with the Qwen3-8B architecture and random bf16 weights (throughput does not depend on weight values) decodes
at a fixed context (8K by default). For every method the same KV-memory budget decides the largest batch that fits;
we then measure steady-state decode tokens/s (CUDA-event timed steps after warm-up) and peak GPU memory at several
batch sizes up to that maximum. Caches are filled with random keys/values through their real insertion path
(``DynamicCache.update``, ``StaticCache.update``, ``KittyLayer.append``, which quantizes pages), so no prefill
compute is spent on an 8B model.

    python -m benchmarks.throughput --budget-gib 20 --context 8192 --out $OUT

Writes ``throughput.json`` (rows, notes and the run's settings; ``benchmarks/summarize.py`` renders it into
``benchmarks/RESULTS.md``), ``throughput.md`` and ``throughput.png`` (memory and tokens/s against batch) to ``--out``
(default ``benchmarks/results/<gpu>-<date>/``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.results_dir import default_out
from kitty import PRESETS, KittyCache
from kitty.core.memory import analytic_report, token_layout
from kitty.hf.compat import cache_kwargs

DEVICE = "cuda"


def qwen3_8b_config(num_layers: int | None = None, smoke: bool = False):
    """Qwen3-8B's architecture (36 layers, 32 query / 8 KV heads, head_dim 128); ``smoke``: a tiny one for CPU
    checks."""
    from transformers import Qwen3Config

    if smoke:
        return Qwen3Config(
            vocab_size=1000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
        )
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=num_layers or 36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def build_model(num_layers: int | None, smoke: bool = False):
    from transformers import AutoModelForCausalLM

    config = qwen3_8b_config(num_layers, smoke)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():  # small random weights keep activations finite over 36 layers
        p.data.normal_(0, 0.02)
    return model.eval()


def kv_bytes_per_seq(method: str, config, context: int) -> int:
    """KV bytes one sequence of ``context`` tokens takes under ``method``, as allocated (what the budget limits).

    Kitty: its pages (analytic, equal to the cache's report) plus the full-precision buffers at their allocated
    capacity (sink, both qbuffers and the local window exist for every row whether filled or not).
    """
    D, H, L = config.head_dim, config.num_key_value_heads, config.num_hidden_layers
    if method.startswith("fp16"):
        return 2 * context * H * D * L * 2
    cfg = PRESETS[method]
    rep = analytic_report(cfg, context, D, H, L, 2)
    buffer_slots = 2 * cfg.sink_tokens + 2 * cfg.group_size + cfg.local_window
    return rep.payload_bytes + rep.metadata_bytes + buffer_slots * H * D * 2 * L


def pages_per_row(method: str, context: int) -> int:
    lay = token_layout(PRESETS[method], context)
    return max(lay.key_pages, lay.value_pages)


def fill_cache(method: str, model, batch: int, context: int, extra: int):
    """A cache holding ``context`` random tokens per row, ready for ``extra`` decode steps."""
    from transformers import DynamicCache, StaticCache

    c = model.config
    H, D = c.num_key_value_heads, c.head_dim
    g = torch.Generator(device=DEVICE).manual_seed(0)
    chunk = 1024

    def rand(t):
        return torch.randn(batch, H, t, D, device=DEVICE, dtype=torch.bfloat16, generator=g)

    if method == "fp16-dynamic":
        cache = DynamicCache(config=c)
        for i in range(c.num_hidden_layers):
            cache.update(rand(context), rand(context), i)
        return cache
    if method == "fp16-static":
        cache = StaticCache(config=c, max_cache_len=context + extra)
        pos = torch.arange(context, device=DEVICE)
        for i in range(c.num_hidden_layers):
            cache.update(rand(context), rand(context), i, {"cache_position": pos})
        return cache
    # pools sized exactly (no doubling slack), so the allocated KV memory is what the budget allowed
    cache = KittyCache(
        c,
        PRESETS[method],
        backend="triton" if DEVICE == "cuda" else "torch",
        max_pages=batch * pages_per_row(method, context + extra),
    )
    for layer in cache.layers:
        for start in range(0, context, chunk):
            t = min(chunk, context - start)
            layer.append(rand(t), rand(t))
    return cache


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_rate(model, cache, batch: int, context: int, steps: int, warmup: int, static: bool) -> float:
    """Decode tokens/s over ``steps`` timed single-token steps for all rows."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=DEVICE)
    times = []
    for i in range(warmup + steps):
        pos = context + i
        kw = {"cache_position": torch.tensor([pos], device=DEVICE)} if static else {}
        sync()
        t = time.perf_counter()
        logits = model(ids, **cache_kwargs(cache), use_cache=True, **kw).logits
        ids = logits[:, -1:].argmax(-1)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    times.sort()
    return batch / times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=20.0, help="KV-memory budget shared by every method")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a smoke run")
    ap.add_argument("--methods", default="fp16-dynamic,fp16-static,quantized-hf,kitty,kitty-pro")
    ap.add_argument("--out", default=None, help="folder for the results (default: benchmarks/results/<gpu>-<date>/)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU: checks the plumbing, measures nothing useful"
    )
    a = ap.parse_args()
    global DEVICE
    if a.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/throughput.py needs a CUDA GPU (or --smoke)")
    mem = (lambda: torch.cuda.memory_allocated()) if DEVICE == "cuda" else (lambda: 0)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    out = Path(a.out) if a.out else default_out(gpu)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(a.layers, a.smoke)
    weights = mem()
    budget = int(a.budget_gib * 2**30)
    meta = dict(
        gpu=gpu,
        torch=torch.__version__,
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        budget_gib=a.budget_gib,
        context=a.context,
        steps=a.steps,
        warmup=a.warmup,
        layers=model.config.num_hidden_layers,
        weights_gib=weights / 2**30,
    )
    rows, notes = [], []
    for method in a.methods.split(","):
        if method == "quantized-hf":
            try:
                import optimum.quanto  # noqa: F401
                from transformers import QuantizedCache  # noqa: F401
            except Exception as e:  # noqa: BLE001
                notes.append(
                    f"transformers' QuantizedCache: not run ({type(e).__name__}: {e}); it needs optimum-quanto or hqq, "
                    "absent on the device"
                )
                continue
        per_seq = kv_bytes_per_seq(method, model.config, a.context + a.warmup + a.steps)
        max_batch = budget // per_seq
        if max_batch < 1:
            notes.append(f"{method}: one sequence ({per_seq / 2**30:.2f} GiB) exceeds the budget")
            continue
        batches = sorted({b for b in (1, 4, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        for b in tqdm(batches, desc=method, unit="batch"):
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                cache = fill_cache(method, model, b, a.context, a.warmup + a.steps)
                kv = mem() - weights
                rate = decode_rate(model, cache, b, a.context, a.steps, a.warmup, method == "fp16-static")
                peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
                rows.append(
                    dict(
                        method=method,
                        context=a.context,
                        batch=b,
                        max_batch=max_batch,
                        kv_gib=kv / 2**30,
                        peak_gib=peak / 2**30,
                        tokens_per_s=rate,
                    )
                )
                print(rows[-1], flush=True)
                (out / "throughput.json").write_text(
                    json.dumps(dict(meta=meta, rows=rows, notes=notes), indent=1)
                )  # partial results survive a timeout
            except torch.cuda.OutOfMemoryError as e:
                notes.append(f"{method} batch {b}: out of memory ({e})")
            finally:
                cache = None
    best = {}
    for r in rows:
        if r["batch"] == r["max_batch"]:
            best[r["method"]] = r
    base = best.get("fp16-dynamic") or best.get("fp16-static")
    lines = [
        f"## End-to-end decode throughput at one KV budget ({a.budget_gib:g} GiB), context {a.context}",
        "",
        f"`benchmarks/throughput.py` on {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU (smoke)'}, "
        f"torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. "
        "Qwen3-8B architecture, random bf16 weights "
        f"({weights / 2**30:.1f} GiB), {model.config.num_hidden_layers} layers; tokens/s = batch / median wall time "
        f"(synchronized) of {a.steps} steps after {a.warmup} warm-up.",
        "",
        "KV GiB: GPU memory held by the filled cache (allocated, including empty buffer slots and pool capacity).",
        "",
        "| method | max batch | batch vs fp16 | KV GiB | peak GiB | tokens/s | vs fp16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in best.items():
        rel_b = r["batch"] / base["batch"] if base else float("nan")
        rel_t = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        lines.append(
            f"| {m} | {r['batch']} | {rel_b:.1f}x | {r['kv_gib']:.2f} | {r['peak_gib']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {rel_t:.2f}x |"
        )
    lines += [
        "",
        "All points (batch sweep):",
        "",
        "| method | batch | KV GiB | peak GiB | tokens/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['batch']} | {r['kv_gib']:.2f} | {r['peak_gib']:.2f} | {r['tokens_per_s']:.0f} |"
        for r in rows
    ]
    lines += [""] + [f"- {n}" for n in notes] + ["", f"_run took {time.time() - t0:.0f} s_", ""]
    (out / "throughput.md").write_text("\n".join(lines))
    (out / "throughput.json").write_text(json.dumps(dict(meta=meta, rows=rows, notes=notes), indent=1))
    plot(rows, out / "throughput.png", a.budget_gib)
    print("\n".join(lines))


def plot(rows, path, budget_gib) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        ax1.plot([r["batch"] for r in rs], [r["peak_gib"] for r in rs], "o-", label=m)
        ax2.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=m)
    ax1.set_xlabel("batch")
    ax1.set_ylabel("peak GPU memory (GiB)")
    ax1.set_xscale("log", base=2)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("decode tokens/s")
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Decode at {rows[0]['context'] if rows else 8192} context, KV budget {budget_gib:g} GiB (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()


# ------------------------------------------------------------------ static caches, decode step captured in a CUDA graph


def static_row_lengths(batch: int, context: int, ragged: bool) -> list[int]:
    """Tokens per row: all ``context``, or (ragged) spread evenly over half to full context."""
    if not ragged or batch == 1:
        return [context] * batch
    return [context // 2 + (context - context // 2) * i // (batch - 1) for i in range(batch)]


def static_bytes_per_row(method: str, config, max_cache_len: int) -> int:
    """Bytes one row of a static cache holds (allocated, not filled): FP16 ``max_cache_len`` columns; Kitty its
    fixed pages for ``max_cache_len`` tokens plus the full-precision buffers once (no pool slack)."""
    return kv_bytes_per_seq("fp16" if method.startswith("fp16") else method, config, max_cache_len)


def fill_static(method: str, model, lengths: list[int], context: int, extra: int):
    """A static cache (``StaticCache`` for fp16 methods, else a static ``KittyCache``; ``preset/backend`` picks the
    attention backend, default ``triton``) holding ``lengths[b]``
    random tokens in row b (left-padded to ``context`` columns), room for ``extra`` decode steps; and the
    ``[B, context + extra]`` attention mask of the fill (padding 0, real and future columns 1)."""
    from transformers import DynamicCache, StaticCache

    c = model.config
    H, D, B = c.num_key_value_heads, c.head_dim, len(lengths)
    L = context + extra
    g = torch.Generator(device=DEVICE).manual_seed(0)
    n = torch.tensor(lengths, device=DEVICE)
    mask = (torch.arange(L, device=DEVICE)[None, :] >= (context - n)[:, None]).long()  # (B, L)

    def rand(t):
        return torch.randn(B, H, t, D, device=DEVICE, dtype=torch.bfloat16, generator=g)

    if method == "fp16-dynamic":
        cache = DynamicCache(config=c)
        for i in range(c.num_hidden_layers):
            cache.update(rand(context), rand(context), i)
        return cache, mask
    if method.startswith("fp16"):
        cache = StaticCache(config=c, max_cache_len=L)
        for i in range(c.num_hidden_layers):
            cache.update(rand(context), rand(context), i, {"cache_position": torch.arange(context, device=DEVICE)})
        return cache, mask
    preset, _, backend = method.partition("/")  # "kitty/gluon": the preset on another attention backend
    cache = KittyCache(c, PRESETS[preset], backend=backend or "triton", max_batch_size=B, max_cache_len=L)
    chunk = 1024
    # the first chunk reaches the first column where every row holds a token (a chunk may not leave a row empty)
    first = max(context - min(lengths) + 1, min(chunk, context))
    bounds = [0, *range(first, context, chunk), context]
    for layer in cache.layers:
        for start, stop in zip(bounds, bounds[1:]):
            layer.append(rand(stop - start), rand(stop - start), mask[:, start:stop].bool().cpu())
    return cache, mask


def page_steps(method: str, lengths: list[int], steps: int) -> list[bool]:
    """Whether decode step i (0-based) packs a key or value page in some row (kitty methods): the step that
    completes it, and unless ``$KITTY_STAGGER_PACK=0`` the step after too."""
    if method.startswith("fp16"):
        return [False] * steps
    from kitty.cache.static import stagger_requested

    cfg = PRESETS[method.partition("/")[0]]
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    late = (0, 1) if stagger_requested() else (0,)
    out = []
    for i in range(steps):
        ns = [n + i + 1 - d for n in lengths for d in late]
        keys = any((x - S) > 0 and (x - S) % G == 0 for x in ns)
        values = any((x - S - R) > 0 and (x - S - R) % G == 0 for x in ns)
        out.append(keys or values)
    return out


@torch.no_grad()
def static_decode(
    model,
    cache,
    mask,
    lengths,
    context,
    steps: int,
    warmup: int,
    captured: bool,
    profile_steps: int = 4,
    trace: Path | None = None,
    timed: bool = True,
):
    """Time ``steps`` single-token decode steps of every row with static input buffers (eager, or one step
    captured in a CUDA graph and replayed). Returns per-step seconds and a dict: ``pipelined_ms`` (the mean step of
    ``steps`` more run back to back, as ``generate_static`` runs them) and, when profiled, GPU busy; ``trace``: where
    to write the profiled steps' Chrome trace (kernel start and end times). ``timed=False``: the profile only.

    Time a process's points before profiling any of them: once the profiler has run, CUPTI stays attached for the
    life of the process (kineto does not tear it down where CUDA graphs are used), and every later graph launch
    costs the host ~0.7 ms more (H100, ~2,200 kernel nodes: ``host_replay_us`` 10 us before, 620-780 us after),
    which a synchronized step pays on the GPU's critical path."""
    from kitty.hf.generate import _advance

    B = len(lengths)
    ids = torch.randint(0, model.config.vocab_size, (B, 1), device=DEVICE)
    pos = torch.tensor(lengths, device=DEVICE)[:, None]
    kitty = isinstance(cache, KittyCache)
    dyn = not getattr(cache, "is_compileable", False)
    mask_buf = mask.clone()
    cols = [context]  # the dynamic cache's mask grows by a column per step

    def step():
        m = mask_buf[:, : cols[0] + 1] if dyn else mask_buf
        logits = model(
            ids, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits
        ids.copy_(logits[:, -1:].argmax(-1))
        pos.add_(1)
        cols[0] += 1

    from kitty.cache.static import stagger_packs, stagger_requested

    if stagger_requested():  # a page's packs over two steps, as generate_static's loop does
        stagger_packs(getattr(cache, "layers", []))
    graph = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    if captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        _advance(cache, -1)

    host = {"replay": [], "advance": []}  # host seconds per synchronized step: graph.replay(), then the counters

    def run(timed: bool = False):
        if graph is None:
            step()
            return
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        _advance(cache, 1)
        if timed:
            host["replay"].append(t1 - t0)
            host["advance"].append(time.perf_counter() - t1)

    times, busy = [], {}
    for _ in range(steps if timed else 0):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(timed=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    # the product's loop (generate_static): replays back to back, the host reading once at the end, so the
    # launch of step i + 1 overlaps the GPU work of step i; the timed loop above synchronizes after every step
    torch.cuda.synchronize()
    if timed:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            run()
        b.record()
        b.synchronize()
        busy["pipelined_ms"] = a.elapsed_time(b) / 1e3 / steps * 1e3
    if host["replay"]:  # medians: where a synchronized step's time goes on the host, beside the GPU's
        busy |= {f"host_{k}_us": sorted(v)[len(v) // 2] * 1e6 for k, v in host.items()}
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(profile_steps):
                run()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        if trace is not None:
            prof.export_chrome_trace(str(trace))
        device_events = [
            e
            for e in prof.key_averages()
            if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
        ]
        kern = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in device_events)
        busy |= dict(
            kernels_per_step=sum(e.count for e in device_events) / profile_steps,
            wall_ms_per_step=wall / profile_steps * 1e3,
            gpu_ms_per_step=kern / 1e3 / profile_steps,
            gpu_busy=kern / 1e6 / wall,
        )
    del kitty
    return times, busy


UNMASKED = "fp16_unmasked_sdpa"


def _unmasked_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA over every cached column with no mask and the KV heads unrepeated: ``[B, T, Hq, D]``."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_unmasked() -> dict:
    """Register :func:`_unmasked_sdpa` (no mask function: transformers then passes ``attention_mask=None``)."""
    from torch.nn.attention import SDPBackend
    from transformers import AttentionInterface

    AttentionInterface.register(UNMASKED, _unmasked_sdpa)
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


SDPA_BACKENDS = _register_unmasked()


def parse_points(text: str) -> list[tuple[str, int, int, bool, bool]]:
    """``method:batch:context:equal|ragged[:eager]`` items, comma-separated, as run_static's plan entries."""
    plan = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (4, 5) or parts[3] not in ("equal", "ragged") or parts[4:] not in ([], ["eager"]):
            raise ValueError(f"--points item must be method:batch:context:equal|ragged[:eager], got {item!r}")
        plan.append((parts[0], int(parts[1]), int(parts[2]), parts[3] == "ragged", parts[4:] != ["eager"]))
    return plan


def static_point(model, method, batch, context, ragged, captured, steps, warmup, weights, profile=False) -> dict:
    """One point of the static table: its timed steps (``profile=False``: no profiler), or only its profile
    (``profile=True``: kernels per step, GPU busy), which :func:`run_static` takes after every point is timed."""
    lengths = static_row_lengths(batch, context, ragged)
    extra = 2 * steps + warmup + 8 + 4  # the timed steps, the pipelined ones, warmup, capture, the profiled ones
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache, mask = fill_static(method, model, lengths, context, extra)
    kv = torch.cuda.memory_allocated() - weights
    # "-gqa": transformers' SDPA told to pass the KV heads unrepeated (enable_gqa) even with a mask; without it a
    # masked SDPA call first copies every KV head once per query head (repeat_kv). "-unmasked-<backend>": an upper
    # bound on FP16 speed, every column of the static cache attended with no mask, KV heads unrepeated, one SDPA
    # backend (cuDNN or flash); its outputs are not the model's (the unfilled columns are attended too), its
    # bytes and work are those of the masked step. The fastest variant is the FP16 baseline.
    gqa = method.endswith("-gqa")
    unmasked = "-unmasked-" in method
    old_env = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1" if gqa else "0"
    old_impl = model.config._attn_implementation
    run = dict(steps=steps, warmup=warmup, captured=captured, profile_steps=4 if profile else 0, timed=not profile)
    try:
        if unmasked:
            from torch.nn.attention import sdpa_kernel

            model.config._attn_implementation = UNMASKED
            with sdpa_kernel([SDPA_BACKENDS[method.rsplit("-", 1)[1]]]):
                times, busy = static_decode(model, cache, mask, lengths, context, **run)
        else:
            times, busy = static_decode(model, cache, mask, lengths, context, **run)
    finally:
        model.config._attn_implementation = old_impl
        if old_env is None:
            os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA")
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = old_env
    if profile:
        del cache
        return busy
    pages = page_steps(method, [n + warmup for n in lengths], steps)
    srt = sorted(times)
    paged = sorted(t for t, p in zip(times, pages) if p)
    base, _, variant = method.partition("-static-")
    row = dict(
        method=(base + "-static" if variant else method)
        + ("" if method == "fp16-dynamic" else "-captured" if captured else "-eager")
        + (("-" + variant) if variant else ""),
        context=context,
        ragged=ragged,
        batch=batch,
        kv_gib=kv / 2**30,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        steps=steps,
        tokens_per_s=batch / srt[len(srt) // 2],
        pipelined_tokens_per_s=batch / (busy["pipelined_ms"] / 1e3),
        p50_ms=srt[len(srt) // 2] * 1e3,
        p99_ms=srt[min(len(srt) - 1, int(0.99 * len(srt)))] * 1e3,
        p99_page_ms=(paged[min(len(paged) - 1, int(0.99 * len(paged)))] * 1e3) if paged else None,
        page_steps=len(paged),
        **(busy or {}),
    )
    if method.startswith("kitty"):
        from kitty.cache.static import stagger_requested

        row["stagger_pack"] = stagger_requested()
    del cache
    return row


def run_static(
    model, contexts, budget_gib, steps, warmup, out: Path, deadline: float, methods=None, points: str = ""
) -> list[dict]:
    """The static-cache throughput table: the captured decode step against a captured FP16 StaticCache."""
    weights = torch.cuda.memory_allocated()
    budget = int(budget_gib * 2**30)
    rows, notes = [], []
    plan = []
    for context in contexts:
        L = context + steps + warmup + 8
        maxb = {m: budget // static_bytes_per_row(m, model.config, L) for m in ("fp16", "kitty", "kitty-pro")}
        notes.append(f"context {context}: largest static batch under {budget_gib:g} GiB: {maxb}")
        fb = maxb["fp16"]
        for ragged in (False, True):
            for b in sorted({1, 16, fb} if fb >= 16 else {1, fb}):
                if b >= 1:
                    plan.append(("fp16-static", b, context, ragged, True))
                    plan.append(("fp16-static-gqa", b, context, ragged, True))
            if context == contexts[0] and not ragged:
                plan += [("fp16-static", fb, context, False, False), ("fp16-dynamic", fb, context, False, False)]
            for m in ("kitty", "kitty-pro"):
                for b in (maxb[m], 16, 1) if m == "kitty" else (maxb[m],):
                    plan.append((m, b, context, ragged, True))
            if not ragged and context == contexts[0]:
                plan.append(("kitty", maxb["kitty"], context, False, False))
    if methods:
        plan = [p for p in plan if p[0] in methods]
    if points:
        plan = parse_points(points)
    timed = []  # the plan entries of rows, in order
    for method, b, context, ragged, captured in plan:
        if time.time() > deadline:
            notes.append(f"skipped (time): {method} batch {b} context {context} ragged={ragged} captured={captured}")
            continue
        try:
            rows.append(static_point(model, method, b, context, ragged, captured, steps, warmup, weights))
            timed.append((method, b, context, ragged, captured))
            print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001 - one failing point must not lose the others
            notes.append(
                f"{method} batch {b} context {context} ragged={ragged} captured={captured}: "
                f"{type(e).__name__}: {str(e)[:300]}"
            )
            print(notes[-1], flush=True)
        (out / "static_throughput.json").write_text(json.dumps(dict(rows=rows, notes=notes), indent=1))
    # the profiles last: a profiled process launches graphs slower from then on (static_decode)
    for row, (method, b, context, ragged, captured) in zip(rows, timed):
        if time.time() > deadline:
            notes.append(f"not profiled (time): {row['method']} batch {b} context {context}")
            continue
        try:
            row |= static_point(model, method, b, context, ragged, captured, steps, warmup, weights, profile=True)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{row['method']} batch {b} context {context}: profile: {type(e).__name__}: {str(e)[:300]}")
        (out / "static_throughput.json").write_text(json.dumps(dict(rows=rows, notes=notes), indent=1))
    return rows, notes
