"""Build data/chat_sanity/: a SANITY chat set for supervised fine-tuning, every answer a fixed rule of its question.

    python scripts/make_chat_sanity.py [--out data/chat_sanity]

Generated, not collected: each conversation asks one of a few tasks (sums, reversed words, capitals, letter counts,
sorted words) and the assistant answers by that task's rule; a system turn in some rows changes the answer's form
(only the result, or capitals), some rows go on for a second turn that builds on the first answer, and some are
written as {"prompt", "response"} instead of {"messages"}. The rules are in data/chat_sanity/README.md. A model
that learns them shows that chat rendering, the response-only loss, packing and fine-tuning work, nothing more.
Deterministic (random.Random(seed) per split): rerunning writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPLITS = (("train", 1200, 1), ("val", 150, 2))  # name, conversations, seed
WORDS = (
    "apple river stone garden candle window basket forest silver yellow orange planet rocket pencil "
    "marble violin ladder pocket summer winter spring autumn island harbor castle dragon feather tunnel "
    "button carpet cookie dinner jacket kitten lemon mirror needle pepper rabbit saddle turtle wagon"
).split()
ONLY_RESULT = "Reply with the result only."
CAPITALS = "Answer in capital letters."
FRIENDLY = "You are a helpful assistant."


def add(rng: random.Random) -> tuple[str, str, str, list]:
    """question, full answer, bare result, and what a follow-up turn needs."""
    a, b = rng.randrange(100), rng.randrange(100)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}", str(a + b), ["sum", a + b]


def reverse(rng: random.Random):
    word = rng.choice(WORDS)
    return f"Reverse the word {word}.", f"{word} reversed is {word[::-1]}", word[::-1], ["word", word]


def capitals(rng: random.Random):
    text = " ".join(rng.sample(WORDS, 2))
    return f"Write in capitals: {text}", f"In capitals: {text.upper()}", text.upper(), ["text", text]


def count(rng: random.Random):
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters", str(len(word)), ["word", word]


def sort(rng: random.Random):
    words = rng.sample(WORDS, 3)
    ordered = " ".join(sorted(words))
    return f"Sort these words: {' '.join(words)}", f"In order: {ordered}", ordered, ["words", words]


TASKS = (add, reverse, capitals, count, sort)


def follow_up(rng: random.Random, memo: list) -> tuple[str, str, str] | None:
    """A second question about the first answer: add to the sum, or spell the word (or first word) back."""
    kind, value = memo
    if kind == "sum":
        c = rng.randrange(1, 10)
        return f"Now add {c}.", f"{value} + {c} = {value + c}", str(value + c)
    word = value[0] if kind == "words" else value.split()[0] if kind == "text" else value
    return f"Spell {word} with dashes.", f"{word} spelled: {'-'.join(word)}", "-".join(word)


def styled(answer: str, result: str, system: str | None) -> str:
    if system == ONLY_RESULT:
        return result
    if system == CAPITALS:
        return answer.upper()
    return answer


def conversation(rng: random.Random) -> dict:
    question, answer, result, memo = rng.choice(TASKS)(rng)
    system = rng.choice((None, None, ONLY_RESULT, CAPITALS, FRIENDLY))
    messages = [{"role": "system", "content": system}] if system else []
    messages += [
        {"role": "user", "content": question},
        {"role": "assistant", "content": styled(answer, result, system)},
    ]
    if rng.random() < 0.25:
        question, answer, result = follow_up(rng, memo)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": styled(answer, result, system)},
        ]
    elif system is None and rng.random() < 0.3:
        return {"prompt": messages[0]["content"], "response": messages[1]["content"]}
    return {"messages": messages}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "data" / "chat_sanity")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows, seed in SPLITS:
        rng = random.Random(seed)
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for _ in range(rows):
                f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
    main()
