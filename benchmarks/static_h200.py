"""One GPU run for the static cache and the captured decode step: correctness first, then throughput (H200).

    python -m benchmarks.static_h200                       # everything, < 9 minutes
    python -m benchmarks.static_h200 --layers 12 --minutes 6   # shallower model / shorter budget

(a) correctness on a tiny random fp16 Llama (seconds): generate_static captured vs eager tokens for the fp16,
    kitty and kitty-pro presets on a left-padded ragged batch (equal required), the same against transformers'
    generate with the growing KittyCache (reported), no host synchronization in a replayed decode step
    (``torch.cuda.set_sync_debug_mode("error")``; an eager one has one by design, the padding check of the decode
    column, which ``tests/test_cuda.py`` counts), and whether transformers' compile path
    (``model.generate`` with the static cache, which compiles itself on CUDA, and ``torch.compile(model.forward,
    mode="reduce-overhead")`` with the prompt run eagerly, the supported form, and with the prompt through it too)
    runs and gives the same tokens (reported with the error if not).
(b) throughput (``benchmarks/throughput.run_static``): Qwen3-8B shape, random bf16 weights, 20 GiB KV budget,
    8K and 32K contexts, equal and ragged lengths; FP16 StaticCache captured (batch 1, 16, largest), eager static
    and dynamic at the largest batch, kitty/kitty-pro static captured at their largest batch (kitty also at 1 and
    16, and eager); tokens/s from the median step, p50/p99 (p99 over page-completing steps too), GPU busy from a
    profiler trace of 4 steps (and the kernels per step it ran), taken after every point is timed (a process
    launches CUDA graphs slower once it has been profiled): the kernel time over the profiled wall (``gpu_busy``) and
    over the same pipelined loop's time without the profiler (``benchmarks/summarize.busy_unprofiled``; the profiler
    stretches every replay). Stops starting new points at the deadline.

Writes ``benchmarks/results/h200-<date>/static_correctness.json``, ``static_throughput.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
import traceback
from pathlib import Path

import torch

from kitty import KittyCache
from kitty.hf.generate import generate_static


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float16).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def ragged(B=4, T=200):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (B, T), generator=g).cuda()
    mask = torch.ones(B, T, dtype=torch.long, device="cuda")
    for b in range(1, B):
        mask[b, : 37 * b] = 0
    return ids, mask


def correctness(out: Path) -> dict:
    res = {}
    model = tiny_llama()
    ids, mask = ragged()
    new = 150  # crosses page boundaries (G=128 with the presets' sizes) in every row
    L = ids.shape[1] + new
    for name in ("fp16", "kitty", "kitty-pro"):
        r = {}
        try:
            toks = {}
            for cap in (False, True):
                cache = KittyCache(model.config, name, max_batch_size=4, max_cache_len=L)
                toks[cap] = generate_static(model, ids, mask, cache, new, capture=cap)
            r["captured_equals_eager"] = bool(torch.equal(toks[True], toks[False]))
            grow = KittyCache(model.config, name)
            hf = model.generate(
                ids, attention_mask=mask, past_key_values=grow, max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[:, ids.shape[1] :]
            r["agreement_with_growing_cache_generate"] = (hf == toks[True]).float().mean().item()
        except Exception:  # noqa: BLE001
            r["error"] = traceback.format_exc()[-2000:]
        res[name] = r
        print(name, r, flush=True)
    # no host synchronization inside a replayed decode step
    r = {}
    try:
        cache = KittyCache(model.config, "kitty", max_batch_size=4, max_cache_len=L)
        generate_static(model, ids, mask, cache, 3, capture=False)  # prompt + 2 eager steps (kernels compiled)
        inp = torch.zeros(4, 1, dtype=torch.long, device="cuda")
        pos = mask.sum(-1, keepdim=True) + 2
        m = torch.ones(4, L, dtype=torch.long, device="cuda")
        m[:, : ids.shape[1]] = mask

        def step():
            model(inp, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
            pos.add_(1)

        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        from kitty.hf.generate import _advance

        _advance(cache, -1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            g.replay()
            _advance(cache, 1)
            r["replayed_step_no_sync"] = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except Exception:  # noqa: BLE001
        r["error"] = traceback.format_exc()[-2000:]
    res["no_sync"] = r
    print("no_sync", r, flush=True)
    # transformers' compile path: generate compiling its decode steps; a user's reduce-overhead forward in the
    # supported form (the prompt eager, the decode steps compiled); the same forward getting the prompt too
    r = {}
    hows = ("generate_auto_compile", "torch_compile_reduce_overhead", "torch_compile_reduce_overhead_prompt_compiled")
    for preset, how in itertools.product(("fp16", "kitty"), hows):
        how = f"{preset}:{how}"
        try:
            t = time.time()
            ref_cache = KittyCache(model.config, preset, max_batch_size=4, max_cache_len=L)
            ref = generate_static(model, ids, mask, ref_cache, 40, capture=False)
            cache = KittyCache(model.config, preset, max_batch_size=4, max_cache_len=L)
            if how.endswith("generate_auto_compile"):
                got = model.generate(
                    ids,
                    attention_mask=mask,
                    past_key_values=cache,
                    max_new_tokens=40,
                    min_new_tokens=40,
                    do_sample=False,
                )[:, ids.shape[1] :]
            else:
                compiled = torch.compile(model.forward, mode="reduce-overhead")
                prompt_compiled = how.endswith("prompt_compiled")

                def forward(x, **kw):
                    return (compiled if prompt_compiled or x.shape[1] == 1 else model)(x, **kw)

                runner = type("Runner", (), {"device": model.device, "__call__": staticmethod(forward)})()
                got = generate_static(runner, ids, mask, cache, 40, capture=False)
            r[how] = dict(ran=True, same_tokens=bool(torch.equal(got, ref)), seconds=time.time() - t)
        except Exception as e:  # noqa: BLE001
            r[how] = dict(ran=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
        print(how, r[how], flush=True)
    res["transformers_compile"] = r
    (out / "static_correctness.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36, help="model depth (fewer if time is short)")
    ap.add_argument("--budget-gib", type=float, default=20.0)
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per point (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=8.5, help="stop starting new points after this")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--methods", default="", help="comma list to restrict the throughput points")
    ap.add_argument(
        "--points", default="", help="explicit plan: method:batch:context:equal|ragged[:eager], comma-separated"
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    out = Path(a.out or Path(__file__).parent / "results" / f"h200-{datetime.date.today():%Y-%m-%d}")
    out.mkdir(parents=True, exist_ok=True)
    corr = {} if a.skip_correctness else correctness(out)
    from benchmarks import throughput
    from benchmarks.summarize import busy_unprofiled

    throughput.DEVICE = "cuda"
    torch.cuda.empty_cache()
    model = throughput.build_model(a.layers)
    rows, notes = throughput.run_static(
        model,
        [int(c) for c in a.contexts.split(",")],
        a.budget_gib,
        a.steps,
        a.warmup,
        out,
        t0 + a.minutes * 60,
        [m for m in a.methods.split(",") if m] or None,
        a.points,
    )
    print("\n== correctness ==")
    for k, v in corr.items():
        print(k, json.dumps(v)[:400])
    print("\n== throughput (tokens/s; kernels per step; GPU busy; p50 / p99 / p99 of page steps, ms) ==")
    base, piped = {}, {}
    for r in rows:
        if r["method"].startswith("fp16-static-captured") and not r["ragged"]:
            base[r["context"]] = max(base.get(r["context"], 0), r["tokens_per_s"])
            key = (r["context"], r["batch"])
            piped[key] = max(piped.get(key, 0), r.get("pipelined_tokens_per_s", 0))
    for r in rows:
        rel = r["tokens_per_s"] / base[r["context"]] if r["context"] in base else float("nan")
        same, own = piped.get((r["context"], r["batch"])), r.get("pipelined_tokens_per_s", float("nan"))
        print(
            f"{r['method']:22s} ctx {r['context']:6d} {'ragged' if r['ragged'] else 'equal ':6s} B {r['batch']:4d} "
            f"KV {r['kv_gib']:6.2f} GiB  {r['tokens_per_s']:8.0f} tok/s  {rel:5.2f}x best fp16-captured  "
            f"kernels/step {r.get('kernels_per_step', float('nan')):.0f}  "
            f"busy {busy_unprofiled(r) or float('nan'):.0%} (profiled {r.get('gpu_busy', float('nan')):.0%})  "
            f"p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} "
            f"p99-page {r['p99_page_ms'] if r['p99_page_ms'] is not None else float('nan'):.1f}"
        )
        print(
            f"    pipelined (the product's loop) {own:8.0f} tok/s"
            + (f", {own / same:.2f}x the best fp16-captured of the same batch" if same else "")
            + (
                f"; host per synchronized step: replay {r['host_replay_us']:.0f} us, "
                f"counters {r['host_advance_us']:.0f} us"
                if "host_replay_us" in r
                else ""
            )
        )
    for n in notes:
        print("-", n)
    print(f"\ntotal {time.time() - t0:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
