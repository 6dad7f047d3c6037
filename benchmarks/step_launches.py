"""Operations and kernel launches per layer of one static decode step: FP16 ``StaticCache`` (masked and unmasked
SDPA) against Kitty's static layer, today's path and the three custom ops of ``kitty/cache/custom_ops.py``.

    TRITON_INTERPRET=1 python benchmarks/step_launches.py [--out DIR]     # CPU: counts, no timing
    python benchmarks/step_launches.py --out DIR                          # CUDA: also kernels of a captured step

On the CPU a ``TorchDispatchMode`` counts the aten operations one layer's decode step runs, split into those that
launch a kernel on CUDA (everything but views and allocations), allocations, and host reads
(``_local_scalar_dense``: ``.item()`` / ``.tolist()``, which would end a CUDA-graph capture); Triton launches are
counted by wrapping the kernels of ``kernels/`` (the interpreter's own tensor work inside a launch is not counted).
On CUDA the step is also captured in a CUDA graph and one replay is profiled: the number of GPU kernels it runs.
Writes ``step_launches.json`` and ``step_launches.md`` to ``--out`` (default: print only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# the repository root, not this folder: benchmarks/kernels.py would shadow the hub package transformers imports
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from kitty.core.config import PRESETS  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach"}
KERNEL_MODULES = ("insert", "decode_attention", "pack")


class OpCounter(TorchDispatchMode):
    """Counts aten operations by kind while active (paused inside Triton launches)."""

    def __init__(self):
        super().__init__()
        self.kernels, self.allocations, self.views, self.host_reads = Counter(), 0, 0, 0
        self.triton = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kitty":  # a custom op (kitty/cache/custom_ops.py): count what runs inside it
            from torch._library.custom_ops import _maybe_get_opdef

            with self:  # the op's Python body, under this mode again
                return _maybe_get_opdef(func)._init_fn(*args, **(kwargs or {}))
        if not self.paused:
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                self.host_reads += 1
            elif func.is_view or name in ("view", "_unsafe_view", "alias", "as_strided"):
                self.views += 1
            elif name in NO_KERNEL:
                self.allocations += 1
            else:
                self.kernels[name] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        return dict(
            torch_kernels=sum(self.kernels.values()),
            triton_launches=sum(self.triton.values()),
            launches=sum(self.kernels.values()) + sum(self.triton.values()),
            allocations=self.allocations,
            host_reads=self.host_reads,
            ops=dict(sorted(self.kernels.items(), key=lambda x: -x[1])),
            triton=dict(self.triton),
        )


class _CountedKernel:
    """A Triton kernel whose launches ``kernel[grid](...)`` are counted (and the counter paused while it runs)."""

    def __init__(self, kernel, name: str, counter: OpCounter):
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counter.triton[self.name] += 1
            self.counter.paused += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self.counter.paused -= 1

        return run


@contextmanager
def counting():
    """An :class:`OpCounter`, active, with the kernels of ``kernels/`` wrapped."""
    import importlib

    from triton.runtime.jit import KernelInterface

    counter = OpCounter()
    saved = []
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(f"kitty.kernels.{mod_name}")
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, KernelInterface) and name.endswith("_kernel"):  # launched, not device functions
                saved.append((mod, name, obj))
                setattr(mod, name, _CountedKernel(obj, name, counter))
    try:
        with counter:
            yield counter
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


# ---------------------------------------------------------------------------------------------------- the steps


def fp16_step(B, Hkv, QH, D, L, prompt, dtype, device, masked: bool):
    """One layer of transformers' ``StaticCache``: the KV write of ``StaticLayer.update`` and SDPA over all
    ``max_cache_len`` columns, with the padding mask (``masked``) or without (the unmasked bound)."""
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(max_cache_len=L)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    layer.update(rnd(B, Hkv, prompt, D), rnd(B, Hkv, prompt, D))
    mask = (torch.arange(L, device=device) <= prompt)[None, None, None, :].expand(B, 1, 1, L)
    k, v, q = rnd(B, Hkv, 1, D), rnd(B, Hkv, 1, D), rnd(B, Hkv * QH, 1, D)

    def step():
        keys, values = layer.update(k, v)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask if masked else None, enable_gqa=True, scale=D**-0.5
        )

    return step


def kitty_step(
    B, Hkv, QH, D, L, prompt, dtype, device, preset: str, ops: bool, merge_inside: bool = False, defer: str = ""
):
    """One static Kitty layer's decode step: the layer's ``StaticKittyLayer.attend_and_append`` (``ops=False``:
    what a model's step runs, with the workspace the prompt allocates; ``merge_inside``: its launch merges inside;
    ``defer``: ``"keys"`` or ``"values"``, that side packed at the next step's start, as ``generate_static``'s loop
    staggers the packs), or the three custom ops (insert, attention with the merge inside, predicated pack) called by
    hand."""
    from kitty.cache import custom_ops
    from kitty.cache.static import StaticKittyLayer

    cfg = PRESETS[preset]
    layer = StaticKittyLayer(cfg, Hkv, D, 0, "triton", Hkv, max_cache_len=L, max_batch_size=B)
    layer.merge_inside = merge_inside
    if defer:
        setattr(layer, f"defer_{defer}", True)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    layer.append(rnd(B, Hkv, prompt, D), rnd(B, Hkv, prompt, D))
    k, v, q = rnd(B, Hkv, 1, D), rnd(B, Hkv, 1, D), rnd(B, Hkv * QH, 1, D)
    layer.prepare_workspace(Hkv * QH)  # as the prompt of a model's forward does
    if not ops:

        def step():
            pending, _ = layer.update(k, v)
            return layer.attend_and_append(q, pending.key_states, pending.value_states, None, D**-0.5)

        return step
    state = layer.storage()
    from kitty.kernels.launch import Launch

    ws, launch = custom_ops.attention_workspace(q[:, :, 0], state)
    launch = Launch(**{**launch.__dict__, "merge_inside": True})
    ws, _ = custom_ops.attention_workspace(q[:, :, 0], state, launch)
    kq, vq = k[:, :, 0], v[:, :, 0]

    def step():
        custom_ops.insert_token(kq, vq, layer.lengths, layer.sink_k, layer.sink_v, layer.k_qbuf, layer.v_qbuf,
                                layer.v_local)  # fmt: skip
        out = custom_ops.decode_attention(q[:, :, 0], state, cfg, D**-0.5, full_qbuffer=True, workspace=ws,
                                          launch=launch)  # fmt: skip
        custom_ops.pack_completed(cfg, layer.lengths, layer.k_qbuf, layer.v_qbuf, layer.key_pool.tensors,
                                  layer.value_pool.tensors, layer.k_page_table, layer.v_page_table, 0,
                                  layer.query_scale())  # fmt: skip
        return out

    return step


def cuda_graph_kernels(step) -> int:
    """GPU kernels one replay of ``step`` captured in a CUDA graph runs (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


CASES = {
    "fp16 StaticCache, masked": dict(kind="fp16", masked=True),
    "fp16 StaticCache, unmasked": dict(kind="fp16", masked=False),
    "kitty, static step": dict(kind="kitty", preset="kitty", ops=False),
    "kitty, static step, merge inside": dict(kind="kitty", preset="kitty", ops=False, merge_inside=True),
    "kitty, static step, keys packed a step late": dict(kind="kitty", preset="kitty", ops=False, defer="keys"),
    "kitty, custom ops by hand (insert, attend+merge, pack)": dict(kind="kitty", preset="kitty", ops=True),
    "kitty-pro, static step": dict(kind="kitty", preset="kitty-pro", ops=False),
    "kitty-pro, custom ops by hand": dict(kind="kitty", preset="kitty-pro", ops=True),
    "kitty-query, static step": dict(kind="kitty", preset="kitty-query", ops=False),
}


def measure(B=2, Hkv=2, QH=4, D=128, L=512, prompt=300, dtype=torch.float16, device=None) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = {}
    for name, case in CASES.items():
        case = dict(case)
        kind = case.pop("kind")
        make = fp16_step if kind == "fp16" else kitty_step
        step = make(B, Hkv, QH, D, L, prompt, dtype, device, **case)
        for _ in range(2):  # warm: first-call allocations (a static layer's workspace, the first pack of the pages a
            step()  # step left to the next) are not part of a step
        with counting() as c:
            step()
        rows[name] = c.summary()
        if device.type == "cuda":
            rows[name]["cuda_graph_kernels"] = cuda_graph_kernels(make(B, Hkv, QH, D, L, prompt, dtype, device, **case))
    return dict(shape=dict(B=B, Hkv=Hkv, QH=QH, D=D, max_cache_len=L, prompt=prompt, dtype=str(dtype),
                           device=str(device)), rows=rows)  # fmt: skip


def markdown(result: dict) -> str:
    cuda = any("cuda_graph_kernels" in r for r in result["rows"].values())
    head = "| step (one layer) | launches | torch kernels | Triton launches | allocations | host reads |"
    head += " captured GPU kernels |" if cuda else ""
    lines = [f"Shape: {result['shape']}", "", head, "|---" * (head.count("|") - 1) + "|"]
    for name, r in result["rows"].items():
        line = f"| {name} | {r['launches']} | {r['torch_kernels']} | {r['triton_launches']} | {r['allocations']} |"
        line += f" {r['host_reads']} |" + (f" {r.get('cuda_graph_kernels', '')} |" if cuda else "")
        lines.append(line)
    lines.append("")
    for name, r in result["rows"].items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in {**r["ops"], **r["triton"]}.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for step_launches.json / .md")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("without CUDA set TRITON_INTERPRET=1 (the Triton kernels run under the interpreter)")
    result = measure(B=args.batch, dtype=getattr(torch, args.dtype))
    md = markdown(result)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_launches.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "step_launches.md").write_text(md)


if __name__ == "__main__":
    main()
