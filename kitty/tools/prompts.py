"""Prompts in one place: the shipped texts, the demo's examples, the passkey haystack and prompt preparation.

- :data:`TEXTS` / :func:`shipped_text`: the texts shipped as package data in ``kitty/texts/`` (``essay.txt``,
  ``python_reference.txt``; sources and licenses in ``kitty/texts/SOURCES.md``) that eval, calibration and the demo
  read, found through :mod:`importlib.resources` so that a wheel or ``pip install .`` has them too;
- :func:`passkey_text` / :func:`passkey_prompt`: a pass key hidden in filler, sized by filler repeats (the demo's
  example) or by a token budget (the evaluation);
- :func:`example_prompts`: the demo's example gallery;
- :func:`prepare_prompt`: the demo's checks (empty, over-long), chat template and truncation with a visible note;
  :func:`encode_prompt`: the plain tokenization the CLI and the evaluation use.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

TEXTS = ("essay.txt", "python_reference.txt")  # the shipped texts, in kitty/texts/

MAX_PROMPT_TOKENS = 2048  # longer prompts keep their last 2048 tokens: prefill stays a few seconds per column
MAX_PROMPT_CHARS = 100_000  # guard before tokenizing (about 20k tokens of English)
EMPTY_PROMPT_MESSAGE = "The prompt is empty: type a question or pick an example below, then press Generate."


class PromptError(ValueError):
    """A prompt the demo refuses, with a message meant for the user."""


# ------------------------------------------------------------------------------------------- shipped texts


def shipped_text(name: str) -> str:
    """The text ``name`` (one of :data:`TEXTS`) shipped in the installed package's ``kitty/texts/``."""
    if name not in TEXTS:
        raise ValueError(f"name must be one of the shipped texts {TEXTS}, got {name!r}")
    return (resources.files("kitty") / "texts" / name).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------- passkey

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_HEAD = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
PASSKEY_TAIL = "\nWhat is the pass key? The pass key is"


def _needle(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def passkey_text(key: int, before: int, after: int) -> str:
    """The pass key ``key`` between ``before`` and ``after`` repeats of :data:`FILLER`, in plain form.

    Ends with "The pass key is" (the plain form the default model can solve; a chat form mostly fails).
    """
    if before < 0 or after < 0:
        raise ValueError(f"before and after must be >= 0, got {before} and {after}")
    return PASSKEY_HEAD + FILLER * before + _needle(key) + FILLER * after + PASSKEY_TAIL


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> str:
    """A passkey prompt of about ``n_tokens`` tokens with the key at relative ``depth`` (0: first, 1: last)."""
    per_filler = len(tokenizer(FILLER).input_ids)
    budget = n_tokens - len(tokenizer(PASSKEY_HEAD + _needle(key) + PASSKEY_TAIL).input_ids)
    n_fill = max(budget // per_filler, 0)
    before = round(n_fill * depth)
    return passkey_text(key, before, n_fill - before)


def needle_positions(tokenizer, case: str) -> tuple[str, dict, list[int]]:
    """The passkey prompt of ``case`` (``"length:depth:key"``, :func:`passkey_prompt`'s arguments), its encoding
    (with character offsets) and the positions of the tokens that overlap the needle sentence."""
    try:
        n, depth, key = int(case.split(":")[0]), float(case.split(":")[1]), int(case.split(":")[2])
    except (IndexError, ValueError) as e:
        raise ValueError(f"case must be 'length:depth:key', got {case!r}") from e
    text = passkey_prompt(tokenizer, n, depth, key)
    enc = tokenizer([text], return_offsets_mapping=True, return_tensors="pt")
    start = text.index(_needle(key))
    end = start + len(_needle(key))
    spans = enc["offset_mapping"][0].tolist()
    return text, enc, [i for i, (s, e) in enumerate(spans) if s < end and e > start]


# ------------------------------------------------------------------------------------------------ examples


def essay_excerpt(max_chars: int = 4500) -> str:
    """The first paragraphs of the shipped ``essay.txt`` (whole paragraphs, at most ``max_chars``)."""
    paragraphs = shipped_text("essay.txt").split("\n\n")
    out: list[str] = []
    for p in paragraphs:
        if out and sum(len(q) + 2 for q in out) + len(p) > max_chars:
            break
        out.append(p.strip())
    return "\n\n".join(out)


def example_prompts() -> list[tuple[str, bool, int]]:
    """``(prompt, use_chat_template, max_new_tokens)`` for the demo's example gallery."""
    doc = essay_excerpt()
    question = (
        "\n\nQuestion: according to the essay, what did the first navigators carry instead of charts, "
        "and why? Answer in two sentences."
    )
    return [
        ("What are three simple tips for staying focused while studying?", True, 64),
        (doc + question, True, 64),
        (passkey_text(68351, 16, 24), False, 12),  # the key 40% of the way into 40 fillers
    ]


# ------------------------------------------------------------------------------------------ tokenization


@dataclass(frozen=True)
class PreparedPrompt:
    """Token ids ready for prefill, and what was done to the user's text."""

    ids: torch.Tensor  # [1, T] int64
    note: str  # empty, or a visible note (e.g. truncation)

    @property
    def tokens(self) -> int:
        return self.ids.shape[-1]


def _template(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompt(tokenizer, text: str, chat: bool = False) -> torch.Tensor:
    """Token ids ``[1, T]`` of ``text``, wrapped in the chat template with ``chat`` (no checks, no truncation)."""
    if chat:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return enc["input_ids"]
    return tokenizer([text], return_tensors="pt").input_ids


def prepare_prompt(
    tokenizer,
    text: str | None,
    chat_template: bool = True,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
) -> PreparedPrompt:
    """Tokenize ``text`` (through the chat template if asked and available), keeping at most ``max_prompt_tokens``.

    Raises :class:`PromptError` for an empty prompt. An over-long prompt keeps its *end* (where the question is)
    and says so in ``note``.
    """
    text = (text or "").strip()
    if not text:
        raise PromptError(EMPTY_PROMPT_MESSAGE)
    notes = []
    if len(text) > max_prompt_chars:
        notes.append(f"the prompt had {len(text):,} characters; only the last {max_prompt_chars:,} were read")
        text = text[-max_prompt_chars:]
    use_template = chat_template and getattr(tokenizer, "chat_template", None)
    if chat_template and not use_template:
        notes.append("this tokenizer has no chat template, so the prompt is used as plain text")
    overhead = len(tokenizer(_template(tokenizer, ""), add_special_tokens=False).input_ids) if use_template else 0
    budget = max_prompt_tokens - overhead
    if budget < 1:
        raise PromptError(
            f"max_prompt_tokens={max_prompt_tokens} leaves no room after the chat template ({overhead} tokens)"
        )
    body = tokenizer(text, add_special_tokens=False).input_ids
    if len(body) > budget:
        notes.append(
            f"the prompt had {len(body):,} tokens, over the cap of {budget:,}: the first "
            f"{len(body) - budget:,} were dropped and the last {budget:,} kept"
        )
        text = tokenizer.decode(body[-budget:])
    if use_template:
        ids = tokenizer(_template(tokenizer, text), add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text).input_ids
    ids = ids[-max_prompt_tokens:]  # re-tokenizing a cut text can add a token or two
    note = ("✂️ Truncated: " + "; ".join(notes) + ".") if notes else ""
    return PreparedPrompt(torch.tensor([ids], dtype=torch.long), note)
