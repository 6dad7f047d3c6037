"""The ``"kitty"`` attention function and mask function for transformers, and the torch reference backend.

Registered at import with ``transformers.AttentionInterface`` and ``AttentionMaskInterface`` under ``"kitty"``:

- the mask function does not build a 4-D mask; it returns a :class:`KittyMask` carrying the 2-D padding mask
  (``[B, past + T]``, True = real token), which transformers hands to every layer's attention call;
- the attention function receives the :class:`kitty.core.storage.PendingKV` handle that the layer's ``update``
  returned instead of key/value tensors, and runs the layer's own step, ``attend_and_append`` (``kitty.cache.layer``,
  ``kitty.cache.static``): attend, then insert the valid new tokens (paper §4.3 order: insert, attend with the qbuffer
  in full precision, quantize a full qbuffer afterwards).

``KittyCache`` does not change the user's attention implementation: the model's config reads ``"kitty"`` only on a
thread that is running a forward pass with a KittyCache (:func:`use_kitty_attention`). With ordinary tensors (any
other cache, or none) both functions run the implementation the user chose (eager, sdpa, ...), so a model whose
config says ``"kitty"`` keeps working without a KittyCache.

Backends (``KittyCache(..., backend=)``, resolved once per layer into its ops object: ``kitty/cache/backend.py``):

- every step with more than one new token per row (a prompt, a chunk, padding), on either backend: read the layer
  back in position order with the kernels' torch reference (:func:`kitty.kernels.reference.dequantize_cache`, pages
  dequantized transiently), then SDPA over ``[cached tokens | new tokens]`` with a causal + padding mask; the new
  tokens are attended in full precision. Nothing dequantized is kept. The torch backend runs decode steps so too.
- decode steps (one new token per row) of a Triton layer: insert the token, attend with
  ``layer.ops.attend`` (the fused kernel) over the storage of ``docs/LAYOUT.md`` with a qbuffer the token
  filled still in full precision, then pack what filled, as the paper does.
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch._guards import TracingContext
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..core.config import KVQuantConfig
from ..core.storage import PendingKV
from ..kernels.reference import dequantize_cache
from .backend import BACKEND_ENV, requested_backend, resolve_backend  # noqa: F401 (public here too)

ATTN_NAME = "kitty"

# ------------------------------------------------------------------------- the user's attention implementation

_STATE = threading.local()  # .on: this thread is in a forward pass with a KittyCache


def kitty_forward(on: bool) -> None:
    """Mark this thread as running (or no longer running) a forward pass with a KittyCache. transformers reads the
    attention name right after ``Cache.update`` and the mask name right after ``get_mask_sizes``, so the cache sets
    the flag in those two hooks and clears it where a layer's step ends (success, rollback, reset): see
    docs/ARCHITECTURE.md, "How the model finds the kitty functions"."""
    _STATE.on = on


def in_kitty_forward() -> bool:
    return getattr(_STATE, "on", False)


def mask_owner(cache) -> None:
    """``cache`` asked for its mask sizes on this thread: the mask function transformers calls next builds the
    mask of ``cache``'s forward pass (and checks it before any layer runs: :func:`kitty_mask`)."""
    _STATE.mask_owner = weakref.ref(cache)


def _take_mask_owner():
    ref = getattr(_STATE, "mask_owner", None)
    _STATE.mask_owner = None
    return ref() if ref is not None else None


_PATCHED: set[type] = set()  # config classes whose ``_attn_implementation`` reads "kitty" in a KittyCache pass


def use_kitty_attention(config) -> None:
    """Let every config of ``type(config)`` select the ``"kitty"`` functions during KittyCache forward passes only
    (idempotent).

    The class's ``_attn_implementation`` property is wrapped: it reads ``"kitty"`` on a thread inside a KittyCache
    forward pass, else what the user set (setting it works as usual). The class, not the instance, is changed, so a
    cache built from a copy of the model's config (``copy.deepcopy(model.config)``, ``AutoConfig``) still switches
    the model's own config, and copies and pickles of a config are plain configs.
    """
    cls = type(config)
    if cls in _PATCHED:
        return
    own = inspect.getattr_static(cls, "_attn_implementation", None)
    if not isinstance(own, property):
        raise ValueError(
            f"config must be a transformers PretrainedConfig (pass model.config), got {cls.__name__} without an "
            "_attn_implementation property"
        )
    if not getattr(own.fget, "_kitty", False):  # a base class may be wrapped already

        def read(self):
            return ATTN_NAME if in_kitty_forward() or _read_by_dynamo(self) else own.fget(self)

        read._kitty = True
        cls._attn_implementation = property(read, own.fset, own.fdel, own.__doc__)
    _PATCHED.add(cls)


_DYNAMO_READ: dict[int, weakref.ref] = {}  # configs whose property dynamo evaluated for real while tracing


def _read_by_dynamo(config) -> bool:
    """Whether ``config`` reads ``"kitty"`` outside a KittyCache forward pass: once some ``torch.compile`` trace has
    evaluated its ``_attn_implementation`` as a real call, from then on.

    Some dynamo releases (torch 2.11) do not trace this property: they call it while tracing and guard on the value
    it returned, so the thread flag (set by ``get_mask_sizes`` inside the same trace) is not seen, and a guard
    checked before each compiled call must see the same name as the trace did. Such a config therefore reads
    ``"kitty"`` for good: the ``"kitty"`` mask and attention functions hand layers of other caches to the user's
    implementation (:func:`_user_attention`, :meth:`KittyMask.sdpa`), so those passes are unchanged. Releases
    whose dynamo traces the property (torch 2.13) never get here while compiling.
    """
    ref = _DYNAMO_READ.get(id(config))
    if ref is not None and ref() is config:
        return True
    if torch.compiler.is_compiling():  # traced symbolically: the thread flag is seen as set
        return False
    if TracingContext.try_get() is None:  # an eager read
        return False
    _DYNAMO_READ[id(config)] = weakref.ref(config, lambda _, key=id(config): _DYNAMO_READ.pop(key, None))
    return True


def user_implementation(config) -> str:
    """The attention implementation the user chose for ``config`` (never ``"kitty"``; ``"sdpa"`` if unset)."""
    name = getattr(config, "_attn_implementation_internal", None)
    return "sdpa" if name in (None, ATTN_NAME) else name


# ------------------------------------------------------------------------------------------------------ the mask


@dataclass
class KittyMask:
    """What the ``"kitty"`` mask function returns: the 2-D padding mask, plus how to build the SDPA mask instead.

    ``padding_mask``: bool ``[B, past + T]`` (True = real token) or ``None`` (no padding).
    """

    padding_mask: torch.Tensor | None
    sdpa_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    _sdpa: Any = field(default=None, repr=False)
    _new_cpu: Any = field(default=None, repr=False)
    _decode_checked: bool = field(default=False, repr=False)

    @property
    def ndim(self) -> int:
        """4: a prepared mask. ``generate`` builds the mask ahead of the forward for a compileable (static) cache;
        when the model then calls the mask function with this object, transformers passes it through as it is
        (it reads ``ndim`` first) and :func:`kitty_mask` returns it unchanged."""
        return 4

    def contiguous(self) -> "KittyMask":
        """Itself: transformers 5.18-5.23 call ``.contiguous()`` on the mask ``generate`` prepares for a static cache
        (``kitty.hf.compat`` lists the difference)."""
        return self

    def check_decode_column(self, column: int) -> None:
        """A decode step that stores every row's token without reading the mask (a static cache): ``ValueError``
        if the mask marks that token (``column`` of the padding mask) as padding in some row. Read once per forward
        pass (one synchronization), and not at all while a CUDA graph is captured or the step is compiled."""
        m = self.padding_mask
        if self._decode_checked or m is None or m.dim() != 2 or m.shape[1] <= column:
            return
        if torch.compiler.is_compiling() or (m.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        self._decode_checked = True
        padded = (~m[:, column].to(device="cpu", dtype=torch.bool)).nonzero().flatten().tolist()
        if padded:
            raise ValueError(
                f"attention_mask marks the new token of rows {padded} as padding, but a static cache stores every "
                "row's token in a one-token step: feed real tokens after the prompt (as generate does), or use the "
                "growing cache (KittyCache without max_cache_len), which skips padded tokens"
            )

    def new_token_mask(self, batch_size: int, q_length: int, device: torch.device | str) -> torch.Tensor:
        """bool ``[B, T]``: which of the ``T`` new columns are real tokens.

        The mask is brought to the CPU once per forward (the object is shared by every layer), so the cache's
        bookkeeping costs one device synchronization per step, not one per layer.
        """
        if self.padding_mask is None:
            return torch.ones(batch_size, q_length, dtype=torch.bool, device=device)
        m = self.padding_mask
        if m.dim() != 2 or m.shape[0] != batch_size or m.shape[1] < q_length:
            raise ValueError(
                f"attention_mask must be 2-D [batch, past + new] with batch {batch_size} and >= {q_length} columns, got {tuple(m.shape)}"
            )
        if self._new_cpu is None or self._new_cpu.shape[1] != q_length:
            self._new_cpu = m[:, -q_length:].to(device="cpu", dtype=torch.bool)
        return self._new_cpu.to(device)

    def sdpa(self) -> torch.Tensor | None:
        """The mask the user's attention implementation would have built (transformers' ``sdpa_mask`` for sdpa;
        computed once, shared by all layers)."""
        if self._sdpa is None and self.sdpa_kwargs:
            config = self.sdpa_kwargs.get("config")
            name = user_implementation(config) if config is not None else "sdpa"
            build = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
            self._sdpa = (build(**self.sdpa_kwargs),)
        return self._sdpa[0] if self._sdpa else None


def kitty_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> KittyMask:
    """Mask function registered as ``"kitty"``: keep the 2-D padding mask (bool ``[B, kv_length]`` or ``None``)."""
    owner = None if torch.compiler.is_compiling() else _take_mask_owner()  # a compiled step checks no mask
    if isinstance(attention_mask, KittyMask):  # built already (generate prepares masks for a static cache)
        return attention_mask
    sdpa_kwargs = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )
    mask = KittyMask(attention_mask, sdpa_kwargs)
    if owner is not None and q_length == 1:
        owner.check_decode_mask(mask)  # before any layer: a hybrid model's window layers are written in place
    return mask


# ---------------------------------------------------------------------------------------- the torch path


def attend_torch(
    query: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    valid: torch.Tensor,
    storage: dict[str, torch.Tensor],
    cfg: KVQuantConfig,
    scale: float,
) -> torch.Tensor:
    """Attention of ``T`` new queries over the cached tokens (dequantized) and the new tokens (full precision).

    ``query`` ``[B, Hq, T, D]``; ``key_states``/``value_states`` ``[B, Hkv, T, D]``; ``valid`` bool ``[B, T]``
    marks real new tokens. New tokens attend causally to each other and to every cached token of their row.
    Returns ``[B, Hq, T, D]``; padding query rows get finite values that nothing reads.
    """
    B, Hq, T, D = query.shape
    keys, values, past_valid = dequantize_cache(storage, cfg, key_states, value_states)  # (B, H, L+T, D)
    L = past_valid.shape[1]
    mask, is_causal = None, False
    if bool(valid.all()) and bool(past_valid.all()):  # no padding, rows equally long: no explicit mask needed
        is_causal = T > 1 and L == 0
        needs_mask = T > 1 and L > 0
    else:
        needs_mask = True
    if needs_mask:
        i = torch.arange(T, device=query.device)
        causal = i[:, None] >= i[None, :]  # (T, T)
        new = (causal & valid[:, None, :]) | torch.eye(
            T, dtype=torch.bool, device=query.device
        )  # (B, T, T); a padding query sees itself
        mask = torch.cat([past_valid[:, None, :].expand(B, T, L), new], dim=2)[:, None]  # (B, 1, T, L+T)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=Hq != keys.shape[1]
    )


# -------------------------------------------------------------------------------------- the attention function


def kitty_attention_forward(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: KittyMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention registered as ``"kitty"``; returns ``([B, T, Hq, D], None)`` like transformers' functions.

    ``key``/``value``: the :class:`kitty.core.storage.PendingKV` of a KittyCache layer (or plain tensors: SDPA fallback).
    ``attention_mask``: the :class:`KittyMask` of :func:`kitty_mask` (or ``None``: no padding).
    """
    if not isinstance(key, PendingKV):
        mask = attention_mask.sdpa() if isinstance(attention_mask, KittyMask) else attention_mask
        return _user_attention(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        attention_mask = KittyMask(attention_mask)  # a plain 2-D padding mask (no mask function ran)
    if attention_mask is not None and not isinstance(attention_mask, KittyMask):
        raise ValueError(
            f"KittyCache needs the 2-D padding mask (the 'kitty' mask function); got a {type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    layer = key.layer
    B, Hq, T, D = query.shape
    scale = D**-0.5 if scaling is None else scaling
    if torch.compiler.is_compiling():
        if T == 1 and getattr(layer, "traceable", False):  # a static decode step: device work, no record or mask
            out = layer.attend_and_append(query, key.key_states, key.value_states, None, scale)
            kitty_forward(False)  # the step is over (KittyCache.end_step's part that a traced step has)
            return out.transpose(1, 2).contiguous(), None
        return _eager_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    valid = layer.new_tokens(attention_mask, B, T)  # (B, T) on the CPU (bookkeeping only), or None: a decode step
    cache = layer.cache
    with cache.layer_step(layer) if cache is not None else layer.atomic():  # a failure undoes the forward pass
        if valid is None and isinstance(attention_mask, KittyMask):
            # inside the step: a refusal also puts back the layers this pass already changed (a hybrid model's
            # window layers run before its first Kitty layer)
            attention_mask.check_decode_column(layer.seen_tokens)
        out = layer.attend_and_append(query, key.key_states, key.value_states, valid, scale)
    return out.transpose(1, 2).contiguous(), None  # (B, T, Hq, D)


@torch.compiler.disable
def _eager_attention(*args, **kwargs):
    """:func:`kitty_attention_forward` outside the graph of a compiled forward pass (a prompt, a growing layer): its
    host bookkeeping runs eagerly."""
    return kitty_attention_forward(*args, **kwargs)


def _user_attention(module: torch.nn.Module | None):
    """The attention function of the user's implementation for ``module`` (its model's own eager function for
    ``"eager"``, SDPA when nothing says otherwise)."""
    config = getattr(module, "config", None)
    name = user_implementation(config) if config is not None else "sdpa"
    eager = (
        getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if module is not None
        else None
    )
    if name == "eager" and eager is not None:
        return eager
    if name in ALL_ATTENTION_FUNCTIONS and name != ATTN_NAME:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sdpa_attention_forward


AttentionInterface.register(ATTN_NAME, kitty_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, kitty_mask)
