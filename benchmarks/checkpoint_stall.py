"""How long does saving a checkpoint hold up training, and how fast is a DCP save?

    python benchmarks/checkpoint_stall.py --config vit_base_patch16_224 --nproc 1 --steps 40 --every 10

Runs train.py twice on synthetic data, with synchronous and with asynchronous saves every --every steps
(each run on its own fresh checkpoint folder), and prints per mode: the mean step time of the logged
intervals (save pauses excluded, so a slower step during an async write shows up here), the stall of
each save (the seconds the loop waited: for async saves the copy to host memory and any wait for the
previous save), its size and the seconds until it was complete on disk, and the write throughput.
Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path

from train_runs import TrainRunFailed, run_train

REPO = Path(__file__).resolve().parents[1]
SAVED = re.compile(r"saved checkpoint \S+ \((?P<mb>[\d.]+) MB in (?P<s>[\d.]+) s")


def run(
    config: str, nproc: int, steps: int, every: int, async_save: bool, data: str, extra: list[str], timeout: float
) -> dict:
    try:
        rows, output = run_train(
            config,
            nproc,
            [
                *([f"data={data}"] if data else []),
                f"training.steps={steps}",
                f"training.log_every_n_steps={every}",
                f"checkpoint.save_every_n_steps={every}",
                f"checkpoint.async_save={str(async_save).lower()}",
                *extra,
            ],
            timeout,
        )
    except TrainRunFailed as e:
        raise SystemExit(str(e)) from None
    train = [r for r in rows if "split" not in r and "step_time" in r]
    stalls = [r["stall_s"] for r in rows if r.get("split") == "checkpoint"]
    saves = [(float(m["mb"]), float(m["s"])) for m in SAVED.finditer(output)]
    # The first interval includes warm-up (compilation, allocator growth): report the later ones.
    later = train[1:] or train
    return {
        "async": async_save,
        "step_time": sum(r["step_time"] for r in later) / len(later),
        "stall_s": stalls,
        "saves_mb_s": saves,
        "write_gb_per_s": [mb / 1024 / s for mb, s in saves if s > 0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="vit_base_patch16_224")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save (and log) every this many steps")
    p.add_argument("--data", default="synthetic", help='data config ("": the config\'s own)')
    p.add_argument("--extra", default="", help="more overrides for both runs")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()

    results = [
        run(args.config, args.nproc, args.steps, args.every, mode, args.data, shlex.split(args.extra), args.timeout)
        for mode in (False, True)
    ]
    for r in results:
        stalls = ", ".join(f"{s:.3f}" for s in r["stall_s"])
        sizes = ", ".join(f"{mb:.0f} MB in {s:.2f} s" for mb, s in r["saves_mb_s"])
        print(
            f"{'async' if r['async'] else 'sync '}: step {r['step_time']:.4f} s | stalls [{stalls}] s | "
            f"saves [{sizes}] | {max(r['write_gb_per_s'], default=0):.2f} GB/s best"
        )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path = out / f"checkpoint_stall-{args.config}-{args.nproc}gpu-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "config": args.config,
                "nproc": args.nproc,
                "date": stamp,
                "command": " ".join(shlex.quote(a) for a in sys.argv),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(path.read_text())


if __name__ == "__main__":
    main()
