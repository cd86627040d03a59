"""Real (unpadded) tokens per second of the ESM-2 peer's runs, from the metrics run.sh records.

    python benchmarks/esm2_peer/summary.py OUT/peer_mfsdp.jsonl [...] [--skip 10]

Per file: the logged steps after the first --skip (start-up, compilation), their real tokens over their summed
step time, and the mean and spread of the per-step rates."""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--skip", type=int, default=10, help="logged steps left out at the start")
    args = ap.parse_args()
    for path in args.files:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        timed = [r for r in rows if "train/step_time" in r][args.skip :]
        if not timed:
            print(f"{path}: no logged steps after the first {args.skip}")
            continue
        tokens = sum(r["train/total_unpadded_tokens_per_batch"] for r in timed)
        seconds = sum(r["train/step_time"] for r in timed)
        rates = [r["train/unpadded_tokens_per_second_per_gpu"] for r in timed]
        print(
            f"{path}: steps {timed[0]['step']}-{timed[-1]['step']}: {tokens / seconds:,.0f} real tokens/s "
            f"(per-step mean {statistics.mean(rates):,.0f}, min {min(rates):,.0f}, max {max(rates):,.0f}; "
            f"step {1000 * seconds / len(timed):.1f} ms, loss {timed[-1].get('train/loss', float('nan')):.3f})"
        )


if __name__ == "__main__":
    main()
