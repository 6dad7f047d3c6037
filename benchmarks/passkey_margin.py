"""How narrowly fp16 itself solves each passkey prompt: the logit margin of its own greedy answer (a diagnostic for
``docs/PRESETS_RESEARCH.md``).

Each prompt of the eval's passkey set (``kitty.tools.eval.passkey_table``'s cases, seed 0) is answered greedily with
a full-precision cache; the answer's tokens up to the one that completes the key are then scored in one forward pass
of prompt + answer. A prompt's **margin** is the smallest, over those of its tokens that write digits, of the chosen
token's logit minus the best other token's (nats): how far the closest step of fp16's own retrieval was from going
another way. A cache whose error moves some logit by about that much can lose the prompt.

``--stores`` (``benchmarks/presets_research.py`` passkey stores, ``passkey.json``): each prompt is marked with every
method of those stores that lost it while fp16 solved it.

    python -m benchmarks.passkey_margin --model gemma-3-270m --stores /tmp/r36/gemma_pk_Q1/passkey.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kitty.core.config import PRESETS
from kitty.hf.generate import generate_fast
from kitty.hf.models import load_model
from kitty.tools.eval_metrics import eos_ids, passkey_cases
from kitty.tools.prompts import encode_prompt, passkey_prompt


def answer_margin(model, tokenizer, ids: torch.Tensor, answer: list[int], key: int) -> float | None:
    """The smallest logit margin (chosen minus the best other) over ``answer``'s tokens after ``ids`` ``[1, T]`` that
    write digits, up to the one that completes ``key`` in the decoded text (the words before the key, " the" or not,
    do not decide the retrieval); ``None`` if the answer never holds the key."""
    end = next((i + 1 for i in range(len(answer)) if str(key) in tokenizer.decode(answer[: i + 1])), None)
    if end is None:
        return None
    full = torch.cat([ids, torch.tensor([answer[:end]])], 1)
    with torch.no_grad():
        logits = model(full).logits[0, ids.shape[1] - 1 : full.shape[1] - 1].float()  # [end, vocab]
    chosen = torch.tensor(answer[:end])
    top = logits.gather(1, chosen[:, None])[:, 0]
    other = logits.scatter(1, chosen[:, None], float("-inf")).amax(1)
    digits = torch.tensor([any(ch.isdigit() for ch in tokenizer.decode(answer[i : i + 1])) for i in range(end)])
    return float((top - other)[digits].min())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for load_model: a packaged model's name, a folder or a hub id")
    p.add_argument("--stores", default="", help="comma-separated passkey.json stores whose lost prompts are marked")
    p.add_argument("--lengths", default="1024,2048,4096")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(a.model)
    cases = passkey_cases([int(n) for n in a.lengths.split(",")])  # kitty.tools.eval.passkey_table's
    lost: dict[tuple, dict[str, None]] = {}
    for path in filter(None, a.stores.split(",")):
        store = json.loads(Path(path).read_text())
        for m, solved in store.items():
            if m.startswith("_") or m == "fp16":
                continue
            for c, ok, ok16 in zip(store["_cases"], solved, store["fp16"]):
                if ok16 and not ok:
                    lost.setdefault(tuple(c), {})[m] = None  # a dict: each method once, in order
    rows = []
    for c in tqdm(cases, desc="passkey margins"):
        ids = encode_prompt(tok, passkey_prompt(tok, *c))
        answer = generate_fast(model, ids, PRESETS["fp16"], 8, eos=eos_ids(model, tok))
        rows.append((answer_margin(model, tok, ids, answer, c[2]), c, tok.decode(answer, skip_special_tokens=True)))
    solved = sorted((r for r in rows if r[0] is not None), key=lambda r: r[0])
    print(f"fp16 solves {len(solved)} of {len(rows)}; by margin, smallest first:\n")
    print("| rank | (length, depth, key) | fp16 margin (nats) | fp16 answer | lost by |")
    print("|---|---|---|---|---|")
    for i, (margin, c, text) in enumerate(solved, 1):
        print(f"| {i} | {tuple(c)} | {margin:.2f} | {text!r} | {', '.join(lost.get(tuple(c), [])) or '—'} |")


if __name__ == "__main__":
    main()
