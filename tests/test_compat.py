"""``kitty.hf.compat`` on the transformers release that is installed, checked against transformers itself.

CI runs this file on the newest release (the main run) and on the lower bound and 5.23 (``make test-compat``,
environments built with ``pip install --no-deps --target``), so each release's real functions and forwards are
what is tested here, never a fake of an older release. The end-to-end tests assert that the cache really holds
the generated tokens after the generation loop, ``model.generate`` and the CLI: a forward that ignores the cache
keyword decodes without any cache and would otherwise pass unseen.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch
import transformers
from fixtures import W, tiny_config, tiny_model
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from kitty import PRESETS, KittyCache
from kitty.hf import compat
from kitty.hf.generate import generate_tokens

FAMILIES = ("llama", "qwen3", "gemma3", "mistral", "qwen2")
MODEL_CLASSES = (LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)


def test_release_is_admitted_and_read_from_transformers():
    assert compat.transformers_version() >= compat.MIN_TRANSFORMERS
    assert ".".join(map(str, compat.transformers_version())) in transformers.__version__


def test_requirements_admit_exactly_the_supported_range():
    """requirements.txt and pyproject.toml admit transformers from compat's lower bound up to the next major."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bound = "transformers>={}.{},<6".format(*compat.MIN_TRANSFORMERS)
    reqs = [ln.split("#", 1)[0].strip() for ln in (root / "requirements.txt").read_text().splitlines()]
    assert [r for r in reqs if r.startswith("transformers")] == [bound]
    assert f'"{bound}"' in (root / "pyproject.toml").read_text()


def test_release_below_the_lower_bound_is_refused(monkeypatch):
    # the module as imported now: transformers' lazy module may have replaced the one this file imported
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.2")
    compat.transformers_version.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"transformers>=5\.17,<6, found transformers 5\.16\.2"):
            compat.cache_kwargs(None)
    finally:
        monkeypatch.undo()
        compat.transformers_version.cache_clear()


@pytest.mark.parametrize("model_cls", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_cache_keyword_is_the_one_the_forward_declares(model_cls):
    """The chosen keyword is a parameter of every family's forward on this release; ``cache`` is chosen exactly
    where the forward declares it (before 5.24 it lands in ``**kwargs`` and is ignored)."""
    params = inspect.signature(model_cls.forward).parameters
    assert compat.cache_kwarg() in params
    assert ("cache" in params) == (compat.cache_kwarg() == "cache")
    assert compat.cache_kwargs("c") == {compat.cache_kwarg(): "c"}


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_types_match_transformers(family):
    """One type and one dict per layer, equal to transformers' own inference (its per-layer lists where the
    release returns them, its shared dict given to each windowed layer where it returns one dict) and to the
    layers ``DynamicCache`` builds from the same config."""
    text = tiny_config(family)  # the hybrid ones with sliding layers of window W
    types, kwargs = compat.layer_types_and_kwargs(text)
    own_types, own_kwargs = get_layer_types_and_kwargs(text)
    assert types == list(own_types) and len(kwargs) == len(types) == text.num_hidden_layers
    if isinstance(own_kwargs, dict):  # 5.17-5.18
        assert all(kw == own_kwargs for t, kw in zip(types, kwargs) if t == "sliding_attention")
        assert all("sliding_window" not in kw for t, kw in zip(types, kwargs) if t == "full_attention")
    else:
        assert kwargs == list(own_kwargs)
    layers = DynamicCache(config=text).layers
    assert len(layers) == len(types)
    for kind, kw, layer in zip(types, kwargs, layers):
        if kind == "sliding_attention":
            assert isinstance(layer, DynamicSlidingWindowLayer) and layer.sliding_window == kw["sliding_window"] == W
        else:
            assert kind == "full_attention" and type(layer) is DynamicLayer
    expected = {"llama": 0, "qwen3": 0, "gemma3": 2, "mistral": 2, "qwen2": 1}[family]
    assert types.count("sliding_attention") == expected


def test_layer_types_rule_for_a_config_transformers_cannot_read():
    """A config lacking fields transformers' function reads gets the same rule from ``kitty.hf.compat``."""
    from types import SimpleNamespace

    text = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=8)
    assert compat.layer_types_and_kwargs(text) == (["sliding_attention"] * 3, [{"sliding_window": 8}] * 3)


# (tp_plan, KV heads, tp_size) -> KV heads per rank, or None where they cannot be split evenly
KV_HEADS_CASES = [
    ({}, 4, 2, 4),
    ({"layers.*.self_attn.o_proj": "rowwise"}, 3, 2, 3),
    ({"layers.*.self_attn.k_proj": "rowwise"}, 8, 4, 8),
    ({"layers.*.self_attn.k_proj": "colwise"}, 8, 4, 2),
    ({"layers.*.self_attn.k_proj": "colwise"}, 3, 2, None),
    ({"layers.*.self_attn.qkv_proj": "colwise"}, 4, 2, 2),
    ({"layers.*.self_attn.query_key_value": "colwise"}, 1, 1, 1),
]


@pytest.mark.parametrize("plan, heads, tp, expected", KV_HEADS_CASES)
def test_kv_heads_per_rank(plan, heads, tp, expected):
    """The rule Kitty uses, its own copy and transformers' function (where the release has it: 5.20 on) agree."""
    assert compat.get_kv_heads_per_rank(plan, heads, tp) == expected
    assert compat.kv_heads_per_rank(plan, heads, tp) == expected
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank
    except ImportError:
        assert compat.transformers_version() < (5, 20)
        return
    assert get_kv_heads_per_rank(plan, heads, tp) == expected


def test_kv_heads_rule_matches_transformers_on_a_grid():
    """Kitty's copy of the rule equals transformers' function over plans x heads x ranks (releases that have it)."""
    try:
        from transformers.distributed.tensor_parallel import get_kv_heads_per_rank
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no get_kv_heads_per_rank (compat's rule is used)")
    for plan, *_ in KV_HEADS_CASES:
        for heads in (1, 2, 3, 4, 8):
            for tp in (1, 2, 4):
                assert compat.kv_heads_per_rank(plan, heads, tp) == get_kv_heads_per_rank(plan, heads, tp), (
                    plan,
                    heads,
                    tp,
                )


# ------------------------------------------------------------------------- the cache really holds the tokens


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_model()


PROMPT, NEW = 30, 12  # with S=4, G=8, R=8 the prompt alone fills pages
SMALL_FP16 = PRESETS["fp16"].with_(sink_tokens=4, group_size=8, local_window=8)


def generate_with(model, cache, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), **compat.cache_kwargs(cache), max_new_tokens=NEW,
            min_new_tokens=NEW, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, prompt.shape[1] :].tolist()


def test_generation_loop_and_generate_fill_the_cache(tiny_llama):
    """``generate_tokens`` and ``model.generate(**cache_kwargs(cache))`` store every token in the KittyCache, and
    with the fp16 preset give ``DynamicCache``'s greedy tokens."""
    prompt = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    expected = generate_with(tiny_llama, DynamicCache(config=tiny_llama.config), prompt)
    loop_cache, gen_cache = KittyCache(tiny_llama.config, SMALL_FP16), KittyCache(tiny_llama.config, SMALL_FP16)
    eos = [tiny_llama.generation_config.eos_token_id]  # masked for NEW tokens, as generate's min_new_tokens does
    assert generate_tokens(tiny_llama, prompt, loop_cache, NEW, eos=eos, min_new_tokens=NEW) == expected
    assert generate_with(tiny_llama, gen_cache, prompt) == expected
    for cache in (loop_cache, gen_cache):  # the last token is returned, never fed back
        assert cache.get_seq_length() == PROMPT + NEW - 1
        counts = cache.token_counts()
        assert counts["tokens"] == PROMPT + NEW - 1 and counts["key_pages"] > 0


def test_cli_run_fills_the_cache(tmp_path):
    """``python -m kitty`` on a tiny saved model: the JSON's token counts show the cache held the prompt and the
    generated tokens (a forward ignoring the cache keyword would leave them at 0)."""
    from transformers import AutoTokenizer

    from kitty.hf.models import resolve_default_model

    tok = AutoTokenizer.from_pretrained(resolve_default_model())
    folder = tmp_path / "llama"
    tiny_model(vocab_size=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "run.json"
    args = ["Name three colors of the rainbow, please.", "--model", str(folder), "--method", "kitty"]
    args += ["--max-new-tokens", "6", "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "kitty", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (result,) = json.loads(out.read_text())
    counts = result["counts"]
    # the prompt (8 words: at least 8 tokens) and every generated token but the last
    assert result["new_tokens"] >= 1 and counts["tokens"] >= 8 + result["new_tokens"] - 1, counts


def test_generate_shows_the_columns_it_sized_the_call_for():
    """Where the room check reads from: the argument of the function that marks a user's cache, on this release.
    A frame without it (a future release) gives ``None``, and the check then stays out of the way."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin._prepare_cache_for_generation).parameters
    assert "max_cache_length" in params
    assert "_is_user_defined = True" in inspect.getsource(GenerationMixin._prepare_cache_for_generation)

    def caller(max_cache_length):
        return compat.generate_cache_columns(sys._getframe(0))

    assert caller(41) == 41
    assert caller(True) is None and caller("41") is None
    assert compat.generate_cache_columns(sys._getframe(0)) is None
    assert compat.generate_cache_columns(None) is None
