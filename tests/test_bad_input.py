"""Bad input, as a hostile new user would give it: every case is refused with a message naming what is wrong, or
handled, and never leaves the cache half-changed. Tiny random-weight models, or the session's default model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from fixtures import tiny_config
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kitty import PRESETS, KittyCache, KVQuantConfig
from kitty.cache.attention import KittyMask, dequantize_cache, kitty_attention_forward
from kitty.core.quant import (
    dequantize_key_page,
    dequantize_value_page,
    quantize_key_page,
    quantize_value_page,
)
from kitty.core.ranges import minmax_params
from kitty.hf.compat import cache_kwargs

HKV, HQ, D = 2, 4, 16
SMALL = PRESETS["kitty"].with_(sink_tokens=4, group_size=8, local_window=8)


def tiny_model(layers: int = 4, attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(
        num_hidden_layers=layers,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=D,
        max_position_embeddings=512,
    )
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def greedy(model, ids, mask, cache, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


BUFFERS = ("sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local")  # slots past a row's tokens hold dead data


def snapshot(cache: KittyCache) -> list[dict]:
    """What every layer holds: its cached tokens in position order (dequantized), pages, page tables, bookkeeping."""
    out = []
    for layer in cache.layers:
        storage = layer.storage()
        keys, values, valid = dequantize_cache(storage, layer.cfg)
        state = {k: v.clone() for k, v in storage.items() if k not in BUFFERS}
        out.append(
            {
                **state,
                "keys": keys,
                "values": values,
                "valid": valid,
                "n": layer.host_lengths,
                "seen": layer.seen_tokens,
            }
        )
    return out


def assert_same(before: list[dict], after: list[dict]) -> None:
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        assert old.keys() == new.keys(), i
        for k in old:
            same = torch.equal(old[k], new[k]) if isinstance(old[k], torch.Tensor) else old[k] == new[k]
            assert same, (i, k)


# ---------------------------------------------------------------------------------- 1: failed steps, backends


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_triton_backend_refused_before_anything_changes(monkeypatch):
    import kitty.cache.backend as kcache

    monkeypatch.delenv("KITTY_BACKEND", raising=False)
    # the kernels read TRITON_INTERPRET once, at import (tests/conftest.py sets it): simulate its absence
    monkeypatch.setattr(kcache, "interpreting", lambda: False)
    for backend in ("triton", "gluon"):  # each refusal names the backend asked for
        with pytest.raises(ValueError, match=f"backend='{backend}' needs a CUDA GPU"):
            KittyCache(tiny_model(2).config, SMALL, backend=backend)
    monkeypatch.setattr(kcache, "interpreting", lambda: True)  # constructed for interpreted CPU runs ...
    cache = KittyCache(tiny_model(2).config, SMALL.with_(group_size=16), backend="triton")
    monkeypatch.setattr(kcache, "interpreting", lambda: False)  # ... then fed CPU tensors without the interpreter
    with pytest.raises(ValueError, match="CUDA tensors"):
        cache.update(torch.randn(1, HKV, 3, D), torch.randn(1, HKV, 3, D), 0)
    assert cache.lengths == [] and cache.get_seq_length() == 0


def test_explicit_backend_wins_over_environment(monkeypatch):
    monkeypatch.setenv("KITTY_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = KittyCache(tiny_model(2).config, SMALL, backend="torch")  # no GPU needed: the argument decides
    assert cache.backend == "torch" and {layer.backend for layer in cache.layers} == {"torch"}
    monkeypatch.setenv("KITTY_BACKEND", "torch")
    assert KittyCache(tiny_model(2).config, SMALL).backend == "torch"  # the environment is the default


@pytest.mark.parametrize("phase", ["chunk", "decode"])
def test_failure_in_a_late_layer_leaves_every_layer_as_it_was(monkeypatch, phase):
    """A failure injected in the last layer, after the earlier layers (and the last one's insertion) ran: every
    layer holds what it held before, and the same step then gives the state of a cache that never failed."""
    import kitty.cache.layer as kcache

    model = tiny_model(4)
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache, clean = KittyCache(model.config, SMALL), KittyCache(model.config, SMALL)
    tokens = greedy(model, ids, mask, cache, 12)  # 12 tokens in: a decode step now fills a key page in row 0
    greedy(model, ids, mask, clean, 12)
    full_mask = torch.cat([mask, torch.ones(2, 11, dtype=mask.dtype)], 1)
    new = (
        tokens[:, -1:]
        if phase == "decode"
        else torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    )
    inputs = dict(input_ids=new, attention_mask=torch.cat([full_mask, torch.ones_like(new)], 1), use_cache=True)
    before = snapshot(cache)
    last = model.config.num_hidden_layers - 1
    real_quantize = kcache.quantize_key_page

    def failing_quantize(k, cfg, salt=0, **kw):  # a chunk fills key pages: fail packing the last layer's
        if salt == last:
            raise RuntimeError("injected failure")
        return real_quantize(k, cfg, salt=salt, **kw)

    def failing_pack(filled):  # every decode step packs (or finds nothing to pack) after inserting
        raise RuntimeError("injected failure")

    monkeypatch.setattr(kcache, "quantize_key_page", failing_quantize)
    monkeypatch.setattr(cache.layers[last], "pack_filled", failing_pack)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        model(**inputs, **cache_kwargs(cache))
    assert_same(before, snapshot(cache))
    monkeypatch.undo()

    # an update refused in the last layer rolls back the layers the same pass already changed
    q = torch.randn(2, HQ, 1, D)
    for i in range(last):
        k, v = torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D)
        kitty_attention_forward(None, q, *cache.update(k, v, i), KittyMask(None), scaling=D**-0.5)
    with pytest.raises(ValueError, match="key_states"):
        cache.update(torch.randn(2, HKV, 1, D + 1), torch.randn(2, HKV, 1, D + 1), last)
    assert_same(before, snapshot(cache))

    with torch.no_grad():
        logits = model(**inputs, **cache_kwargs(cache)).logits
        expect = model(**inputs, **cache_kwargs(clean)).logits
    assert torch.equal(logits, expect)
    assert_same(snapshot(clean), snapshot(cache))


# ----------------------------------------------------------------- issue 14: the user's attention is kept


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_kitty_cache_keeps_the_users_attention_implementation(attn):
    model = tiny_model(2, attn)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    before = greedy(model, ids, mask, DynamicCache(config=model.config), 10)
    kitty = greedy(model, ids, mask, KittyCache(model.config, "fp16"), 10)
    assert model.config._attn_implementation == attn
    after = greedy(model, ids, mask, DynamicCache(config=model.config), 10)
    assert torch.equal(before, after) and torch.equal(kitty, before)  # fp16 preset: nothing is quantized
    assert model.config._attn_implementation == attn
    cache = KittyCache(model.config, SMALL)  # driven one layer at a time, as the tests of the attention function do
    k, v = torch.randn(1, HKV, 3, D), torch.randn(1, HKV, 3, D)
    kitty_attention_forward(None, torch.randn(1, HQ, 3, D), *cache.update(k, v, 0), None, scaling=D**-0.5)
    assert model.config._attn_implementation == attn
    clone = copy.deepcopy(model.config)  # copies are plain configs again
    assert type(clone) is LlamaConfig and clone._attn_implementation == attn
    model.config._attn_implementation = "eager" if attn == "sdpa" else "sdpa"  # the user may still change it
    assert model.config._attn_implementation != attn


# ------------------------------------------------------------------------------------ 2, 3, 7: the CLI


@pytest.fixture
def cli_model(default_model, monkeypatch):
    """``python -m kitty``'s main() with the session's model instead of a fresh load."""
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda name=None, *a, **kw: default_model)
    monkeypatch.delenv("KITTY_BACKEND", raising=False)
    from kitty.tools.cli import main

    return main


def test_cli_decodes_non_utf8_prompt_bytes(cli_model, capsys):
    prompt = os.fsdecode(b"caf\xe9 \xff\xfe ok")  # what Python makes of these bytes in sys.argv
    assert cli_model([prompt, "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr()
    assert "not UTF-8" in out.err and "[kitty] 2 new tokens" in out.out


def test_cli_accepts_field_overrides(cli_model, capsys):
    assert cli_model(["Hi", "--method", "kitty+key_range=fit", "--max-new-tokens", "2"]) == 0
    assert "[kitty+key_range=fit]" in capsys.readouterr().out
    assert cli_model(["Hi", "--compare", "--methods", "fp16,kitty+key_range=fit", "--max-new-tokens", "2"]) == 0
    rows = [r.split("|")[1].strip() for r in capsys.readouterr().out.splitlines() if r.startswith("| ")][1:]
    assert rows == ["fp16", "kitty+key_range=fit"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hi", "--compare", "--methods", ","], "names no preset"),
        (["hi", "--methods", "fp16"], "--methods is for --compare"),
        (["hi", "--sample", "--temperature", "0"], "--temperature must be > 0"),
        (["hi", "--method", "kitty+value_bits=2.0"], "value_bits"),
        (["hi", "--model", "/nonexistent"], "no such folder"),
        (["hi", "--json", "."], "is a folder"),
        pytest.param(
            ["hi", "--json", "/proc/kitty.json"],
            "cannot write there",
            marks=pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, where no file can be made"),
        ),
        (["hi", "--sample", "--seed", str(2**64)], "--seed must be in [0, 2**63)"),
        (["hi", "--seed", "-1"], "--seed must be in [0, 2**63)"),
        (["hi", "--temperature", "inf"], "--temperature must be a finite number"),
        (["hi", "--temperature", "nan"], "--temperature must be a finite number"),
        (["hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "no such file"),
        (["hi", "--compare", "--width", "-1"], "--width"),
    ],
)
def test_cli_refuses_before_loading_the_model(argv, message, capsys, monkeypatch):
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda name=None, *a, **kw: pytest.fail("the model was loaded"))
    from kitty.tools.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists("/proc/kitty.json")


def test_cli_without_a_prompt_says_how_to_give_one(capsys, monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    from kitty.tools.cli import main

    assert main([]) == 2
    assert "no prompt: give it as text, as --prompt-file PATH, or on stdin" in capsys.readouterr().err


def test_cli_json_check_leaves_no_file_behind(cli_model, tmp_path, monkeypatch):
    """The --json path is probed before generating; the probe's file never stays behind if the run then fails."""
    import kitty.tools.cli

    def failing_generate(*args, **kwargs):
        assert not path.exists()  # probed and removed before any generation
        raise RuntimeError("injected failure")

    path = tmp_path / "out.json"
    monkeypatch.setattr(kitty.tools.cli, "generate", failing_generate)
    with pytest.raises(RuntimeError, match="injected"):
        cli_model(["hi", "--json", str(path)])
    assert not path.exists()


def test_eval_writes_to_a_working_folder_by_default(default_model, monkeypatch, tmp_path, capsys):
    import kitty.hf.models
    import kitty.tools.eval

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda name=None, *a, **kw: default_model)
    monkeypatch.chdir(tmp_path)
    kitty.tools.eval.main(["--methods", "kivi-k2v2", "--skip", "ppl,agreement,passkey", "--quick"])  # pack only: quick
    assert (tmp_path / "kitty-eval" / "eval_quick.md").exists()
    out = capsys.readouterr().out
    assert "wrote kitty-eval/eval_pack_quick.csv" in out and "wrote kitty-eval/eval_quick.md" in out


# ------------------------------------------------------------------------------------- 4: validation gaps


@pytest.mark.parametrize(
    "field, value",
    [
        ("value_bits", 2.0),
        ("key_bits", True),
        ("boost_fraction", True),
        ("sink_tokens", True),
        ("local_window", False),
        ("group_size", 2**20),
        ("sink_tokens", 10**9),
        ("local_window", 10**9),
        ("seed", True),
    ],
)
def test_config_rejects_bools_floats_and_absurd_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        KVQuantConfig(**{field: value})


def test_max_pages_rejects_bool():
    with pytest.raises(ValueError, match="max_pages"):
        KittyCache(tiny_model(2).config, SMALL, max_pages=True)


# -------------------------------------------------------------------------------- 5, 7: the page quantizers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_input_near_the_dtype_limits_never_comes_back_nan(dtype):
    top = torch.finfo(dtype).max
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    x[0, 0, 5], x[0, 1, 5] = top, -top  # a key channel spanning the whole range
    x[1, 7, :2] = torch.tensor([top, -top])  # a value token doing the same
    x = x.to(dtype)
    cfg = PRESETS["kitty"]
    for quantize, dequantize, step in (
        (quantize_key_page, dequantize_key_page, lambda p: p.scale[..., None, :]),
        (quantize_value_page, dequantize_value_page, lambda p: p.scale[..., None]),
    ):
        page = quantize(x, cfg)
        out = dequantize(page)
        assert torch.isfinite(page.scale).all() and torch.isfinite(out).all()
        err = (out.double() - x.double()).abs()
        assert (err <= step(page).double() / 2 * (1 + 2**-6) + 1e-6).all()


def test_overflow_safe_step_is_bit_identical_for_normal_input():
    """The overflow guard changes nothing elsewhere: same scale as ``(max - min) / levels`` rounded up."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 50).to(dtype)
        scale, zero = minmax_params(x, 3, -1, dtype)
        xf = x.float()
        plain = (xf.amax(-1) - xf.amin(-1)) / 3
        assert (scale.float() >= plain).all() and torch.equal(zero, x.amin(-1))
        if dtype == torch.float32:
            assert torch.equal(scale, plain)
        page = quantize_value_page(x, PRESETS["kitty"])
        from kitty.core.quant import unpack_bits

        codes = unpack_bits(page.codes, 2).transpose(-1, -2).float()  # codes [D, G/4] -> [G, D]
        expect = (codes * page.scale.float()[..., None] + page.zero.float()[..., None]).to(dtype)
        assert torch.equal(dequantize_value_page(page), expect)


@pytest.mark.parametrize("shape", [(128,), (0, 16), (4, 0), (0, 8, 16)])
def test_page_quantizers_refuse_1d_and_empty_input(shape):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match="k must"):
        quantize_key_page(x, PRESETS["kitty"])
    with pytest.raises(ValueError, match="v must"):
        quantize_value_page(x, PRESETS["kitty"])


# ------------------------------------------------------------------------- 6: the error bound as stated


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_error_is_half_a_step_plus_the_output_rounding(dtype):
    """README: error <= half a step per element + the output dtype's rounding (half an ulp of the result);
    half a step alone is not a bound in 16-bit (the fp32 reconstruction is rounded once more)."""
    x = (torch.randn(8, 4, 128, 64, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    beyond = 0
    for quantize, dequantize, step in (
        (quantize_key_page, dequantize_key_page, lambda p: p.scale.float()[..., None, :]),
        (quantize_value_page, dequantize_value_page, lambda p: p.scale.float()[..., None]),
    ):
        page = quantize(x, PRESETS["kitty"])
        out = dequantize(page)
        err = (out.float() - x.float()).abs()
        up = torch.nextafter(out, torch.full_like(out, float("inf"))).float() - out.float()
        down = out.float() - torch.nextafter(out, torch.full_like(out, -float("inf"))).float()
        half_ulp = torch.maximum(up, down) / 2
        assert (err <= step(page) / 2 + half_ulp + 2**-22 * x.float().abs()).all()
        beyond += int((err > step(page) / 2).sum())
    assert beyond > 0


# ------------------------------------------------------------------------------------------- 7: the app


@pytest.fixture(scope="module")
def app_module():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import app

    return app


def run_handler(app_module, method_1="fp16", seed=0, new=1) -> list[tuple]:
    handler = app_module.make_generate(app_module.get_engine(None), 64)
    return list(handler("Hi", True, new, 0.0, 1.0, seed, method_1, "kivi-k2v2", "kitty"))


@pytest.mark.parametrize(
    "method, seed, message",
    [
        (None, 0, "choose a cache method for column 1"),
        ("fp16", 1e30, "seed must be in"),
        ("fp16", None, "whole number"),
    ],
)
def test_app_shows_bad_input_in_the_ui(app_module, method, seed, message):
    (out,) = run_handler(app_module, method, seed)
    assert message in out[0]
    generate_button, stop_button = out[-2], out[-1]
    assert generate_button["interactive"] is True and stop_button["interactive"] is False


def test_app_stop_after_a_finished_run_says_nothing_runs(app_module):
    outs = run_handler(app_module)
    assert outs[-1][10] is None  # the final state holds no stop flag
    assert app_module.stop_generation(outs[-1][10]) == "Nothing is running."


# ---------------------------------------------------------- dtypes, head_dim, prompt shapes, two threads


@pytest.mark.parametrize("preset", ["fp16", "kitty"])
def test_float64_model_is_refused_at_the_first_forward_pass(preset):
    """float64 is stored by no preset (pages, kernels and the fp16 preset's raw pages hold 16/32-bit floats):
    refused before the first token, not when the first page quantizes."""
    from kitty.hf.generate import stream_tokens

    model = tiny_model(2).double()
    cache = KittyCache(model.config, PRESETS[preset].with_(sink_tokens=4, group_size=8, local_window=8))
    tokens = stream_tokens(model, torch.randint(3, 128, (1, 5)), cache, 40)
    with pytest.raises(ValueError, match="got torch.float64.*dtype=torch.float32"):
        next(tokens)
    assert cache.lengths == [] and cache.get_seq_length() == 0


def test_head_dim_above_256_runs_with_full_precision_keys():
    """Only quantized keys need head_dim <= 256 (uint8 boost_idx): the fp16 preset runs any head_dim."""
    torch.manual_seed(0)
    config = tiny_config(num_attention_heads=2, num_key_value_heads=1, head_dim=320)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        caches = [DynamicCache(config=model.config), KittyCache(model.config, "fp16", backend="torch")]
        logits = [model(ids, **cache_kwargs(c)).logits for c in caches]
        logits += [model(ids[:, :1], **cache_kwargs(c)).logits for c in caches]
    torch.testing.assert_close(logits[1], logits[0])
    torch.testing.assert_close(logits[3], logits[2])
    with pytest.raises(ValueError, match="head_dim must be <= 256 for quantized keys"):
        KittyCache(model.config, "kitty")
    values_2bit = PRESETS["fp16"].with_(value_bits=2)
    values_2bit.check_head_dim(322)  # value codes pack along tokens (4 per byte): any head_dim
    page = quantize_value_page(torch.randn(values_2bit.group_size, 322), values_2bit)
    assert page.codes.shape == (322, values_2bit.group_size // 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        PRESETS["kitty"].check_head_dim(254)  # key codes pack 4 channels per byte


def test_the_value_quantizer_takes_any_channel_count_and_never_speaks_of_keys():
    """Values pack along tokens, so a key preset's value side takes D = 63; its only refusals name values."""
    cfg = PRESETS["kitty"]
    v = torch.randn(2, cfg.group_size, 63, generator=torch.Generator().manual_seed(5))
    page = quantize_value_page(v, cfg)
    assert page.codes.shape == (2, 63, cfg.group_size // 4)
    assert (dequantize_value_page(page) - v).abs().max() <= page.scale.max()  # within one 2-bit step
    with pytest.raises(ValueError, match="value page packs 4 tokens per byte") as err:
        quantize_value_page(v[:, :127], cfg)
    assert "key" not in str(err.value)


def test_generate_tokens_names_ids_and_the_cache_it_cannot_take():
    from kitty.hf.generate import generate_tokens

    model = tiny_model(2)
    ids = torch.randint(3, 128, (1, 6))
    for bad in (ids[0], ids.repeat(2, 1), ids[:, :0], ids.float()):
        with pytest.raises(ValueError, match="ids must"):
            generate_tokens(model, bad, KittyCache(model.config, SMALL), 2)
    batch = KittyCache(model.config, SMALL)
    greedy(model, ids.repeat(2, 1), torch.ones(2, 6, dtype=torch.long), batch, 2)  # a cache of two rows
    with pytest.raises(ValueError, match="fresh cache .* or call cache.reset"):
        generate_tokens(model, ids, batch, 2)
    batch.reset()
    assert len(generate_tokens(model, ids, batch, 2)) == 2


def test_a_second_thread_inside_an_open_forward_pass_is_refused():
    """Two threads interleaving layers in one cache would mix their tokens: the second is refused while the
    first's pass is open (and that pass completes as if alone); steps from different threads in turn are fine."""
    import threading

    model = tiny_model(3)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    cache, clean = KittyCache(model.config, SMALL), KittyCache(model.config, SMALL)
    inside, refused = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    real_end_step = cache.end_step

    def end_step(layer):  # the first thread pauses after its layer 0, inside its forward pass
        real_end_step(layer)
        if layer.layer_idx == 0 and threading.current_thread().name == "first":
            inside.set()
            assert refused.wait(60)

    def second() -> None:
        assert inside.wait(60)
        try:
            with torch.no_grad():
                model(ids, **cache_kwargs(cache))
        except RuntimeError as e:
            errors.append(e)
        finally:
            refused.set()

    cache.end_step = end_step
    results: list[torch.Tensor] = []
    first = threading.Thread(
        target=lambda: results.append(model(ids, **cache_kwargs(cache)).logits.detach()), name="first"
    )
    other = threading.Thread(target=second)
    with torch.no_grad():
        first.start(), other.start()
        first.join(120), other.join(120)
        expect = model(ids, **cache_kwargs(clean)).logits
    assert len(errors) == 1 and "another thread" in str(errors[0])
    torch.testing.assert_close(results[0], expect, rtol=0, atol=0)
    assert_same(snapshot(clean), snapshot(cache))

    # one step per thread, one after the other (a streaming server's worker pool): allowed and exact
    tok = expect[:, -1:].argmax(-1)
    step = threading.Thread(target=lambda: results.append(model(tok, **cache_kwargs(cache)).logits.detach()))
    with torch.no_grad():
        step.start(), step.join(120)
        torch.testing.assert_close(results[1], model(tok, **cache_kwargs(clean)).logits, rtol=0, atol=0)
