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
"Inside the cache" tab, with :func:`kitty.core.quant.inspect_keys`).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch

from ..core.config import KVQuantConfig
from .compat import cache_kwargs

MAX_SEED = 2**63  # seeds in [0, 2**63) are what torch.Generator.manual_seed takes on every device
# below these, logits / temperature overflow float32 and a top-p mass rounds to 0 in float32 (no token kept); both
# limits already pick the most likely token alone, as greedy decoding (temperature 0) does
MIN_TEMPERATURE, MIN_TOP_P = 1e-4, 1e-6


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0`` (the default), else temperature + nucleus (top-p) sampling.

    The defaults are the demo's and the CLI's (``app.py``, ``python -m kitty``): greedy, top-p 0.95 once a
    temperature is set, seed 0.
    """

    temperature: float = 0.0
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        t, p, seed = self.temperature, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if p < MIN_TOP_P:
            raise ValueError(f"top_p must be >= {MIN_TOP_P:g} (it then keeps the most likely token alone), got {p!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")

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
    from ..cache.kitty_cache import KittyCache

    return KittyCache(model.config, cfg, backend=backend)


DECODE_PATH_ENV = "KITTY_DECODE_PATH"
DECODE_PATHS = ("auto", "captured", "eager")
PATH_HELP = (
    "On a CUDA GPU with Triton, decoding runs a static KittyCache and one decode step captured in a CUDA graph "
    "(kitty.hf.generate.generate_static); elsewhere (the CPU, sliding-window models, tensor parallelism) the eager "
    f"loop with a growing cache. ${DECODE_PATH_ENV}=eager|captured overrides the choice."
)


def fast_path_available(model, cache_cfg: KVQuantConfig | str | None = None) -> bool:
    """Whether ``model`` can decode on the captured path: a CUDA model, Triton installed, no sliding-window layer
    (their transformers update branches on a host counter) and no tensor parallelism. ``cache_cfg``: the preset it
    would run (every preset runs on the static cache; kept so that a preset the path cannot take can be refused)."""
    from .. import kernels

    device = getattr(model, "device", torch.device("cpu"))
    if torch.device(device).type != "cuda" or not kernels.HAS_TRITON:
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return "sliding_attention" not in (getattr(config, "layer_types", None) or ())


def decode_path(model, cache_cfg: KVQuantConfig | str | None = None) -> str:
    """``"captured"`` (a static cache and :func:`generate_static`) where :func:`fast_path_available`, else
    ``"eager"`` (:func:`make_cache` and :func:`stream_tokens`); ``$KITTY_DECODE_PATH`` overrides (``"captured"`` on
    the CPU runs the same static step eagerly)."""
    choice = os.environ.get(DECODE_PATH_ENV) or "auto"
    if choice not in DECODE_PATHS:
        raise ValueError(f"${DECODE_PATH_ENV} must be one of {DECODE_PATHS}, got {choice!r}")
    if choice != "auto":
        return choice
    return "captured" if fast_path_available(model, cache_cfg) else "eager"


def decode_chunks(
    model,
    ids: torch.Tensor,
    cfg: KVQuantConfig | str,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    backend: str = "auto",
    min_new_tokens: int = 0,
    path: str | None = None,
    check_every: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[object, Iterator[list[int]]]:
    """The cache and the new token ids of one prompt ``ids`` ``[1, T]`` on the :func:`decode_path` (``path``
    overrides it), in chunks as they reach the host: every entry point decodes through here. Eager:
    :func:`make_cache` and :func:`stream_tokens`, one token per chunk (``generator`` draws sampled tokens).
    Captured: a static ``KittyCache`` of ``T + max_new_tokens`` columns and :func:`generate_static`'s loop, the
    prompt's token, then up to ``check_every`` tokens per chunk (one host read each; sampled tokens are drawn on the
    device from ``sampling.seed``). When a chunk yields, the cache holds exactly the tokens yielded so far, minus
    the last (not yet fed back). ``min_new_tokens`` between 0 and ``max_new_tokens`` (an eos masked for a while)
    runs eagerly; at ``max_new_tokens`` or more, ``eos`` is never picked on either path. The last chunk ends at the
    first ``eos``."""
    path = path or decode_path(model, cfg)
    if path not in DECODE_PATHS[1:]:
        raise ValueError(f"path must be one of {DECODE_PATHS[1:]} or None, got {path!r}")
    if path == "captured" and 0 < min_new_tokens < max_new_tokens:
        path = "eager"
    if path == "eager":
        cache = make_cache(model, cfg, backend=backend)
        stream = stream_tokens(model, ids, cache, max_new_tokens, sampling, eos, generator, min_new_tokens)
        return cache, ([tok] for tok in stream)
    from ..cache.kitty_cache import KittyCache

    check_generation_args(max_new_tokens, eos)
    check_prompt_ids(ids, None)
    cache = KittyCache(
        model.config, cfg, backend=backend, max_batch_size=1, max_cache_len=ids.shape[1] + max_new_tokens
    )
    ban = frozenset(eos) if min_new_tokens >= max_new_tokens else frozenset()  # eos never picked
    stop = frozenset(eos) - ban

    def chunks() -> Iterator[list[int]]:
        shown = 0
        loop = _static_chunks(
            model, ids, None, cache, max_new_tokens, sampling, sorted(stop), None, None, check_every, 2, ban
        )
        try:
            for out, n in loop:
                new = out[0, shown:n].tolist()
                ended = next((i for i, tok in enumerate(new) if tok in stop), None)
                if ended is not None:
                    yield new[: ended + 1]
                    return
                if new:
                    yield new
                shown = n
        finally:
            loop.close()

    return cache, chunks()


def decode_stream(
    model,
    ids: torch.Tensor,
    cfg: KVQuantConfig | str,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    backend: str = "auto",
    min_new_tokens: int = 0,
    path: str | None = None,
    check_every: int = 8,
) -> tuple[object, Iterator[int]]:
    """:func:`decode_chunks` one token at a time: the cache and the token stream of one prompt ``ids``."""
    cache, chunks = decode_chunks(
        model, ids, cfg, max_new_tokens, sampling, eos, backend, min_new_tokens, path, check_every
    )

    def tokens() -> Iterator[int]:
        try:
            for chunk in chunks:
                yield from chunk
        finally:
            chunks.close()

    return cache, tokens()


def generate_fast(
    model,
    ids: torch.Tensor,
    cfg: KVQuantConfig | str,
    max_new_tokens: int,
    eos: Collection[int] = (),
    min_new_tokens: int = 0,
    backend: str = "auto",
) -> list[int]:
    """Greedy new token ids of one prompt on the :func:`decode_path` (:func:`decode_stream`, collected)."""
    _, tokens = decode_stream(model, ids, cfg, max_new_tokens, eos=eos, backend=backend, min_new_tokens=min_new_tokens)
    return list(tokens)


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


def check_prompt_ids(ids: torch.Tensor, cache) -> None:
    """``ValueError`` unless ``ids`` is one prompt ``[1, T]`` of integer token ids (``T >= 1``) that ``cache`` can
    take: the loop decodes a single row, so a cache still holding the rows of an earlier batch is refused too."""
    shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
    if shape is None or len(shape) != 2 or shape[0] != 1 or shape[1] < 1:
        hint = " (a 1-D tensor: pass ids[None])" if shape is not None and len(shape) == 1 else ""
        raise ValueError(
            f"ids must be a [1, T] tensor of token ids (one prompt, T >= 1), got "
            f"{f'shape {shape}' if shape is not None else type(ids).__name__}{hint}; this loop decodes one row: "
            "for a batch call model.generate(..., **kitty.hf.compat.cache_kwargs(KittyCache(...))) with a fresh "
            "cache per batch (cache= is read from transformers 5.24 only)"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"ids must hold integer token ids, got dtype {ids.dtype}")
    rows = getattr(cache, "lengths", None)
    if rows is not None and len(rows) > 1 and cache.get_seq_length() > 0:
        raise ValueError(
            f"cache holds {len(rows)} rows of an earlier batch, and ids is one prompt: pass a fresh cache "
            "(kitty.hf.generate.make_cache) for each generation, or call cache.reset() first"
        )


def check_generation_args(max_new_tokens, eos, ids=None) -> None:
    """``ValueError`` naming the argument unless ``max_new_tokens`` is an integer >= 1 (not a bool), ``eos`` a
    collection of integer token ids (not a string) and ``ids`` (if given) a tensor of integer token ids."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(eos, (str, bytes)) or not isinstance(eos, Collection):
        raise ValueError(f"eos must be a collection of integer token ids (e.g. {{2}}), got {eos!r}")
    bad = [e for e in eos if isinstance(e, bool) or not isinstance(e, numbers.Integral)]
    if bad:
        raise ValueError(f"eos must hold integer token ids, got {bad[0]!r} (e.g. tokenizer.eos_token_id)")
    if ids is not None and (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dtype.is_complex
        or ids.dtype == torch.bool
    ):
        what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a tensor of integer token ids, got {what}")


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
    check_generation_args(max_new_tokens, eos)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_prompt_ids(ids, cache)
    from ..cache.kitty_cache import start_generation  # a fresh (reset) cache that holds the whole generation

    start_generation(cache, ids.shape[1] + max_new_tokens - 1)
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
    from ..core.config import QUERY_SELECTIONS

    if cfg.channel_selection not in QUERY_SELECTIONS:
        return None
    cache = make_cache(model, cfg)
    model(ids.to(model.device), **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache.layers[layer].query_scale()[0, head].cpu()


# --------------------------------------------------------------- batched decoding with a static cache (captured)


def sample_tokens_no_sync(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids ``[B]`` from last-position ``logits`` ``[B, V]`` on the device, with no host synchronization:
    argmax when greedy, else temperature + top-p with the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``:
    a draw from ``p``, as gpt-fast's ``multinomial_sample_one_no_sync``)."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sampling.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)


def _cache_len(cache) -> int:
    """``max_cache_len`` of a static cache (a static ``KittyCache`` or transformers' ``StaticCache``)."""
    n = getattr(cache, "max_cache_len", None)
    if n is None:
        n = next((getattr(layer, "max_cache_len", None) for layer in cache.layers), None)
    if n is None or not getattr(cache, "is_compileable", False):
        raise ValueError(
            "generate_static needs a static cache: KittyCache(config, preset, max_batch_size=..., max_cache_len=...) "
            "or transformers' StaticCache"
        )
    return int(n)


def _advance(cache, steps: int) -> None:
    """Count ``steps`` decode steps on the layers that keep host counters (their Python did not run)."""
    for layer in cache.layers:
        advance = getattr(layer, "advance", None)
        if advance is not None:
            advance(steps)


@torch.no_grad()
def generate_static(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    pad_token_id: int | None = None,
    capture: bool | None = None,
    check_every: int = 16,
    warmup: int = 2,
) -> torch.Tensor:
    """Batched decoding gpt-fast style: the prompt eagerly, then one decode step captured in a CUDA graph and
    replayed per token. Returns the new token ids ``[B, <= max_new_tokens]``.

    ``input_ids`` ``[B, T]`` (left padding marked 0 in ``attention_mask``; ``None``: no padding); ``cache``: a
    static cache (``KittyCache(..., max_cache_len=...)`` or transformers' ``StaticCache``) holding at least
    ``T + max_new_tokens - 1`` columns. The decode step reads and writes static buffers only: input ids ``[B, 1]``,
    position ids ``[B, 1]`` (each row's count of real tokens), a ``[B, max_cache_len]`` attention mask (the prompt's
    padding, ones after it) and the cache's own storage; the sampled token (argmax, or temperature + top-p drawn on
    the device) is copied into the input buffer inside the step. ``eos``: a row that produced one of these ids
    gets ``pad_token_id`` (default: the first ``eos``, else 0) afterwards, as ``model.generate`` pads finished
    rows; the host checks whether every row has finished once every ``check_every`` steps (one synchronization),
    so up to ``check_every - 1`` steps may run past the last row's end (their tokens are pads, cut here).

    ``capture``: ``None`` captures on CUDA when every layer can be captured (no sliding-window layer, whose
    transformers update branches on a host counter), ``False`` runs the same step eagerly (the CPU, and the
    reference the captured tokens are compared with). The first ``warmup`` decode steps run eagerly on a side
    stream before capture (compiling kernels, allocating workspaces); they are real steps of the generation.
    """
    check_generation_args(max_new_tokens, eos, input_ids)
    eos_set = sorted(set(eos))
    out, n = None, 0
    for out, n in _static_chunks(
        model, input_ids, attention_mask, cache, max_new_tokens, sampling, eos_set, pad_token_id, capture,
        check_every, warmup,
    ):  # fmt: skip
        pass
    if eos_set:  # cut the columns after every row finished
        hit = torch.isin(out[:, :n], torch.tensor(eos_set, device=out.device)).long()
        ended = (hit.cumsum(-1) - hit) > 0  # (B, N): an earlier column of the row is an eos
        return out[:, : int((~ended).any(0).nonzero().max()) + 1]
    return out[:, :n]


@torch.no_grad()
def _static_chunks(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos: Collection[int] = (),
    pad_token_id: int | None = None,
    capture: bool | None = None,
    check_every: int = 16,
    warmup: int = 2,
    ban: Collection[int] = (),
) -> Iterator[tuple[torch.Tensor, int]]:
    """:func:`generate_static`'s loop as a generator of ``(out, n)``: the output buffer ``[B, max_new_tokens]`` on
    the device whose first ``n`` columns are final, after the prompt and every ``check_every`` decode steps (so a
    caller can show them: one host read each time), and once at the end. ``ban``: token ids never picked (their
    logits masked on the device, as ``min_new_tokens`` masks eos)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
    if check_every < 1 or warmup < 0:
        raise ValueError(f"check_every must be >= 1 and warmup >= 0, got {check_every} and {warmup}")
    B, T = input_ids.shape
    L = _cache_len(cache)
    if T + max_new_tokens - 1 > L:
        raise ValueError(
            f"a prompt of {T} columns and max_new_tokens={max_new_tokens} need {T + max_new_tokens - 1} cache "
            f"columns, the cache holds max_cache_len={L}"
        )
    device = model.device
    ids = input_ids.to(device)
    mask = torch.ones(B, T, dtype=torch.long, device=device) if attention_mask is None else attention_mask.to(device)
    if mask.shape != (B, T):
        raise ValueError(f"attention_mask must be [batch, tokens] = {(B, T)}, got {tuple(mask.shape)}")
    from ..cache.kitty_cache import start_generation  # a fresh (reset) cache: positions restart at 0

    start_generation(cache, T + max_new_tokens - 1)
    eos = sorted(set(eos))
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

    # ---- prompt: eager, positions as generate gives them (left padding skipped)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(
        ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True, logits_to_keep=1
    ).logits[:, -1]
    ban_t = torch.tensor(sorted(set(ban)), dtype=torch.long, device=device)
    if len(ban_t):
        logits = logits.index_fill(-1, ban_t, float("-inf"))
    first = sample_tokens_no_sync(logits, sampling, generator)

    # ---- static buffers of the decode step
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    input_buf = first[:, None].clone()  # (B, 1)
    position_buf = mask.long().sum(-1, keepdim=True)  # (B, 1): the next token's position in each row
    mask_buf = torch.ones(B, L, dtype=mask.dtype, device=device)
    mask_buf[:, :T] = mask
    out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
    out[:, 0] = first
    done = torch.isin(first, eos_t) if eos else torch.zeros(B, dtype=torch.bool, device=device)
    step_idx = torch.ones(1, dtype=torch.long, device=device)
    yield out, 1

    def step() -> None:
        logits = model(
            input_buf,
            attention_mask=mask_buf,
            position_ids=position_buf,
            **cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if len(ban_t):
            logits = logits.index_fill(-1, ban_t, float("-inf"))
        nxt = torch.where(done, pad, sample_tokens_no_sync(logits, sampling, generator))
        if eos:
            done.logical_or_(torch.isin(nxt, eos_t))
        input_buf.copy_(nxt[:, None])
        position_buf.add_(1)
        out.index_copy_(1, step_idx, nxt[:, None])
        step_idx.add_(1)

    steps = max_new_tokens - 1
    sliding = any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    if capture is None:
        capture = device.type == "cuda" and not sliding
    if capture and (device.type != "cuda" or sliding):
        raise ValueError("capture=True needs a CUDA model and a cache without sliding-window layers")
    ran = 0

    def finished(i: int) -> bool:  # one host read every check_every steps
        return bool(eos) and (i % check_every == 0) and bool(done.all())

    from ..cache.static import stagger_packs, stagger_requested

    # the packs of the pages a step completes spread over it and the next (stagger_packs; $KITTY_STAGGER_PACK=0: not);
    # whenever the loop hands the cache back (every yield, the end) it packs what is pending first
    deferring = stagger_packs(cache.layers) if stagger_requested() else []

    def handed_back() -> tuple[torch.Tensor, int]:
        for layer in deferring:  # (each layer knows whether a deferred step ran since it last packed)
            layer.pack_pending()
        return out, ran + 1

    try:
        if capture and steps > warmup:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            ran = warmup
            graph = torch.cuda.CUDAGraph()
            if generator is not None and hasattr(graph, "register_generator_state"):
                graph.register_generator_state(generator)
            # thread_local: a capture restricts only its own thread, so the demo's columns (one thread each) may
            # run eager steps, or capture their own graphs, while this one captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
            _advance(cache, -1)  # capture ran the step's Python, not its kernels
            while ran < steps and not finished(ran):
                graph.replay()  # room for every step was checked above
                _advance(cache, 1)
                ran += 1
                if ran % check_every == 0:
                    yield handed_back()
        while ran < steps and not finished(ran):
            step()
            ran += 1
            if ran % check_every == 0:
                yield handed_back()
        yield handed_back()
    finally:
        for layer in deferring:
            layer.pack_pending()
            layer.defer_keys = layer.defer_values = False
