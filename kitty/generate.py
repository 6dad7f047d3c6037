"""One generation loop for every caller: prefill, one decode step, sampling with a seed, a streaming generator.

gpt-fast style, plain functions, one per step::

    logits = prefill(model, ids, cache)                  # the prompt [1, T] into the cache; last logits [V]
    tok = sample_next(logits, sampling, generator)       # greedy, or temperature + top-p with a seeded generator
    logits = decode_one_token(model, cache, tok)         # one token through the model and the cache

:func:`stream_tokens` chains them into a generator that yields one token id per ``next()`` (the demo's columns,
the CLI's streamed text); :func:`generate_tokens` collects it (the evaluation's greedy runs and passkey answers).
The cache is any transformers cache, usually a :class:`kitty.KittyCache` (:func:`make_cache`); a greedy run
gives the tokens of ``model.generate(..., **compat.cache_kwargs(cache), do_sample=False)``.

:func:`prompt_keys` and :func:`prompt_query_scale` run a prefill to show what a cache would receive (the demo's
"Inside the cache" tab, with :func:`kitty.quant.inspect_keys`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch

from .compat import cache_kwargs
from .config import KVQuantConfig


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0`` (the default), else temperature + nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """Next token id from last-position ``logits`` ``[V]``."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_cache(model, cfg: KVQuantConfig | str, backend: str = "auto"):
    """A fresh :class:`kitty.KittyCache` for ``model`` (one per generation, never shared)."""
    from .cache import KittyCache

    return KittyCache(model.config, cfg, backend=backend)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt ``ids`` ``[1, T]`` through ``model`` into ``cache``; returns the last logits ``[V]``."""
    return model(ids.to(model.device), **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[0, -1]


@torch.no_grad()
def decode_one_token(model, cache, token_id: int | torch.Tensor) -> torch.Tensor:
    """Feed one token (an int, or a 0-d/one-element tensor) through ``model`` with ``cache``; returns logits ``[V]``."""
    if isinstance(token_id, torch.Tensor):
        ids = token_id.reshape(1, 1).to(device=model.device, dtype=torch.long)
    else:
        ids = torch.tensor([[token_id]], dtype=torch.long, device=model.device)
    return model(ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[0, -1]


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a generation: the model's generation config and the tokenizer's EOS."""
    ids: set[int] = set()
    for e in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(e, int):
            ids.add(e)
        elif e is not None:
            ids.update(int(i) for i in e)
    return ids


def stream_tokens(
    model,
    ids: torch.Tensor,
    cache,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    generator: torch.Generator | None = None,
    min_new_tokens: int = 0,
) -> Iterator[int]:
    """Prefill ``ids`` ``[1, T]`` into ``cache``, then yield up to ``max_new_tokens`` token ids, one per ``next()``.

    The first ``next()`` runs the prefill, each later one a single decode step. Stops after an ``eos`` token (it is
    yielded) unless fewer than ``min_new_tokens`` came: those steps never pick an ``eos`` token (its logits are
    masked, as transformers' ``min_new_tokens`` does). ``generator``: the sampling generator (default: one on the
    logits' device seeded with ``sampling.seed``). Closing the generator early leaves the cache to the caller.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = frozenset(eos)
    logits = prefill(model, ids, cache)
    if generator is None and not sampling.greedy:
        generator = torch.Generator(device=logits.device).manual_seed(sampling.seed)
    for i in range(max_new_tokens):
        if i < min_new_tokens and eos:
            logits = logits.index_fill(-1, torch.tensor(sorted(eos), device=logits.device), float("-inf"))
        tok = sample_next(logits, sampling, generator)
        yield tok
        if tok in eos or i + 1 == max_new_tokens:
            return
        logits = decode_one_token(model, cache, tok)


def generate_tokens(
    model,
    ids: torch.Tensor,
    cache,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    min_new_tokens: int = 0,
) -> list[int]:
    """The new token ids of :func:`stream_tokens`, as a list."""
    return list(stream_tokens(model, ids, cache, max_new_tokens, sampling, eos, min_new_tokens=min_new_tokens))


# ----------------------------------------------------------------------------------- what a prefill stores


@torch.no_grad()
def prompt_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Post-RoPE keys of every layer for ``ids`` ``[1, T]``: a list of ``[Hkv, T, D]``, read from a DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids.to(model.device), **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return [layer.keys[0].detach().cpu() for layer in cache.layers]  # each (Hkv, T, D)


@torch.no_grad()
def prompt_query_scale(model, ids: torch.Tensor, cfg: KVQuantConfig, layer: int, head: int) -> torch.Tensor | None:
    """The per-channel query magnitude ``[D]`` a ``KittyCache`` under ``cfg`` ranks channels of ``layer``/``head`` by
    after the prompt ``ids`` ``[1, T]`` (``None`` unless ``channel_selection`` is ``"query"`` or ``"oracle"``)."""
    from .cache import QUERY_SELECTIONS

    if cfg.channel_selection not in QUERY_SELECTIONS:
        return None
    cache = make_cache(model, cfg)
    model(ids.to(model.device), **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache.layers[layer].query_scale()[0, head].cpu()
