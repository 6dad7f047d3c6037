"""The one-launch decode insert (``kernels/insert.py``) against its torch reference: bit-identical buffers and
lengths after every step of a ragged batch, through the sink's end, full qbuffers and the local ring's wrap."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kitty.kernels import insert_token, insert_token_ref  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
NAMES = ("lengths", "sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local")


def _state(B: int, Hkv: int, D: int, S: int, G: int, R: int, lengths: list[int], dtype, seed: int) -> dict:
    """Random buffers (no zeros: a slot written with the wrong token shows) and the given row lengths."""
    g = torch.Generator().manual_seed(seed)

    def buf(slots: int) -> torch.Tensor:
        return (torch.randn(B, Hkv, slots, D, generator=g) + 3.0).to(dtype).to(DEVICE)

    return dict(
        lengths=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
        sink_k=buf(S),
        sink_v=buf(S),
        k_qbuf=buf(G),
        v_qbuf=buf(G),
        v_local=buf(R),
    )


def _same(a: dict, b: dict, step: int) -> None:
    for name in NAMES:
        x, y = a[name], b[name]
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x.float(), y.float()), f"{name} differs after step {step}"


CASES = [  # (S, G, R): a sink, R < G; R > G; no local window; no sink
    (4, 16, 8),
    (4, 16, 24),
    (4, 16, 0),
    (0, 16, 8),
]


@pytest.mark.parametrize("S,G,R", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_insert_matches_reference_over_steps(S, G, R, dtype):
    B, Hkv, D = 5, 3, 32  # 3 KV heads: the kernel's head tile pads to 4
    # ragged rows: empty, just before the sink's end, at the sink's end, one token before a full key qbuffer, one
    # before the local window starts handing values to the value qbuffer
    lengths = [0, max(S - 1, 0), S, S + G - 1, S + R + G - 1]
    steps = 2 * G + R + 3  # every row crosses a qbuffer boundary twice and the ring wraps
    got = _state(B, Hkv, D, S, G, R, lengths, dtype, seed=S + G + R)
    ref = {name: t.clone() for name, t in got.items()}
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        # the new token as the model hands it over: a [B, H, 1, D] tensor, read through its [:, :, 0] view
        kv = (torch.randn(2, B, Hkv, 1, D, generator=g) - 2.0).to(dtype).to(DEVICE)
        k, v = kv[0][:, :, 0], kv[1][:, :, 0]
        insert_token(k, v, *(got[n] for n in NAMES))
        insert_token_ref(k, v, *(ref[n] for n in NAMES))
        _same(got, ref, step)
    assert got["lengths"].tolist() == [n + steps for n in lengths]


def test_reference_matches_the_layer_slots():
    """The reference writes the slots the layer's own torch insertion writes (``KittyLayer.write_token_slots``)."""
    from kitty.cache.layer import KittyLayer
    from kitty.core.config import PRESETS

    if not hasattr(KittyLayer, "write_token_slots"):
        pytest.skip("the layer's torch insertion moved")
    S, G, R = 4, 16, 24
    cfg = PRESETS["kitty"].with_(sink_tokens=S, group_size=G, local_window=R)
    B, Hkv, D = 4, 2, 32
    lengths = [1, S, S + R - 1, S + R + G - 1]
    ref = _state(B, Hkv, D, S, G, R, lengths, torch.float32, seed=3)
    layer = SimpleNamespace(cfg=cfg, on_undo=lambda undo: None, **{n: t.clone() for n, t in ref.items()})
    g = torch.Generator().manual_seed(4)
    for step in range(G + R + 2):
        k, v = torch.randn(2, B, Hkv, D, generator=g)
        insert_token_ref(k, v, *(ref[n] for n in NAMES))
        KittyLayer.write_token_slots(layer, k, v, torch.arange(B))
        layer.lengths.add_(1)
        _same(vars(layer), ref, step)


def test_insert_rejects_bad_shapes():
    st = _state(2, 2, 16, 4, 16, 8, [0, 1], torch.float16, seed=0)
    k = torch.randn(2, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="lengths"):
        insert_token(k, k, st["lengths"].long(), *(st[n] for n in NAMES[1:]))
    with pytest.raises(ValueError, match="k_qbuf"):
        insert_token(k, k, st["lengths"], st["sink_k"], st["sink_v"], st["k_qbuf"][:1], st["v_qbuf"], st["v_local"])
    with pytest.raises(ValueError, match="k and v"):
        insert_token(k, k.float(), *(st[n] for n in NAMES))
