"""Memory model: token layout, analytic bits per element, and agreement with measured nbytes."""

import pytest
import torch

from kitty import PRESETS, analytic_report, token_layout
from kitty.core.memory import MemoryReport, asymptotic_bits
from kitty.core.quant import quantize_key_page, quantize_value_page


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 159, 160, 161, 288, 289, 1000, 4096])
def test_token_layout_accounts_for_every_token(n):
    cfg = PRESETS["kitty"]
    lay = token_layout(cfg, n)
    G = cfg.group_size
    assert lay.sink + lay.key_pages * G + lay.key_qbuffer == n
    assert lay.sink + lay.value_pages * G + lay.value_qbuffer + lay.local == n
    assert lay.local <= cfg.local_window and lay.key_qbuffer < G and lay.value_qbuffer < G


def test_design_card_bits_per_element():
    """The layout's bit budget: key pages 2.56 (kitty) / 2.81 (kitty-pro) bits at D=G=128, value pages 2.25 (D=128), 2.5 (D=64)."""
    assert asymptotic_bits(PRESETS["kitty"], 128)["key_total"] == pytest.approx(2.5625)
    assert asymptotic_bits(PRESETS["kitty-pro"], 128)["key_total"] == pytest.approx(2.8125)
    assert asymptotic_bits(PRESETS["kitty"], 128)["value_total"] == pytest.approx(2.25)
    assert asymptotic_bits(PRESETS["kitty"], 64)["value_total"] == pytest.approx(2.5)
    assert asymptotic_bits(PRESETS["fp16"], 64)["total"] == pytest.approx(16)


@pytest.mark.parametrize("preset", ["kitty", "kitty-pro", "kivi-k2v2", "kivi-k2v4-sink", "kivi-k4v4", "fp16"])
@pytest.mark.parametrize("n", [20, 200, 700])
def test_measured_bytes_equal_analytic(preset, n):
    """Quantize a sequence's pages for real and sum nbytes of pages and filled buffers: equals the formula."""
    cfg = PRESETS[preset]
    H, D, G = 3, 64, cfg.group_size
    lay = token_layout(cfg, n)
    x = torch.randn(H, G, D, dtype=torch.bfloat16) + 0.5
    pages = [quantize_key_page(x, cfg) for _ in range(lay.key_pages)]
    pages += [quantize_value_page(x, cfg) for _ in range(lay.value_pages)]
    full_tokens = 2 * lay.sink + lay.key_qbuffer + lay.value_qbuffer + lay.local
    full = torch.empty(H, full_tokens, D, dtype=torch.bfloat16).nbytes
    payload, meta = sum(p.payload_nbytes for p in pages), sum(p.metadata_nbytes for p in pages)
    measured = MemoryReport(n, 2 * 2 * n * H * D, payload, meta, full)
    assert measured == analytic_report(cfg, n, D, num_kv_heads=H)


def test_compression_grows_with_context_and_is_honest_for_short_ones():
    cfg = PRESETS["kitty"]
    short = analytic_report(cfg, 100, 64, 3, 30)
    long = analytic_report(cfg, 8192, 64, 3, 30)
    assert short.compression < 2.0  # mostly sink/qbuffer/local at 100 tokens
    assert long.compression > short.compression
    assert analytic_report(PRESETS["fp16"], 8192, 64, 3, 30).compression == pytest.approx(1.0)
    assert (short + long).tokens == 8292


@pytest.mark.parametrize("fraction", [1 / 64, 6 / 64, 0.125, 13 / 64])
def test_asymptotic_bits_are_the_real_page_bytes(fraction):
    """The compact high plane holds ``ceil(nb / 4)`` bytes per token: the bill counts its padded slots, as the
    quantized page's tensors do (nb = 1, 6, 8, 13 at D = 64)."""
    cfg = PRESETS["kitty"].with_(boost_fraction=fraction)
    G, D = cfg.group_size, 64
    nb = cfg.num_boosted(D)
    page = quantize_key_page(torch.randn(G, D, dtype=torch.bfloat16), cfg)
    assert page.num_boosted == nb and page.high.shape == (G, -(-nb // 4))
    a = asymptotic_bits(cfg, D)
    assert a["key_high"] == pytest.approx(8 * -(-nb // 4) / D)
    assert a["key_total"] == pytest.approx(8 * page.nbytes / (G * D))
    lay = token_layout(cfg, 1000)
    rep = analytic_report(cfg, 1000, D)
    assert rep.payload_bytes == lay.key_pages * page.payload_nbytes + lay.value_pages * G * D // 4


def test_asymptotic_bits_of_a_boost_profile_average_its_layers():
    """Layer-adaptive boost: each layer's high plane is rounded up to whole bytes on its own (nb = 1 and 15)."""
    cfg = PRESETS["kitty"].with_(boost_fraction=0.125, boost_profile=(1 / 64, 15 / 64))
    D, G = 64, cfg.group_size
    x = torch.randn(G, D, dtype=torch.float16)
    key_bytes = [quantize_key_page(x, cfg.for_layer(i)).nbytes for i in range(2)]
    assert key_bytes[0] - key_bytes[1] == G * (1 - 4)  # k_high: 1 byte vs 4 bytes per token
    a = asymptotic_bits(cfg, D)
    assert a["key_high"] == pytest.approx((8 * 1 + 8 * 4) / D / 2)
    assert a["key_total"] == pytest.approx(8 * sum(key_bytes) / 2 / (G * D))
    n = 5000
    lay, rep = token_layout(cfg, n), analytic_report(cfg, n, D, num_layers=2)
    value_bytes = quantize_value_page(x, cfg).nbytes
    assert rep.payload_bytes + rep.metadata_bytes == lay.key_pages * sum(key_bytes) + 2 * lay.value_pages * value_bytes
