"""Command-line scaffolding shared by ``python -m kitty``, ``python -m kitty.eval`` and ``python -m kitty.calibrate``.

The ``add_*`` functions add one group of flags to an ``argparse`` parser, each with its help and default; the
``parse_*``/``check_*`` functions read a flag's value and raise ``ValueError`` naming the flag; ``say_error`` prints
an error once (rank 0 under ``torchrun``) and ``closing_distributed`` closes the process group a sharded load opened.
Nothing here loads a model, so every check runs before the weights do.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core.config import PRESETS, get_preset
from ..hf.generate import MAX_SEED, MIN_TEMPERATURE, MIN_TOP_P, Sampling
from ..hf.models import tp_rank_and_size

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAMPLING = Sampling()  # the defaults the demo app uses too: greedy, top-p 0.95 once a temperature is set, seed 0
SAMPLE_TEMPERATURE = 1.0  # --sample without --temperature: the model's own distribution


# ------------------------------------------------------------------------------------------------ flags


def add_model(p: argparse.ArgumentParser) -> None:
    """``--model``: a hub id, a local folder or a packaged model's name."""
    p.add_argument(
        "--model",
        default=None,
        help="hub id, local path, or a packaged model (gemma-3-270m, qwen2.5-coder-0.5b-instruct: their chunk "
        "packages installed) (default: the embedded SmolLM2-135M-Instruct)",
    )


def add_tp(p: argparse.ArgumentParser) -> None:
    """``--tp/--no-tp``: shard over the ``torchrun`` ranks."""
    p.add_argument(
        "--tp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard the model over the torchrun ranks (tp_plan='auto') (default: on when WORLD_SIZE > 1)",
    )


def add_backend(p: argparse.ArgumentParser) -> None:
    """``--backend``: the attention backend."""
    from ..core.config import BACKENDS

    p.add_argument(
        "--backend",
        default=None,
        choices=BACKENDS,
        help="attention backend (default: $KITTY_BACKEND, else auto: the Gluon kernel on Hopper GPUs with triton 3.6, "
        "the Triton kernel on other GPUs, torch on CPU)",
    )


def add_dtype(p: argparse.ArgumentParser, default: str = "bfloat16") -> None:
    """``--dtype``: the weight dtype, one of ``DTYPES``."""
    p.add_argument("--dtype", default=default, choices=tuple(DTYPES), help=f"weight dtype (default: {default})")


def add_sampling(p: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--sample``, ``--top-p`` and ``--seed``; read them with ``sampling_of``."""
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature; 0 decodes greedily (default: {SAMPLING.temperature:g}, greedy, as the demo app; "
        f"{SAMPLE_TEMPERATURE:g} with --sample)",
    )
    p.add_argument(
        "--sample",
        action="store_true",
        help=f"sample (at --temperature, default {SAMPLE_TEMPERATURE:g}) instead of greedy decoding",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=SAMPLING.top_p,
        help=f"nucleus sampling mass (default: {SAMPLING.top_p:g}, as the demo app)",
    )
    p.add_argument(
        "--seed", type=int, default=SAMPLING.seed, help=f"sampling seed in [0, 2**63) (default: {SAMPLING.seed})"
    )


# ------------------------------------------------------------------------------------------------ values


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The run's sampling from ``--temperature``/``--sample``/``--top-p``/``--seed``; ``ValueError`` names the flag."""
    temperature = args.temperature
    if temperature is None:
        temperature = SAMPLE_TEMPERATURE if args.sample else SAMPLING.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if args.sample and temperature == 0:
        raise ValueError("--temperature must be > 0 with --sample (or leave out --sample for greedy decoding)")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"--temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_p < MIN_TOP_P:
        raise ValueError(
            f"--top-p must be >= {MIN_TOP_P:g} (it then keeps the most likely token alone), got {args.top_p}"
        )
    if not 0 <= args.seed < MAX_SEED:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    return Sampling(temperature, args.top_p, args.seed)


def check_method(name: str, flag: str) -> str:
    """``name`` when it is a preset, optionally ``+field=value...``; else ``ValueError`` naming ``flag``."""
    try:
        get_preset(name)
    except ValueError as e:
        raise ValueError(f"{flag} {name!r}: {e}") from e
    return name


def parse_methods(text: str, flag: str = "--methods") -> list[str]:
    """The comma-separated methods of ``text``, each checked by ``check_method``; none at all is an error."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"{flag} names no preset; choose from {list(PRESETS)}")
    return [check_method(m, flag) for m in methods]


def parse_numbers(text: str, flag: str, kind: type = int) -> tuple:
    """The comma-separated numbers of ``text`` as ``kind`` (int or float); ``ValueError`` names ``flag``."""
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise ValueError(f"{flag} must be comma-separated {noun}, got {text!r}") from None


def check_at_least_one(**values: int) -> None:
    """``ValueError`` for the first flag below 1; keywords name flags with ``_`` for ``-`` (``max_new_tokens``)."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_transformers() -> None:
    """``ValueError`` when the installed transformers is outside the range Kitty admits (before any model loads)."""
    from ..hf.compat import transformers_version

    try:
        transformers_version()
    except ImportError as e:
        raise ValueError(str(e)) from None


def check_backend_env(backend: str | None) -> None:
    """``ValueError`` naming ``$KITTY_BACKEND`` when no ``--backend`` is given and the variable holds no backend."""
    from ..cache.backend import requested_backend

    requested_backend(backend)


def check_at_least_zero(**values: int | None) -> None:
    """``ValueError`` for the first flag below 0 (``None``: not given); keywords name flags as in
    ``check_at_least_one``."""
    for name, value in values.items():
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


def check_model_path(model: str | None) -> None:
    """``--model`` written as a path (``/``, ``.``, ``~``) must exist; a hub id is checked when it loads. The
    installed transformers is checked here too (:func:`check_transformers`), so that every command refuses an
    unsupported release before loading weights."""
    check_transformers()
    if model is not None and model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise ValueError(f"--model {model!r}: no such folder (give a local model folder or a hub id)")


def tensor_parallel(tp: bool | None) -> tuple[int, int, bool]:
    """``(rank, world, shard)`` of this launch: ``--tp`` unset shards whenever ``torchrun`` started several ranks;
    ``--tp`` without them is a ``ValueError``."""
    rank, world = tp_rank_and_size()
    shard = world > 1 if tp is None else tp
    if shard and world < 2:
        raise ValueError(f"--tp needs a launch by torchrun --nproc-per-node N with N >= 2 (WORLD_SIZE is {world})")
    return rank, world, shard


def writable_file(path: Path, flag: str) -> str | None:
    """Why ``path`` cannot take the output file (``None`` when it can): checked before any work by opening it for
    appending (a file made only for the check is removed again); a character device (``/dev/full``) is written a
    newline, so that a device that takes no bytes is found before the work rather than after."""
    if path.is_dir():
        return f"{flag} {str(path)!r} is a folder; give a file path"
    if not path.parent.is_dir():
        return f"{flag} {str(path)!r}: its folder does not exist"
    existed = path.exists()
    try:
        with open(path, "a") as f:
            if path.is_char_device():
                f.write("\n")
                f.flush()
    except OSError as e:
        return f"{flag} {str(path)!r}: cannot write there ({e.strerror or e})"
    if not existed:
        path.unlink()
    return None


def writable_folder(path: Path, flag: str) -> str | None:
    """Why ``path`` cannot take the output files (``None`` when it can): the folder is made and a file is written
    and removed there, so that a run never fails at its end for want of a place to write."""
    if path.exists() and not path.is_dir():
        return f"{flag} {str(path)!r} is a file, not a folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kitty-eval-probe-"):
            pass
    except OSError as e:
        return f"{flag} {str(path)!r} cannot take files: {e.strerror or e}"
    return None


# ------------------------------------------------------------------------------------------------ running


def say_error(message: str) -> None:
    """Print ``error: message`` to stderr, once: by rank 0 only, since every rank meets the same error."""
    try:
        rank0 = tp_rank_and_size()[0] == 0
    except ValueError:  # a malformed RANK: say the error anyway
        rank0 = True
    if rank0:
        print(f"error: {message}", file=sys.stderr)


@contextmanager
def closing_distributed() -> Iterator[None]:
    """Destroy the process group on the way out, on every path (``from_pretrained(tp_plan=...)`` opens it)."""
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
