"""A hostile new user: two threads on one cache, caches that were not reset, copies of the config, absurd sizes,
near-zero sampling parameters and malformed arguments. Every case is refused up front with a message naming the
parameter and what would work, or it works; none gives silently wrong tokens. Tiny random models."""

from __future__ import annotations

import copy
import os
import threading
import warnings

import pytest
import torch
from fixtures import tiny_config, tiny_model
from transformers import DynamicCache, StaticCache

from kitty import PRESETS, KittyCache
from kitty.hf.compat import cache_kwargs
from kitty.hf.generate import Sampling, generate_static, generate_tokens, stream_tokens

S, G, R = 4, 8, 8
SMALL = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)


def prompt(n: int = 12, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama")
    m.generation_config.eos_token_id = None
    return m


# ------------------------------------------------------------------- two generations on one cache (threads)


def test_a_second_generation_on_a_claimed_cache_is_refused_whatever_the_timing(model, monkeypatch):
    """Thread B starts generate_tokens on the cache thread A is generating with: at A's prefill, between A's
    decode steps, or after A finished. B is refused every time before touching the cache, and A's tokens equal a
    run alone."""
    import kitty.hf.generate as gen

    ids, other = prompt(12), prompt(9, seed=8)
    alone = generate_tokens(model, ids, KittyCache(model.config, SMALL), 8)
    for moment in ("prefill", "decode", "after"):
        cache = KittyCache(model.config, SMALL)
        reached, release = threading.Event(), threading.Event()
        real_prefill, real_decode = gen.prefill, gen.decode_one_token
        steps = []

        def prefill(m, i, c):  # A pauses just before its prompt enters the (claimed, still empty) cache
            if threading.current_thread().name == "A" and moment == "prefill":
                reached.set()
                assert release.wait(60)
            return real_prefill(m, i, c)

        def decode(m, c, t):  # A pauses between two decode steps
            steps.append(t)
            if threading.current_thread().name == "A" and moment == "decode" and len(steps) == 3:
                reached.set()
                assert release.wait(60)
            return real_decode(m, c, t)

        monkeypatch.setattr(gen, "prefill", prefill)
        monkeypatch.setattr(gen, "decode_one_token", decode)
        results, errors = {}, []

        def run_a() -> None:
            results["A"] = generate_tokens(model, ids, cache, 8)

        def run_b() -> None:
            try:
                results["B"] = generate_tokens(model, other, cache, 8)
            except (RuntimeError, ValueError) as e:
                errors.append(e)

        a = threading.Thread(target=run_a, name="A")
        a.start()
        if moment == "after":
            a.join(120)
        else:
            assert reached.wait(60)
        b = threading.Thread(target=run_b, name="B")
        b.start(), b.join(120)
        release.set()
        a.join(120)
        assert "B" not in results and len(errors) == 1, moment
        assert (
            "reset()" in str(errors[0]) and "one cache per generation" in str(errors[0]) or "earlier" in str(errors[0])
        )
        assert results["A"] == alone, moment
        assert cache.lengths == [12 + 8 - 1]
        monkeypatch.undo()
        cache.reset()  # a reset cache takes the next generation
        assert generate_tokens(model, ids, cache, 8) == alone


def test_a_prompt_from_a_second_thread_on_a_held_cache_is_refused(model):
    """model.generate / plain forwards: a prompt (several tokens) from another thread on top of the tokens of a
    generation started elsewhere is refused; that generation's next steps are unaffected (steps of one token may
    come from any thread)."""
    ids = prompt(12)
    cache, clean = KittyCache(model.config, SMALL), KittyCache(model.config, SMALL)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        model(ids, **cache_kwargs(clean))
    errors = []

    def second() -> None:
        try:
            with torch.no_grad():
                model(prompt(5, seed=3), **cache_kwargs(cache))
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=second)
    t.start(), t.join(60)
    assert len(errors) == 1 and "another thread" in str(errors[0]) and "reset()" in str(errors[0])
    assert cache.lengths == [12]
    tok = torch.tensor([[5]])
    out = []
    step = threading.Thread(target=lambda: out.append(model(tok, **cache_kwargs(cache)).logits.detach()))
    with torch.no_grad():
        step.start(), step.join(60)
        torch.testing.assert_close(out[0], model(tok, **cache_kwargs(clean)).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------ caches that were not reset


def test_generate_tokens_on_a_cache_that_was_not_reset_says_reset(model):
    ids = prompt(12)
    cache = KittyCache(model.config, SMALL)
    first = generate_tokens(model, ids, cache, 4)
    with pytest.raises(RuntimeError, match=r"reset\(\)"):
        generate_tokens(model, ids, cache, 4)
    dynamic = DynamicCache(config=model.config)
    generate_tokens(model, ids, dynamic, 4)
    with pytest.raises(ValueError, match=r"holds 15 columns .* call cache.reset\(\)"):
        generate_tokens(model, ids, dynamic, 4)
    cache.reset()
    assert generate_tokens(model, ids, cache, 4) == first


@pytest.mark.parametrize("kind", ["kitty", "transformers"])
def test_generate_static_on_a_cache_that_was_not_reset_says_reset(model, kind):
    """transformers' StaticCache used to give silently wrong tokens here (positions restart at 0 over its cached
    columns), Kitty's static cache errors that blamed the mask or max_cache_len."""
    ids = prompt(12).repeat(2, 1)

    def fresh():
        if kind == "kitty":
            return KittyCache(model.config, SMALL, max_batch_size=2, max_cache_len=40)
        return StaticCache(config=model.config, max_cache_len=40)

    cache = fresh()
    first = generate_static(model, ids, None, cache, 6)
    with pytest.raises((ValueError, RuntimeError), match=r"reset\(\)"):
        generate_static(model, ids, None, cache, 6)
    cache.reset()
    torch.testing.assert_close(generate_static(model, ids, None, cache, 6), first, rtol=0, atol=0)
    torch.testing.assert_close(generate_static(model, ids, None, fresh(), 6), first, rtol=0, atol=0)


# ------------------------------------------------------------------------ sizes checked up front


def test_generate_tokens_checks_max_cache_len_before_any_work(model, monkeypatch):
    import kitty.hf.generate as gen

    monkeypatch.setattr(gen, "prefill", lambda *a: pytest.fail("the prompt ran"))
    cache = KittyCache(model.config, SMALL, max_cache_len=16)
    with pytest.raises(ValueError, match=r"needs 19 cache columns .* max_cache_len=16"):
        generate_tokens(model, prompt(12), cache, 8)
    with pytest.raises(ValueError, match=r"needs 19 cache columns .* max_cache_len=16"):
        generate_tokens(model, prompt(12), StaticCache(config=model.config, max_cache_len=16), 8)


def test_absurd_max_cache_len_is_refused_with_the_bytes_it_needs(model):
    with pytest.raises(ValueError, match=r"max_cache_len=1000000000000 .* GiB"):
        KittyCache(model.config, SMALL, max_cache_len=10**12)
    KittyCache(model.config, SMALL, max_cache_len=4096)  # a sane size is accepted


# ------------------------------------------------------------------------ which config the cache is built from


@pytest.mark.parametrize("how", ["deepcopy", "from_dict"])
def test_cache_built_from_a_copy_of_the_config_works(how):
    """The model's own config is switched whichever copy of it the cache was built from, whether or not an earlier
    cache saw model.config."""
    model = tiny_model("qwen3", seed=3)
    model.generation_config.eos_token_id = None
    config = copy.deepcopy(model.config) if how == "deepcopy" else type(model.config).from_dict(model.config.to_dict())
    ids = prompt(10)
    ref = generate_tokens(model, ids, DynamicCache(config=model.config), 6)
    fp16 = PRESETS["fp16"].with_(sink_tokens=S, group_size=G, local_window=R)
    assert generate_tokens(model, ids, KittyCache(config, fp16), 6) == ref
    assert generate_tokens(model, ids, KittyCache(model.config, fp16), 6) == ref
    assert model.config._attn_implementation != "kitty"  # outside a KittyCache pass: the user's implementation
    copied = copy.deepcopy(model.config)
    assert type(copied) is type(model.config) and copied.to_dict() == model.config.to_dict()


# ------------------------------------------------------------------------ reported lengths


def test_static_cache_on_an_all_sliding_model_reports_its_tokens():
    config = tiny_config("mistral")  # every layer sliding, window 16
    torch.manual_seed(0)
    from transformers import MistralForCausalLM

    model = MistralForCausalLM(config).eval()
    ids = prompt(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        static = KittyCache(model.config, SMALL, max_cache_len=32)
        growing = KittyCache(model.config, SMALL)
    with torch.no_grad():
        model(ids, **cache_kwargs(static))
        model(ids, **cache_kwargs(growing))
    assert static.lengths == growing.lengths == [10]
    assert static.memory_report().tokens == 10 and static.token_counts()["tokens"] == 10


# ------------------------------------------------------------------------ malformed arguments


@pytest.mark.parametrize("bad", [None, "model", "str"])
def test_kitty_cache_of_a_model_or_none_says_pass_model_config(model, bad):
    arg = {"model": model, "str": "llama"}.get(bad)
    with pytest.raises(ValueError, match=r"pass model.config"):
        KittyCache(arg, SMALL)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
        (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
        (dict(max_new_tokens=4, eos="5"), "eos must be a collection of integer token ids"),
        (dict(max_new_tokens=4, eos=[5.0]), "eos must hold integer token ids"),
    ],
)
def test_generation_arguments_are_checked_before_any_work(model, kwargs, message):
    ids = prompt(6).repeat(2, 1)
    cache = KittyCache(model.config, SMALL, max_batch_size=2, max_cache_len=32)
    with pytest.raises(ValueError, match=message):
        generate_static(model, ids, None, cache, **kwargs)
    with pytest.raises(ValueError, match=message):
        list(stream_tokens(model, ids[:1], KittyCache(model.config, SMALL), **kwargs))
    assert cache.get_seq_length() == 0 and len(generate_static(model, ids, None, cache, 2)[0]) == 2


@pytest.mark.parametrize(
    "name, message",
    [
        ("kitty+boost_fraction=2", "boost_fraction must be a number in [0, 1], got 2"),
        ("kitty-pro+key_bits=16x", "key_bits must be one of the integers (2, 4, 16), got '16x'"),
        (
            "kitty+value_range=bogus",
            "value_range must be one of ('minmax', 'fit', 'fit-peak', 'fit-bounded', 'fit-standout', 'fit-peak-standout', 'fit-token-standout', 'fit-peak-token-standout', 'fit-loose-token-standout'), got 'bogus'",
        ),
        ("kitty+sink=4", "method override must be field=value with a field in"),
        ("bogus", "method must be one of"),
    ],
)
def test_a_bad_method_is_named_for_what_is_wrong_with_it(name, message):
    """A known method with a bad value names the field and the value, never "unknown method"."""
    from kitty.core.config import get_preset

    with pytest.raises(ValueError) as err:
        get_preset(name)
    assert message in str(err.value)
    assert name == "bogus" or "method must be one of" not in str(err.value)


def test_generate_tokens_hint_for_a_batch_works_on_every_release(model):
    """The hint for a batch names the keyword through ``cache_kwargs``, which every admitted release reads."""
    with pytest.raises(ValueError) as err:
        generate_tokens(model, prompt(6).repeat(2, 1), KittyCache(model.config, SMALL), 2)
    assert "kitty.hf.compat.cache_kwargs(KittyCache(...))" in str(err.value)
    assert "cache=KittyCache" not in str(err.value)


def test_generate_static_refuses_float_ids(model):
    cache = KittyCache(model.config, SMALL, max_batch_size=2, max_cache_len=32)
    with pytest.raises(ValueError, match="input_ids must be a tensor of integer token ids"):
        generate_static(model, prompt(6).repeat(2, 1).float(), None, cache, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=1e-300), "temperature must be 0 .greedy. or >= 0.0001"),
        (dict(temperature=1.0, top_p=1e-300), "top_p must be >= 1e-06"),
    ],
)
def test_near_zero_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_the_smallest_sampling_parameters_work(model):
    for sampling in (Sampling(1e-4), Sampling(1.0, 1e-6)):
        out = generate_tokens(model, prompt(6), KittyCache(model.config, SMALL), 3, sampling)
        greedy = generate_tokens(model, prompt(6), KittyCache(model.config, SMALL), 3)
        assert out == greedy  # both limits keep the most likely token alone


# ------------------------------------------------------------------------ the command line


@pytest.fixture
def no_load(monkeypatch):
    """``python -m kitty``'s main(), failing the test if it loads a model."""
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda *a, **kw: pytest.fail("the model was loaded"))
    from kitty.tools.cli import main

    return main


@pytest.fixture
def cli_model(default_model, monkeypatch):
    """``python -m kitty``'s main() with the session's model instead of a fresh load."""
    import kitty.hf.models

    monkeypatch.setattr(kitty.hf.models, "load_model", lambda *a, **kw: default_model)
    monkeypatch.delenv("KITTY_BACKEND", raising=False)
    from kitty.tools.cli import main

    return main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hi", "--sample", "--temperature", "1e-300"], "--temperature must be 0 (greedy) or >= 0.0001"),
        (["hi", "--sample", "--top-p", "1e-300"], "--top-p must be >= 1e-06"),
        (["hi", "--max-prompt-tokens", "-1"], "--max-prompt-tokens must be >= 0"),
        (["--prompt-file", "."], "is a folder"),
        pytest.param(
            ["hi", "--json", "/dev/full"],
            "cannot write there (No space left on device)",
            marks=pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full"),
        ),
        pytest.param(
            ["--prompt-file", "/dev/null"],
            "is a character device, not a text file",
            marks=pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null"),
        ),
    ],
)
def test_cli_refuses_before_loading_the_model(no_load, argv, message, capsys):
    assert no_load(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_an_unsupported_transformers_before_loading(no_load, monkeypatch, capsys):
    import transformers

    from kitty.hf.compat import transformers_version

    monkeypatch.setattr(transformers, "__version__", "5.16.0")
    transformers_version.cache_clear()
    try:
        assert no_load(["hi"]) == 2
        assert "kitty needs transformers>=5.17,<6, found transformers 5.16.0" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        transformers_version.cache_clear()


def test_cli_refuses_a_bad_backend_variable_before_loading(no_load, monkeypatch, capsys):
    monkeypatch.setenv("KITTY_BACKEND", "bogus")
    assert no_load(["hi"]) == 2
    assert "$KITTY_BACKEND must be one of" in capsys.readouterr().err


def test_cli_reads_a_pipe_and_warns_about_non_utf8_stdin(monkeypatch, tmp_path, capsys):
    import io
    import sys
    from types import SimpleNamespace

    from kitty.tools.cli import read_prompt

    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("from a pipe"))
    writer.start()
    assert read_prompt(SimpleNamespace(prompt=None, prompt_file=str(fifo))) == "from a pipe"
    writer.join(10)

    class Stdin(io.TextIOWrapper):
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(sys, "stdin", Stdin(io.BytesIO(b"caf\xe9 ok")))
    assert read_prompt(SimpleNamespace(prompt="-", prompt_file=None)) == "caf\ufffd ok"
    assert "stdin is not valid UTF-8" in capsys.readouterr().err


def test_cli_refuses_a_prompt_longer_than_the_limit_before_generating(cli_model, monkeypatch, capsys):
    import kitty.tools.cli

    monkeypatch.setattr(kitty.tools.cli, "generate", lambda *a, **kw: pytest.fail("generated"))
    assert cli_model(["one two three four five six seven", "--max-prompt-tokens", "5"]) == 2
    assert "more than --max-prompt-tokens=5" in capsys.readouterr().err


def test_cli_refuses_a_prompt_longer_than_the_models_context_by_default(cli_model, default_model, monkeypatch, capsys):
    """Without --max-prompt-tokens the limit is the model's context (max_position_embeddings)."""
    import kitty.tools.cli

    model, _ = default_model
    monkeypatch.setattr(model.config, "max_position_embeddings", 5)
    monkeypatch.setattr(kitty.tools.cli, "generate", lambda *a, **kw: pytest.fail("generated"))
    assert cli_model(["one two three four five six seven"]) == 2
    assert "more than --max-prompt-tokens=5 (the model's context, max_position_embeddings)" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_cli_json_that_fails_after_the_generation_is_printed(cli_model, monkeypatch, capsys):
    import json

    import kitty.tools.cliargs

    monkeypatch.setattr(kitty.tools.cliargs, "writable_file", lambda *a: None)  # as if /dev/full filled up later
    assert cli_model(["Hi", "--max-new-tokens", "2", "--json", "/dev/full"]) == 2
    out = capsys.readouterr()
    assert "cannot write the results" in out.err and "printed above" in out.err
    start = out.out.index("[\n")
    assert json.loads(out.out[start:])[0]["new_tokens"] == 2


def test_model_generate_checks_a_static_cache_before_the_first_token(model):
    ids = prompt(12)
    cache = KittyCache(model.config, SMALL, max_cache_len=16)
    with pytest.raises(ValueError, match=r"needs 19 cache columns .* max_cache_len=16"):
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)
    assert cache.get_seq_length() == 0
    out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape[1] == 12 + 5 and cache.lengths == [16]


def test_a_padded_token_in_a_static_decode_step_is_refused(model):
    """A static cache stores every row's token in a one-token step without reading the mask: a row marked as
    padding there is refused (the growing cache skips it)."""
    ids = prompt(6).repeat(2, 1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -1] = 0
    static = KittyCache(model.config, SMALL, max_batch_size=2, max_cache_len=16)
    growing = KittyCache(model.config, SMALL)
    with torch.no_grad():
        for cache in (static, growing):
            model(ids, **cache_kwargs(cache))
        with pytest.raises(ValueError, match=r"new token of rows \[1\] as padding"):
            model(ids[:, :1], attention_mask=mask, **cache_kwargs(static))
        assert static.lengths == [6, 6] and static.get_seq_length() == 6
        model(ids[:, :1], attention_mask=mask, **cache_kwargs(growing))
    assert growing.lengths == [7, 6]


@pytest.mark.parametrize("static", [False, True])
def test_a_hybrid_cache_refuses_a_new_batch_or_too_many_columns_before_any_layer(static):
    """gemma3 runs its window layers first: a batch change without reset() (and, static, more than max_cache_len
    columns) is refused before they change, with the Kitty layers' message rather than a shape error."""
    model = tiny_model("gemma3", seed=1)
    kw = dict(max_batch_size=3, max_cache_len=16) if static else {}
    cache = KittyCache(model.config, SMALL, **kw)
    with torch.no_grad():
        model(prompt(6).repeat(2, 1), **cache_kwargs(cache))
        with pytest.raises(ValueError, match=r"holds 2 rows but got a batch of 3; call cache.reset\(\)"):
            model(prompt(6).repeat(3, 1), **cache_kwargs(cache))
        if static:
            with pytest.raises(ValueError, match="exceed max_cache_len=16"):
                model(prompt(11).repeat(2, 1), **cache_kwargs(cache))
        assert cache.lengths == [6, 6] and cache.get_seq_length() == 6
        cache.reset()
        model(prompt(6).repeat(3, 1), **cache_kwargs(cache))  # a reset cache takes the new batch
    assert cache.lengths == [6, 6, 6]


def test_a_hybrid_static_cache_refuses_a_padded_decode_token_before_any_layer_changes():
    """gemma3 runs its window layers before the first Kitty layer, whose step finds the padded token: the refusal
    puts the window layers back too, so the next step gives what a cache that never saw the refused one gives."""
    model = tiny_model("gemma3", seed=1)
    ids = prompt(6).repeat(2, 1)
    bad = torch.ones(2, 7, dtype=torch.long)
    bad[1, -1] = 0
    refused, clean = (KittyCache(model.config, SMALL, max_batch_size=2, max_cache_len=16) for _ in range(2))
    with torch.no_grad():
        for cache in (refused, clean):
            model(ids, **cache_kwargs(cache))
        with pytest.raises(ValueError, match=r"new token of rows \[1\] as padding"):
            model(ids[:, :1], attention_mask=bad, **cache_kwargs(refused))
        good = torch.ones(2, 7, dtype=torch.long)
        logits = [model(ids[:, 1:2], attention_mask=good, **cache_kwargs(c)).logits for c in (refused, clean)]
    assert torch.equal(logits[0], logits[1])
    assert refused.lengths == clean.lengths == [7, 7]
