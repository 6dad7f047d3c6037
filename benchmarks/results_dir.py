"""Where the benchmark scripts write: one folder per GPU and date, ``benchmarks/results/<gpu>-<date>/``.

A script's ``--out`` defaults to :func:`default_out` for the device it measures; its files keep the names the script
gives them, and a second run of the same kind on the same GPU and day gets ``-2`` (``-3``, ...) before the suffix
(:func:`unused_path`), so nothing measured is overwritten. Each folder's ``COMMANDS.md`` records the command that made
each file; ``benchmarks/summarize.py`` turns the folders into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def gpu_tag(device_name: str) -> str:
    """A short folder-name tag for a device: the last word of its name, lower case (``NVIDIA H200`` -> ``h200``)."""
    words = device_name.split()
    tag = re.sub(r"[^a-z0-9]+", "-", words[-1].lower()).strip("-") if words else ""
    return tag or "unknown"


def default_out(device_name: str, day: datetime.date | None = None) -> Path:
    """``benchmarks/results/<gpu>-<YYYY-MM-DD>/`` for ``device_name`` on ``day`` (today, UTC, by default)."""
    day = day or datetime.datetime.now(datetime.timezone.utc).date()
    return RESULTS / f"{gpu_tag(device_name)}-{day.isoformat()}"


def unused_path(folder: str | Path, name: str) -> Path:
    """``folder / name``, or ``folder / stem-2.suffix`` (``-3``, ...) when a file of that name is already there."""
    folder = Path(folder)
    path, stem, suffix = folder / name, Path(name).stem, Path(name).suffix
    n = 2
    while path.exists():
        path, n = folder / f"{stem}-{n}{suffix}", n + 1
    return path


def run_env(props) -> dict:
    """What a result file records of the machine: the GPU's name and SM count (``props``: CUDA device properties,
    or any object with ``name`` / ``multi_processor_count``), the torch and triton releases, the UTC time."""
    import torch
    import triton

    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
