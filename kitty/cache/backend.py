"""Torch or Triton: a Kitty layer's backend, resolved once (when the layer first sees tensors) into a small ops object.

As transformers' quantized cache backends override only their quantize/dequantize methods, the two backends differ
only in what their ops object does; the cache and the attention function call the ops and never ask which one runs:

- :class:`TorchOps`: full qbuffers become pages with ``kitty.core.quant``; decode attention is the torch reference
  (``kernels/reference.py``, also what the torch path of ``kitty.cache.attention`` reads);
- :class:`TritonOps`: decode steps attend with the fused kernel (``kitty.kernels.decode_attention_triton``); full
  qbuffers of CUDA layers are packed by ``kitty.kernels.pack_pages`` where it packs bit-identically to
  ``kitty.core.quant`` (2/4 bits, any channel selection, any key range, min-max value ranges), else as
  :class:`TorchOps` packs them; a static layer's completed qbuffers (``kitty.cache.static``) by
  ``kitty.kernels.pack_completed`` under the same conditions, side by side with ``pack_completed_ref`` for the other
  sides (both free of host reads on CUDA, so that the decode step can be captured in a CUDA graph whatever the
  config).

``backend="auto"`` is Triton for CUDA tensors when Triton is installed and the fused kernel handles the config
(``kitty.kernels.triton_supports``), else torch. :func:`check_triton` is the one refusal of ``backend="triton"``.
"""

from __future__ import annotations

import os
import warnings

import torch

from .. import kernels
from ..core.config import BACKENDS, KVQuantConfig
from ..core.pages import PagePool
from ..core.quant import quantize_key_page, quantize_value_page
from ..core.storage import KittyLayerState, page_fields
from ..kernels.launch import Launch, kernel_packs_key_range
from ..kernels.reference import decode_attention_ref, pack_completed_ref

BACKEND_ENV = "KITTY_BACKEND"


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (``kitty.kernels.interpreting``)."""
    return kernels.interpreting()


def requested_backend(backend: str | None) -> str:
    """``backend``, or ``$KITTY_BACKEND`` when it is ``None``, or ``"auto"``; ``ValueError`` if not in ``BACKENDS``."""
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (or None for ${BACKEND_ENV}), got {backend!r}")
        return backend
    choice = os.environ.get(BACKEND_ENV) or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"${BACKEND_ENV} must be one of {BACKENDS}, got {choice!r}")
    return choice


def check_triton(
    cfg: KVQuantConfig | None, head_dim: int | None, device: torch.device | None = None, backend: str = "triton"
) -> None:
    """Refuse ``backend="triton"`` (or ``"gluon"``, named by ``backend``: it runs the same kernels where its own does
    not apply) where it cannot run, before any token is stored.

    ``NotImplementedError`` without Triton; ``ValueError`` without a CUDA GPU (``device=None``: the machine's) or
    for tensors on ``device`` that are not CUDA tensors (both unless under ``TRITON_INTERPRET=1``), or for a config
    the fused kernel does not handle at ``head_dim``.
    """

    def refuse(why: str, error: type[Exception] = ValueError):
        raise error(f"backend={backend!r} {why}; use backend='auto' or 'torch' (or ${BACKEND_ENV}=torch)")

    if not kernels.HAS_TRITON:
        refuse("needs Triton for kitty.kernels.decode_attention_triton, which is not installed", NotImplementedError)
    if device is None and not torch.cuda.is_available() and not interpreting():
        refuse("needs a CUDA GPU, and torch sees none (CPU runs need TRITON_INTERPRET=1 set before triton is imported)")
    if device is not None and device.type != "cuda" and not interpreting():
        refuse(f"runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got tensors on {device}")
    if cfg is not None and cfg.torch_only:
        refuse(
            "cannot run key_rotation, key_rounding, key_outlier_fraction, boost_bits=3, value_groups or "
            "value_scale_bits (read by the torch quantizer only)"
        )
    if cfg is not None and not kernels.triton_supports(cfg, head_dim):
        refuse(
            f"cannot run group_size={cfg.group_size}, head_dim={head_dim}, value_bits={cfg.value_bits} "
            "(see kitty.kernels.triton_supports)"
        )


def resolve_backend(
    requested: str | None, device: torch.device, cfg: KVQuantConfig | None = None, head_dim: int | None = None
) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``; ``requested`` as in :func:`requested_backend`.

    ``"auto"`` picks Triton only for CUDA tensors, when Triton is installed and (per
    ``kitty.kernels.triton_supports``) the fused kernel handles ``cfg`` at ``head_dim``.
    """
    choice = requested_backend(requested)
    if choice != "auto":
        return choice
    if device.type != "cuda" or (cfg is not None and cfg.torch_only):  # torch_only: options the kernels do not read
        return "torch"
    if not kernels.HAS_TRITON:
        warnings.warn("Triton is not installed: KittyCache(backend='auto') uses the torch backend", stacklevel=3)
        return "torch"
    if cfg is not None and not kernels.triton_supports(cfg, head_dim):
        return "torch"
    if AUTO_GLUON and cfg is not None and _gluon_pages(cfg, head_dim, device):
        return "gluon"
    return "triton"


def _gluon_pages(cfg: KVQuantConfig, head_dim: int | None, device: torch.device) -> bool:
    """Whether the Gluon kernel applies to ``cfg`` on ``device`` for some dtype and GQA (per call it re-checks)."""
    from ..kernels.gluon_launch import gluon_supports

    return head_dim is not None and gluon_supports(cfg, head_dim, torch.float16, device, 4)


class TorchOps:
    """The torch backend of one layer: pages by ``kitty.core.quant``, decode attention by the torch reference.

    Capabilities, read where they matter (nothing downstream asks for a backend's name): ``fused_decode``, whether a
    decode step (one new token in every row) inserts the token and attends with :meth:`attend` over the storage,
    instead of the torch path's read-back and SDPA.
    """

    fused_decode = False
    decodes_with_gluon = False  # GluonOps: the Gluon kernel wherever gluon_supports holds (compiled steps too)

    def __init__(self, cfg: KVQuantConfig, device: torch.device):
        self.cfg, self.device = cfg, device

    def pack_keys(
        self,
        qbuf: torch.Tensor,
        rows: torch.Tensor,
        pool: PagePool,
        ids: torch.Tensor,
        salt: int,
        query_scale: torch.Tensor | None,
        query_cov: torch.Tensor | None = None,
    ) -> None:
        """Quantize the full key qbuffers ``qbuf[rows]`` ``[n, H, G, D]`` into pool pages ``ids`` (``query_cov``:
        ``key_rounding="query"``'s second moment of the queries, ``[n, H, D, D]``)."""
        page = quantize_key_page(qbuf[rows], self.cfg, salt=salt, query_scale=query_scale, query_cov=query_cov)
        pool.write(ids, page_fields(page))

    def pack_values(self, qbuf: torch.Tensor, rows: torch.Tensor, pool: PagePool, ids: torch.Tensor, salt: int) -> None:
        """Quantize the full value qbuffers ``qbuf[rows]`` ``[n, H, G, D]`` into pool pages ``ids``."""
        pool.write(ids, page_fields(quantize_value_page(qbuf[rows], self.cfg)))

    def pack_completed(
        self,
        lengths: torch.Tensor,
        k_qbuf: torch.Tensor,
        v_qbuf: torch.Tensor,
        key_pool: dict[str, torch.Tensor],
        value_pool: dict[str, torch.Tensor],
        k_page_table: torch.Tensor,
        v_page_table: torch.Tensor,
        salt: int,
        query_scale: torch.Tensor | None,
        keys: bool = True,
        values: bool = True,
    ) -> None:
        """A static layer's stage 3 (``kitty.cache.static``): pack every row whose qbuffer the last token filled into
        its fixed page, predicated on the device (``kernels/reference.py`` ``pack_completed_ref``; no host read except
        on the CPU); ``keys`` / ``values``: which sides."""
        tensors = (lengths, k_qbuf, v_qbuf, key_pool, value_pool, k_page_table, v_page_table)
        self._pack_completed_torch(*tensors, salt=salt, query_scale=query_scale, keys=keys, values=values)

    def _pack_completed_torch(self, *tensors, salt, query_scale, keys: bool = True, values: bool = True) -> None:
        """``pack_completed_ref`` of ``keys`` / ``values`` for this layer's config (``tensors``: lengths,
        the two qbuffers, the two pools, the two page tables); a host read skips idle steps on the CPU only, elsewhere
        the reference reads nothing back (``skip_idle=False``: capturable in a CUDA graph)."""
        pack_completed_ref(
            self.cfg,
            *tensors,
            salt=salt,
            query_scale=query_scale,
            skip_idle=self.device.type == "cpu",
            keys=keys,
            values=values,
        )

    def attend(
        self,
        q: torch.Tensor,
        state: KittyLayerState,
        scaling: float,
        full_qbuffer: bool = False,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One query token per row ``q`` ``[B, Hq, D]`` over the layer's ``state`` -> ``[B, Hq, D]``. ``workspace``:
        the fused kernel's preallocated buffers (``kitty.kernels.decode_attention_triton``); the torch reference
        ignores it."""
        return decode_attention_ref(q, state, self.cfg, scaling, full_qbuffer=full_qbuffer)


class TritonOps(TorchOps):
    """The Triton backend of one layer: the fused decode kernel; the pack kernel where it gives kitty.core.quant's
    bytes."""

    fused_decode = True
    # the kernel launch of every decode step (a static layer sets it with its workspace); None: the default per call
    launch: Launch | None = None

    def __init__(self, cfg: KVQuantConfig, device: torch.device):
        super().__init__(cfg, device)
        self.pack_scratch: dict = {}  # kitty.kernels.pack_completed's per-layer constants (allocated on its first call)
        # the kernel gives kitty.core.quant's bytes for quantized keys with the ranges of PACK_KEY_RANGES (min-max, or
        # fitted: the kernel runs fitted_params' search, kernels/_pack_fit.py) and any channel selection (the
        # non-magnitude ones pass it torch's boost mask, computed without host reads), and for quantized values with
        # min-max ranges; other ranges stay on kitty.core.quant. A layer's cfg is already its own
        # (KVQuantConfig.for_layer), so a boost profile's per-layer nb needs nothing here.
        kernel_keys = (
            cfg.quantizes_keys and cfg.boost_profile is None and kernel_packs_key_range(cfg.key_range, cfg.group_size)
        )
        kernel_values = cfg.quantizes_values and cfg.value_range == "minmax"
        self.packs_keys = device.type == "cuda" and kernel_keys
        self.packs_values = device.type == "cuda" and kernel_values
        # kitty.kernels.pack_completed packs these sides in one launch (on CUDA or under the interpreter), the torch
        # reference the others: on CUDA it runs kitty.core.quant sync-free (skip_idle=False), no host read and no
        # host-to-device copy, so a static layer's decode step stays capturable in a CUDA graph with fitted ranges
        self.completes_keys, self.completes_values = kernel_keys, kernel_values

    def pack_keys(self, qbuf, rows, pool, ids, salt, query_scale, query_cov=None) -> None:
        if not self.packs_keys:
            return super().pack_keys(qbuf, rows, pool, ids, salt, query_scale, query_cov)
        kernels.pack_pages(
            self.cfg, qbuf, None, k_rows=rows, pool=pool.tensors, k_pages=ids, salt=salt, query_scale=query_scale
        )

    def pack_values(self, qbuf, rows, pool, ids, salt) -> None:
        if not self.packs_values:
            return super().pack_values(qbuf, rows, pool, ids, salt)
        kernels.pack_pages(self.cfg, None, qbuf, v_rows=rows, pool=pool.tensors, v_pages=ids, salt=salt)

    def pack_completed(
        self,
        lengths,
        k_qbuf,
        v_qbuf,
        key_pool,
        value_pool,
        k_page_table,
        v_page_table,
        salt,
        query_scale,
        keys: bool = True,
        values: bool = True,
    ) -> None:
        tensors = (lengths, k_qbuf, v_qbuf, key_pool, value_pool, k_page_table, v_page_table)
        ref_keys, ref_values = keys and not self.completes_keys, values and not self.completes_values
        if ref_keys or ref_values:  # the sides the kernel does not pack: the sync-free reference on CUDA
            self._pack_completed_torch(*tensors, salt=salt, query_scale=query_scale, keys=ref_keys, values=ref_values)
        keys, values = keys and self.completes_keys, values and self.completes_values
        if keys or values:
            kernels.pack_completed(
                self.cfg,
                *tensors,
                salt=salt,
                query_scale=query_scale,
                keys=keys,
                values=values,
                scratch=self.pack_scratch,
            )

    def attend(self, q, state, scaling, full_qbuffer=False, workspace=None) -> torch.Tensor:
        # looked up on the package at every call, so that the kernel can be wrapped (tests count its calls)
        return kernels.decode_attention_triton(
            q, state, self.cfg, scaling, full_qbuffer=full_qbuffer, workspace=workspace, launch=self.launch
        )


# Whether backend="auto" picks the Gluon kernel where kernels/gluon_launch.py's gluon_supports holds (an sm_90 GPU
# with triton 3.6; elsewhere auto picks the tl kernel). Verified: every case of benchmarks/gluon_check.py on the H200
# (172 of 172); on the H100 the whole of tests/test_cuda.py with Gluon as auto's choice (33 of 33: teacher-forced
# logits, captured = eager for every entry point, the compiled steps of Gluon layers), and the captured decode step
# level with the tl kernel at batch 1 and faster from batch 16 on (benchmarks/results/h100-2026-12-06/). With bf16
# codes read as subnormals (the launch's default since): 297 of 297 check cases and 37 of 37 CUDA tests on an H100
# (benchmarks/results/h100-2026-12-07/).
AUTO_GLUON = True


class GluonOps(TritonOps):
    """The Triton backend with decode attention by the Gluon kernel (``kernels/decode_gluon.py``) wherever
    ``gluon_supports`` holds for the call's dtype and GQA ratio, else by the ``tl`` kernel."""

    decodes_with_gluon = True

    def attend(self, q, state, scaling, full_qbuffer=False, workspace=None) -> torch.Tensor:
        from ..kernels.gluon_launch import gluon_applies

        if gluon_applies(self.cfg, q, state.k_qbuf):
            from ..kernels.decode_gluon import decode_attention_gluon

            return decode_attention_gluon(q, state, self.cfg, scaling, full_qbuffer=full_qbuffer, workspace=workspace)
        return super().attend(q, state, scaling, full_qbuffer, workspace)


def backend_ops(requested: str | None, device: torch.device, cfg: KVQuantConfig, head_dim: int) -> TorchOps | TritonOps:
    """The ops object of a layer whose tensors live on ``device`` (``"triton"`` / ``"gluon"``: refused by
    :func:`check_triton` where it cannot run; ``"gluon"`` runs the ``tl`` kernel where the Gluon one does not apply)."""
    choice = resolve_backend(requested, device, cfg, head_dim)
    if choice == "gluon":
        check_triton(cfg, head_dim, device, "gluon")
        return GluonOps(cfg, device)
    if choice == "triton":
        check_triton(cfg, head_dim, device)
        return TritonOps(cfg, device)
    return TorchOps(cfg, device)
