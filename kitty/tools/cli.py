"""Command line: generate through a Kitty cache and print what the cache holds, or compare presets.

python -m kitty "What is a KV cache?" --method kitty --max-new-tokens 64 --chat
python -m kitty "What is a KV cache?" --compare --methods fp16,kivi-k2v2,kitty,kitty-pro
python -m kitty --prompt-file long_document.txt --compare      # or: cat long_document.txt | python -m kitty -
torchrun --nproc-per-node 2 -m kitty "What is a KV cache?" --model PATH   # sharded: tensor parallelism

Launched by ``torchrun`` (``WORLD_SIZE`` > 1, or with ``--tp``) the model is loaded with ``tp_plan="auto"``: every
rank holds its shard of the weights and of the KV heads and runs the same loop; only rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.config import PRESETS, get_preset
from ..core.memory import MemoryReport
from ..hf.generate import PATH_HELP, Sampling, decode_stream, eos_ids, make_cache
from ..hf.models import tp_rank_and_size
from . import cliargs
from .cliargs import DTYPES, SAMPLE_TEMPERATURE, SAMPLING, sampling_of
from .demo import DEFAULT_METHODS
from .prompts import encode_prompt

DEFAULT_COMPARE = ",".join((*DEFAULT_METHODS, "kitty-pro"))  # the demo's three columns, then kitty-pro


@dataclass
class Result:
    """One generation through a KittyCache."""

    method: str
    text: str
    new_tokens: int
    seconds: float
    report: MemoryReport
    counts: dict[str, int]
    tokens: list[int] = field(default_factory=list)  # the new token ids

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
            "tokens": self.tokens,
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
    temperature: float = SAMPLE_TEMPERATURE,
    top_p: float = SAMPLING.top_p,
    seed: int = SAMPLING.seed,
    backend: str = "auto",
) -> Result:
    """Generate from ``prompt`` with the preset ``method``; return the text, speed and the cache's memory report.

    ``on_text``: called with each new piece of text as tokens arrive (the terminal's streamed output).
    """
    cfg = get_preset(method)
    ids = encode_prompt(tokenizer, prompt, chat)
    sampling = Sampling(temperature, top_p, seed) if do_sample else Sampling(seed=seed)
    new: list[int] = []
    shown = ""
    start = time.perf_counter()
    # the captured static step on CUDA, else the eager loop (kitty.hf.generate.decode_path)
    cache, tokens = decode_stream(model, ids, cfg, max_new_tokens, sampling, eos_ids(model, tokenizer), backend)
    for tok in tokens:
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
    return Result(method, text, len(new), seconds, cache.memory_report(), cache.token_counts(), new)


def describe(result: Result) -> str:
    """Memory report and token placement of one run, for the terminal."""
    c = result.counts
    r = result.report
    rank = f" (per rank of {r.ranks})" if r.ranks > 1 else ""
    return "\n".join(
        [
            f"[{result.method}] {result.new_tokens} new tokens in {result.seconds:.1f} s "
            f"({result.tokens_per_second:.1f} tokens/s)",
            f"KV cache: {r.summary()}",
            f"  quantized payload{rank} {r.payload_bytes / 2**10:.1f} KiB | "
            f"metadata {r.metadata_bytes / 2**10:.1f} KiB | full precision {r.full_precision_bytes / 2**10:.1f} KiB",
            f"  tokens per layer: sink {c['sink']} | key pages {c['key_pages']} | key qbuffer {c['key_qbuffer']} | "
            f"value pages {c['value_pages']} | value qbuffer {c['value_qbuffer']} | local {c['local']}",
        ]
    )


def divergence(tokens: list[int], reference: list[int]) -> int | None:
    """1-based position of the first new token that differs from ``reference`` (a shorter run differs where it
    ends), ``None`` when both are the same tokens."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return None if same == len(tokens) == len(reference) else same + 1


def table(results: list[Result], width: int = 0) -> str:
    """A Markdown table: method, bits/element, compression, cached tokens, tokens/s, where the text first differs
    from the first result's (the reference, fp16 by default) and the text on one line (cut to ``width`` characters
    if > 0). Below it, a note when the rows cached different token counts (their memory is then not like for like)
    or when the prompt is too short for a quantizing preset to fill its first page."""
    ref = results[0]
    lines = [
        f"| method | bits/element | compression | cached tokens | tokens/s | diverges from {ref.method} at | text |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        text = " ".join(r.text.split())
        if width > 0 and len(text) > width:
            text = text[: width - 1] + "…"
        at = divergence(r.tokens, ref.tokens)
        where = "(reference)" if r is ref else f"never ({len(r.tokens)} tokens)" if at is None else f"token {at}"
        lines.append(
            f"| {r.method} | {r.report.bits_per_element:.2f} | {r.report.compression:.2f}x | {r.report.tokens} | "
            f"{r.tokens_per_second:.1f} | {where} | {text.replace('|', '/')} |"
        )
    cached = {r.report.tokens for r in results}
    if len(cached) > 1:
        lines += [
            "",
            f"note: the rows cached {min(cached)} to {max(cached)} tokens (a generation ended early at "
            "end-of-sequence), so their bits/element are not measured at one length; compare rows with equal "
            "cached tokens.",
        ]
    short = [r for r in results if r.counts and _quantizes(r.method) and r.counts.get("key_pages", 0) == 0]
    if short:
        cfg = get_preset(short[0].method)
        lines += [
            "",
            f"note: the prompt is too short to fill a page: {', '.join(r.method for r in short)} quantized nothing "
            f"yet (pages start after {cfg.sink_tokens + cfg.group_size} tokens for {cfg.name}: sink "
            f"{cfg.sink_tokens} + page {cfg.group_size}; this run cached {short[0].report.tokens}), so every row "
            "is at 16 bits. Give a longer prompt (--prompt-file, stdin) to see the compression.",
        ]
    return "\n".join(lines)


def _quantizes(method: str) -> bool:
    cfg = get_preset(method)
    return cfg.quantizes_keys or cfg.quantizes_values


def preset_list(width: int = 100) -> str:
    """When pages start, and every preset with its description, for ``--help``."""
    kitty = PRESETS["kitty"]
    first = kitty.sink_tokens + kitty.group_size
    lines = textwrap.wrap(
        f"Nothing is quantized until the context passes the sink and one page ({first} tokens for kitty): short "
        "prompts stay at 16 bits; long ones (--prompt-file, stdin) show the compression.",
        width,
    )
    lines += [
        "",
        "presets (--method, --methods; add +field=value to change a field, e.g. kitty+key_range=fit):",
    ]
    for name in PRESETS:
        lines += textwrap.wrap(
            PRESETS[name].description, width, initial_indent=f"  {name:<24}", subsequent_indent=" " * 26
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kitty",
        description="Generate with a 2-bit Kitty KV cache (arXiv 2511.18643) and print what the cache holds. "
        + PATH_HELP,
        epilog=preset_list(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help="the prompt text; '-' reads it from stdin, as does a piped stdin with no prompt given",
    )
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from this UTF-8 text file")
    p.add_argument(
        "--method", default="kitty", help="cache preset (see below), optionally +field=value... (default: kitty)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="refuse a longer prompt (0: no limit) (default: the model's context, max_position_embeddings)",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (default: off)")
    cliargs.add_model(p)
    p.add_argument(
        "--compare", action="store_true", help="run several presets on the same prompt and print a table (default: off)"
    )
    p.add_argument(
        "--methods",
        default=None,
        help=f"presets for --compare, comma-separated, each optionally +field=value... (default: {DEFAULT_COMPARE})",
    )
    p.add_argument(
        "--width",
        type=int,
        default=0,
        help="cut each text in the --compare table to this many characters (default: 0, the whole text)",
    )
    cliargs.add_sampling(p)
    cliargs.add_backend(p)
    cliargs.add_dtype(p)
    cliargs.add_tp(p)
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the results (text, tokens, memory report) as JSON (default: off)",
    )
    return p


def _fail(message: str) -> int:
    cliargs.say_error(message)
    return 2


def utf8_text(arg: str) -> str:
    """A command-line argument as valid text: bytes that were not UTF-8 (kept by Python as surrogate escapes) become
    U+FFFD, so the tokenizer never sees an unencodable string."""
    return arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    with cliargs.closing_distributed():
        return run(build_parser().parse_args(argv))


def unreadable_prompt_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a prompt (``None``: a regular file, or a pipe such as ``<(command)``)."""
    if not path.exists():
        return "no such file"
    if path.is_dir():
        return "is a folder; give a text file"
    if path.is_file() or path.is_fifo():
        return None
    kind = "a character device" if path.is_char_device() else "a block device" if path.is_block_device() else "a socket"
    return f"is {kind}, not a text file"


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, ``--prompt-file`` or stdin (``-``, or piped with no prompt given), as valid
    text; ``ValueError`` says what is missing or unreadable."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise ValueError("give the prompt as text or as --prompt-file, not both")
        path = Path(args.prompt_file).expanduser()
        problem = unreadable_prompt_file(path)
        if problem:
            raise ValueError(f"--prompt-file {args.prompt_file!r}: {problem}")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"--prompt-file {args.prompt_file!r}: cannot read it ({e.strerror or e})") from e
        text = data.decode("utf-8", "replace")
        if text.encode("utf-8") != data:
            print(
                f"warning: {args.prompt_file} is not valid UTF-8; those bytes were replaced by U+FFFD", file=sys.stderr
            )
        return text
    if args.prompt == "-" or (args.prompt is None and sys.stdin is not None and not sys.stdin.isatty()):
        if tp_rank_and_size()[1] > 1:
            raise ValueError("under torchrun every rank needs the prompt: give it as text or as --prompt-file")
        buffer = getattr(sys.stdin, "buffer", None)
        data = buffer.read() if buffer is not None else None
        text = data.decode("utf-8", "replace") if data is not None else sys.stdin.read()
        if data is not None and text.encode("utf-8") != data:
            print("warning: stdin is not valid UTF-8; those bytes were replaced by U+FFFD", file=sys.stderr)
    elif args.prompt is None:
        raise ValueError("no prompt: give it as text, as --prompt-file PATH, or on stdin ('-' or a pipe)")
    else:
        text = args.prompt
    return utf8_text(text)


def run(args: argparse.Namespace) -> int:
    """The command for parsed ``args``; returns the exit status."""
    try:
        raw = args.prompt if args.prompt_file is None and args.prompt != "-" else None
        args.prompt = read_prompt(args)
        sampling = sampling_of(args)
    except ValueError as e:
        return _fail(str(e))
    if raw is not None and args.prompt != raw:
        print("warning: the prompt holds bytes that are not UTF-8; they were replaced by U+FFFD", file=sys.stderr)
    if not args.prompt.strip():
        return _fail("the prompt is empty")
    if args.width < 0:
        return _fail(f"--width must be >= 0 (0: the whole text), got {args.width}")
    if args.methods is not None and not args.compare:
        return _fail("--methods is for --compare; use --method for a single preset")
    try:
        cliargs.check_at_least_one(max_new_tokens=args.max_new_tokens)
        if args.compare:
            methods = cliargs.parse_methods(args.methods if args.methods is not None else DEFAULT_COMPARE)
        else:
            methods = [cliargs.check_method(args.method, "--method")]
        cliargs.check_model_path(args.model)
        cliargs.check_backend_env(args.backend)
        cliargs.check_at_least_zero(max_prompt_tokens=args.max_prompt_tokens)
        rank, world, tp = cliargs.tensor_parallel(args.tp)
    except ValueError as e:
        return _fail(str(e))
    if args.json is not None:
        problem = cliargs.writable_file(Path(args.json).expanduser(), "--json")
        if problem:
            return _fail(problem)

    from ..hf.models import check_tensor_parallel, load_model

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
    problem = prompt_too_long(model, tokenizer, args)
    if problem:
        return _fail(problem)
    for m in methods:
        try:
            make_cache(model, get_preset(m), backend=args.backend)  # the cache's own checks, before any generation
        except ValueError as e:
            return _fail(f"method {m!r} does not fit this model: {e}")
    out = print if rank == 0 else (lambda *a, **k: None)
    options = dict(
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        do_sample=not sampling.greedy,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
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
        out(table(results, args.width))
        out()
        for r in results:
            out(describe(r))
    if args.json is not None and rank == 0:
        return write_json(args.json, [r.as_dict() for r in results])
    return 0


def write_json(where: str, results: list[dict]) -> int:
    """Write ``results`` to ``--json``; if that fails after all (checked before the generation), the JSON goes to
    stdout instead, so the work is not lost. Returns the exit status."""
    text = json.dumps(results, indent=1)
    try:
        with open(Path(where).expanduser(), "w") as f:
            f.write(text)
    except OSError as e:
        print(text)
        return _fail(f"--json {where!r}: cannot write the results ({e.strerror or e}); they are printed above")
    return 0


def prompt_too_long(model, tokenizer, args: argparse.Namespace) -> str | None:
    """Why the prompt is refused (``None``: it is not): more tokens than ``--max-prompt-tokens`` (default: the
    model's context, ``max_position_embeddings``; 0: no limit), checked before any generation."""
    limit = args.max_prompt_tokens
    if limit is None:
        text = model.config.get_text_config(decoder=True)
        limit = getattr(text, "max_position_embeddings", None) or 0
    if not limit:
        return None
    n = encode_prompt(tokenizer, args.prompt, args.chat).shape[-1]
    if n <= limit:
        return None
    default = " (the model's context, max_position_embeddings)" if args.max_prompt_tokens is None else ""
    return (
        f"the prompt is {n:,} tokens, more than --max-prompt-tokens={limit}{default}: shorten it, or give a larger "
        "--max-prompt-tokens (0: no limit) to run it anyway"
    )


if __name__ == "__main__":
    sys.exit(main())
