"""The passkey margin of ``benchmarks/passkey_margin.py``: the smallest step-by-step logit gap of an answer, up to the
token that completes the key, on a tiny random model (whose greedy tokens a digit-per-token decoder turns into a
"key")."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch
from fixtures import tiny_model

answer_margin = runpy.run_path(str(Path(__file__).resolve().parent.parent / "benchmarks" / "passkey_margin.py"))[
    "answer_margin"
]


class Digits:
    """Decodes each token id as its last decimal digit."""

    def decode(self, ids, **kw) -> str:
        return "".join(str(int(i) % 10) for i in ids)


def test_margin_is_the_smallest_greedy_gap_up_to_the_key() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    answer, gaps, full = [], [], ids
    with torch.no_grad():
        for _ in range(6):  # greedy, one forward per step: each step's chosen-minus-runner-up gap
            top2 = model(full).logits[0, -1].float().topk(2)
            answer.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            full = torch.cat([full, top2.indices[:1][None]], 1)
    key = int("1" + Digits().decode(answer[:4]))  # a key the first 4 tokens complete only with a leading 1 ...
    assert answer_margin(model, Digits(), ids, answer, key) is None  # ... so the answer never holds it
    key = int(Digits().decode(answer[:4]).lstrip("0") or "0")
    digits = Digits().decode(answer)
    end = next(i + 1 for i in range(len(answer)) if str(key) in digits[: i + 1])
    margin = answer_margin(model, Digits(), ids, answer, key)
    assert margin is not None and abs(margin - min(gaps[:end])) < 1e-3
