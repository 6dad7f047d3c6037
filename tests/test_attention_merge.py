"""The split-K merge inside the attention launch (``Launch.merge_inside``: the last program of each (row, KV head)
merges) against the two-launch form and the torch reference of the merge, on random data under the interpreter."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kitty.core.config import PRESETS  # noqa: E402
from kitty.kernels import decode_attention_ref, decode_attention_triton, merge_splits_ref  # noqa: E402
from kitty.kernels.launch import default_launch  # noqa: E402
from kitty.kernels.testing import attention_tolerance, make_state, planted_kv  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize(
    "preset,gqa,dtype,splits",
    [("kitty", 4, torch.float16, 3), ("kitty-pro", 3, torch.bfloat16, 4), ("kitty", 1, torch.float16, 1)],
)
def test_merge_inside_equals_two_launches(preset, gqa, dtype, splits):
    cfg = PRESETS[preset].with_(group_size=16, local_window=24, sink_tokens=8)
    S, G, R = cfg.sink_tokens, cfg.group_size, cfg.local_window
    lengths = [S + 3 * G + 5, 1, S + R + 2 * G, S + G]  # several pages; sink only; values past the window; a page
    B, Hkv, D = len(lengths), 2, 64
    k, v = planted_kv(B, Hkv, max(lengths), D, dtype, DEVICE, seed=gqa + splits)
    state = make_state(cfg, k, v, lengths, seed=1, full_qbuffer=True)
    q = torch.randn(B, Hkv * gqa, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    base = dataclasses.replace(default_launch(B, Hkv, state.k_page_table.shape[1] + 1, q.device), num_splits=splits)
    two = decode_attention_triton(q, state, cfg, full_qbuffer=True, launch=base).clone()
    ws: dict[str, torch.Tensor] = {}
    one = decode_attention_triton(
        q, state, cfg, full_qbuffer=True, workspace=ws, launch=dataclasses.replace(base, merge_inside=True)
    )
    assert torch.equal(one.float(), two.float()), "the merge inside the launch differs from the reduce launch"
    assert ws["tickets"].shape == (B * Hkv,) and not ws["tickets"].any(), "tickets must be left at 0"
    # the merge's torch reference, on the partials the launch left in the workspace
    block_h = ws["m"].numel() // (B * Hkv * splits)
    merged = merge_splits_ref(ws["m"], ws["l"], ws["acc"], B, Hkv, gqa, splits, block_h)
    torch.testing.assert_close(
        one.float(), merged.to(dtype).float(), rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-3
    )
    ref = decode_attention_ref(q, state, cfg, upcast=True, full_qbuffer=True)
    pt = decode_attention_ref(q, state, cfg, upcast=False, full_qbuffer=True)
    assert (one.float() - ref.float()).abs().max().item() <= attention_tolerance(ref, pt, dtype)
    # a second launch on the same workspace (a replayed graph) starts from clean tickets and gives the same output
    again = decode_attention_triton(
        q, state, cfg, full_qbuffer=True, workspace=ws, launch=dataclasses.replace(base, merge_inside=True)
    )
    assert torch.equal(again.float(), two.float()) and not ws["tickets"].any()
