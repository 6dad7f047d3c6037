"""Static KittyCache (``kitty.cache.static``) and the captured decode loop (``kitty.hf.generate.generate_static``) on the CPU.

Tiny random models from configs, tiny Kitty sizes (S=4, G=8, R=8) so that a few dozen tokens fill pages; batches
left-padded and ragged, so that rows complete pages at different steps. The static cache runs the same math as the
growing one, so greedy tokens must be identical (quantized presets included). The predicated pack kernel is
compared with its torch reference under ``TRITON_INTERPRET=1`` (set by conftest without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from fixtures import tiny_model
from transformers import StaticCache

from kitty import PRESETS, KittyCache
from kitty.cache.static import StaticKittyLayer
from kitty.hf.compat import cache_kwargs
from kitty.hf.generate import Sampling, generate_static
from kitty.kernels.reference import pack_completed_ref

S, G, R = 4, 8, 8
SMALL = {
    name: PRESETS[name].with_(sink_tokens=S, group_size=G, local_window=R) for name in ("fp16", "kitty", "kitty-pro")
}
B, T, NEW = 3, 13, 30


def build(family: str) -> torch.nn.Module:
    model = tiny_model(family)  # seed 0; gemma3: sliding, sliding, full with a window of 16
    model.generation_config.eos_token_id = None
    return model


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` prompts of ``T`` columns, rows 1 and 2 left-padded (8 and 4 real tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :9] = 0
    return ids, mask


def hf_greedy(model, ids, mask, cache, new: int = NEW) -> torch.Tensor:
    out = model.generate(
        ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("preset", ["fp16", "kitty", "kitty-pro"])
def test_static_greedy_tokens_equal_the_growing_cache(family, preset):
    model = build(family)
    ids, mask = ragged_batch()
    cfg = SMALL[preset]
    ref = hf_greedy(model, ids, mask, KittyCache(model.config, cfg, backend="torch"))
    cache = KittyCache(model.config, cfg, backend="torch", max_batch_size=B, max_cache_len=T + NEW)
    assert cache.is_compileable
    out = generate_static(model, ids, mask, cache, NEW)
    assert torch.equal(out, ref)
    assert cache.lengths == [T - 1 + NEW, T - 6 + NEW, T - 10 + NEW]  # real tokens only: padding never stored
    counts = cache.token_counts(per_row=True)
    assert all(c["key_pages"] > 0 for c in counts)  # pages were really completed (and packed) in every row
    if family == "llama":  # transformers' own loop over the same static cache gives the same tokens
        cache.reset()
        assert torch.equal(hf_greedy(model, ids, mask, cache), ref)


def test_static_storage_is_preallocated_and_matches_the_growing_layer():
    """Every tensor keeps its address across decode steps; buffers, pages and the memory report equal the growing
    layer's after the same ragged tokens."""
    model = build("llama")
    ids, mask = ragged_batch()
    cfg = SMALL["kitty"]
    static = KittyCache(model.config, cfg, backend="torch", max_batch_size=4, max_cache_len=T + 20)
    dynamic = KittyCache(model.config, cfg, backend="torch")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for cache in (static, dynamic):  # the prompt
        model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
    layer = static.layers[0]
    assert isinstance(layer, StaticKittyLayer)
    Wk, Wv = (T + 20 - S) // G, (T + 20 - S - R) // G
    assert layer.k_page_table.shape == (B, Wk) and layer.key_pool.tensors["k_low"].shape[0] == B * Wk
    assert layer.v_page_table.shape == (B, Wv) and layer.value_pool.tensors["v_codes"].shape[0] == B * Wv
    ptrs = {name: t.data_ptr() for name, t in layer.storage().items()}
    tok = torch.zeros(B, 1, dtype=torch.long)
    for t in range(19):
        pos = torch.tensor([[T + t], [T - 5 + t], [T - 9 + t]])
        for cache in (static, dynamic):
            full = torch.ones(B, T + t + 1, dtype=torch.long)
            full[:, :T] = mask
            model(tok + t, attention_mask=full, position_ids=pos, **cache_kwargs(cache), use_cache=True)
    assert {name: t.data_ptr() for name, t in layer.storage().items()} == ptrs
    for i in range(2):
        a, b = static.layers[i], dynamic.layers[i]
        assert torch.equal(a.lengths, b.lengths) and a.host_lengths == b.host_lengths
        for name in ("sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for row in range(B):
            for j in range(int((b.k_page_table[row] >= 0).sum())):
                pa, pb = a.key_page(row, j), b.key_page(row, j)
                assert torch.equal(pa.low, pb.low) and torch.equal(pa.scale, pb.scale)
                assert int(a.k_page_table[row, j]) == row * Wk + j  # fixed ids: no allocator
            for j in range(int((b.v_page_table[row] >= 0).sum())):
                assert torch.equal(a.value_page(row, j).codes, b.value_page(row, j).codes)
    assert static.token_counts() == dynamic.token_counts()
    assert static.memory_report() == dynamic.memory_report()


def test_static_bounds_raise_before_anything_changes():
    model = build("llama")
    ids, mask = ragged_batch()
    cache = KittyCache(model.config, SMALL["kitty"], backend="torch", max_batch_size=B, max_cache_len=T + 2)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate_static(model, ids, mask, cache, 4)  # checked up front
    generate_static(model, ids, mask, cache, 3)  # fills the cache exactly: T + 2 columns
    before = (cache.lengths, cache.layers[0].lengths.clone(), cache.get_seq_length())
    with pytest.raises(ValueError, match="max_cache_len"):
        model(ids[:, :1], **cache_kwargs(cache), use_cache=True)
    assert cache.lengths == before[0] and cache.get_seq_length() == before[2]
    assert torch.equal(cache.layers[0].lengths, before[1])
    cache.reset()
    with pytest.raises(ValueError, match="max_batch_size"):
        model(torch.zeros(B + 1, 2, dtype=torch.long), **cache_kwargs(cache), use_cache=True)
    for bad in (dict(max_cache_len=0), dict(max_batch_size=2), dict(max_cache_len=8, max_batch_size=0)):
        with pytest.raises(ValueError, match="max_cache_len|max_batch_size"):
            KittyCache(model.config, "kitty", **bad)
    with pytest.raises(ValueError, match="max_pages"):
        KittyCache(model.config, "kitty", max_pages=4, max_cache_len=8)
    with pytest.raises(ValueError, match="static cache"):
        generate_static(model, ids, mask, KittyCache(model.config, "kitty"), 2)


def test_generate_static_sampling_eos_and_transformers_static_cache():
    model = build("llama")
    ids, mask = ragged_batch()
    # transformers' StaticCache through the same loop: the FP16 baseline of the benchmark
    ref = hf_greedy(model, ids, mask, None)
    assert torch.equal(
        generate_static(model, ids, mask, StaticCache(config=model.config, max_cache_len=T + NEW), NEW), ref
    )
    # seeded sampling repeats; a row that emits an eos id is padded after it; trailing all-pad columns are cut
    draws = []
    for _ in range(2):
        cache = KittyCache(model.config, SMALL["kitty"], backend="torch", max_batch_size=B, max_cache_len=T + NEW)
        draws.append(
            generate_static(model, ids, mask, cache, NEW, Sampling(0.9, 0.9, seed=3), eos=[5, 7], pad_token_id=0)
        )
    assert torch.equal(draws[0], draws[1])
    out = draws[0]
    for row in out.tolist():
        hits = [i for i, t in enumerate(row) if t in (5, 7)]
        if hits:
            assert all(t == 0 for t in row[hits[0] + 1 :])
    assert len(set(out.flatten().tolist())) > 5  # sampling, not a constant


def _random_pools(kf: dict, vf: dict, Bq: int, Wk: int, Wv: int, device, low: int):
    """Key and value pools of ``pool_fields`` specs ``kf`` / ``vf`` (Wk / Wv pages per row) full of random bytes
    from ``low``, and empty page tables: a pack must overwrite exactly the pages it completes."""
    torch.manual_seed(5)
    key = {n: torch.randint(low, 200, (Bq * Wk, *s), device=device).to(dt) for n, (s, dt) in kf.items()}
    value = {n: torch.randint(low, 200, (Bq * Wv, *s), device=device).to(dt) for n, (s, dt) in vf.items()}
    tables = (
        torch.full((Bq, Wk), -1, dtype=torch.int32, device=device),
        torch.full((Bq, Wv), -1, dtype=torch.int32, device=device),
    )
    return key, value, tables


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no Triton")
@pytest.mark.parametrize("preset", ["kitty", "kitty-pro"])
def test_pack_completed_kernel_matches_reference(preset):
    """One launch over all rows: rows that just filled a key and/or value qbuffer are packed at their fixed ids,
    the others (and every other page) are left alone; bit-identical to the torch reference."""
    from kitty.kernels import pack_completed

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = PRESETS[preset].with_(sink_tokens=4, group_size=16, local_window=16)
    Bq, H, D, Wk, Wv = 5, 2, 32, 3, 2
    g = torch.Generator().manual_seed(0)
    k_qbuf = torch.randn(Bq, H, 16, D, generator=g).half().to(device)
    v_qbuf = torch.randn(Bq, H, 16, D, generator=g).half().to(device)
    # per row (m = n - S, mv = m - R): key page 1 + value page 0 (m=32, mv=16); key page 0 only (m=16);
    # nothing (m=5); key page 2 + value page 1 (m=48, mv=32); nothing, still in the sink (n=3)
    lengths = torch.tensor([36, 20, 9, 52, 3], dtype=torch.int32, device=device)
    from kitty.core.storage import pool_fields

    kf, vf = pool_fields(cfg, H, D, torch.float16)

    kk, vk, (tk, tv) = _random_pools(kf, vf, Bq, Wk, Wv, device, low=0)
    kr, vr, (rk, rv) = _random_pools(kf, vf, Bq, Wk, Wv, device, low=0)
    before = {n: t.clone() for n, t in kk.items()}
    pack_completed(cfg, lengths, k_qbuf, v_qbuf, kk, vk, tk, tv, salt=3)
    pack_completed_ref(cfg, lengths, k_qbuf, v_qbuf, kr, vr, rk, rv, salt=3)
    for name in kk:
        assert torch.equal(kk[name], kr[name]), name
    for name in vk:
        assert torch.equal(vk[name], vr[name]), name
    assert torch.equal(tk, rk) and torch.equal(tv, rv)
    assert tk.tolist() == [[-1, 1, -1], [3, -1, -1], [-1] * 3, [-1, -1, 11], [-1] * 3]
    assert tv.tolist() == [[0, -1], [-1, -1], [-1, -1], [-1, 7], [-1, -1]]
    changed = [p for p in range(Bq * Wk) if not torch.equal(kk["k_low"][p], before["k_low"][p])]
    assert changed == [1, 3, 11]  # only the completed pages were written


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no Triton")
@pytest.mark.parametrize("preset", ["kitty-query", "kitty-oracle", "kitty-fit", "kivi-k4v2-sink", "kivi-k2v4-sink"])
def test_triton_ops_pack_completed_side_by_side(preset):
    """The Triton backend's stage 3 packs each side the kernel packs bit-identically (query-aware selections with the
    rows' query_scale; fitted key ranges; 4-bit keys or values): the pools and tables equal pack_completed_ref's."""
    from kitty.cache.backend import TritonOps
    from kitty.core.storage import pool_fields

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = PRESETS[preset].with_(sink_tokens=4, group_size=16, local_window=16)
    ops = TritonOps(cfg, torch.device(device))
    assert ops.completes_keys and ops.completes_values
    Bq, H, D, Wk, Wv = 4, 2, 32, 3, 2
    g = torch.Generator().manual_seed(1)
    k_qbuf = (torch.randn(Bq, H, 16, D, generator=g) * torch.linspace(0.5, 3.0, D)).half().to(device)
    v_qbuf = torch.randn(Bq, H, 16, D, generator=g).half().to(device)
    qs = (torch.rand(Bq, H, D, generator=g) + 0.1).to(device) if cfg.channel_selection in ("query", "oracle") else None
    lengths = torch.tensor([36, 20, 9, 52], dtype=torch.int32, device=device)  # key+value, key, nothing, key+value
    kf, vf = pool_fields(cfg, H, D, torch.float16)

    kk, vk, (tk, tv) = _random_pools(kf, vf, Bq, Wk, Wv, device, low=1)
    kr, vr, (rk, rv) = _random_pools(kf, vf, Bq, Wk, Wv, device, low=1)
    ops.pack_completed(lengths, k_qbuf, v_qbuf, kk, vk, tk, tv, 3, qs)
    pack_completed_ref(cfg, lengths, k_qbuf, v_qbuf, kr, vr, rk, rv, salt=3, query_scale=qs)
    for name in kk:
        assert torch.equal(kk[name], kr[name]), name
    for name in vk:
        assert torch.equal(vk[name], vr[name]), name
    assert torch.equal(tk, rk) and torch.equal(tv, rv)
    assert tk.tolist() == [[-1, 1, -1], [3, -1, -1], [-1] * 3, [-1, -1, 11]]


def test_triton_backend_packs_every_min_max_side():
    """Which presets the Triton backend packs with the kernel on a GPU: every quantized side (any channel selection,
    min-max, "fit" and "fit-peak" key ranges, the layer's own nb under a boost profile); other key ranges and fitted
    value ranges would stay on kitty.core.quant, and no preset has fitted value ranges."""
    from kitty.cache.backend import TritonOps
    from kitty.kernels.launch import PACK_KEY_RANGES

    cuda = torch.device("cuda")  # only read for its type: nothing is allocated
    on_torch = {}
    for name in PRESETS:
        cfg = PRESETS[name].for_layer(0)  # what a layer holds (KittyCache builds layers with cfg.for_layer)
        ops = TritonOps(cfg, cuda)
        sides = [
            s
            for s, kernel, quantized in (
                ("keys", ops.packs_keys, cfg.quantizes_keys),
                ("values", ops.packs_values, cfg.quantizes_values),
            )
            if quantized and not kernel
        ]
        assert ops.packs_keys == ops.completes_keys and ops.packs_values == ops.completes_values
        if sides:
            on_torch[name] = sides
    fitted = [n for n in PRESETS if PRESETS[n].key_range in ("fit", "fit-peak")]
    other = [n for n in PRESETS if PRESETS[n].key_range not in PACK_KEY_RANGES and PRESETS[n].quantizes_keys]
    assert fitted and all(PRESETS[n].value_range == "minmax" for n in PRESETS)
    assert on_torch == {n: ["keys"] for n in other}  # key ranges the kernel does not fit (none today)
