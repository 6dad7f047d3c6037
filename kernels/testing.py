"""Build a :class:`KittyLayerState` from full-precision sequences, exactly as docs/LAYOUT.md stores them.

Used by the kernel tests and benchmarks (no cache object needed): each row's ``n`` tokens are split by
``kitty.core.memory.token_layout`` into sink, pages (quantized with ``kitty.core.quant`` or the Triton pack kernel,
placed at shuffled pool indices so the page tables matter), key/value qbuffers and the value local ring. Unused slots
are filled with ``fill`` (NaN by default) so that a kernel reading a slot it should not read produces NaN.
"""

from __future__ import annotations

import torch

from kitty.core.config import KVQuantConfig
from kitty.core.memory import token_layout
from kitty.core.quant import quantize_key_page, quantize_value_page
from kitty.core.storage import (
    BUFFER_FIELDS,
    KittyLayerState,
    allocate_pool,
    allocate_rows,
    page_fields,
    pool_fields,
    row_fields,
)

# flash-attention's rule: a kernel passes when max|out - ref| <= 2 max|pt - ref| + floor, where ref is the fp32 torch
# reference and pt the same reference in the kernel's dtype, both on the same 2-bit codes; the floor is ~1/10 of an
# output ulp at |out| ~ 1
TOLERANCE_FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float32: 1e-5}


def attention_tolerance(ref: torch.Tensor, pt: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest error a kernel in ``dtype`` may make against ``ref`` (the fp32 reference), given ``pt`` (the same
    reference computed in ``dtype``): ``2 max|pt - ref| + TOLERANCE_FLOOR[dtype]``."""
    return 2 * (pt.float() - ref.float()).abs().max().item() + TOLERANCE_FLOOR[dtype]


def planted_kv(
    B: int, Hkv: int, L: int, D: int, dtype: torch.dtype, device="cpu", seed: int = 0, outliers: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys/values ``[B, Hkv, L, D]`` with ``outliers`` planted high-magnitude key channels per head."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g)
    chans = torch.stack([torch.randperm(D, generator=g)[:outliers] for _ in range(Hkv)])  # (Hkv, outliers)
    boost = torch.ones(Hkv, D)
    boost.scatter_(1, chans, torch.linspace(4.0, 10.0, outliers).expand(Hkv, outliers))  # distinct: no ties
    k = k * boost[None, :, None, :] + 0.5 * boost[None, :, None, :]
    v = torch.randn(B, Hkv, L, D, generator=g)
    return k.to(dtype).to(device), v.to(dtype).to(device)


def make_state(
    cfg: KVQuantConfig,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths,
    *,
    seed: int = 0,
    fill: float = float("nan"),
    extra_pages: int = 3,
    pack=None,
    full_qbuffer: bool = False,
) -> KittyLayerState:
    """Lay out ``k``/``v`` ``[B, Hkv, L, D]`` (row ``b`` holds ``lengths[b]`` valid tokens) as a Kitty layer.

    ``pack``: ``None`` quantizes pages with ``kitty.core.quant``; ``"triton"`` with :func:`kernels.pack.pack_pages`.
    ``full_qbuffer``: lay rows out mid-step (qbuffers hold 1..G tokens, ``kitty.core.memory.token_layout``).
    """
    B, Hkv, L, D = k.shape
    dev, dt = k.device, k.dtype
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    lengths = [int(x) for x in lengths]
    if len(lengths) != B or max(lengths, default=0) > L:
        raise ValueError(f"lengths must be {B} values <= {L}, got {lengths}")
    lays = [token_layout(cfg, n, full_qbuffer) for n in lengths]
    max_pages = max([lay.key_pages for lay in lays] + [1])
    n_k, n_v = sum(lay.key_pages for lay in lays), sum(lay.value_pages for lay in lays)
    P = max(n_k, n_v) + extra_pages
    g = torch.Generator().manual_seed(seed)
    kperm, vperm = torch.randperm(P, generator=g).tolist(), torch.randperm(P, generator=g).tolist()

    rows = allocate_rows(row_fields(cfg, Hkv, D, dt), B, dev, fill=fill)
    sink_k, sink_v, k_qbuf, v_qbuf, v_local = (rows[name] for name in BUFFER_FIELDS)
    k_pt = torch.full((B, max_pages), -1, dtype=torch.int32, device=dev)
    v_pt = torch.full((B, max_pages), -1, dtype=torch.int32, device=dev)
    k_pages, v_pages, k_ids, v_ids = [], [], [], []
    for b, (n, lay) in enumerate(zip(lengths, lays)):
        m = max(n - S, 0)
        mv = max(m - R, 0)
        sink_k[b, :, : lay.sink] = k[b, :, : lay.sink]
        sink_v[b, :, : lay.sink] = v[b, :, : lay.sink]
        for j in range(lay.key_pages):
            k_pages.append(k[b, :, S + j * G : S + (j + 1) * G])
            k_ids.append(kperm.pop())
            k_pt[b, j] = k_ids[-1]
        for j in range(lay.value_pages):
            v_pages.append(v[b, :, S + j * G : S + (j + 1) * G])
            v_ids.append(vperm.pop())
            v_pt[b, j] = v_ids[-1]
        k_qbuf[b, :, : lay.key_qbuffer] = k[b, :, S + lay.key_pages * G : n]
        v_qbuf[b, :, : lay.value_qbuffer] = v[b, :, S + lay.value_pages * G : S + mv]
        if R:
            slots = torch.arange(mv, m, device=dev) % R
            v_local[b][:, slots] = v[b, :, S + mv : n]
    (qk, qv), (k_spec, v_spec) = pool_fields(cfg, Hkv, D, dt, quantized=True), pool_fields(cfg, Hkv, D, dt)
    spec = {**qk, **qv, **k_spec, **v_spec}  # every quantized field, and k_raw / v_raw of a 16-bit side
    pool = allocate_pool(spec, P, dev, fill=0)
    if not cfg.quantizes_keys and k_pages:
        pool["k_raw"][k_ids] = torch.stack(k_pages)
    if not cfg.quantizes_values and v_pages:
        pool["v_raw"][v_ids] = torch.stack(v_pages)
    kq = torch.stack(k_pages) if k_pages and cfg.quantizes_keys else None
    vq = torch.stack(v_pages) if v_pages and cfg.quantizes_values else None
    if pack == "triton" and (kq is not None or vq is not None):
        from .pack import pack_pages

        pack_pages(
            cfg, kq, vq, pool=pool, k_pages=k_ids if kq is not None else None, v_pages=v_ids if vq is not None else None
        )
    else:
        if kq is not None:
            for name, t in page_fields(quantize_key_page(kq, cfg)).items():
                pool[name][k_ids] = t
        if vq is not None:
            for name, t in page_fields(quantize_value_page(vq, cfg)).items():
                pool[name][v_ids] = t
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    return KittyLayerState(lens, sink_k, sink_v, k_qbuf, v_qbuf, v_local, k_pt, v_pt, **pool)


def _prmt(a, b, sel: int):
    """PTX ``prmt.b32`` (default mode): result byte ``i`` is byte ``(sel >> 4i) & 7`` of the 8 bytes ``{b:a}``."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _lop3(a, b, c, lut: int):
    """PTX ``lop3.b32``: bit ``i`` of each result bit's truth table ``lut`` indexed by ``(a, b, c)`` bits as ``4a +
    2b + c``."""
    out = 0
    for i in range(8):
        if lut >> i & 1:
            out = out | ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c))
    return out & 0xFFFFFFFF


def run_ptx(asm: str, regs: dict) -> dict:
    """Run the 32-bit integer instructions of an inline-PTX block (``.reg`` declarations and braces skipped) on
    ``regs`` (``"$n"`` -> Python int or int64 tensor, elementwise) and return every register afterwards: the
    kernels' unpack blocks (``kernels/operands.py``, ``kernels/_gluon_parts.py``) checked on the CPU, where no GPU
    runs them. Handles ``shr``, ``shl``, ``mul.lo`` / ``mul.hi`` (``.u32``), ``and``, ``or``, ``mov``, ``prmt`` (default
    mode) and ``lop3``."""
    regs = dict(regs)

    def val(x: str):
        if x in regs:
            return regs[x]
        lit = int(x, 0)
        some = next(iter(regs.values()))
        return torch.full_like(some, lit) if isinstance(some, torch.Tensor) else lit

    for stmt in (s.strip() for s in asm.strip("{} ").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        d, *src = [x.strip() for x in args.split(",")]
        a = [val(x) for x in src]
        if op == "shr.b32":
            regs[d] = a[0] >> a[1]
        elif op == "mul.lo.u32":
            regs[d] = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "mul.hi.u32":
            regs[d] = (a[0] * a[1]) >> 32
        elif op == "shl.b32":
            regs[d] = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[d] = a[0] & a[1]
        elif op == "or.b32":
            regs[d] = a[0] | a[1]
        elif op == "mov.b32":
            regs[d] = a[0]
        elif op == "prmt.b32":
            regs[d] = _prmt(a[0], a[1], int(src[2], 0))
        elif op == "lop3.b32":
            regs[d] = _lop3(a[0], a[1], a[2], int(src[3], 0))
        else:
            raise NotImplementedError(f"PTX op {op} (extend kernels/testing.run_ptx)")
    return regs
