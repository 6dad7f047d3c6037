"""The decode step's ``torch.library`` custom ops (``kitty/cache/custom_ops.py``): the same results as direct kernel calls,
``torch.library.opcheck``, and a compiled static step (no graph break) equal to the eager one, on random data under
the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kitty.cache import custom_ops  # noqa: E402
from kitty.cache.backend import TritonOps  # noqa: E402
from kitty.core.config import PRESETS  # noqa: E402
from kitty.core.storage import KittyLayerState, pool_fields  # noqa: E402
from kitty.kernels import decode_attention_triton, insert_token  # noqa: E402
from kitty.kernels.launch import default_launch  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CFG = PRESETS["kitty"].with_(sink_tokens=4, group_size=16, local_window=4)
B, HKV, QH, D, WIDTH = 3, 2, 2, 32, 3  # WIDTH: key and value pages per row (max_cache_len = 4 + 3 * 16 + 4)
# row lengths: inside the sink (crosses its end); mid-qbuffer; one token before a full key qbuffer (its key page,
# then its value page four tokens later, are packed during the steps)
LENGTHS = [2, 12, 19]
STEPS = 6
ROW = ("lengths", "sink_k", "sink_v", "k_qbuf", "v_qbuf", "v_local")


def _layer(dtype=torch.float16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A static layer's tensors: random buffers (no zeros), rows that hold no page yet, fixed-id pools, empty tables."""
    g = torch.Generator().manual_seed(seed)
    S, G, R = CFG.sink_tokens, CFG.group_size, CFG.local_window

    def buf(slots: int) -> torch.Tensor:
        return (torch.randn(B, HKV, slots, D, generator=g) + 1.0).to(dtype).to(DEVICE)

    t = dict(lengths=torch.tensor(LENGTHS, dtype=torch.int32, device=DEVICE))
    t.update(sink_k=buf(S), sink_v=buf(S), k_qbuf=buf(G), v_qbuf=buf(G), v_local=buf(R))
    key_fields, value_fields = pool_fields(CFG, HKV, D, dtype)
    for name, (shape, dt) in {**key_fields, **value_fields}.items():
        t[name] = torch.zeros((B * WIDTH, *shape), dtype=dt, device=DEVICE)
    t["k_page_table"] = torch.full((B, WIDTH), -1, dtype=torch.int32, device=DEVICE)
    t["v_page_table"] = torch.full((B, WIDTH), -1, dtype=torch.int32, device=DEVICE)
    return t


def _state(t: dict) -> KittyLayerState:
    return KittyLayerState(**{n: t[n] for n in custom_ops.STATE_FIELDS if n in t})


def _pools(t: dict) -> tuple[dict, dict]:
    return (
        {n: t[n] for n in custom_ops.KEY_POOL_FIELDS if n in t},
        {n: t[n] for n in custom_ops.VALUE_POOL_FIELDS if n in t},
    )


def _inputs(step: int, dtype=torch.float16):
    g = torch.Generator().manual_seed(100 + step)
    k, v = (torch.randn(2, B, HKV, D, generator=g) - 0.5).to(dtype).to(DEVICE)
    q = torch.randn(B, HKV * QH, D, generator=g).to(dtype).to(DEVICE)
    return k, v, q


def _direct_step(t: dict, k, v, q, ws: dict, launch):
    insert_token(k, v, *(t[n] for n in ROW))
    out = decode_attention_triton(q, _state(t), CFG, 0.25, full_qbuffer=True, workspace=ws, launch=launch).clone()
    kp, vp = _pools(t)
    TritonOps(CFG, k.device).pack_completed(
        t["lengths"], t["k_qbuf"], t["v_qbuf"], kp, vp, t["k_page_table"], t["v_page_table"], 0, None
    )
    return out


def _op_step(t: dict, k, v, q, ws: list, launch):
    custom_ops.insert_token(k, v, *(t[n] for n in ROW))
    out = custom_ops.decode_attention(q, _state(t), CFG, 0.25, full_qbuffer=True, workspace=ws, launch=launch)
    kp, vp = _pools(t)
    custom_ops.pack_completed(CFG, t["lengths"], t["k_qbuf"], t["v_qbuf"], kp, vp, t["k_page_table"], t["v_page_table"])
    return out


def _same_layer(a: dict, b: dict) -> None:
    for name in a:
        assert torch.equal(a[name].float(), b[name].float()), name


@pytest.mark.parametrize("merge_inside", [False, True])
def test_ops_match_direct_calls_and_compile_without_graph_breaks(merge_inside):
    direct, ops, compiled = _layer(), _layer(), _layer()
    q0 = _inputs(0)[2]
    ws_ops, launch = custom_ops.attention_workspace(q0, _state(ops))
    launch = launch.__class__(**{**launch.__dict__, "num_splits": 2, "merge_inside": merge_inside})
    ws_ops, _ = custom_ops.attention_workspace(q0, _state(ops), launch)
    ws_compiled, _ = custom_ops.attention_workspace(q0, _state(compiled), launch)
    step = torch.compile(_op_step, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    ws_direct: dict[str, torch.Tensor] = {}
    for i in range(STEPS):
        k, v, q = _inputs(i)
        want = _direct_step(direct, k, v, q, ws_direct, launch)
        assert torch.equal(_op_step(ops, k, v, q, ws_ops, launch).float(), want.float()), f"op step {i}"
        assert torch.equal(step(compiled, k, v, q, ws_compiled, launch).float(), want.float()), f"compiled step {i}"
        _same_layer(ops, direct)
        _same_layer(compiled, direct)
    assert direct["lengths"].tolist() == [n + STEPS for n in LENGTHS]
    assert direct["k_page_table"][2, 0] == 2 * WIDTH and direct["v_page_table"][2, 0] == 2 * WIDTH  # pages packed
    explain = torch._dynamo.explain(_op_step)(_layer(), *_inputs(0), ws_compiled, launch)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_opcheck():
    t = _layer()
    k, v, q = _inputs(0)
    opcheck = torch.library.opcheck
    opcheck(torch.ops.kitty.insert_token.default, (k, v, *(t[n].clone() for n in ROW)))
    t["lengths"] += 1  # the step's token is counted: attention is mid-step
    ws, launch = custom_ops.attention_workspace(q, _state(t))
    state = [t.get(n) for n in custom_ops.STATE_FIELDS]
    args = (q, state, custom_ops.config_key(CFG), 0.25, True, ws, custom_ops._launch_ints(launch))
    opcheck(torch.ops.kitty.decode_attention.default, args)
    t["lengths"][2] = CFG.sink_tokens + CFG.group_size  # row 2's key qbuffer is full: the pack writes a page
    kp, vp = _pools(t)
    pools = [kp.get(n) for n in custom_ops.KEY_POOL_FIELDS] + [vp.get(n) for n in custom_ops.VALUE_POOL_FIELDS]
    args = (custom_ops.config_key(CFG), t["lengths"], t["k_qbuf"], t["v_qbuf"], *pools, t["k_page_table"],
            t["v_page_table"], 0, None)  # fmt: skip
    opcheck(torch.ops.kitty.pack_completed.default, args)


def test_gluon_flag_rides_with_the_launch():
    """A Gluon layer's op arguments carry one more integer: the tl launch reads back unchanged, and where the Gluon
    kernel does not apply (here: the CPU) the op runs the tl kernel, to the same bits."""
    t = _layer()
    k, v, q = _inputs(0)
    t["lengths"] += 1
    ws, launch = custom_ops.attention_workspace(q, _state(t))
    ints = custom_ops._launch_ints(launch, gluon=True)
    assert ints[:-1] == custom_ops._launch_ints(launch) and custom_ops._gluon_asked(ints)
    assert custom_ops._launch_of(ints) == launch and not custom_ops._gluon_asked(custom_ops._launch_ints(launch))
    assert custom_ops._launch_of(custom_ops._launch_ints(None, gluon=True)) is None
    state = [t.get(n) for n in custom_ops.STATE_FIELDS]
    key = custom_ops.config_key(CFG)
    outs = [torch.ops.kitty.decode_attention(q, state, key, 0.25, True, ws, i) for i in (ints, ints[:-1])]
    assert torch.equal(*outs)


def test_bad_input():
    with pytest.raises(ValueError, match="cfg"):
        custom_ops.config_key("kitty")
    with pytest.raises(ValueError, match="registered"):
        custom_ops._config("KVQuantConfig(unknown)")
    t = _layer()
    kp, vp = _pools(t)
    with pytest.raises(ValueError, match="key_pool"):
        custom_ops.pack_completed(
            CFG, t["lengths"], t["k_qbuf"], t["v_qbuf"], {**kp, "x": kp["k_low"]}, vp, t["k_page_table"],
            t["v_page_table"],
        )  # fmt: skip
    assert default_launch  # imported for the launch type the wrappers take
