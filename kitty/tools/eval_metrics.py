"""Evaluation metrics, each measured through :class:`kitty.KittyCache` exactly as generation uses it: decode
perplexity (the prompt attended in full precision, every later token scored by a decode step that reads the quantized
cache), greedy agreement with fp16, passkey retrieval, and the pack-time cost of a page.

The tables and plots are :mod:`kitty.tools.eval_report`; the command line, ``python -m kitty.eval``, is
:mod:`kitty.tools.eval`.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm as _tqdm

from ..core.config import PRESETS, KVQuantConfig, get_preset
from ..hf import generate as gen
from ..hf.generate import eos_ids, generate_fast, make_cache
from ..hf.models import tp_rank_and_size
from .prompts import TEXTS, encode_prompt, passkey_prompt, shipped_text

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # a passkey's relative depths in its prompt (0: first, 1: last)


def tqdm(*args, **kwargs):
    """A progress bar shown by rank 0 only: under tensor parallelism every rank runs the same loops."""
    kwargs.setdefault("disable", tp_rank_and_size()[0] != 0)
    return _tqdm(*args, **kwargs)


# ------------------------------------------------------------------------------------- decode perplexity


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, cfg: KVQuantConfig, prefill: int) -> torch.Tensor:
    """Teacher-forced NLL of ``ids[prefill:]``, scored one decode step at a time through a Kitty cache.

    ``ids``: ``[T]`` token ids. Returns ``[T - prefill]`` per-token NLL (nats): token ``prefill`` is scored from
    the prefill's last logits, every later token from a single-token decode step that reads the quantized cache.
    """
    if not 0 < prefill < ids.numel():
        raise ValueError(f"prefill must be in (0, {ids.numel()}), got {prefill}")
    ids = ids.to(model.device)
    cache = make_cache(model, cfg)
    logits = gen.prefill(model, ids[None, :prefill], cache)
    nll = []
    for t in range(prefill, ids.numel()):
        nll.append(F.cross_entropy(logits.float()[None], ids[t : t + 1]))
        if t + 1 < ids.numel():
            logits = gen.decode_one_token(model, cache, ids[t])
    return torch.stack(nll)


def text_windows(
    tokenizer, names=TEXTS, prefill: int = 1024, scored: int = 256, per_text: int = 2, with_names: bool = False
) -> list:
    """Non-overlapping windows of ``prefill + scored`` tokens from the texts shipped in ``kitty/texts/``.

    Returns ``[T]`` id tensors, or ``(text name, ids)`` pairs with ``with_names``.
    """
    windows = []
    for name in names:
        ids = tokenizer(shipped_text(name), return_tensors="pt").input_ids[0]
        size = prefill + scored
        n = min(per_text, ids.numel() // size)
        if n == 0:
            raise ValueError(f"{name} has {ids.numel()} tokens, fewer than prefill + scored = {size}")
        windows += [(name, ids[i * size : (i + 1) * size]) for i in range(n)]
    return windows if with_names else [w for _, w in windows]


@dataclass
class PerplexityResult:
    method: str
    nll: float
    ppl: float
    ppl_change: float  # relative to fp16 on the same text(s), e.g. 0.10 = +10%
    bits_per_element: float  # of the cache after the run, one window (includes full-precision parts)
    tokens_scored: int
    text: str = "all"  # "all" or the shipped text the windows came from


_WORKER: dict = {}


def _worker_init(model_name: str | None) -> None:
    torch.set_num_threads(1)
    from ..hf.models import load_model

    _WORKER["model"] = load_model(model_name)[0]


def _worker_nll(cfg: KVQuantConfig, windows: list[torch.Tensor], prefill: int) -> list[torch.Tensor]:
    return [decode_nll(_WORKER["model"], w, cfg, prefill) for w in windows]


def perplexity_table(
    model, tokenizer, methods, prefill=1024, scored=256, per_text=2, names=TEXTS, by_text: bool = False, jobs: int = 1
) -> list[PerplexityResult]:
    """Decode-mode perplexity of each method (preset name or :class:`KVQuantConfig`) on the shipped texts, with the
    change against ``fp16``; ``fp16`` is always evaluated first.

    ``by_text``: after the ``text="all"`` rows, one row per (text, method), its change against fp16 on that text.
    ``jobs > 1``: methods run in that many worker processes (each loads the model from
    ``model.config._name_or_path`` with one torch thread; set ``OMP_WAIT_POLICY=PASSIVE`` on small CPUs).
    """
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    named = text_windows(tokenizer, names, prefill, scored, per_text, with_names=True)
    windows = [w for _, w in named]
    cfgs = [get_preset(m) if isinstance(m, str) else m for m in methods]
    cfgs = [get_preset("fp16")] + [c for c in cfgs if c.name != "fp16"]
    if jobs == 1:
        with tqdm(total=len(cfgs) * len(windows), desc="perplexity", unit="window") as bar:
            nlls = []
            for c in cfgs:
                nlls.append([])
                for w in windows:
                    bar.set_postfix_str(c.name)
                    nlls[-1].append(decode_nll(model, w, c, prefill))
                    bar.update()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(
            jobs, mp_context=ctx, initializer=_worker_init, initargs=(model.config._name_or_path,)
        ) as pool:
            futures = [pool.submit(_worker_nll, c, windows, prefill) for c in cfgs]
            nlls = [f.result() for f in tqdm(futures, desc=f"perplexity ({jobs} processes)")]
    groups = [("all", list(range(len(windows))))]
    if by_text:
        groups += [(Path(t).stem, [i for i, (n, _) in enumerate(named) if n == t]) for t in names]
    results = []
    for text, idx in groups:
        rows = []
        for c, per_window in zip(cfgs, nlls):
            nll = torch.cat([per_window[i] for i in idx]).mean().item()
            rows.append(
                PerplexityResult(
                    c.name, nll, math.exp(nll), 0.0, _bits_after(model, c, prefill + scored), len(idx) * scored, text
                )
            )
        for r in rows:
            r.ppl_change = r.ppl / rows[0].ppl - 1
        results += rows
    return results


# ------------------------------------------------------------------------------------------- pack-time cost


@dataclass
class PackCost:
    method: str
    channel_selection: str
    key_range: str
    value_range: str
    us_per_key_page: float  # one page of G tokens x D channels, one KV head (median, torch on this CPU)
    us_per_value_page: float
    vs_paper_rule: float  # (key + value page time) / the same with magnitude selection and min-max ranges


def pack_cost_table(
    methods,
    head_dim: int = 64,
    heads: int = 3,
    pages: int = 8,
    repeats: int = 7,
    dtype=torch.bfloat16,
    device: str | torch.device = "cpu",
) -> list[PackCost]:
    """Time to pack ``pages x heads`` pages per call with the torch quantizers, per page, for each method
    (on ``device``; CUDA calls are synchronized before the clock stops).

    Decode attention never sees the difference (it reads the same page layout); this is the one-off cost of
    choosing channels and ranges when a qbuffer fills, once per ``G`` tokens.
    """
    from ..core.quant import quantize_key_page, quantize_value_page

    g = torch.Generator().manual_seed(0)
    cfgs = [get_preset(m) if isinstance(m, str) else m for m in methods]
    G = cfgs[0].group_size
    k = (torch.randn(pages, heads, G, head_dim, generator=g) * torch.linspace(0.2, 4, head_dim)).to(device, dtype)
    v = torch.randn(pages, heads, G, head_dim, generator=g).to(device, dtype)
    q = (torch.rand(pages, heads, head_dim, generator=g) + 0.5).to(device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def median_us(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return 1e6 * sorted(times)[len(times) // 2] / (pages * heads)

    rows = []
    for c in tqdm(cfgs, desc="pack cost"):
        c = c.with_(boost_profile=None) if c.boost_profile else c  # a profile's average layer: the uniform budget
        tk = median_us(lambda: quantize_key_page(k, c, query_scale=q))
        tv = median_us(lambda: quantize_value_page(v, c))
        plain = c.with_(channel_selection="magnitude", key_range="minmax", value_range="minmax")
        if plain == c:  # the paper rule itself: its own time, exactly 1 (two timings would differ by noise)
            base = tk + tv
        else:
            base = median_us(lambda: quantize_key_page(k, plain)) + median_us(lambda: quantize_value_page(v, plain))
        rows.append(PackCost(c.name, c.channel_selection, c.key_range, c.value_range, tk, tv, (tk + tv) / base))
    return rows


def _bits_after(model, cfg, n_tokens: int) -> float:
    from ..core.memory import analytic_report
    from ..hf.models import kv_dims

    num_layers, num_kv_heads, head_dim = kv_dims(model.config)
    rep = analytic_report(cfg, n_tokens, head_dim, num_kv_heads, num_layers, model.dtype.itemsize)
    return rep.bits_per_element


# -------------------------------------------------------------------------------------- greedy agreement


def agreement_prompts(tokenizer, n: int = 6, length: int = 512, names=TEXTS) -> list[str]:
    """``n`` plain-text prompts of about ``length`` tokens cut from the texts shipped in ``kitty/texts/``
    (alternating texts).

    Long enough that decode steps read quantized pages (a short chat question never leaves the full-precision
    sink, qbuffer and local window, so it would agree with fp16 trivially).
    """
    streams = [tokenizer(shipped_text(name)).input_ids for name in names]
    prompts = []
    for i in range(n):
        ids = streams[i % len(streams)]
        start = (i // len(streams)) * length
        if start + length > len(ids):
            raise ValueError(f"{names[i % len(names)]} is too short for {n} prompts of {length} tokens")
        prompts.append(tokenizer.decode(ids[start : start + length]))
    return prompts


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, cfg: KVQuantConfig, max_new_tokens: int, chat: bool = False) -> list[int]:
    """Greedy continuation of ``prompt`` (plain text, or wrapped in the chat template) through a Kitty cache:
    exactly ``max_new_tokens`` tokens (end-of-sequence tokens are never picked, like ``min_new_tokens``)."""
    ids = encode_prompt(tokenizer, prompt, chat)
    eos = eos_ids(model, tokenizer)
    return generate_fast(model, ids, cfg, max_new_tokens, eos=eos, min_new_tokens=max_new_tokens)  # decode_path


@dataclass
class AgreementResult:
    method: str
    mean_identical_prefix: float  # tokens before the first difference from fp16
    match_rate: float  # share of positions with the same token as fp16


def agreement_table(model, tokenizer, methods, prompts: list[str], max_new_tokens: int = 64) -> list[AgreementResult]:
    """Greedy agreement of each preset with ``fp16`` over a prompt set (see :func:`agreement_prompts`)."""
    ref = [greedy(model, tokenizer, p, PRESETS["fp16"], max_new_tokens) for p in tqdm(prompts, desc="agreement fp16")]
    results = []
    bar = tqdm(total=len(methods) * len(prompts), desc="agreement", unit="prompt")
    for m in methods:
        cfg = get_preset(m)
        bar.set_postfix_str(cfg.name)
        prefixes, matches = [], []
        for p, r in zip(prompts, ref):
            out = greedy(model, tokenizer, p, cfg, max_new_tokens)
            bar.update()
            same = [a == b for a, b in zip(out, r)]
            prefixes.append(same.index(False) if False in same else len(same))
            matches.append(sum(same) / len(same))
        results.append(AgreementResult(cfg.name, sum(prefixes) / len(prefixes), sum(matches) / len(matches)))
    bar.close()
    return results


# ---------------------------------------------------------------------------------------------- passkey


def passkey_answer(model, tokenizer, prompt: str, cfg: KVQuantConfig, max_new_tokens: int = 8) -> str:
    """Greedy answer (up to ``max_new_tokens``, ending at end-of-sequence) to a plain ``prompt`` through a Kitty
    cache under ``cfg`` (prompts: :func:`kitty.tools.prompts.passkey_prompt`)."""
    ids = encode_prompt(tokenizer, prompt)
    new = generate_fast(model, ids, cfg, max_new_tokens, eos=eos_ids(model, tokenizer))  # decode_path
    return tokenizer.decode(new, skip_special_tokens=True)


@dataclass
class PasskeyResult:
    method: str
    length: int
    depth: float
    solved: int  # prompts answered correctly, among those fp16 solves
    total: int  # prompts fp16 solves


def passkey_cases(
    lengths=(1024, 2048, 4096), depths=DEPTHS, trials: int = 2, seed: int = 0
) -> list[tuple[int, float, int]]:
    """The ``(length, depth, key)`` prompts :func:`passkey_table` asks with the same arguments: ``trials`` random
    5-digit keys per (length, depth), drawn in that order from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [(n, d, rng.randint(10000, 99999)) for n in lengths for d in depths for _ in range(trials)]


def passkey_table(
    model, tokenizer, methods, lengths=(1024, 2048, 4096), depths=DEPTHS, trials=2, seed=0
) -> list[PasskeyResult]:
    """Passkey accuracy per (length, depth) on the prompts that ``fp16`` solves."""
    cases = passkey_cases(lengths, depths, trials, seed)
    prompts = {c: passkey_prompt(tokenizer, c[0], c[1], c[2]) for c in cases}
    fp16_ok = [
        c
        for c in tqdm(cases, desc="passkey fp16")
        if str(c[2]) in passkey_answer(model, tokenizer, prompts[c], PRESETS["fp16"])
    ]
    results = []
    bar = tqdm(total=len(methods) * len(fp16_ok), desc="passkey", unit="prompt")
    for m in methods:
        cfg = get_preset(m)
        bar.set_postfix_str(cfg.name)
        ok = {}
        for c in fp16_ok:
            ok[c] = str(c[2]) in passkey_answer(model, tokenizer, prompts[c], cfg)
            bar.update()
        for n in lengths:
            for d in depths:
                cs = [c for c in fp16_ok if c[0] == n and c[1] == d]
                results.append(PasskeyResult(cfg.name, n, d, sum(ok[c] for c in cs), len(cs)))
    bar.close()
    return results
