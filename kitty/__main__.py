"""Command line: generate through a Kitty cache and print what the cache holds, or compare presets.

python -m kitty "What is a KV cache?" --method kitty --max-new-tokens 64 --chat
python -m kitty "What is a KV cache?" --compare --methods fp16,kivi-k2v2,kitty,kitty-pro
torchrun --nproc-per-node 2 -m kitty "What is a KV cache?" --model PATH   # sharded: tensor parallelism

Launched by ``torchrun`` (``WORLD_SIZE`` > 1, or with ``--tp``) the model is loaded with ``tp_plan="auto"``: every
rank holds its shard of the weights and of the KV heads and runs the same loop; only rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import PRESETS, get_preset
from .generate import Sampling, eos_ids, make_cache, stream_tokens
from .memory import MemoryReport
from .models import tp_rank_and_size
from .prompts import encode_prompt

DEFAULT_COMPARE = "fp16,kivi-k2v2,kitty,kitty-pro"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Result:
    """One generation through a KittyCache."""

    method: str
    text: str
    new_tokens: int
    seconds: float
    report: MemoryReport
    counts: dict[str, int]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        """The result as plain JSON-ready values; the report with its totals over tensor-parallel ranks."""
        report = asdict(self.report) | {
            "stored_bytes": self.report.stored_bytes,
            "total_stored_bytes": self.report.total_stored_bytes,
            "total_fp16_bytes": self.report.total_fp16_bytes,
            "bits_per_element": self.report.bits_per_element,
        }
        return {
            "method": self.method,
            "text": self.text,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "report": report,
            "counts": self.counts,
        }


def generate(
    model,
    tokenizer,
    prompt: str,
    method: str,
    max_new_tokens: int = 64,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    backend: str = "auto",
) -> Result:
    """Generate from ``prompt`` with the preset ``method``; return the text, speed and the cache's memory report.

    ``on_text``: called with each new piece of text as tokens arrive (the terminal's streamed output).
    """
    cfg = get_preset(method)
    ids = encode_prompt(tokenizer, prompt, chat)
    cache = make_cache(model, cfg, backend=backend)
    sampling = Sampling(temperature, top_p, seed) if do_sample else Sampling(seed=seed)
    new: list[int] = []
    shown = ""
    start = time.perf_counter()
    for tok in stream_tokens(model, ids, cache, max_new_tokens, sampling, eos_ids(model, tokenizer)):
        new.append(tok)
        if on_text is not None:
            text = tokenizer.decode(new, skip_special_tokens=True)
            if len(text) > len(shown) and not text.endswith("\ufffd"):  # wait for a whole multi-byte character
                on_text(text[len(shown) :])
                shown = text
    seconds = time.perf_counter() - start
    text = tokenizer.decode(new, skip_special_tokens=True)
    if on_text is not None and len(text) > len(shown):
        on_text(text[len(shown) :])
    return Result(method, text, len(new), seconds, cache.memory_report(), cache.token_counts())


def describe(result: Result) -> str:
    """Memory report and token placement of one run, for the terminal."""
    c = result.counts
    r = result.report
    rank = f" (per rank of {r.ranks})" if r.ranks > 1 else ""
    return "\n".join(
        [
            f"[{result.method}] {result.new_tokens} new tokens in {result.seconds:.1f} s ({result.tokens_per_second:.1f} tokens/s)",
            f"KV cache: {r.summary()}",
            f"  quantized payload{rank} {r.payload_bytes / 2**10:.1f} KiB | metadata {r.metadata_bytes / 2**10:.1f} KiB | "
            f"full precision {r.full_precision_bytes / 2**10:.1f} KiB",
            f"  tokens per layer: sink {c['sink']} | key pages {c['key_pages']} | key qbuffer {c['key_qbuffer']} | "
            f"value pages {c['value_pages']} | value qbuffer {c['value_qbuffer']} | local {c['local']}",
        ]
    )


def table(results: list[Result], width: int = 60) -> str:
    """A Markdown table: method, bits/element, compression, tokens/s, text (one line, cut to ``width``)."""
    lines = ["| method | bits/element | compression | tokens/s | text |", "|---|---:|---:|---:|---|"]
    for r in results:
        text = " ".join(r.text.split())
        text = text if len(text) <= width else text[: width - 1] + "…"
        lines.append(
            f"| {r.method} | {r.report.bits_per_element:.2f} | {r.report.compression:.2f}x | {r.tokens_per_second:.1f} | {text.replace('|', '/')} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kitty", description="Generate with a 2-bit Kitty KV cache (arXiv 2511.18643)."
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--method", default="kitty", help="cache preset, optionally +field=value... (default: kitty)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--model", default=None, help="hub id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--compare", action="store_true", help="run several presets on the same prompt and print a table")
    p.add_argument(
        "--methods",
        default=None,
        help=f"presets for --compare, comma-separated, each optionally +field=value... (default: {DEFAULT_COMPARE})",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend", default=None, choices=("auto", "torch", "triton"), help="default: $KITTY_BACKEND, else auto"
    )
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="weight dtype (default: bfloat16)")
    p.add_argument(
        "--tp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shard the model over the torchrun ranks (tp_plan='auto'); default: on when WORLD_SIZE > 1",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results (text, memory report) as JSON")
    return p


def _is_rank0() -> bool:
    try:
        return tp_rank_and_size()[0] == 0
    except ValueError:  # a malformed RANK: say the error anyway
        return True


def _fail(message: str) -> int:
    if _is_rank0():  # every rank meets the same error: say it once
        print(f"error: {message}", file=sys.stderr)
    return 2


def utf8_text(arg: str) -> str:
    """A command-line argument as valid text: bytes that were not UTF-8 (kept by Python as surrogate escapes) become
    U+FFFD, so the tokenizer never sees an unencodable string."""
    return arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # from_pretrained(tp_plan=...) opened it; close it on every path
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """The command for parsed ``args``; returns the exit status."""
    prompt = utf8_text(args.prompt)
    if prompt != args.prompt:
        print("warning: the prompt holds bytes that are not UTF-8; they were replaced by U+FFFD", file=sys.stderr)
    args.prompt = prompt
    if not args.prompt.strip():
        return _fail("the prompt is empty")
    if args.max_new_tokens < 1:
        return _fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.sample and not args.temperature > 0:
        return _fail(
            f"--temperature must be > 0 with --sample (use greedy decoding without --sample), got {args.temperature}"
        )
    if args.sample and not 0 < args.top_p <= 1:
        return _fail(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.methods is not None and not args.compare:
        return _fail("--methods is for --compare; use --method for a single preset")
    if args.compare:
        methods = [
            m.strip() for m in (args.methods if args.methods is not None else DEFAULT_COMPARE).split(",") if m.strip()
        ]
        if not methods:
            return _fail(f"--methods names no preset; choose from {sorted(PRESETS)}")
    else:
        methods = [args.method]
    for m in methods:
        try:
            get_preset(m)
        except ValueError as e:
            return _fail(f"unknown method {m!r}: {e}")

    if args.model is not None and args.model.startswith(("/", ".", "~")) and not Path(args.model).expanduser().exists():
        return _fail(f"--model {args.model!r}: no such folder (give a local model folder or a hub id)")
    if args.json is not None and not Path(args.json).expanduser().parent.is_dir():
        return _fail(f"--json {args.json!r}: its folder does not exist")
    try:
        rank, world = tp_rank_and_size()
    except ValueError as e:
        return _fail(str(e))
    tp = world > 1 if args.tp is None else args.tp
    if tp and world < 2:
        return _fail(f"--tp needs a launch by torchrun --nproc-per-node N with N >= 2 (WORLD_SIZE is {world})")

    from .models import check_tensor_parallel, load_model

    if tp:
        try:
            check_tensor_parallel(args.model, world)  # before the weights load
        except ValueError as e:
            return _fail(f"cannot shard the model over {world} ranks: {e}")
        except OSError as e:
            return _fail(f"cannot load the model {args.model!r}: {e}")
    try:
        model, tokenizer = load_model(args.model, DTYPES[args.dtype], tp_plan="auto" if tp else None)
    except (OSError, ValueError, RuntimeError) as e:
        return _fail(f"cannot load the model {args.model!r}: {e}")
    for m in methods:
        try:
            make_cache(model, get_preset(m), backend=args.backend)  # the cache's own checks, before any generation
        except ValueError as e:
            return _fail(f"method {m!r} does not fit this model: {e}")
    out = print if rank == 0 else (lambda *a, **k: None)
    options = dict(
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        do_sample=args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        backend=args.backend,
    )
    if not args.compare:

        def show(piece: str) -> None:
            out(piece, end="", flush=True)

        results = [generate(model, tokenizer, args.prompt, args.method, on_text=show, **options)]
        out()
        out(describe(results[0]))
    else:
        from tqdm import tqdm

        results = []
        for method in tqdm(methods, desc="presets", unit="preset", disable=rank != 0):
            results.append(generate(model, tokenizer, args.prompt, method, **options))
        out(table(results))
        out()
        for r in results:
            out(describe(r))
    if args.json is not None and rank == 0:
        Path(args.json).expanduser().write_text(json.dumps([r.as_dict() for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
