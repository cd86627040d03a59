"""A chat set with the lengths of real instruction data, for SFT throughput (packed against padded rows).

SFT sets are long-tailed: most conversations are a few hundred tokens, a few fill the context. The rows here are
{"prompt", "response"} of random lowercase words (one byte-tokenizer token per character), the prompt's and the
response's lengths drawn log-normally (medians --prompt-median and --response-median characters, sigma --sigma),
each conversation cut to --max-chars. The text is meaningless: only the lengths matter for speed.

    python benchmarks/chat_lengths.py /tmp/chats/train.jsonl --rows 20000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

WORDS = "the of and to in is was for on that with as by at from this be are or an it not have which".split()


def conversation_lengths(rows: int, prompt_median: float, response_median: float, sigma: float, seed: int):
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(np.log(prompt_median), sigma, rows).astype(int) + 1
    responses = rng.lognormal(np.log(response_median), sigma, rows).astype(int) + 1
    return prompts, responses, rng


def text(rng: np.random.Generator, chars: int) -> str:
    words = rng.choice(WORDS, size=chars // 3 + 1)
    return " ".join(words)[:chars]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--prompt-median", type=float, default=200)
    p.add_argument("--response-median", type=float, default=400)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--max-chars", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts, responses, rng = conversation_lengths(
        args.rows, args.prompt_median, args.response_median, args.sigma, args.seed
    )
    prompts = np.minimum(prompts, args.max_chars // 2)
    responses = np.minimum(responses, args.max_chars - prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for a, b in zip(prompts, responses):
            f.write(json.dumps({"prompt": text(rng, int(a)), "response": text(rng, int(b))}) + "\n")
    total = prompts + responses
    print(
        f"{args.out}: {args.rows} conversations, characters: median {int(np.median(total))}, mean {int(total.mean())}, "
        f"99th percentile {int(np.percentile(total, 99))}, longest {int(total.max())}"
    )


if __name__ == "__main__":
    main()
