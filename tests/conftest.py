"""Shared fixtures: the default model, loaded once per test session.

Without a GPU, Triton kernels run only under its interpreter, and ``TRITON_INTERPRET`` must be set before the
first import of ``triton`` (which any test module may trigger), so the variable is set here, before any test module
is collected. It changes nothing for ``KittyCache(backend="auto")``, which picks Triton only for CUDA tensors.
"""

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of the default embedded SmolLM2-135M-Instruct (bf16, offline)."""
    from kitty.hf.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def demo_url():
    """URL of the Gradio demo (``app.demo``) served in-process on a free local port for the test session."""
    import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.demo.launch(prevent_thread_lock=True, server_port=port, quiet=True, **app.LAUNCH_STYLE)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.demo.close()
