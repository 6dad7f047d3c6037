"""Evaluation command line: decode perplexity, greedy agreement with fp16, passkey retrieval and pack cost per preset.

``python -m kitty.eval [--model NAME] [--methods a,b,...] [--quick]`` writes a markdown table, a CSV and plots
into ``./kitty-eval/`` under the working folder (or ``--out``; ``--out assets`` refreshes the files the README
cites). Every number is measured through :class:`kitty.KittyCache` exactly as generation uses it: the prompt
(prefill) is attended in full precision, every later token reads the quantized cache.

``torchrun --nproc-per-node N -m kitty.eval --model PATH ...`` shards the model over N ranks (``tp_plan="auto"``,
or ``--tp``); every rank runs the same evaluation on its KV heads, rank 0 alone shows progress and writes results.

The metrics live in :mod:`kitty.tools.eval_metrics`, the tables and plots in :mod:`kitty.tools.eval_report`; both are
re-exported here, so ``from kitty.tools.eval import decode_nll`` keeps working.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..core.config import PRESETS, KVQuantConfig, get_preset
from ..hf import generate as gen
from ..hf.generate import make_cache
from . import cliargs
from .demo import DEFAULT_METHODS
from .eval_metrics import (
    DEPTHS,
    AgreementResult,
    PackCost,
    PasskeyResult,
    PerplexityResult,
    agreement_prompts,
    agreement_table,
    decode_nll,
    greedy,
    pack_cost_table,
    passkey_answer,
    passkey_cases,
    passkey_table,
    perplexity_table,
    text_windows,
)
from .eval_report import markdown_table, plot_pareto, plot_passkey, ppl_markdown, write_csv
from .prompts import TEXTS

__all__ = [  # the command line, and the metrics and report names that callers import from here
    "DEPTHS",
    "PRESETS",
    "TEXTS",
    "AgreementResult",
    "PackCost",
    "PasskeyResult",
    "PerplexityResult",
    "agreement_prompts",
    "agreement_table",
    "build_parser",
    "decode_nll",
    "greedy",
    "main",
    "markdown_table",
    "measure_step",
    "pack_cost_table",
    "passkey_answer",
    "passkey_cases",
    "passkey_table",
    "perplexity_table",
    "plot_passkey",
    "plot_pareto",
    "ppl_markdown",
    "text_windows",
    "write_csv",
]

DEFAULT_OUT = "kitty-eval"  # relative to the working folder: a run never overwrites the committed assets/ unless asked

PARTS = ("ppl", "agreement", "passkey", "pack")
QUICK_METHODS = DEFAULT_METHODS  # --quick without --methods: the demo's three columns
QUICK = dict(prefill=160, scored=32, windows_per_text=1, agreement=(2, 200, 16), lengths=(256,), depths=(0.5,))
AGREEMENT_LENGTH = 512  # tokens per agreement prompt (long enough that decode steps read quantized pages)
PASSKEY_ANSWER_TOKENS = 8  # passkey_answer's max_new_tokens
TAG_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m kitty.eval``, each with its help and default."""
    p = argparse.ArgumentParser(
        prog="python -m kitty.eval",
        description=__doc__.splitlines()[0],
        epilog=f"parts (--skip): ppl = decode perplexity, agreement = greedy agreement with fp16, passkey = passkey "
        f"retrieval, pack = pack-time cost per page. presets: {', '.join(PRESETS)}.",
    )
    cliargs.add_model(p)
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated presets, each optionally +field=value... (default: every preset that fits the model)",
    )
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for the markdown, CSV and plots (default: ./{DEFAULT_OUT})"
    )
    p.add_argument("--prefill", type=int, default=1024, help="prompt tokens per perplexity window (default: 1024)")
    p.add_argument("--scored", type=int, default=256, help="decode-scored tokens per perplexity window (default: 256)")
    p.add_argument("--windows-per-text", type=int, default=2, help="perplexity windows per shipped text (default: 2)")
    p.add_argument(
        "--passkey-lengths",
        default="1024,2048,4096",
        help="comma-separated passkey prompt lengths in tokens (default: 1024,2048,4096)",
    )
    p.add_argument("--agreement-prompts", type=int, default=6, help="prompts for greedy agreement (default: 6)")
    p.add_argument("--agreement-tokens", type=int, default=64, help="greedy tokens per agreement prompt (default: 64)")
    p.add_argument("--passkey-trials", type=int, default=2, help="passkey prompts per (length, depth) (default: 2)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run for CI (default: off): prefill {QUICK['prefill']}, {QUICK['scored']} scored tokens, one "
        "window per text, 2 agreement prompts of 200 tokens x 16 tokens, one 256-token passkey per method, and "
        f"without --methods only {','.join(QUICK_METHODS)}; "
        "overrides the size flags above",
    )
    p.add_argument("--skip", default="", help=f"comma-separated parts to skip, from {','.join(PARTS)} (default: none)")
    p.add_argument(
        "--jobs", type=int, default=1, help="worker processes for perplexity, one torch thread each (default: 1)"
    )
    p.add_argument("--tag", default=None, help="suffix of the output files (default: full, or quick with --quick)")
    cliargs.add_tp(p)
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    with cliargs.closing_distributed():
        _run(a)


def _fail(message: str) -> None:
    """Exit with status 2 and ``message`` (said once, by rank 0: every rank meets the same error)."""
    cliargs.say_error(message)
    raise SystemExit(2)


def _check_flags(a: argparse.Namespace) -> tuple[list[str] | None, set[str]]:
    """Every flag that can be checked without the model, each refused with a message naming it: the methods (or
    ``None`` for every preset that fits), the parts to skip; ``a.passkey_lengths`` becomes a tuple of ints."""
    try:
        methods = None if a.methods is None else cliargs.parse_methods(a.methods)
        skip = {s.strip() for s in a.skip.split(",")} - {""}
        if skip - set(PARTS):
            raise ValueError(f"--skip takes parts from {PARTS}, got {sorted(skip - set(PARTS))}")
        if skip == set(PARTS):
            raise ValueError(f"--skip {a.skip!r} skips every part: nothing to run")
        cliargs.check_at_least_one(
            prefill=a.prefill,
            scored=a.scored,
            windows_per_text=a.windows_per_text,
            agreement_prompts=a.agreement_prompts,
            agreement_tokens=a.agreement_tokens,
            passkey_trials=a.passkey_trials,
            jobs=a.jobs,
        )
        a.passkey_lengths = cliargs.parse_numbers(a.passkey_lengths, "--passkey-lengths")
        if min(a.passkey_lengths) < 1:
            raise ValueError(f"--passkey-lengths must be >= 1 each, got {a.passkey_lengths}")
        if a.tag is not None and (not a.tag or set(a.tag) - TAG_CHARS):
            raise ValueError(f"--tag must be letters, digits, '.', '_' or '-' (it names files), got {a.tag!r}")
        cliargs.check_model_path(a.model)
    except ValueError as e:
        _fail(str(e))
    problem = cliargs.writable_folder(Path(a.out), "--out")
    if problem:
        _fail(problem)
    if a.quick:
        a.prefill, a.scored, a.windows_per_text = QUICK["prefill"], QUICK["scored"], QUICK["windows_per_text"]
    return methods, skip


def measure_step(model, cfg: KVQuantConfig, context: int = 192, steps: int = 3) -> tuple[float, float]:
    """Rough ``(seconds per decode step, seconds per prompt token)`` of ``model`` through a cache under ``cfg`` on
    this machine: one prefill of ``context`` tokens, then ``steps`` decode steps (the runtime estimate)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = (torch.arange(context) * 7919 % vocab).to(model.device)
    cache = make_cache(model, cfg)
    start = time.perf_counter()
    gen.prefill(model, ids[None], cache)
    mid = time.perf_counter()
    for i in range(steps):
        gen.decode_one_token(model, cache, ids[i])
    return (time.perf_counter() - mid) / steps, (mid - start) / context


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 90
        else f"{seconds / 60:.0f} min"
        if seconds < 5400
        else f"{seconds / 3600:.1f} h"
    )


def _run(a: argparse.Namespace) -> None:
    methods, skip = _check_flags(a)
    from ..hf.models import check_tensor_parallel, kv_dims, load_model

    try:
        rank, world, tp = cliargs.tensor_parallel(a.tp)
    except ValueError as e:
        _fail(str(e))
    if tp and a.jobs > 1:
        _fail("--jobs > 1 starts unsharded worker processes; under tensor parallelism use --jobs 1")
    if tp:
        try:
            check_tensor_parallel(a.model, world)  # before the weights load
        except ValueError as e:
            _fail(f"cannot shard the model over {world} ranks: {e}")
    try:
        model, tokenizer = load_model(a.model, tp_plan="auto" if tp else None)
    except (OSError, ValueError, RuntimeError) as e:
        _fail(f"--model {a.model!r}: cannot load the model: {e}")
    text = model.config.get_text_config(decoder=True)
    num_layers = kv_dims(model.config)[0]
    if methods is None and a.quick:  # the CI run: the demo's three columns (fp16, the fair baseline, kitty)
        methods = list(QUICK_METHODS)
    if methods is None:  # layer-adaptive presets are calibrated for one model: keep those that fit this one
        methods = [
            m for m in PRESETS if PRESETS[m].boost_profile is None or len(PRESETS[m].boost_profile) == num_layers
        ]
    for m in methods:  # the cache's own checks (boost_profile length, head_dim, ...) before any work
        try:
            make_cache(model, get_preset(m))
        except ValueError as e:
            _fail(f"--methods: {m!r} does not fit this model: {e}")
    others = [m for m in methods if get_preset(m).name != "fp16"]
    pack_methods = [m for m in methods if get_preset(m).quantizes_keys]
    runs = {
        "ppl": True,
        "agreement": bool(others),
        "passkey": bool(others),
        "pack": bool(pack_methods),
    }
    parts = [p for p in PARTS if p not in skip and runs[p]]
    for p in PARTS:
        if p not in skip and not runs[p] and rank == 0:
            print(f"note: {p} is skipped: it needs a method other than fp16{' with quantized keys' * (p == 'pack')}")
    if not parts:
        _fail("nothing to run with these --methods and --skip")

    # sizes that depend on the tokenizer and the model, checked before any part runs
    n_prompts, length, n_new = (
        QUICK["agreement"] if a.quick else (a.agreement_prompts, AGREEMENT_LENGTH, a.agreement_tokens)
    )
    lengths = QUICK["lengths"] if a.quick else a.passkey_lengths
    depths = QUICK["depths"] if a.quick else DEPTHS
    trials = 1 if a.quick else a.passkey_trials
    max_pos = getattr(text, "max_position_embeddings", None)
    windows = prompts = None
    if "ppl" in parts:
        try:
            windows = text_windows(tokenizer, TEXTS, a.prefill, a.scored, a.windows_per_text)
        except ValueError as e:
            _fail(f"--prefill {a.prefill} + --scored {a.scored} do not fit the shipped texts: {e}")
        if max_pos and a.prefill + a.scored > max_pos:
            _fail(f"--prefill + --scored = {a.prefill + a.scored} exceeds the model's {max_pos} positions")
    if "agreement" in parts:
        try:
            prompts = agreement_prompts(tokenizer, n_prompts, length)
        except ValueError as e:
            _fail(f"--agreement-prompts {n_prompts}: {e}")
    if "passkey" in parts and max_pos and max(lengths) + PASSKEY_ANSWER_TOKENS > max_pos:
        _fail(f"--passkey-lengths {max(lengths)} exceeds the model's {max_pos} positions")

    out = Path(a.out)
    tag = a.tag or ("quick" if a.quick else "full")
    # the estimate: each configuration's own step and prompt-token cost (a fitted or oracle preset packs far slower
    # than plain kitty), measured just now, times the work each part gives every configuration
    configs = ["fp16", *others]
    cost = {m: measure_step(model, get_preset(m)) for m in configs}
    per_cfg: dict[str, tuple[float, float, float]] = {}  # part -> (decode steps, prompt tokens, share) per config
    if "ppl" in parts:
        per_cfg["ppl"] = (len(windows) * a.scored, len(windows) * a.prefill, 1 / min(a.jobs, len(configs)))
    if "agreement" in parts:
        per_cfg["agreement"] = (n_prompts * n_new, n_prompts * length, 1.0)
    if "passkey" in parts:
        cases = len(lengths) * len(depths) * trials
        per_cfg["passkey"] = (cases * PASSKEY_ANSWER_TOKENS, trials * len(depths) * sum(lengths), 1.0)
    part_s = {
        part: share * sum(n_steps * cost[m][0] + n_tokens * cost[m][1] for m in configs)
        for part, (n_steps, n_tokens, share) in per_cfg.items()
    }
    if "pack" in parts:  # pack_cost_table: repeats x a key page and a value page per method, plus warm-up
        part_s["pack"] = len(pack_methods) * (4 if a.quick else 8) * 0.05
    steps = sum(n * share * len(configs) for n, _, share in per_cfg.values())
    tokens = sum(n * share * len(configs) for _, n, share in per_cfg.values())
    step_s = sum(c[0] for c in cost.values()) / len(cost)
    token_s = sum(c[1] for c in cost.values()) / len(cost)
    t0 = time.time()
    if rank == 0:
        print(
            f"parts: {', '.join(parts)}; {len(methods)} methods. Estimated runtime: about "
            f"{_duration(sum(part_s.values()))} ("
            + ", ".join(f"{p} {_duration(v)}" for p, v in part_s.items())
            + f"; {steps:.0f} decode steps at {1e3 * step_s:.0f} ms and {tokens:.0f} prompt tokens at "
            f"{1e3 * token_s:.1f} ms on average, each method timed just now; longer contexts run slower)",
            flush=True,
        )
    report = [f"# Kitty evaluation ({tag})\n", f"model: {a.model or 'SmolLM2-135M-Instruct (embedded)'}\n"]
    wrote: list[Path] = []

    def save(name: str, write) -> None:
        """Write one result file now (rank 0), so that a later failure keeps it; and the report so far."""
        if rank == 0:
            write(out / name)
            (out / f"eval_{tag}.md").write_text("\n".join(report))
            wrote.extend(p for p in (out / name, out / f"eval_{tag}.md") if p not in wrote)

    from tqdm import tqdm

    # the parts that remain, with the estimate of what is left (the inner bars count prompts within a part)
    progress = tqdm(total=len(parts), desc="eval parts", unit="part", disable=rank != 0, position=0)

    def part_done(part: str) -> None:
        left = parts[parts.index(part) + 1 :]
        progress.update()
        progress.set_postfix_str(
            f"left: {', '.join(left)} (~{_duration(sum(part_s.get(p, 0.0) for p in left))})" if left else "done"
        )

    if "ppl" in parts:
        ppl = perplexity_table(
            model, tokenizer, methods, a.prefill, a.scored, a.windows_per_text, by_text=True, jobs=a.jobs
        )
        report += [
            f"## Decode perplexity (prefill {a.prefill}, {a.scored} scored tokens per window, "
            f"{a.windows_per_text} windows per text)\n",
            ppl_markdown(ppl),
            "",
        ]
        save(f"eval_ppl_{tag}.csv", lambda p: write_csv(ppl, p))
        save(f"eval_pareto_{tag}.png", lambda p: plot_pareto([r for r in ppl if r.text == "all"], p))
        part_done("ppl")
    if "agreement" in parts:
        agr = agreement_table(model, tokenizer, others, prompts, n_new)
        report += [
            f"## Greedy agreement with fp16 ({n_prompts} plain-text prompts of {length} tokens from kitty/texts/, "
            f"{n_new} new tokens)\n",
            markdown_table(agr),
            "",
        ]
        save(f"eval_agreement_{tag}.csv", lambda p: write_csv(agr, p))
        part_done("agreement")
    if "passkey" in parts:
        pk = passkey_table(model, tokenizer, others, lengths, depths, trials)
        totals = {}
        for r in pk:
            s, t = totals.get(r.method, (0, 0))
            totals[r.method] = (s + r.solved, t + r.total)
        report += ["## Passkey (plain form, prompts fp16 solves)\n", "| method | solved |", "|---|---|"]
        report += [f"| {m} | {s}/{t} |" for m, (s, t) in totals.items()] + [""]
        save(f"eval_passkey_{tag}.csv", lambda p: write_csv(pk, p))
        save(f"eval_passkey_{tag}.png", lambda p: plot_passkey(pk, p))
        part_done("passkey")
    if "pack" in parts:
        pack = pack_cost_table(pack_methods, repeats=3 if a.quick else 7)
        report += [
            "## Pack-time cost per page (torch quantizers on this CPU; decode attention is unchanged)\n",
            markdown_table(pack, ".1f"),
            "",
        ]
        save(f"eval_pack_{tag}.csv", lambda p: write_csv(pack, p))
        part_done("pack")
    progress.close()
    where = f" per rank, {world} tensor-parallel ranks" if tp else ""
    report.append(f"_{time.time() - t0:.0f} s on {torch.get_num_threads()} CPU threads{where}_\n")
    if rank == 0:
        text = "\n".join(report)
        (out / f"eval_{tag}.md").write_text(text)
        print(text)
        for path in wrote:
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
