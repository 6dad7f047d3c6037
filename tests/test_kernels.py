"""Triton kernels against their torch references, on CPU under the Triton interpreter.

Tolerances (flash-attention's rule, ``tests/test_flash_attn.py``): ``ref`` = torch reference in fp32, ``pt`` = the same
reference computed in the kernel dtype, both on the *same* 2-bit codes; a kernel passes when
``max|out - ref| <= 2 * max|pt - ref| + floor`` (``kitty.kernels.testing.attention_tolerance``: floor fp16 1e-4,
bf16 1e-3, ~1/10 of an output ulp at |out| ~ 1; under the interpreter bf16 products run in fp32). Pack and
dequantization are exact: bit-identical to ``kitty.core.quant``.
Sizes are small (G=16, a few pages) to keep the interpreter under CI's time budget.
"""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kitty.kernels as kernels  # noqa: E402
from kitty.cache.backend import backend_ops  # noqa: E402
from kitty.core.config import PRESETS, get_preset  # noqa: E402
from kitty.core.memory import token_layout  # noqa: E402
from kitty.core.quant import (  # noqa: E402
    dequantize_key_page,
    dequantize_value_page,
    quantize_key_page,
    quantize_value_page,
    unpack_2bit,
)
from kitty.core.storage import pool_fields  # noqa: E402
from kitty.kernels import (  # noqa: E402
    KittyLayerState,
    decode_attention_ref,
    decode_attention_triton,
    decode_attention_unfused,
    dequantize_key_page_triton,
    dequantize_value_page_triton,
    pack_pages,
    pack_pages_ref,
)
from kitty.kernels._pack_math import _div, _reciprocal  # noqa: E402
from kitty.kernels.launch import Launch, default_launch  # noqa: E402
from kitty.kernels.testing import attention_tolerance, make_state, planted_kv  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
KEY_FIELDS = ("low", "high", "boost_idx", "scale", "zero")
VALUE_FIELDS = ("codes", "scale", "zero")


def small(preset: str, **kw):
    """A preset with interpreter-sized pages (G=16) and a local window longer than a page (R=24 > G)."""
    kw = {"group_size": 16, "local_window": 24, "sink_tokens": 8, **kw}
    if PRESETS[preset].sink_tokens == 0:
        kw["sink_tokens"] = 0
    return PRESETS[preset].with_(**kw)


# ------------------------------------------------------------------------------------------------------ pack

PACK_CASES = [  # (preset, D, dtype, overrides): >8 boosted channels (kitty-pro D=128 -> 32) catch uint8 slot overflow;
    # nb = 5 and 13 are not multiples of 4 (the high plane's last byte holds padding slots), nb = 12 needs a padded tile
    ("kitty-pro", 128, torch.float16, {}),
    ("kitty", 64, torch.bfloat16, {}),
    ("kitty", 128, torch.bfloat16, {}),
    ("kitty", 64, torch.float16, {"boost_fraction": 5 / 64}),
    ("kitty", 64, torch.bfloat16, {"boost_fraction": 13 / 64}),
    ("kitty", 64, torch.float32, {"boost_fraction": 12 / 64}),
    ("kivi-k4v4", 64, torch.float16, {}),  # 4-bit keys: every channel "boosted"; 4-bit values
    ("kivi-k4v4", 256, torch.float16, {}),  # nb = D = 256: slot 255 is a real slot
    ("kivi-k4v2-sink", 64, torch.bfloat16, {}),  # 4-bit keys, 2-bit values
    ("kivi-k2v4-sink", 128, torch.bfloat16, {}),  # no boost, 4-bit values
    ("kitty-random", 64, torch.float16, {}),  # random selection: mask from torch, packing in the kernel
]


@pytest.mark.parametrize("preset,D,dtype,kw", PACK_CASES)
def test_pack_bit_identical(preset, D, dtype, kw):
    cfg = small(preset, group_size=32, **kw)
    k, v = planted_kv(4, 2, 32, D, dtype, DEVICE, seed=D + len(preset))
    k[0, 1, :, 3] = 0.25  # a constant channel: zero range -> scale 0, codes 0
    rows = [3, 0, 2]  # a subset, out of order
    kp, vp = pack_pages(cfg, k, v, k_rows=rows, v_rows=rows[:2], salt=5)
    rk, rv = pack_pages_ref(cfg, k, v, k_rows=rows, v_rows=rows[:2], salt=5)
    nb = cfg.num_boosted(D)
    assert kp.num_boosted == rk.num_boosted == nb
    assert kp.low.shape == (3, 2, 32, D // 4) and kp.high.shape == (3, 2, 32, -(-nb // 4))
    assert vp.codes.shape == (2, 2, D, 32 * cfg.value_bits // 8)
    for f in KEY_FIELDS:
        assert torch.equal(getattr(kp, f), getattr(rk, f)), f"key {f} differs"
    for f in VALUE_FIELDS:
        assert torch.equal(getattr(vp, f), getattr(rv, f)), f"value {f} differs"
    assert (unpack_2bit(kp.high)[..., nb:] == 0).all()  # padding slots of the last high-plane byte
    # the planted outlier channels are boosted (magnitude selection)
    if cfg.channel_selection == "magnitude" and 0 < nb < D:
        top = k[3].float().abs().mean(-2).argmax(-1)  # (Hkv,)
        assert (kp.boost_idx[0].gather(-1, top[:, None].long()) < nb).all()


@pytest.mark.parametrize(
    "preset,D,dtype,kw",
    [
        ("kitty-query", 64, torch.bfloat16, {}),
        ("kitty-pro-query", 128, torch.float16, {}),
        ("kitty-query", 64, torch.float16, {"boost_fraction": 13 / 64}),
        ("kitty-oracle", 64, torch.bfloat16, {}),
        ("kitty-range", 64, torch.float16, {"boost_fraction": 5 / 64}),
    ],
)
def test_pack_query_aware_selection_bit_identical(preset, D, dtype, kw):
    """Query-aware selections ("query", "oracle") pack in the kernel with the rows' query_scale: the boost mask is
    kitty.core.quant's own choice, the bytes are kitty.core.quant's."""
    cfg = small(preset, group_size=32, **kw)
    k, _ = planted_kv(4, 2, 32, D, dtype, DEVICE, seed=D + 1)
    rows = [2, 0, 3]
    g = torch.Generator().manual_seed(3)
    qs = (torch.rand(len(rows), 2, D, generator=g) * 2 + 0.1).to(DEVICE)  # [N, Hkv, D], rows' query magnitudes
    kp, _ = pack_pages(cfg, k, k_rows=rows, salt=2, query_scale=qs)
    rk, _ = pack_pages_ref(cfg, k, k_rows=rows, salt=2, query_scale=qs)
    for f in KEY_FIELDS:
        assert torch.equal(getattr(kp, f), getattr(rk, f)), f"key {f} differs"
    if cfg.channel_selection in ("query", "oracle"):
        with pytest.raises(ValueError, match="query_scale"):
            pack_pages(cfg, k, k_rows=rows)


FIT_PRESETS = ("kitty-fit", "kitty-pro-fit", "kitty-pro-fit-peak", "kitty+key_range=fit-peak")


def _grid_keys(B: int, Hkv: int, G: int, D: int, dtype, seed: int) -> torch.Tensor:
    """Keys as ``benchmarks/pack_speed.py``'s ``layer()`` builds them: random, each channel of a head scaled by its own
    factor, multiples of 2**-8 below 2**5 without zeros (fp16 and bf16 keep them), so that the channel sums of
    ``|k|`` are exact in fp32 whatever the order."""
    g = torch.Generator().manual_seed(seed)
    factor = torch.stack([torch.linspace(0.5, 3.0, D)[torch.randperm(D, generator=g)] for _ in range(Hkv)])
    k = (torch.randn(B, Hkv, G, D, generator=g) * factor[None, :, None, :] * 256).round().clamp(-8191, 8191) / 256
    return torch.where(k == 0, 2.0**-8, k).to(dtype).to(DEVICE)


def _query_scale(n: int, Hkv: int, D: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, Hkv, D, generator=g) * 2 + 0.1).to(DEVICE)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", FIT_PRESETS)
def test_pack_fitted_key_ranges_bit_identical(preset, dtype, D):
    """Fitted key ranges ("fit", "fit-peak": kernels/_pack_fit.py) pack in the kernel to kitty.core.quant's bytes, on
    a subset of rows out of order with several KV heads; the min-max values of the same launch too."""
    cfg = get_preset(preset).with_(group_size=32)
    k = _grid_keys(4, 3, 32, D, dtype, seed=D + len(preset))
    _, v = planted_kv(4, 3, 32, D, dtype, DEVICE, seed=D)
    rows = [3, 0, 2]
    qs = _query_scale(len(rows), 3, D)
    kp, vp = pack_pages(cfg, k, v, k_rows=rows, v_rows=rows[:2], salt=2, query_scale=qs)
    rk, rv = pack_pages_ref(cfg, k, v, k_rows=rows, v_rows=rows[:2], salt=2, query_scale=qs)
    for f in KEY_FIELDS:
        assert torch.equal(getattr(kp, f), getattr(rk, f)), f"key {f} differs"
    for f in VALUE_FIELDS:
        assert torch.equal(getattr(vp, f), getattr(rv, f)), f"value {f} differs"
    assert not torch.equal(
        kp.scale, pack_pages_ref(cfg.with_(key_range="minmax"), k, k_rows=rows, salt=2, query_scale=qs)[0].scale
    )  # the fit moved some ranges


@pytest.mark.parametrize(
    "preset,dtype,D,splits",
    [
        ("kitty-fit", torch.float16, 64, (1, 1)),
        ("kitty-pro-fit", torch.bfloat16, 128, (1, 2)),
        ("kitty-pro-fit-peak", torch.float16, 128, (1, 4)),
        ("kitty+key_range=fit-peak", torch.bfloat16, 64, None),  # one key program per page (_default_splits)
    ],
)
def test_pack_completed_fitted_keys_split_pages_bit_identical(preset, dtype, D, splits):
    """The predicated pack of fitted keys (one key program per page, value pages over several): ragged rows that
    complete a key page, a value page, both or neither, over pools of other bytes, equal pack_completed_ref's."""
    cfg = get_preset(preset).with_(group_size=32, local_window=32, sink_tokens=4)
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    B, Hkv, W = 4, 2, 3
    lengths = torch.tensor([S + 2 * G, S + G, S + G + 7, S + R + 2 * G], dtype=torch.int32, device=DEVICE)
    k = _grid_keys(B, Hkv, G, D, dtype, seed=D)
    _, v = planted_kv(B, Hkv, G, D, dtype, DEVICE, seed=D + 1)
    g = torch.Generator().manual_seed(5)
    pools = _pools(cfg, Hkv, D, dtype, B * W, lambda shape, dt: torch.randint(1, 200, shape, generator=g).to(dt))
    qs = _query_scale(B, Hkv, D)
    tables = _pack_completed_vs_ref(cfg, lengths, k, v, pools, W, salt=1, query_scale=qs, splits=splits)
    assert (tables[0] >= 0).sum(1).tolist() == [1, 1, 0, 1]


# Plain random keys (not on the 2**-8 grid): the kernel follows torch's fp32 operations and its order of summation
# over tokens (kernels/_pack_fit.py), so every page came out identical when measured under the interpreter: 576 of
# 576 pages (random keys of per-channel scales with an outlier channel, the 4 fitted configurations x fp16/bf16, 512
# pages at G = 32 / D = 64 and 64 at G = 128 / D = 128), reconstruction errors equal. Where an fp32 operation could
# still differ (another torch build, a compiler that contracted an operation), two candidates whose errors are an
# ulp apart may be chosen differently: the documented tolerance is at least 90% of pages identical and every page's
# reconstruction error within 1e-3 (relative) of torch's.
FIT_RANDOM_SHARE, FIT_RANDOM_ERR = 0.9, 1e-3


@pytest.mark.parametrize("preset,dtype", [("kitty-pro-fit", torch.float16), ("kitty-pro-fit-peak", torch.bfloat16)])
def test_pack_fitted_key_ranges_random_keys_within_tolerance(preset, dtype):
    cfg = get_preset(preset).with_(group_size=32)
    g = torch.Generator().manual_seed(11)
    N, Hkv, D = 4, 2, 64
    k = (torch.randn(N, Hkv, 32, D, generator=g) * torch.rand(D, generator=g) * 3).to(dtype).to(DEVICE)
    qs = _query_scale(N, Hkv, D)
    kp, _ = pack_pages(cfg, k, query_scale=qs)
    rk, _ = pack_pages_ref(cfg, k, query_scale=qs)
    same = torch.ones(N, Hkv, dtype=torch.bool, device=DEVICE)
    for f in KEY_FIELDS:
        same &= (getattr(kp, f) == getattr(rk, f)).reshape(N, Hkv, -1).all(-1)
    assert same.float().mean() >= FIT_RANDOM_SHARE
    err, ref = ((dequantize_key_page(p).float() - k.float()).square().sum((-1, -2)) for p in (kp, rk))
    assert ((err - ref).abs() <= FIT_RANDOM_ERR * ref).all()


def test_pack_refuses_a_fitted_key_page_over_several_programs():
    """A fitted key range packs in one key program per page (kernels/pack.py _check_splits): more is a ValueError."""
    cfg = get_preset("kitty-fit").with_(group_size=32)
    k = _grid_keys(2, 2, 32, 64, torch.float16, seed=3)
    with pytest.raises(ValueError, match="one key program per page"):
        pack_pages(cfg, k, query_scale=_query_scale(2, 2, 64), splits=(2, 1))


def test_pack_refuses_fitted_value_ranges():
    """Fitted value ranges pack with kitty.core.quant: the kernel refuses them, and packs the keys of such a config."""
    cfg = small("kitty", group_size=32, value_range="fit")
    k, v = planted_kv(2, 2, 32, 64, torch.float16, DEVICE, seed=4)
    with pytest.raises(ValueError, match="value_range='fit'"):
        pack_pages(cfg, k, v)
    kp, _ = pack_pages(cfg, k)
    rk, _ = pack_pages_ref(cfg, k)
    for f in KEY_FIELDS:
        assert torch.equal(getattr(kp, f), getattr(rk, f)), f"key {f} differs"


def test_pack_range_past_fp32_stays_finite_and_bit_identical():
    """A key channel and a value token spanning more than fp32 can hold (finite bf16 near its limits) pack to finite
    scales, exactly as kitty.core.quant does (its overflow-safe range), never to inf/NaN."""
    cfg = small("kitty", group_size=32)
    k, v = planted_kv(1, 2, 32, 64, torch.bfloat16, DEVICE, seed=9)
    k[0, 0, ::2, 5], k[0, 0, 1::2, 5] = 3.0e38, -3.0e38  # one channel's range: 6e38 > fp32 max
    v[0, 1, 7, ::2], v[0, 1, 7, 1::2] = 3.0e38, -3.0e38  # one token's range
    kp, vp = pack_pages(cfg, k, v)
    rk, rv = pack_pages_ref(cfg, k, v)
    for f in KEY_FIELDS:
        assert torch.equal(getattr(kp, f), getattr(rk, f)), f"key {f} differs"
    for f in VALUE_FIELDS:
        assert torch.equal(getattr(vp, f), getattr(rv, f)), f"value {f} differs"
    assert torch.isfinite(kp.scale.float()).all() and torch.isfinite(vp.scale.float()).all()
    assert kp.scale[0, 0, 5].float() * 15 >= 6e38 and vp.scale[0, 1, 7].float() * 3 >= 6e38  # covers the range


def test_pack_into_pool_at_page_ids():
    """Pages land at the given pool ids, every other page keeps its bytes, and the high plane's padding slots are
    written as 0 over a pool that held other bytes (nb = 13: the last byte holds 3 padding slots)."""
    cfg = small("kitty-pro", boost_fraction=13 / 64)
    D, G, Hkv, P = 64, cfg.group_size, 2, 6
    k, v = planted_kv(3, Hkv, G, D, torch.float16, DEVICE, seed=7)
    key_spec, value_spec = pool_fields(cfg, Hkv, D, torch.float16)
    pool = {
        name: torch.full((P, *shape), 0xAB if dt == torch.uint8 else 7.0, dtype=dt, device=DEVICE)
        for name, (shape, dt) in {**key_spec, **value_spec}.items()
    }
    before = {name: t.clone() for name, t in pool.items()}
    assert pack_pages(cfg, k, v, k_rows=[1, 2], k_pages=[4, 0], v_rows=[0], v_pages=[5], pool=pool) is None
    rk = quantize_key_page(k[[1, 2]], cfg)
    rv = quantize_value_page(v[[0]], cfg)
    assert rk.num_boosted == 13 and pool["k_high"].shape[-1] == 4
    for name, f in zip(("k_low", "k_high", "k_boost_idx", "k_scale", "k_zero"), KEY_FIELDS):
        assert torch.equal(pool[name][[4, 0]], getattr(rk, f)), name
        assert torch.equal(pool[name][[1, 2, 3, 5]], before[name][[1, 2, 3, 5]]), f"{name}: other pages touched"
    for name, f in zip(("v_codes", "v_scale", "v_zero"), VALUE_FIELDS):
        assert torch.equal(pool[name][[5]], getattr(rv, f)), name
        assert torch.equal(pool[name][:5], before[name][:5]), f"{name}: other pages touched"
    assert (unpack_2bit(pool["k_high"][[4, 0]])[..., 13:] == 0).all()


@pytest.mark.parametrize("preset", ["kitty", "kivi-k2v4-sink"])
def test_make_state_triton_pack_matches_torch_pack(preset):
    """kernels/testing.make_state with pages packed by the Triton kernel (at shuffled pool ids) equals the torch
    packing, tensor for tensor."""
    cfg = small(preset)
    lengths = _lengths(cfg, 4)
    k, v = planted_kv(4, 2, max(lengths), 64, torch.bfloat16, DEVICE, seed=13)
    ref = make_state(cfg, k, v, lengths, seed=4)
    got = make_state(cfg, k, v, lengths, seed=4, pack="triton")
    for name, t in ref.tensors().items():
        assert torch.equal(t.nan_to_num(), got[name].nan_to_num()), name


def _pools(cfg, Hkv: int, D: int, dtype, pages: int, fill) -> list[dict[str, torch.Tensor]]:
    """Key and value pools of ``pages`` pages whose every byte comes from ``fill(shape, dtype)``."""
    return [
        {n: fill((pages, *shape), dt).to(DEVICE) for n, (shape, dt) in spec.items()}
        for spec in pool_fields(cfg, Hkv, D, dtype)
    ]


def _pack_completed_vs_ref(
    cfg, lengths, k, v, pools, W: int, salt: int = 0, query_scale=None, **launch
) -> list[torch.Tensor]:
    """``pack_completed`` (with ``launch`` keywords) and ``pack_completed_ref`` from the same pools and empty page
    tables of ``W`` columns; asserts every pool field and table equal and returns the kernel's tables."""
    tables = [torch.full((len(lengths), W), -1, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    ref_pools = [{n: t.clone() for n, t in pool.items()} for pool in pools]
    ref_tables = [t.clone() for t in tables]
    kernels.pack_completed(cfg, lengths, k, v, *pools, *tables, salt=salt, query_scale=query_scale, **launch)
    kernels.pack_completed_ref(cfg, lengths, k, v, *ref_pools, *ref_tables, salt=salt, query_scale=query_scale)
    for got, ref in zip(pools, ref_pools):
        for name in got:
            assert torch.equal(got[name], ref[name]), name
    for got, ref in zip(tables, ref_tables):
        assert torch.equal(got, ref)
    return tables


@pytest.mark.parametrize("preset,R", [("kitty", 16), ("kivi-k4v2-sink", 24)])  # R = G: both sides fill at once
def test_pack_completed_matches_its_reference(preset, R):
    """The predicated pack kernel (a static layer's stage 3) against pack_completed_ref on random qbuffers: rows whose
    key qbuffer, value qbuffer, both or neither the last token filled; pools and page tables compared whole."""
    cfg = small(preset, group_size=16, local_window=R, sink_tokens=4)
    S, G = cfg.sink_tokens, cfg.group_size
    B, Hkv, D, W = 5, 2, 64, 4
    lengths = torch.tensor([S + 2 * G, S + R + G, S + 2 * G + R, S + G + 3, S], dtype=torch.int32, device=DEVICE)
    k_qbuf, v_qbuf = planted_kv(B, Hkv, G, D, torch.float16, DEVICE, seed=17)
    pools = _pools(cfg, Hkv, D, torch.float16, B * W, lambda shape, dt: torch.zeros(shape, dtype=dt))
    tables = _pack_completed_vs_ref(cfg, lengths, k_qbuf, v_qbuf, pools, W, salt=1)
    assert tables[0][0, 1] == 0 * W + 1 and tables[1][1, 0] == 1 * W + 0  # row b's page j is pool id b * W + j
    assert (tables[0][3:] == -1).all() and (tables[1][3:] == -1).all()  # rows that filled nothing


def test_pack_completed_never_writes_past_a_rows_last_page():
    """A row whose token completes a page past its table's width (a step past max_cache_len, which only a
    user's own compiled or captured loop can take) writes nothing: no pool byte and no table entry of any row."""
    cfg = small("kitty", group_size=16, local_window=16, sink_tokens=4)
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    B, Hkv, D, W = 2, 2, 64, 2
    # both sides of both rows complete a page j >= W (R = G: a row fills its key and value qbuffers at once)
    lengths = torch.tensor([S + R + (W + 1) * G, S + R + (W + 2) * G], dtype=torch.int32, device=DEVICE)
    k_qbuf, v_qbuf = planted_kv(B, Hkv, G, D, torch.float16, DEVICE, seed=5)
    pools = _pools(cfg, Hkv, D, torch.float16, B * W, lambda shape, dt: torch.full(shape, 7, dtype=dt))
    before = [{n: t.clone() for n, t in pool.items()} for pool in pools]
    tables = _pack_completed_vs_ref(cfg, lengths, k_qbuf, v_qbuf, pools, W)  # the reference clamps j, ...
    for got, ref in zip(pools, before):  # ... so it must leave the pools as they were too
        for name in got:
            assert torch.equal(got[name], ref[name]), name
    assert all((t == -1).all() for t in tables)


PACK_SPLIT_CASES = [  # (preset, dtype, D, R, splits): R = G fills both qbuffers of a row at once, R = G / 2 never
    ("kitty", torch.float16, 64, 32, (1, 1)),
    ("kitty-pro", torch.bfloat16, 128, 16, (4, 2)),
    ("kitty", torch.bfloat16, 128, 16, (2, 4)),
    ("kitty-pro", torch.float16, 64, 32, None),  # pack_splits' choice
]


@pytest.mark.parametrize("preset,dtype,D,R,splits", PACK_SPLIT_CASES)
def test_pack_completed_split_pages_bit_identical(preset, dtype, D, R, splits):
    """The predicated pack with each page spread over several programs (key programs share the page's statistics,
    value programs split its bytes) writes pack_completed_ref's bytes, over pools of other bytes, on random data
    without zeros: rows that complete a key page, a value page, both or neither; in bf16 one row's tokens span
    ranges small enough that its pages divide with IEEE division (the other rows by reciprocals)."""
    cfg = small(preset, group_size=32, local_window=R, sink_tokens=4)
    S, G = cfg.sink_tokens, cfg.group_size
    B, Hkv, W = 5, 2, 3
    # key page 1 (+ value page 0 when R = G); key page 0 only; nothing; value page only (R < G) or both; nothing
    lengths = [S + 2 * G, S + G, S + G + 7, S + R + 2 * G, 2]
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(D + R)
    k, v = (torch.randn(B, Hkv, G, D, generator=g) for _ in range(2))
    k = k * torch.linspace(0.5, 3.0, D)[torch.randperm(D, generator=g)]  # distinct channel magnitudes
    k, v = (torch.where(x == 0, 1.0, x) for x in (k, v))
    if dtype == torch.bfloat16:  # ranges below 2**-80: IEEE division (fp16 has no such nonzero range)
        k[3], v[3] = k[3] * 1e-30, v[3] * 1e-30
    k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    pools = _pools(cfg, Hkv, D, dtype, B * W, lambda shape, dt: torch.randint(1, 200, shape, generator=g).to(dt))
    tables = _pack_completed_vs_ref(cfg, lengths, k, v, pools, W, splits=splits)
    done = (tables[0] >= 0).sum(1).tolist(), (tables[1] >= 0).sum(1).tolist()
    assert done == (([1, 1, 0, 1, 0], [1, 0, 0, 1, 0]) if R == G else ([1, 1, 0, 0, 0], [0, 0, 0, 1, 0]))


@triton.jit
def _div_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    """``a / b`` as a fast pack program divides (by a 16-bit scale)."""
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i)
    tl.store(out_ptr + i, _div(tl.load(a_ptr + i), b, _reciprocal(b, tl.bfloat16)))


@pytest.mark.parametrize("splits", [(8, 8), None])
def test_pack_completed_production_shape_bit_identical(splits):
    """kitty-pro as served (G = R = 128, S = 32, D = 128, bf16), one row completing both sides and one its key side,
    pages spread over 8 programs a side (the launch of a batch of 1) and pack_splits' choice."""
    cfg = PRESETS["kitty-pro"]
    S, G, B, Hkv, D, W = cfg.sink_tokens, cfg.group_size, 2, 2, 128, 3
    k, v = planted_kv(B, Hkv, G, D, torch.bfloat16, DEVICE, seed=11)
    lengths = torch.tensor([S + 2 * G, S + G], dtype=torch.int32, device=DEVICE)
    pools = _pools(cfg, Hkv, D, torch.bfloat16, B * W, lambda shape, dt: torch.full(shape, 7, dtype=dt))
    tables = _pack_completed_vs_ref(cfg, lengths, k, v, pools, W, splits=splits)
    assert tables[0].tolist() == [[-1, 1, -1], [3, -1, -1]] and tables[1].tolist() == [[0, -1, -1], [-1, -1, -1]]


def test_pack_reciprocal_division_is_exact():
    """The kernel's division by a reciprocal (Newton-refined for 16-bit divisors, then one FMA correction by the
    exact remainder) equals IEEE division on quotients a hair from the rounding boundaries n + 1/2, for every
    bf16 and fp16 significand over the exponents a fast program meets."""
    g = torch.Generator().manual_seed(0)
    mant = torch.cat([torch.arange(128) / 128, torch.arange(1024) / 1024]) + 1  # bf16 and fp16 significands
    N = 1 << 16
    b = mant[torch.randint(len(mant), (N,), generator=g)] * 2.0 ** torch.randint(-84, 80, (N,), generator=g)
    n = torch.randint(1, 32, (N,), generator=g) / 2  # the boundaries 1/2 .. 31/2 and the integers between
    a = (n * b).float()  # then a few ulps either way
    a = (a.view(torch.int32) + torch.randint(-8, 9, (N,), generator=g, dtype=torch.int32)).view(torch.float32)
    out = torch.empty(N)
    _div_kernel[(1,)](a, b.float(), out, N=N)
    assert torch.equal(out, a / b.float())


def test_pack_speed_benchmark_cpu_smoke(tmp_path, capsys):
    """benchmarks/pack_speed.py's plumbing on the CPU: the old and the new kernel write the same bytes, and a table
    and JSON come out."""
    import importlib
    import json

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the smoke run is the interpreter's (on CUDA: python -m benchmarks.pack_speed)")
    pack_speed = importlib.import_module("benchmarks.pack_speed")
    pack_speed.main(
        ["--cpu-smoke", "--variants", "default", "--presets", "kitty-pro", "--batches", "2", "--out", str(tmp_path)]
    )
    result = json.loads((tmp_path / "pack_speed.json").read_text())
    assert not result["failures"] and {r["variant"] for r in result["rows"]} >= {"old"}
    assert "| kitty-pro | 2 | complete |" in capsys.readouterr().out


def test_pack_ties_keep_lower_channel_index():
    cfg = small("kitty")  # D=32 -> 4 boosted
    k = torch.ones(1, 1, 16, 32, dtype=torch.float16, device=DEVICE)
    k[..., ::2, :] = -1.0  # every channel has mean |K| = 1: all tied
    kp, _ = pack_pages(cfg, k)
    assert kp.boost_idx[0, 0, :4].tolist() == [0, 1, 2, 3]
    assert (kp.boost_idx[0, 0, 4:] == 255).all()


def test_pack_rejects_bad_shapes():
    cfg = small("kitty")
    with pytest.raises(ValueError, match="group_size"):
        pack_pages(cfg, torch.zeros(1, 1, 32, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="needs k_qbuf"):
        pack_pages(cfg)


# --------------------------------------------------------------------------------------------------- dequant


DEQUANT_CASES = [  # (preset, D, dtype, overrides); nb = 5 and 13 are not multiples of 4
    ("kitty-pro", 128, torch.bfloat16, {}),
    ("kitty", 64, torch.float16, {}),
    ("kitty", 64, torch.bfloat16, {"boost_fraction": 5 / 64}),
    ("kitty", 64, torch.float16, {"boost_fraction": 13 / 64}),
    ("kivi-k4v4", 64, torch.bfloat16, {}),
    ("kivi-k4v2-sink", 64, torch.float16, {}),
    ("kivi-k2v4-sink", 64, torch.bfloat16, {}),
]


@pytest.mark.parametrize("preset,D,dtype,kw", DEQUANT_CASES)
@pytest.mark.parametrize("unpack_reshape", [True, False])
def test_dequantize_pages_bit_identical(preset, D, dtype, kw, unpack_reshape):
    G = 128 if D == 128 else 32  # G=128, kitty-pro: 32 boosted channels, slots past 8 in every high-plane byte
    cfg = small(preset, group_size=G, **kw)
    k, v = planted_kv(2, 3, G, D, dtype, DEVICE, seed=3)
    kp, vp = quantize_key_page(k, cfg), quantize_value_page(v, cfg)
    out = dequantize_key_page_triton(kp, unpack_reshape)
    assert torch.equal(out, dequantize_key_page(kp))
    assert torch.equal(dequantize_value_page_triton(vp, unpack_reshape), dequantize_value_page(vp))
    # boosted channels in every slot, up to the last, read their own high-plane bits: their error is the 4-bit one
    nb = kp.num_boosted
    if 0 < nb < D:
        boosted = kp.boost_idx[0, 0] < nb
        assert int(kp.boost_idx[0, 0][boosted].max()) == nb - 1
        x = k[0, 0].float()[:, boosted]
        err = (out[0, 0].float()[:, boosted] - x).abs()
        step = kp.scale[0, 0, boosted].float()
        rounding = torch.finfo(dtype).eps * x.abs()  # the cast of code * scale + zero to the page dtype
        assert (err <= step / 2 + 1e-2 * step + rounding + 1e-6).all()  # 4-bit bound: a 2-bit-only decode breaks it


def test_dequantize_rejects_inconsistent_page():
    cfg = small("kitty")
    kp = quantize_key_page(planted_kv(1, 1, 16, 64, torch.float16, DEVICE)[0], cfg)
    with pytest.raises(ValueError, match="inconsistent page"):
        dequantize_key_page_triton(dataclasses.replace(kp, num_boosted=kp.num_boosted + 4))


# ---------------------------------------------------------------------------------------------- attention


def _lengths(cfg, B):
    """Ragged lengths hitting the edge cases: 1 token, inside the sink, sink exactly, page boundaries +-1,
    values still all in the local window, several pages."""
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    cands = [S + 3 * G + 5, 1, S + G, S + R + 2 * G, S + 2 * G + 1, S + R - 1, S + 4 * G - 1, max(S, 1)]
    return cands[:B]


def _launch(q, state, **changes) -> Launch:
    """The default launch for ``q`` over ``state`` with ``changes`` (a sweep's launch: ``dataclasses.replace``)."""
    B, Hkv = q.shape[0], state.k_qbuf.shape[1]
    return dataclasses.replace(default_launch(B, Hkv, state.k_page_table.shape[1] + 1, q.device), **changes)


def _check(out, q, state, cfg, scaling=None):
    ref = decode_attention_ref(q, state, cfg, scaling, upcast=True)
    pt = decode_attention_ref(q, state, cfg, scaling, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN/Inf: a kernel read an unused (NaN-filled) slot"
    err = (out.float() - ref.float()).abs().max().item()
    tol = attention_tolerance(ref, pt, q.dtype)
    assert err <= tol, f"max|out-ref| = {err:.3g} > {tol:.3g}"
    return err


ATTN_CASES = [  # (preset, GQA ratio, D, dtype, sink, G, overrides): GQA 1/3/4/8, D 64/128, fp16/bf16, empty sink,
    # R < G and R > G, boost fractions 0 / 12.5% / 25% / 50%, 4-bit values; G=64 gives page quarters of 16 tokens
    # (the tensor-core path the GPU runs at G=128), G=16/32 the small-tile path
    ("kitty", 1, 64, torch.float16, 8, 32, {}),
    ("kitty-pro", 4, 128, torch.bfloat16, 8, 16, {}),
    ("kitty", 3, 64, torch.bfloat16, 0, 32, {}),
    ("kitty-pro", 8, 64, torch.float16, 4, 16, {}),
    ("kivi-k2v4-sink", 2, 64, torch.float16, 8, 32, {}),  # 4-bit values, no boost
    ("fp16", 4, 64, torch.bfloat16, 8, 16, {}),  # 16-bit raw pages
    ("kitty", 4, 128, torch.float16, 8, 64, {}),
    ("kitty-pro", 2, 64, torch.bfloat16, 8, 64, {}),
    ("kitty", 4, 64, torch.float16, 8, 64, {"boost_fraction": 0.5}),
    ("kitty", 4, 128, torch.float16, 8, 64, {"boost_fraction": 0.1}),  # nb = 13: the last high-plane byte pads
    # D = 256 with every channel boosted: boost_idx 255 is channel 255's real slot, not the sentinel (the torch
    # reference and the kernel must both read it as boosted)
    ("kivi-k4v4", 1, 256, torch.float16, 8, 16, {}),
]


@pytest.mark.parametrize("preset,gqa,D,dtype,sink,G,kw", ATTN_CASES)
def test_decode_attention_fused(preset, gqa, D, dtype, sink, G, kw):
    cfg = small(preset, sink_tokens=sink, group_size=G, **kw)
    B, Hkv = 5, 2
    lengths = _lengths(cfg, B)
    k, v = planted_kv(B, Hkv, max(lengths), D, dtype, DEVICE, seed=gqa * D + sink)
    state = make_state(cfg, k, v, lengths, seed=1)
    q = torch.randn(B, Hkv * gqa, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    # one program per row/head over all its pages, then rows split over programs (including empty splits); the
    # two-part operands for neither side and for both
    for changes in (dict(num_splits=1, operand_parts=0), dict(num_splits=3, num_warps=4, operand_parts=3)):
        _check(decode_attention_triton(q, state, cfg, launch=_launch(q, state, **changes)), q, state, cfg)


def test_decode_attention_scaling_pack_and_empty_row():
    """A custom scaling, pages packed by the Triton pack kernel, a row of length 0, odd B*Hkv."""
    cfg = small("kitty-pro")
    B, Hkv, D, dtype = 3, 1, 128, torch.float16
    lengths = [cfg.sink_tokens + 2 * cfg.group_size + cfg.local_window + 3, 0, 2]
    k, v = planted_kv(B, Hkv, max(lengths), D, dtype, DEVICE, seed=11)
    state = make_state(cfg, k, v, lengths, seed=3, pack="triton")
    q = torch.randn(B, 5 * Hkv, D, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    out = decode_attention_triton(q, state, cfg, scaling=0.3)
    _check(out, q, state, cfg, scaling=0.3)
    assert (out[1] == 0).all()


UNFUSED_CASES = [  # (preset, GQA ratio, D, dtype, sink, G, overrides, block_n): value blocks of several token
    # quarters (block_n > G/4), of one quarter, and inside one (4-bit values at G=64: halves of 32 > block_n=16);
    # nb = 5 and 13 (not multiples of 4); 4-bit keys
    ("kitty-pro", 4, 128, torch.bfloat16, 8, 16, {}, 16),
    ("kitty", 3, 64, torch.bfloat16, 0, 32, {}, 16),
    ("kivi-k2v4-sink", 2, 64, torch.float16, 8, 64, {}, 16),
    ("kivi-k2v4-sink", 2, 64, torch.bfloat16, 8, 64, {}, 32),
    ("kivi-k4v2-sink", 2, 64, torch.bfloat16, 8, 32, {}, 16),
    ("kitty", 4, 64, torch.float16, 8, 64, {"boost_fraction": 13 / 64}, 16),
    ("kitty", 1, 64, torch.bfloat16, 4, 16, {"boost_fraction": 5 / 64}, 16),
]


@pytest.mark.parametrize("preset,gqa,D,dtype,sink,G,kw,block_n", UNFUSED_CASES)
@pytest.mark.parametrize("unpack_reshape", [True, False])
def test_decode_attention_unfused(preset, gqa, D, dtype, sink, G, kw, block_n, unpack_reshape):
    cfg = small(preset, sink_tokens=sink, group_size=G, **kw)
    B, Hkv = 4, 2
    lengths = _lengths(cfg, B)
    k, v = planted_kv(B, Hkv, max(lengths), D, dtype, DEVICE, seed=5)
    state = make_state(cfg, k, v, lengths, seed=2)
    q = torch.randn(B, Hkv * gqa, D, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    out = decode_attention_unfused(q, state, cfg, num_splits=2, block_n=block_n, unpack_reshape=unpack_reshape)
    _check(out, q, state, cfg)


def test_reference_matches_plain_attention_on_unquantized_cache():
    """The reference's position bookkeeping: with fp16 pages it is plain softmax attention over the sequence."""
    cfg = small("fp16")
    B, Hkv, D = 3, 2, 64
    lengths = _lengths(cfg, B)
    k, v = planted_kv(B, Hkv, max(lengths), D, torch.float32, DEVICE, seed=9)
    state = make_state(cfg, k, v, lengths)
    q = torch.randn(B, 2 * Hkv, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = decode_attention_ref(q, state, cfg)
    for b, n in enumerate(lengths):
        kk = k[b, :, :n].repeat_interleave(2, 0)
        vv = v[b, :, :n].repeat_interleave(2, 0)
        expect = torch.einsum("hn,hnd->hd", torch.softmax(torch.einsum("hd,hnd->hn", q[b], kk) / D**0.5, -1), vv)
        torch.testing.assert_close(out[b], expect, rtol=1e-5, atol=1e-5)
    lay = token_layout(cfg, lengths[0])
    assert lay.key_pages > lay.value_pages > 0  # the lagging value side was exercised


def test_checks_and_the_one_dispatcher():
    """The kernel checks its inputs; which kernel runs is the ops object's (kitty.cache.backend), never the kernel's."""
    cfg = small("kitty")
    k, v = planted_kv(2, 2, 40, 64, torch.float16, DEVICE)
    state = make_state(cfg, k, v, [40, 17])
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention_triton(torch.zeros(2, 3, 64, dtype=torch.float16, device=DEVICE), state, cfg)
    bad = KittyLayerState(**{**state.tensors(), "v_local": state.v_local[:, :, :3]})
    with pytest.raises(ValueError, match="v_local"):
        decode_attention_triton(q, bad, cfg)
    # the ops objects: torch attends with the reference, triton with the kernel
    torch.testing.assert_close(
        backend_ops("torch", q.device, cfg, 64).attend(q, state, 0.125), decode_attention_ref(q, state, cfg, 0.125)
    )
    _check(backend_ops("triton", q.device, cfg, 64).attend(q, state, 0.125), q, state, cfg, 0.125)
    # where the kernel cannot run (group size 8) the dispatcher refuses triton and says why, as does the kernel
    cfg8 = small("kitty", group_size=8)
    state8 = make_state(cfg8, k, v, [40, 17])
    assert not kernels.triton_supports(cfg8, 64) and kernels.triton_supports(cfg, 64)
    # compiled for a GPU the kernel needs page quarters and value rows of >= 16 (smaller tiles were wrong there)
    assert not kernels.triton_supports(cfg, 64, compiled=True)  # G=16
    assert kernels.triton_supports(small("kitty", group_size=64), 64, compiled=True)
    assert not kernels.triton_supports(small("kitty", group_size=64), 32, compiled=True)  # 8-byte value rows
    with pytest.raises(ValueError, match="group_size"):
        backend_ops("triton", q.device, cfg8, 64)
    with pytest.raises(ValueError, match="group_size"):
        decode_attention_triton(q, state8, cfg8)
    assert {
        "decode_attention_triton",
        "triton_supports",
        "KittyLayerState",
        "pack_pages",
        "pack_pages_ref",
        "pack_completed_ref",
        "dequantize_key_page_triton",
        "decode_attention_unfused",
        "decode_attention_ref",
    } <= set(kernels.__all__)
    assert "decode_attention" not in kernels.__all__  # no second dispatcher


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_mid_step_full_qbuffers(dtype):
    """Mid-step layout (the token just inserted filled a qbuffer, not packed yet): rows whose key qbuffer, value
    qbuffer or both hold exactly G tokens, and a row that is not at a boundary."""
    cfg = small("kitty-pro", group_size=64, local_window=24)
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    lengths = [S + 2 * G, S + R + G, S + 3 * G + 7, S + G]  # key qbuffer full; value qbuffer full; neither; key
    k, v = planted_kv(len(lengths), 2, max(lengths), 64, dtype, DEVICE, seed=21)
    state = make_state(cfg, k, v, lengths, seed=5, full_qbuffer=True)
    lay = [token_layout(cfg, n, full_qbuffer=True) for n in lengths]
    assert lay[0].key_qbuffer == G and lay[1].value_qbuffer == G and lay[3].key_qbuffer == G
    q = torch.randn(len(lengths), 8, 64, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    out = decode_attention_triton(q, state, cfg, full_qbuffer=True, launch=_launch(q, state, num_splits=2))
    ref = decode_attention_ref(q, state, cfg, upcast=True, full_qbuffer=True)
    pt = decode_attention_ref(q, state, cfg, upcast=False, full_qbuffer=True)
    assert torch.isfinite(out).all()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= attention_tolerance(ref, pt, dtype)
    # the mid-step reference pairs positions right: with 16-bit pages it is plain softmax attention
    raw = small("fp16", group_size=64, local_window=24)
    kf, vf = k.float(), v.float()
    st = make_state(raw, kf, vf, lengths, full_qbuffer=True)
    qf = q.float()
    got = decode_attention_ref(qf, st, raw, full_qbuffer=True)
    for b, n in enumerate(lengths):
        kk, vv = kf[b, :, :n].repeat_interleave(4, 0), vf[b, :, :n].repeat_interleave(4, 0)
        expect = torch.einsum("hn,hnd->hd", torch.softmax(torch.einsum("hd,hnd->hn", qf[b], kk) / 8.0, -1), vv)
        torch.testing.assert_close(got[b], expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset,D,expect", [("kitty", 128, 8), ("kitty", 64, 8), ("kitty-pro", 128, 8),
                                             ("kivi-k4v2-sink", 128, 32)])  # fmt: skip
def test_high_plane_tile_is_at_least_32_columns(preset, D, expect):
    """The fused kernel joins a page's high-plane slot quarters into one tile of 4 * NB4P columns: at least 32, since
    16 columns gave wrong scores on the H200 (benchmarks/results/h200-2026-12-02/layout_check_high16cols.json)."""
    from kitty.kernels.decode_attention import kernel_constants

    cfg = PRESETS[preset]
    c = kernel_constants(cfg, D, 4, torch.float16, default_launch(8, 8, 64, 132), full_qbuffer=False)
    assert c["NB4"] == -(-cfg.num_boosted(D) // 4) and c["NB4P"] == expect and 4 * c["NB4P"] >= 32


def test_default_launch_is_the_measured_heuristic():
    """The fused kernel's launch (kernels/launch.py) for the H200's 132 SMs: 2 warps, a 128-register cap and ~8
    programs per SM from a quarter as many (row, KV head) pairs as SMs; 2 warps, no cap and ~4 per SM below. The key
    operand is carried as two 16-bit parts (operand_parts=1). Every kernel of a launch passes its options()."""
    assert default_launch(8, 8, 256, 132) == Launch(num_splits=17, num_warps=2, num_stages=1, maxnreg=128)
    assert default_launch(1, 8, 256, 132) == Launch(num_splits=66, num_warps=2, num_stages=1, maxnreg=None)
    assert default_launch(8, 8, 256, 132).operand_parts == 1
    assert default_launch(1, 8, 5, 132).num_splits == 5  # never more splits than page slots
    # a sweep's launch is a replaced field; the options are what Triton receives (no register cap when interpreting)
    four = dataclasses.replace(default_launch(8, 8, 256, 132), num_warps=4, maxnreg=None)
    assert four == Launch(17, 4, 1, None) and four.options() == dict(num_warps=4, num_stages=1)
    capped = default_launch(8, 8, 256, 132).options()
    assert capped == dict(num_warps=2, num_stages=1, **({} if kernels.interpreting() else {"maxnreg": 128}))
