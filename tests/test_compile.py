"""A static KittyCache under ``torch.compile`` (``kitty.cache.static``, "What happens under torch.compile" in
``docs/ARCHITECTURE.md``): the decode steps that transformers' ``generate`` compiles itself (``compile_config``) and a
user's ``torch.compile(model.forward)`` give the tokens of the eager static decode, with no graph break in a decode
step and no recompilation from one step to the next; the host counters are right after compiled steps.

Without a GPU, conftest sets ``TRITON_INTERPRET=1`` and the Triton kernels run on the CPU. The pages here are tiny
(G = 16, head_dim 32), which the compiled GPU kernels refuse (``triton_supports``), so on a GPU without the interpreter
this module is skipped: ``tests/test_cuda.py`` runs the compiled forms there at sizes the kernels take.
``CompileConfig._compile_all_devices`` makes ``generate`` compile on the CPU. The ragged prompt (row 1 left-padded)
crosses key and value page boundaries during the decode steps.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model
from torch._dynamo.utils import counters
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.configuration_utils import CompileConfig

from kitty import PRESETS, KittyCache
from kitty.cache import custom_ops
from kitty.hf.compat import cache_kwargs
from kitty.hf.generate import generate_static
from kitty.kernels import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="needs TRITON_INTERPRET=1: the compiled GPU kernels refuse these tiny pages"
)

# row 0 holds 34 -> 39 tokens (its second key page completes at 36), row 1 (8 padding columns) 26 -> 31 (its first
# value page completes at 28): NEW tokens generated, NEW - 1 of them fed back through decode steps
B, T, PAD, NEW = 2, 34, 8, 6
SMALL = dict(sink_tokens=4, group_size=16, local_window=8)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model():
    m = tiny_model(head_dim=32).to(DEVICE)
    m.generation_config.eos_token_id = None
    return m


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (B, T), generator=g).to(DEVICE)
    mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)
    mask[1, :PAD] = 0
    return ids, mask


def _cache(model, preset: str, backend: str = "triton") -> KittyCache:
    cfg = PRESETS[preset].with_(**SMALL)
    return KittyCache(model.config, cfg, backend=backend, max_batch_size=B, max_cache_len=T + NEW)


class _Compiles(LogitsProcessor):
    """Records, after every forward pass of a generation, the graph breaks and graphs compiled so far."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def __call__(self, input_ids, scores):
        self.seen.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]))
        return scores


def _generate(model, cache, **kw) -> tuple[torch.Tensor, _Compiles]:
    ids, mask = _inputs()
    record = _Compiles()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         logits_processor=LogitsProcessorList([record]), **cache_kwargs(cache), **kw)  # fmt: skip
    return out[:, T:], record


_EAGER: dict[str, tuple[torch.Tensor, KittyCache]] = {}


def _eager(model, preset: str) -> tuple[torch.Tensor, KittyCache]:
    """The eager static decode's tokens and cache (computed once per preset: the interpreter is slow)."""
    if preset not in _EAGER:
        ids, mask = _inputs()
        cache = _cache(model, preset)
        _EAGER[preset] = generate_static(model, ids, mask, cache, NEW, capture=False), cache
    return _EAGER[preset]


def _steady(record: _Compiles) -> None:
    """No graph break in any decode step; the graphs are compiled by the first decode steps, none after."""
    breaks, graphs = zip(*record.seen)  # seen[0]: after the prompt; seen[i]: after decode step i
    assert len(record.seen) == NEW
    assert breaks[1:] == (breaks[0],) * (NEW - 1), f"graph breaks in decode steps: {breaks}"
    assert graphs[2:] == (graphs[2],) * (NEW - 2), f"recompiled during decoding: {graphs}"


def _same_counters(cache: KittyCache, want: KittyCache) -> None:
    """The host counters after compiled steps (caught up from the device) equal the eager decode's."""
    assert cache.get_seq_length() == want.get_seq_length() == T + NEW - 1
    assert cache.lengths == want.lengths == cache._paged_layer().lengths.tolist()
    assert cache.token_counts(per_row=True) == want.token_counts(per_row=True)


@pytest.mark.parametrize(
    "preset,backend", [("kitty", "eager"), ("kitty-pro", "aot_eager"), ("kitty", "inductor"), ("fp16", "aot_eager")]
)
def test_generate_compile_config_matches_eager_static(model, preset, backend):
    want, eager_cache = _eager(model, preset)
    torch._dynamo.reset()
    counters.clear()
    cache = _cache(model, preset)
    config = CompileConfig(backend=backend, fullgraph=False, mode=None if backend != "inductor" else "default")
    config._compile_all_devices = True  # generate compiles the decode step on the CPU too
    got, record = _generate(model, cache, compile_config=config)
    assert torch.equal(got, want)
    _steady(record)
    assert record.seen[-1][0] == 0, dict(counters["graph_break"])  # the prompt runs eagerly: no break at all
    assert record.seen[-1][1] == 1  # one graph: the decode step
    _same_counters(cache, eager_cache)
    if backend == "eager":  # a second generation (reset, same batch) reuses the graph
        cache.reset()
        again, record = _generate(model, cache, compile_config=config)
        assert torch.equal(again, want) and record.seen[-1] == (0, 1)


def test_user_compiled_forward_matches_eager_static(model):
    """``torch.compile(model.forward)`` as a user compiles it: generate's prompt goes through it too (the prompt's
    Kitty work runs outside the graph, ``torch.compiler.disable``); every decode step is one graph."""
    want, eager_cache = _eager(model, "kitty")
    torch._dynamo.reset()
    counters.clear()
    forward = model.forward
    model.forward = torch.compile(forward, backend="aot_eager")
    try:
        cache = _cache(model, "kitty")
        got, record = _generate(model, cache)
    finally:
        model.forward = forward
    assert torch.equal(got, want)
    _steady(record)
    _same_counters(cache, eager_cache)


@pytest.mark.parametrize("backend", ["triton", "gluon"])  # gluon: the op's Gluon flag (the tl kernel off sm_90)
def test_compiled_decode_step_after_an_eager_prompt(model, backend):
    """The gpt-fast form: the prompt eagerly, then one compiled function per decode step (``fullgraph=True``: a graph
    break raises) with the static cache's fixed-size mask, the position from ``cache.get_seq_length()`` inside the
    graph (a device tensor there); the same loop run eagerly gives the same tokens."""
    ids, mask = _inputs()
    full = torch.cat([mask, torch.ones(B, NEW, dtype=mask.dtype, device=DEVICE)], 1)  # [B, max_cache_len]

    def decode(cache, compiled: bool) -> torch.Tensor:
        kw = cache_kwargs(cache)

        def step(token):
            return model(token, attention_mask=full, **kw).logits[:, -1].argmax(-1, keepdim=True)

        run = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
        tokens = [model(ids, attention_mask=mask, **cache_kwargs(cache)).logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(NEW - 1):
            tokens.append(run(tokens[-1]))
        return torch.cat(tokens, 1)

    eager = _cache(model, "kitty", backend)
    want = decode(eager, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    cache = _cache(model, "kitty", backend)
    assert torch.equal(decode(cache, compiled=True), want)
    assert cache.layers[0].ops.decodes_with_gluon == (backend == "gluon")
    assert custom_ops._gluon_asked(cache.layers[0]._op_args.launch) == (backend == "gluon")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert cache.get_seq_length() == eager.get_seq_length() == T + NEW - 1
    assert cache.token_counts(per_row=True) == eager.token_counts(per_row=True)
    # eager steps go on from the compiled ones: a refused step changes nothing, the next one matches the eager cache's
    # to the bit, and the cache then refuses a step past max_cache_len
    last = want[:, -1:]
    with pytest.raises(ValueError, match="rows"):
        model(torch.cat([last, last[:1]]), attention_mask=torch.cat([full, full[:1]]), **cache_kwargs(cache))
    assert cache.get_seq_length() == T + NEW - 1
    logits = [model(last, attention_mask=full, **cache_kwargs(c)).logits for c in (cache, eager)]
    assert torch.equal(*logits) and cache.lengths == eager.lengths and cache.get_seq_length() == T + NEW
    with pytest.raises(ValueError, match="max_cache_len"):
        model(last, attention_mask=torch.cat([full, full[:, :1]], 1), **cache_kwargs(cache))


def test_compiled_steps_past_max_cache_len_are_reported(model):
    """A compiled decode step checks no room (it reads nothing on the host): steps past ``max_cache_len`` store no
    token, and the first host read of the cache's counters after them raises ``ValueError`` naming
    ``max_cache_len`` rather than counting tokens that were not kept."""
    ids, mask = _inputs()
    full = torch.cat([mask, torch.ones(B, NEW, dtype=mask.dtype, device=DEVICE)], 1)
    cache = _cache(model, "kitty")
    kw = cache_kwargs(cache)
    step = torch.compile(
        lambda token: model(token, attention_mask=full, **kw).logits[:, -1].argmax(-1, keepdim=True),
        backend="aot_eager",
        fullgraph=True,
    )
    token = model(ids, attention_mask=mask, **kw).logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(NEW + 2):  # room for NEW columns after the prompt: two steps too many
        token = step(token)
    with pytest.raises(ValueError, match="2 column.*max_cache_len"):
        cache.get_seq_length()
    cache.reset()
    assert cache.get_seq_length() == 0


def test_torch_backend_steps_run_outside_the_graph(model):
    """The torch backend's decode step reads the host (``attend_torch``), so a compiled forward runs Kitty's part of
    it eagerly, outside the graph (graph breaks there), with the eager step's bookkeeping: the same tokens and
    counters as the eager static decode."""
    ids, mask = _inputs()
    want_cache = _cache(model, "kitty", backend="torch")
    want = generate_static(model, ids, mask, want_cache, NEW, capture=False)
    torch._dynamo.reset()
    cache = _cache(model, "kitty", backend="torch")
    config = CompileConfig(backend="eager", fullgraph=False)
    config._compile_all_devices = True
    got, _ = _generate(model, cache, compile_config=config)
    assert torch.equal(got, want)
    _same_counters(cache, want_cache)


def test_compiled_gluon_step_writes_the_layers_buffers(model, monkeypatch):
    """A Gluon layer's prompt allocates the Gluon kernel's split buffers and tickets once (sized by
    ``gluon_workspace_shapes`` for the launch every call uses), and both its eager and its compiled decode steps hand
    the kernel those buffers (``kitty::decode_attention``'s workspace list), so that the kernel allocates none per
    layer and step (nor zeroes tickets with a memset). Without a
    Hopper GPU the kernel is a stand-in that records its workspace and runs the ``tl`` kernel."""
    import sys
    import types

    from kitty import kernels
    from kitty.cache import static
    from kitty.kernels import gluon_launch as gl

    calls: list[dict | None] = []

    def gluon_stand_in(q, state, cfg, scaling, *, full_qbuffer=False, workspace=None, launch=None):
        calls.append(workspace)
        return kernels.decode_attention_triton(q, state, cfg, scaling, full_qbuffer=full_qbuffer)

    monkeypatch.setitem(sys.modules, "kitty.kernels.decode_gluon", types.SimpleNamespace(
        decode_attention_gluon=gluon_stand_in))  # fmt: skip
    for module in (gl, static):
        monkeypatch.setattr(module, "gluon_applies", lambda cfg, q, k_qbuf: True)
    ids, mask = _inputs()
    cache = _cache(model, "kitty", "gluon")
    kw = cache_kwargs(cache)
    token = model(ids, attention_mask=mask, **kw).logits[:, -1].argmax(-1, keepdim=True)
    full = torch.cat([mask, torch.ones(B, NEW, dtype=mask.dtype, device=DEVICE)], 1)
    layer = cache.layers[0]
    Hq, D, Hkv = model.config.num_attention_heads, layer.head_dim, layer.num_kv_heads
    launch = gl.default_gluon_launch(B, Hkv, layer.k_page_table.shape[1] + 1, layer.device)
    for name, (shape, dtype) in gl.gluon_workspace_shapes(B, Hq, Hkv, D, launch).items():
        assert layer.workspace[name].shape == shape and layer.workspace[name].dtype == dtype, name
    assert not layer.workspace["g_t"].any()

    def step(token):
        return model(token, attention_mask=full, **kw).logits[:, -1].argmax(-1, keepdim=True)

    token = step(token)  # eager: the layer's dict itself
    assert calls and all(ws is cache.layers[i].workspace for i, ws in enumerate(calls))
    calls.clear()
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(token)
    assert len(calls) == len(cache.layers)
    for ws, lay in zip(calls, cache.layers):  # aot_eager functionalizes the op's mutation: it may pass copies
        assert ws is not None and all(
            (ws[n].shape, ws[n].dtype) == (lay.workspace[n].shape, lay.workspace[n].dtype) for n in gl.GLUON_WORKSPACE
        )
        assert ws["g_out"].shape == (B, Hq, D) and ws["g_out"].data_ptr() != lay.workspace["out"].data_ptr()
