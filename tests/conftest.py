"""Shared fixtures: the default model, loaded once per test session."""

import pytest


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the default embedded SmolLM2-135M-Instruct (bf16, offline)."""
    from kitty.models import load_model

    return load_model()
