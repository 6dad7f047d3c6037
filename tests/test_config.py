"""How a transformers config's shape is read (``kitty.core.config.kv_dims``): every head-count spelling, bad counts
refused at cache construction with the field named, never at the first forward."""

from __future__ import annotations

import pytest
from transformers import PretrainedConfig

from kitty import PRESETS, KittyCache
from kitty.core.config import kv_dims


def config(**fields) -> PretrainedConfig:
    base = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    return PretrainedConfig(**(base | fields))


@pytest.mark.parametrize(
    "fields,expect",
    [
        ({"num_key_value_heads": 2}, (2, 2, 16)),
        ({"num_kv_heads": 1}, (2, 1, 16)),  # Falcon's spelling
        ({}, (2, 4, 16)),  # no count: multi-head attention
        ({"num_key_value_heads": 2, "head_dim": 32}, (2, 2, 32)),
    ],
)
def test_kv_dims_reads_every_spelling(fields, expect):
    assert kv_dims(config(**fields)) == expect


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),  # does not divide 4 query heads
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": 2.0}, "num_key_value_heads"),
        ({"num_attention_heads": None}, "num_attention_heads"),
    ],
)
def test_bad_head_counts_are_refused_when_the_cache_is_built(fields, name):
    with pytest.raises(ValueError, match=name):
        KittyCache(config(**fields), PRESETS["kitty"])
