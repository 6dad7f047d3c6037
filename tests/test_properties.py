"""Random sequences of prompts, chunks, decode steps, resets, batch changes and masked rows, driven by hypothesis
through four caches at once on a tiny float32 model: ``DynamicCache``, the growing Kitty cache at fp16, and the
growing and static Kitty caches at a quantized preset (tiny page sizes, so that a few steps pack pages).

Invariants after every step:

- fp16 equals ``DynamicCache``: the logits of every real new token agree (the fp16 preset stores keys and values
  exactly);
- static equals growing: the same logits from the same pages (same quantizer, same order);
- the reported lengths (``lengths``, ``token_counts``, ``memory_report``) are the real tokens fed, padding excluded,
  and ``get_seq_length`` the columns fed;
- nothing raises but the documented errors, each leaving the cache as it was: a batch change without ``reset()``,
  more columns than ``max_cache_len``, a padded token in a static cache's one-token step (``ValueError``).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kitty import PRESETS, KittyCache
from kitty.hf.compat import cache_kwargs

S, G, R = 2, 4, 4
QUANT = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)
FP16 = PRESETS["fp16"].with_(sink_tokens=S, group_size=G, local_window=R)
MAX_BATCH, MAX_LEN = 3, 24

_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=1)
    return _MODELS[family]


# one op: ("prompt", rows, tokens, left pads per row) | ("chunk", tokens) | ("decode", masked row or None)
#         | ("reset",)
ops = st.one_of(
    st.tuples(
        st.just("prompt"),
        st.integers(1, MAX_BATCH),
        st.integers(1, 7),
        st.lists(st.integers(0, 6), min_size=MAX_BATCH, max_size=MAX_BATCH),
    ),
    st.tuples(st.just("chunk"), st.integers(2, 5)),
    st.tuples(st.just("decode"), st.none() | st.integers(0, MAX_BATCH - 1)),
    st.tuples(st.just("reset")),
)


class Run:
    """The four caches and what they should hold."""

    def __init__(self, model) -> None:
        config = model.config
        self.model = model
        self.config = config
        self.fp16 = KittyCache(config, FP16, backend="torch")
        self.growing = KittyCache(config, QUANT, backend="torch")
        self.static = KittyCache(config, QUANT, backend="torch", max_batch_size=MAX_BATCH, max_cache_len=MAX_LEN)
        self.reset()

    def reset(self) -> None:
        # a fresh reference: transformers 5.17's DynamicCache.reset() zeroes its tensors but keeps their columns
        self.dynamic = DynamicCache(config=self.config)
        for cache in (self.fp16, self.growing, self.static):
            cache.reset()
        self.rows: int | None = None  # the batch the caches hold (None: empty)
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # every column fed so far
        self.real: list[int] = []
        self.static_live = True  # False once the static cache refused a step the others took (until reset)

    def forward(self, cache, ids, mask):
        with torch.no_grad():
            return self.model(ids, attention_mask=mask, **cache_kwargs(cache)).logits

    def refused(self, cache, ids, mask, match: str) -> None:
        """``cache`` refuses this step with the documented ``ValueError`` and stays as it was."""
        before = (list(cache.lengths), cache.get_seq_length())
        with pytest.raises(ValueError, match=match):
            self.forward(cache, ids, mask)
        assert (list(cache.lengths), cache.get_seq_length()) == before

    def step(self, ids: torch.Tensor, new_mask: torch.Tensor) -> None:
        """Feed ``ids`` ``[B, T]`` with the padding ``new_mask`` to every cache and check the invariants."""
        B, T = ids.shape
        mask = new_mask if self.rows is None else torch.cat([self.mask, new_mask], dim=1)
        columns = mask.shape[1]
        if columns > MAX_LEN:  # the static cache refuses; the others would go on without it
            if self.static_live:
                self.refused(self.static, ids, mask, "max_cache_len")
            return
        static_ok = self.static_live and not (T == 1 and not bool(new_mask.all()))
        if self.static_live and not static_ok:
            if not any(getattr(layer, "is_sliding", False) for layer in self.static.layers):
                # refused by the first Kitty layer: in a hybrid model the window layers before it (written in
                # place) have taken the step already, so there the cache is only left out from here on
                self.refused(self.static, ids, mask, "as padding")
            self.static_live = False
        logits = {
            name: self.forward(getattr(self, name), ids, mask)
            for name in ("dynamic", "fp16", "growing") + (("static",) if static_ok else ())
        }
        self.mask, self.rows = mask, B
        self.real = [n + int(new_mask[b].sum()) for b, n in enumerate(self.real or [0] * B)]
        keep = new_mask.bool()  # compare real new tokens only
        torch.testing.assert_close(logits["fp16"][keep], logits["dynamic"][keep], rtol=1e-4, atol=1e-4)
        if static_ok:
            torch.testing.assert_close(logits["static"][keep], logits["growing"][keep], rtol=1e-5, atol=1e-5)
        self.check_lengths()

    def check_lengths(self) -> None:
        caches = [self.fp16, self.growing] + ([self.static] if self.static_live else [])
        for cache in caches:
            assert cache.lengths == self.real
            assert cache.get_seq_length() == self.mask.shape[1] == self.dynamic.get_seq_length()
            assert cache.token_counts()["tokens"] == sum(self.real) == cache.memory_report().tokens
            rows = cache.token_counts(per_row=True)
            assert [r["tokens"] for r in rows] == self.real
            for r in rows:
                parts = r["sink"] + r["key_pages"] + r["key_qbuffer"]
                assert parts == r["tokens"] == r["sink"] + r["value_pages"] + r["value_qbuffer"] + r["local"]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no explain phase: it reruns for minutes
)
@given(
    family=st.sampled_from(["llama", "gemma3"]), program=st.lists(ops, min_size=1, max_size=10), seed=st.integers(0, 99)
)
def test_random_programs_keep_every_invariant(family, program, seed):
    model = model_of(family)
    run = Run(model)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for op in program:
        kind = op[0]
        if kind == "reset":
            run.reset()
            continue
        if kind == "prompt":
            _, B, T, pads = op
            ids = torch.randint(0, vocab, (B, T), generator=g)
            new_mask = torch.ones(B, T, dtype=torch.long)
            for b in range(B):
                new_mask[b, : min(pads[b], T - 1)] = 0  # left padding, at least one real token per row
            if run.rows is not None and B != run.rows:  # a new batch without reset(): refused, nothing changed
                mask = torch.cat([run.mask, torch.ones(B, T, dtype=torch.long)], 1) if B == run.rows else new_mask
                for cache in (run.fp16, run.growing) + ((run.static,) if run.static_live else ()):
                    run.refused(cache, ids, mask, r"reset\(\)")
                continue
            run.step(ids, new_mask)
            continue
        if run.rows is None:  # nothing to continue: chunks and decode steps need a prompt first
            continue
        B = run.rows
        if kind == "chunk":
            run.step(torch.randint(0, vocab, (B, op[1]), generator=g), torch.ones(B, op[1], dtype=torch.long))
        else:
            new_mask = torch.ones(B, 1, dtype=torch.long)
            masked = op[1]
            if masked is not None and masked < B and B > 1 and run.real[masked] > 0:
                new_mask[masked, 0] = 0
            run.step(torch.randint(0, vocab, (B, 1), generator=g), new_mask)
