"""The static decode step with the fused backend (``kitty.cache.static``): one insert launch, the preallocated
attention workspace, the pack with cached constants; its undo; which path each entry point takes.

Under ``TRITON_INTERPRET=1`` (set by conftest without a GPU) a ``backend="triton"`` layer runs the Triton insert,
attention and pack kernels on the CPU. Its state after N decode steps must be bit-identical to a ``backend="torch"``
layer's (the torch slot writes and ``kitty.core.quant``), with ragged rows that cross the sink end, page boundaries
and the local ring's wrap at different steps, also when every step is first tried and rolled back.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kitty import PRESETS  # noqa: E402
from kitty.cache import custom_ops  # noqa: E402
from kitty.cache.static import StaticKittyLayer  # noqa: E402
from kitty.kernels import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(
    not interpreting() and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or a GPU"
)

S, G, R = 4, 16, 16
H, HQ, D = 2, 4, 32
PROMPT = [1, 3, 19, 36]  # tokens per row of a left-padded prompt of max(PROMPT) columns
STEPS = 40  # every row crosses a page boundary, row 0 the sink end, rows 2-3 the ring's wrap into the qbuffer
PRESET_NAMES = ("fp16", "kitty", "kitty-query")


def _layer(preset: str, backend: str) -> StaticKittyLayer:
    cfg = PRESETS[preset].with_(sink_tokens=S, group_size=G, local_window=R)
    return StaticKittyLayer(cfg, H, D, backend=backend, max_cache_len=max(PROMPT) + STEPS + 2, max_batch_size=4)


def _tensors(layer: StaticKittyLayer) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in layer.storage().items() if v is not None}
    state.update(q_stat_sum=layer.q_stat_sum, q_count=layer.q_count)
    return state


def _prompt(layers, g: torch.Generator) -> None:
    B, T = len(PROMPT), max(PROMPT)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(PROMPT):
        valid[b, T - n :] = True
    q, (k, v) = torch.randn(B, HQ, T, D, generator=g), torch.randn(2, B, H, T, D, generator=g)
    for layer in layers:
        layer.prepare(k)
        layer.attend_and_append(q, k, v, valid, D**-0.5)


def _decode(layer: StaticKittyLayer, q, k, v) -> torch.Tensor:
    return layer.attend_and_append(q, k, v, None, D**-0.5)


def _token(g: torch.Generator):
    B = len(PROMPT)
    return torch.randn(B, HQ, 1, D, generator=g), *torch.randn(2, B, H, 1, D, generator=g)


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_fused_step_state_is_bit_identical_to_the_torch_path(preset):
    fused, ref = _layer(preset, "triton"), _layer(preset, "torch")
    g = torch.Generator().manual_seed(0)
    _prompt((fused, ref), g)
    assert fused.ops.fused_decode and not ref.ops.fused_decode
    assert fused.workspace is not None and fused.launch is not None  # allocated by the prompt
    ptrs = {name: t.data_ptr() for name, t in fused.workspace.items()}
    for step in range(STEPS):
        q, k, v = _token(g)
        out = _decode(fused, q, k, v)
        want = _decode(ref, q, k, v)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        a, b = _tensors(fused), _tensors(ref)
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)
    assert fused.host_lengths == [n + STEPS for n in PROMPT] == fused.lengths.tolist()
    assert {name: t.data_ptr() for name, t in fused.workspace.items()} == ptrs  # the same buffers at every step


@pytest.mark.parametrize("preset", ["kitty"])
def test_fused_step_rolls_back_exactly(preset):
    """Every step is first tried and rolled back (as when a later layer fails), then run: the state equals the
    torch layer's that never tried; right after each rollback the bookkeeping and the live buffers are as before."""
    fused, ref = _layer(preset, "triton"), _layer(preset, "torch")
    g = torch.Generator().manual_seed(1)
    _prompt((fused, ref), g)
    for step in range(STEPS):
        before = {name: t.clone() for name, t in _tensors(fused).items()}
        counters = (fused.seen_tokens, fused.host_lengths)
        fused.begin_step()
        _decode(fused, *_token(g))
        fused.rollback_step()
        now = _tensors(fused)
        for name in ("lengths", "k_page_table", "v_page_table", "q_stat_sum", "q_count"):
            assert torch.equal(now[name], before[name]), (step, name)
        full = before["lengths"] - S >= R  # rows whose ring is full: the step moved one of its values out
        assert torch.equal(now["v_local"][full], before["v_local"][full]), step
        assert (fused.seen_tokens, fused.host_lengths) == counters
        q, k, v = _token(g)
        fused.begin_step()
        _decode(fused, q, k, v)
        fused.end_step()
        _decode(ref, q, k, v)
        a, b = _tensors(fused), _tensors(ref)
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)


SIDE_FIELDS = {
    "keys": ("k_low", "k_high", "k_boost_idx", "k_scale", "k_zero", "k_page_table"),
    "values": ("v_codes", "v_scale", "v_zero", "v_page_table"),
}


@pytest.mark.parametrize("side", ["keys", "values"])
def test_deferred_pages_match_the_torch_path(side):
    """``defer_keys`` / ``defer_values``: stage 3 leaves that side of a completed page to the next step's start.
    After every step the state equals the torch layer's except those pending pages (table entry -1, page not yet
    written), after :meth:`pack_pending` it equals it bit for bit, and the outputs match at every step (a pending
    page's tokens read in full precision from the full qbuffer). Some steps are first tried and rolled back."""
    fused, ref = _layer("kitty", "triton"), _layer("kitty", "torch")
    setattr(fused, f"defer_{side}", True)
    fields, table, start = SIDE_FIELDS[side], SIDE_FIELDS[side][-1], S + (R if side == "values" else 0)
    g = torch.Generator().manual_seed(6)
    _prompt((fused, ref), g)
    pending_steps = 0
    for step in range(STEPS):
        q, k, v = _token(g)
        if step % 5 == 4:
            fused.begin_step()
            _decode(fused, q, k, v)
            fused.rollback_step()
        out, want = _decode(fused, q, k, v), _decode(ref, q, k, v)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        a, b = _tensors(fused), _tensors(ref)
        for name in b:
            if name not in fields:
                assert torch.equal(a[name], b[name]), (step, name)
        m = b["lengths"].long() - start  # a row whose qbuffer of that side this step filled: m > 0, m % G == 0
        filled = (m > 0) & (m % G == 0)
        pending = a[table] != b[table]
        assert not pending[~filled].any() and (a[table][pending] == -1).all(), step
        pending_steps += int(pending.any())
        if step % 3 == 0 or step == STEPS - 1:
            fused.pack_pending()
            a = _tensors(fused)
            for name in fields:
                assert torch.equal(a[name], b[name]), (step, name)
    assert pending_steps > 0  # the rows did complete pages of that side in these steps


def test_deferred_keys_refused_with_a_query_selection():
    """Keys ranked by the queries seen so far cannot wait a step (the next query changes the ranking): a clear
    error, and :func:`stagger_packs` defers such a layer's values instead."""
    from kitty.cache.static import stagger_packs

    layers = [_layer("kitty-query", "triton") for _ in range(2)]
    assert stagger_packs(layers) == layers
    assert [(la.defer_keys, la.defer_values) for la in layers] == [(False, True), (False, True)]
    layer = layers[0]
    layer.defer_keys = True
    _prompt((layer,), torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="defer_keys"):
        _decode(layer, *_token(torch.Generator().manual_seed(9)))


def test_generate_static_staggers_packs_on_request(monkeypatch):
    """``$KITTY_STAGGER_PACK`` (default 1): ``generate_static``'s loop defers the value pages of even layers and the key pages
    of odd ones to the next step, gives the tokens of the loop that does not, and hands back a cache whose every
    tensor equals that loop's cache's; any other value than 0 or 1 is refused."""
    from fixtures import tiny_model

    from kitty import KittyCache
    from kitty.hf.generate import generate_static

    model = tiny_model("llama")
    assert model.config.num_hidden_layers >= 2  # both sides deferred somewhere
    cfg = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)
    # row 0 completes its first value page (position S + R + G = 36) at the first decode step, row 1 none; key
    # pages complete at positions S + kG (20, 36, ...)
    ids = torch.randint(0, 128, (2, 35), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    runs = {}
    for stagger in ("0", "1"):
        monkeypatch.setenv("KITTY_STAGGER_PACK", stagger)
        cache = KittyCache(model.config, cfg, backend="triton", max_batch_size=2, max_cache_len=48)
        runs[stagger] = generate_static(model, ids, mask, cache, 6, check_every=2), cache
    assert torch.equal(runs["0"][0], runs["1"][0])
    for plain, staggered in zip(runs["0"][1].layers, runs["1"][1].layers):
        assert staggered.ops.fused_decode and not (staggered.defer_keys or staggered.defer_values)  # off again
        a, b = _tensors(staggered), _tensors(plain)
        for name in b:
            assert torch.equal(a[name], b[name]), name
    monkeypatch.setenv("KITTY_STAGGER_PACK", "yes")
    cache = KittyCache(model.config, cfg, backend="triton", max_batch_size=2, max_cache_len=48)
    with pytest.raises(ValueError, match="KITTY_STAGGER_PACK"):
        generate_static(model, ids, mask, cache, 6)


def test_failing_later_layer_rolls_back_the_fused_layers():
    """A forward pass whose second layer fails leaves the first (fused) layer as before the pass."""
    from fixtures import tiny_model

    from kitty import KittyCache
    from kitty.hf.compat import cache_kwargs

    model = tiny_model("llama")
    cfg = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)
    cache = KittyCache(model.config, cfg, backend="triton", max_batch_size=2, max_cache_len=64)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    first, second = cache.layers[0], cache.layers[1]
    assert first.ops.fused_decode
    before = {name: t.clone() for name, t in _tensors(first).items()}
    seen = first.seen_tokens

    def fail(*args, **kwargs):
        raise RuntimeError("a later layer fails")

    second.insert_decode = fail
    full = torch.ones(2, 20, dtype=torch.long)
    full[:, :19] = mask
    with pytest.raises(RuntimeError, match="a later layer fails"):
        model(ids[:, :1], attention_mask=full, **cache_kwargs(cache), use_cache=True)
    now = _tensors(first)
    for name in ("lengths", "k_page_table", "v_page_table", "q_stat_sum", "q_count"):
        assert torch.equal(now[name], before[name]), name
    full = before["lengths"] - S >= R
    assert torch.equal(now["v_local"][full], before["v_local"][full])
    assert first.seen_tokens == seen


def test_merge_inside_is_selectable(monkeypatch):
    """``$KITTY_MERGE_INSIDE=1`` (or the layer's ``merge_inside``) launches the split-K merge inside the attention
    launch, with its tickets in the preallocated workspace; the outputs equal the two-launch step's."""
    monkeypatch.setenv("KITTY_MERGE_INSIDE", "1")  # read when the prompt allocates the workspace
    layers = {merge: _layer("kitty", "triton") for merge in (False, True)}
    layers[False].merge_inside = False  # the layer's own choice wins over the environment
    g = torch.Generator().manual_seed(3)
    _prompt(layers.values(), g)
    assert not layers[False].launch.merge_inside and layers[True].launch.merge_inside
    assert layers[True].workspace["tickets"].shape == (len(PROMPT) * H,)
    for _ in range(3):
        q, k, v = _token(g)
        a, b = (_decode(layers[m], q, k, v) for m in (False, True))
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert int(layers[True].workspace["tickets"].abs().sum()) == 0  # each launch leaves its tickets at zero


def test_workspace_matches_attention_workspace():
    layer = _layer("kitty", "triton")
    _prompt([layer], torch.Generator().manual_seed(4))
    q = torch.empty(len(PROMPT), HQ, D)
    ws, launch = custom_ops.attention_workspace(q, layer.storage(), layer.launch)
    assert launch == layer.launch
    assert [t.shape for t in ws] == [layer.workspace[k].shape for k in ("m", "l", "acc", "tickets")]
    assert layer.workspace["out"].shape == (len(PROMPT), HQ, D)


def test_pack_caches_its_constants():
    """After the first decode step the pack kernel's placeholder and empty mask are the layer's own (no per-step
    allocation)."""
    layer = _layer("kitty", "triton")
    g = torch.Generator().manual_seed(5)
    _prompt([layer], g)
    _decode(layer, *_token(g))
    scratch = layer.ops.pack_scratch
    dummy, mask = scratch["dummy"], scratch["no_mask"]
    for _ in range(3):
        _decode(layer, *_token(g))
    assert scratch["dummy"] is dummy and scratch["no_mask"] is mask


# ------------------------------------------------------------------------------------- which path entry points take


class _Tokenizer:
    """Just enough of a tokenizer for ``kitty.tools.cli.generate`` and ``kitty.tools.eval_metrics``: bytes as ids."""

    eos_token_id = None

    def __call__(self, texts, return_tensors="pt"):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=torch.tensor([[b % 128 for b in texts[0].encode()]]))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def _tiny():
    from fixtures import tiny_model

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return model


def test_fast_path_is_cuda_with_triton_only(monkeypatch):
    from types import SimpleNamespace

    from fixtures import tiny_config

    from kitty import kernels
    from kitty.hf import generate as gen

    monkeypatch.delenv(gen.DECODE_PATH_ENV, raising=False)
    cpu = _tiny()
    assert not gen.fast_path_available(cpu) and gen.decode_path(cpu) == "eager"
    cuda = SimpleNamespace(device=torch.device("cuda", 0), config=tiny_config("llama"))
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    assert gen.fast_path_available(cuda) and gen.decode_path(cuda, "kitty") == "captured"
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    assert not gen.fast_path_available(cuda)
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    sliding = SimpleNamespace(device=torch.device("cuda"), config=tiny_config("gemma3"))
    assert not gen.fast_path_available(sliding)  # a sliding-window layer cannot be captured
    monkeypatch.setenv(gen.DECODE_PATH_ENV, "eager")
    assert gen.decode_path(cuda) == "eager"
    monkeypatch.setenv(gen.DECODE_PATH_ENV, "fast")
    with pytest.raises(ValueError, match="KITTY_DECODE_PATH"):
        gen.decode_path(cuda)


def _spy_static(monkeypatch):
    """Count the captured loop's runs (``_static_chunks``) and say the fast path is available (a CPU run of the
    same static step, eagerly: ``capture=None`` captures on CUDA only)."""
    from kitty.hf import generate as gen

    runs = []
    real = gen._static_chunks

    def chunks(model, ids, mask, cache, *args):
        runs.append(cache)
        yield from real(model, ids, mask, cache, *args)

    monkeypatch.delenv(gen.DECODE_PATH_ENV, raising=False)
    monkeypatch.setattr(gen, "_static_chunks", chunks)
    monkeypatch.setattr(gen, "fast_path_available", lambda model, cfg=None: True)
    return runs


def test_cli_generate_takes_the_captured_path_where_available(monkeypatch):
    from kitty.hf import generate as gen
    from kitty.tools import cli

    model, tok = _tiny(), _Tokenizer()
    monkeypatch.delenv(gen.DECODE_PATH_ENV, raising=False)
    eager = cli.generate(model, tok, "Name a color.", "kitty", max_new_tokens=12)
    runs = _spy_static(monkeypatch)
    shown = []
    fast = cli.generate(model, tok, "Name a color.", "kitty", max_new_tokens=12, on_text=shown.append)
    assert len(runs) == 1 and runs[0].layers[0].max_cache_len == 13 + 12  # a static cache of prompt + new tokens
    assert fast.tokens == eager.tokens and "".join(shown) == fast.text
    assert fast.counts == eager.counts


def test_eval_decoding_takes_the_captured_path_where_available(monkeypatch):
    from kitty.hf import generate as gen
    from kitty.tools import eval_metrics

    model, tok = _tiny(), _Tokenizer()
    cfg = PRESETS["kitty"]
    monkeypatch.delenv(gen.DECODE_PATH_ENV, raising=False)
    eager = eval_metrics.greedy(model, tok, "Name a color.", cfg, 10)
    eager_answer = eval_metrics.passkey_answer(model, tok, "The key is 42.", cfg, 6)
    runs = _spy_static(monkeypatch)
    assert eval_metrics.greedy(model, tok, "Name a color.", cfg, 10) == eager
    assert eval_metrics.passkey_answer(model, tok, "The key is 42.", cfg, 6) == eager_answer
    assert len(runs) == 2


def test_help_says_which_path_runs(capsys):
    from kitty.tools.cli import build_parser

    text = build_parser().format_help()
    assert "CUDA graph" in text and "KITTY_DECODE_PATH" in text
