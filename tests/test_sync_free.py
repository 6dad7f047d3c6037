"""Stage 3 of a static decode step reads nothing back to the host, for every preset (capturable in a CUDA graph).

``pack_completed_ref(..., skip_idle=False)`` (what a static layer on CUDA runs for the sides the pack kernel does not
pack: fitted value ranges, and every side on the torch backend) and the torch-side work of ``kitty.kernels.pack_completed``
(the boost masks torch ranks: random, range, query, oracle) must make no host read, build no shape from tensor data
and copy no host data to the device: on CUDA each of these synchronizes, and a synchronization during a CUDA-graph
capture fails the capture. A ``TorchDispatchMode`` sees every such operation, on the CPU as on CUDA (paused inside
Triton launches, which run on CPU tensors under ``TRITON_INTERPRET=1``, set by conftest without a GPU), and the pages
must be the same bytes as those of the default quantizers (``skip_idle=True``: the checked path with its host reads).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from fixtures import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import kitty.cache.backend as backend
from kitty import PRESETS, KittyCache
from kitty.core.config import get_preset
from kitty.core.storage import pool_fields
from kitty.hf.compat import cache_kwargs
from kitty.hf.generate import generate_static, generate_tokens, make_cache
from kitty.kernels import interpreting
from kitty.kernels.reference import pack_completed_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# every preset, and overrides that fit one side of a preset whose other side the kernel packs
NAMES = (
    *PRESETS,
    "kitty+key_range=fit",
    "kitty+value_range=fit",
    "kitty-pro+key_range=fit-peak",
    "kitty+key_range=fit-bounded",
    "kitty-fit+key_range=fit-standout",
    "kitty-fit+key_range=fit-token-standout",
    "kitty-fit+key_range=fit-loose-token-standout",
    "kitty+key_rotation=hadamard-signs+key_outlier_fraction=0.00390625",
)
# aten operations that read a tensor back to the host, give a shape that depends on tensor data, or make a tensor
# from host data (a host-to-device copy on CUDA)
HOST_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "lift_fresh",
    "lift_fresh_copy",
}


class HostReads(TorchDispatchMode):
    """Records every operation in ``HOST_OPS``, indexing with a boolean mask (a data-dependent shape) and any draw
    from a generator (the random selection's host draw, copied to the device), except while ``paused``."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = func.overloadpacket.__name__
            masks = name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            )
            if name in HOST_OPS or masks or kwargs.get("generator") is not None:
                self.found.append(str(func))
        return func(*args, **kwargs)


@contextmanager
def host_reads(monkeypatch):
    """A :class:`HostReads` mode, also recording ``Tensor.tolist`` / ``numpy`` (host reads that do not dispatch)."""
    mode = HostReads()
    with monkeypatch.context() as m:
        for method in ("tolist", "numpy"):

            def spy(self, *args, _original=getattr(torch.Tensor, method), _name=method, **kwargs):
                if not mode.paused:
                    mode.found.append(f"Tensor.{_name}")
                return _original(self, *args, **kwargs)

            m.setattr(torch.Tensor, method, spy)
        with mode:
            yield mode


class PausedKernel:
    """A Triton kernel whose launches ``kernel[grid](...)`` run with ``mode`` paused (the interpreter's own copies)."""

    def __init__(self, kernel, mode: HostReads):
        self.kernel, self.mode = kernel, mode

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.mode.paused += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self.mode.paused -= 1

        return run


# ------------------------------------------------------------------------------------------- one stage 3 call

B, H, D, WK, WV = 4, 2, 32, 3, 2
# per row (m = n - S, mv = m - R with S = 4, G = R = 16): key page 1 + value page 0; key page 0 only; nothing;
# key page 2 + value page 1
LENGTHS = [36, 20, 9, 52]


def layer_config(name: str, layer: int = 3):
    """Preset ``name`` with small pages, as layer ``layer`` of a 30-layer model holds it (a boost profile's entry)."""
    cfg = get_preset(name).with_(sink_tokens=4, group_size=16, local_window=16)
    return cfg.for_layer(layer, 30) if cfg.boost_profile is not None else cfg


def stage3_inputs(cfg, dtype=torch.float16, seed=0):
    """Random qbuffers (channels of different scales), random pools (never zeros) and empty page tables."""
    g = torch.Generator().manual_seed(seed)
    G = cfg.group_size
    k_qbuf = (torch.randn(B, H, G, D, generator=g) * torch.linspace(0.5, 3.0, D)).to(dtype)
    v_qbuf = torch.randn(B, H, G, D, generator=g).to(dtype)

    def pool(spec, pages):
        return {
            name: torch.randint(1, 255, (pages, *shape), generator=g, dtype=torch.uint8)
            if dt == torch.uint8
            else (torch.randn(pages, *shape, generator=g) + 3).to(dt)
            for name, (shape, dt) in spec.items()
        }

    key_spec, value_spec = pool_fields(cfg, H, D, dtype)
    qs = torch.rand(B, H, D, generator=g) + 0.1 if cfg.channel_selection in ("query", "oracle") else None
    tables = [torch.full((B, w), -1, dtype=torch.int32) for w in (WK, WV)]
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    tensors = (lengths, k_qbuf, v_qbuf, pool(key_spec, B * WK), pool(value_spec, B * WV), *tables)
    return to_device(tensors), None if qs is None else qs.to(DEVICE)


def to_device(tensors, copy=lambda t: t.to(DEVICE)):
    """``tensors`` (tensors and dicts of them) through ``copy``."""
    return tuple(copy(x) if isinstance(x, torch.Tensor) else {n: copy(t) for n, t in x.items()} for x in tensors)


def outputs(tensors) -> dict[str, torch.Tensor]:
    _, _, _, key_pool, value_pool, k_table, v_table = tensors
    return {**key_pool, **value_pool, "k_page_table": k_table, "v_page_table": v_table}


def clone(tensors):
    return to_device(tensors, torch.clone)


@pytest.mark.parametrize("name", NAMES)
def test_pack_completed_ref_reads_nothing_back_and_packs_the_same_bytes(name, monkeypatch):
    """One ``skip_idle=False`` call (after a first one: the warm-up step a capture follows) makes no host read, and
    writes exactly what the checked default path (``skip_idle=True``) writes: the completed rows' pages and table
    entries, nothing else."""
    layers = (0, 3, 29) if get_preset(name).boost_profile is not None else (0,)
    for layer in layers:  # an adaptive preset: layers of different nb (0 at layer 0 of the shipped profile)
        cfg = layer_config(name, layer)
        tensors, qs = stage3_inputs(cfg, seed=layer)
        before = outputs(clone(tensors))
        warm, free, checked = clone(tensors), clone(tensors), clone(tensors)
        pack_completed_ref(cfg, *warm, salt=layer, query_scale=qs, skip_idle=False)
        with host_reads(monkeypatch) as mode:
            pack_completed_ref(cfg, *free, salt=layer, query_scale=qs, skip_idle=False)
        assert mode.found == [], (name, layer)
        pack_completed_ref(cfg, *checked, salt=layer, query_scale=qs, skip_idle=True)
        got, want = outputs(free), outputs(checked)
        for field in want:
            assert torch.equal(got[field], want[field]), (name, layer, field)
        assert want["k_page_table"].tolist() == [[-1, 1, -1], [3, -1, -1], [-1] * 3, [-1, -1, 11]]
        assert want["v_page_table"].tolist() == [[0, -1], [-1, -1], [-1, -1], [-1, 7]]
        written = {"k": {1, 3, 11}, "v": {0, 7}}  # pool ids of the completed pages; the others keep their bytes
        for field, t in got.items():
            if not field.endswith("page_table") and t[0].numel():  # (no high plane where nb = 0)
                changed = {p for p in range(len(t)) if not torch.equal(t[p], before[field][p])}
                assert changed == written[field[0]], (name, layer, field)


# the presets whose kernel side runs torch work each call: a boost mask ranked by torch, next to magnitude ones
KERNEL_NAMES = ("kitty", "kitty-random", "kitty-range", "kitty-query", "kitty-oracle", "kitty-fit", "kivi-k4v2-sink")


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_pack_completed_kernel_torch_side_reads_nothing_back(name, monkeypatch):
    """``kitty.kernels.pack_completed`` on the sides it packs (a min-max range), its second call with the same
    scratch (the first checks the arguments): no host read outside the launch, the reference's bytes."""
    import kitty.kernels as kernels
    from kitty.kernels import pack as pack_module

    cfg = layer_config(name)
    keys = cfg.quantizes_keys and cfg.key_range == "minmax"  # the sides the kernel packs (kitty.cache.backend)
    values = cfg.quantizes_values and cfg.value_range == "minmax"
    tensors, qs = stage3_inputs(cfg)
    packed, ref = clone(tensors), clone(tensors)
    scratch = {}
    kernels.pack_completed(cfg, *clone(tensors), salt=3, query_scale=qs, keys=keys, values=values, scratch=scratch)
    with host_reads(monkeypatch) as mode:
        monkeypatch.setattr(pack_module, "_pack_kernel", PausedKernel(pack_module._pack_kernel, mode))
        kernels.pack_completed(cfg, *packed, salt=3, query_scale=qs, keys=keys, values=values, scratch=scratch)
    assert mode.found == [], name
    pack_completed_ref(cfg, *ref, salt=3, query_scale=qs, skip_idle=True, keys=keys, values=values)
    got, want = outputs(packed), outputs(ref)
    for field in want:
        assert torch.equal(got[field], want[field]), (name, field)


# ---------------------------------------------------------------------- a static decode loop on the sync-free pack

S, G, R = 4, 8, 8
ROWS, T, NEW = 3, 13, 30


@pytest.mark.parametrize("name", ["kitty-fit", "kitty-query"])
def test_static_decode_with_the_sync_free_pack_gives_the_growing_cache_tokens(name, monkeypatch):
    """``generate_static(capture=False)`` on the CPU, its stage 3 forced onto the CUDA path of the reference
    (``skip_idle=False``, every call checked for host reads), gives the growing cache's greedy tokens on a ragged
    batch whose rows complete pages at different steps; row 0 (no padding) also equals ``generate_tokens``."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    cfg = PRESETS[name].with_(sink_tokens=S, group_size=G, local_window=R)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (ROWS, T), generator=g)
    mask = torch.ones(ROWS, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :9] = 0
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    growing = model.generate(ids, attention_mask=mask, **cache_kwargs(make_cache(model, cfg)), **kwargs)[:, T:]
    calls, found = [], []

    def sync_free_ref(*args, skip_idle, **kwargs):
        with host_reads(monkeypatch) as mode:
            pack_completed_ref(*args, skip_idle=False, **kwargs)
        calls.append(1)
        found.extend(mode.found)

    monkeypatch.setattr(backend, "pack_completed_ref", sync_free_ref)
    cache = KittyCache(model.config, cfg, backend="torch", max_batch_size=ROWS, max_cache_len=T + NEW)
    out = generate_static(model, ids, mask, cache, NEW, capture=False)
    assert len(calls) == (NEW - 1) * model.config.num_hidden_layers and found == []
    assert all(c["key_pages"] > 0 for c in cache.token_counts(per_row=True))  # pages were packed in every row
    assert torch.equal(out, growing)
    monkeypatch.undo()
    assert generate_tokens(model, ids[:1], make_cache(model, cfg), NEW) == out[0].tolist()
