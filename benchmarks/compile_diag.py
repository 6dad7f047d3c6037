"""Diagnose a reduce-overhead compiled forward that a prompt goes through too (CUDA): the tokens of three
generations on one static KittyCache (reset between them) against the eager static decode, under variants of the
compile mode and of where cudagraph trees start a new step.

    python -m benchmarks.compile_diag
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent), str(_HERE.parent / "tests")] + [
    p for p in sys.path if Path(p or ".").resolve() != _HERE
]

import torch  # noqa: E402

from kitty import KittyCache  # noqa: E402
from kitty.hf.generate import generate_static  # noqa: E402


class Runner:
    def __init__(self, model, mode, prompt_compiled, mark_step):
        self.model, self.device = model, model.device
        self.compiled = torch.compile(model.forward, mode=mode)
        self.prompt_compiled, self.mark_step = prompt_compiled, mark_step

    def __call__(self, ids, **kw):
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        fn = self.compiled if (ids.shape[1] == 1 or self.prompt_compiled) else self.model
        return fn(ids, **kw)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (reduce-overhead compiles CUDA graphs)")
    from test_cuda import ragged_prompts, tiny_model  # the CUDA tests' model and ragged batch

    model = tiny_model("llama")
    ids, mask = ragged_prompts()
    B, T, new = ids.shape[0], ids.shape[1], 40
    want = generate_static(model, ids, mask, KittyCache(model.config, "kitty", max_batch_size=B, max_cache_len=T + new),
                           new, capture=False)  # fmt: skip
    out = {}
    for name, mode, prompt_compiled, mark in [
        ("decode_reduce_overhead", "reduce-overhead", False, False),
        ("forward_reduce_overhead", "reduce-overhead", True, False),
        ("forward_reduce_overhead_mark_step", "reduce-overhead", True, True),
        ("forward_default", "default", True, False),
        ("forward_max_autotune_no_cudagraphs", "max-autotune-no-cudagraphs", True, False),
    ]:
        torch._dynamo.reset()
        t0 = time.time()
        try:
            cache = KittyCache(model.config, "kitty", max_batch_size=B, max_cache_len=T + new)
            r = Runner(model, mode, prompt_compiled, mark)
            res = []
            for i in range(3):
                if i:
                    cache.reset()
                got = generate_static(r, ids, mask, cache, new, capture=False)
                diff = (got != want).any(0).nonzero().flatten().tolist()
                res.append({"equal": bool(torch.equal(got, want)), "first_diff_step": diff[0] if diff else None})
            out[name] = {"generations": res, "seconds": round(time.time() - t0, 1)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "seconds": round(time.time() - t0, 1)}
        print(name, json.dumps(out[name]), flush=True)
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    (dest / "compile_diag.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
