"""Training throughput of a recipe config, several variants side by side.

Each variant is one `torchrun ... train.py` run on synthetic data: M warm-up steps, then M timed steps
(the loop logs at both; only the second interval counts). With --phases each variant runs once more with
training.time_phases=true to show where a step's time goes (device synchronised at phase boundaries).

    python benchmarks/throughput.py --nproc 1 --micro-batch 64 128 \
        --variant "mfsdp+te=distributed=mfsdp model.backend=te" \
        --variant "fsdp2+torch=distributed=fsdp2 model.backend=torch"

Each optimizer step takes one micro-batch per GPU, unless --global-batch asks for the accumulation a real run
does (e.g. `--global-batch 128` for gpt_1b as configured, 8 micro-batches of 16 on one GPU).

Prints a table and writes JSON to benchmarks/results/. `--data` picks the data config (synthetic images by
default; e.g. `--data gpt_mock` for the GPT configs, or `--data ""` for the config's own); with
`--concurrent K` and --nproc 1, K variants run at once, each on its own GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from train_runs import TrainRunFailed, error_headline, run_train

REPO = Path(__file__).resolve().parents[1]
PHASES = ("forward_backward", "grad_sync_clip", "optimizer")


def run_variant(
    config: str,
    nproc: int,
    steps: int,
    overrides: list[str],
    phases: bool,
    data: str = "synthetic",
    gpus: str | None = None,
    timeout: float | None = None,
) -> dict:
    try:
        rows, _ = run_train(
            config,
            nproc,
            [
                *([f"data={data}"] if data else []),
                f"training.steps={2 * steps}",
                f"training.log_every_n_steps={steps}",
                f"training.time_phases={phases}",
                *overrides,
            ],
            timeout,
            gpus,
        )
    except TrainRunFailed as e:
        return {"error": str(e)[-2000:]}
    return rows[-1]  # the timed interval (after the warm-up interval)


def data_parallel_ranks(nproc: int, overrides: list[str]) -> int:
    """The data-parallel ranks of `nproc` processes run with `overrides`: tensor- and context-parallel ranks
    (distributed.tp, distributed.cp; the last value given wins) share their samples."""
    sizes = {"distributed.tp": 1, "distributed.cp": 1}
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key in sizes and value.isdigit() and int(value) > 0:
            sizes[key] = int(value)
    return max(1, nproc // (sizes["distributed.tp"] * sizes["distributed.cp"]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="vit_base_patch16_224")
    p.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    p.add_argument("--steps", type=int, default=20, help="warm-up steps, then as many timed steps")
    p.add_argument("--micro-batch", type=int, nargs="+", default=[64])
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step, accumulated over micro-batches (default: micro-batch x ranks, "
        "no accumulation); e.g. the config's own training.global_batch_size",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        help='"name=override override ..." (repeatable); default: the config as is',
    )
    p.add_argument("--phases", action="store_true", help="also time forward/backward, grad sync, optimizer")
    p.add_argument("--extra", default="", help="overrides added to every variant (a variant's own win over them)")
    p.add_argument("--data", default="synthetic", help='data config for every variant ("": the config\'s own)')
    p.add_argument("--concurrent", type=int, default=1, help="with --nproc 1: variants run at once, one per GPU")
    p.add_argument("--timeout", type=float, default=900, help="seconds per variant run before it counts as failed")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p


def main() -> None:
    p = _parser()
    args = p.parse_args()
    if args.concurrent > 1 and args.nproc != 1:
        p.error("--concurrent needs --nproc 1")

    variants = [v.split("=", 1) for v in (args.variant or ["default="])]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    free_gpus: queue.Queue = queue.Queue()
    for gpu in range(args.concurrent):
        free_gpus.put(str(gpu) if args.concurrent > 1 else None)

    for name, overrides in variants:
        dp = data_parallel_ranks(args.nproc, shlex.split(args.extra) + shlex.split(overrides))
        for mb in args.micro_batch:
            if args.global_batch and args.global_batch % (mb * dp):
                p.error(
                    f"--global-batch {args.global_batch} (variant {name}) is not a multiple of micro-batch {mb} x "
                    f"{dp} data-parallel ranks"
                )

    def measure(name: str, overrides: str, mb: int) -> dict:
        # The variant's own overrides come after --extra's: Hydra keeps a key's last value, so a variant's wins.
        given = shlex.split(args.extra) + shlex.split(overrides)
        dp = data_parallel_ranks(args.nproc, given)
        # Without --global-batch no gradient accumulation: the global batch is micro-batch x data-parallel ranks.
        global_batch = args.global_batch or mb * dp
        ov = given + [f"training.micro_batch_size={mb}", f"training.global_batch_size={global_batch}"]
        gpu = free_gpus.get()
        try:
            row = {
                "variant": name,
                "micro_batch": mb,
                "nproc": args.nproc,
                "overrides": ov,
                "accumulation": global_batch // (mb * dp),
                **run_variant(args.config, args.nproc, args.steps, ov, False, args.data, gpu, args.timeout),
            }
            if args.phases and "error" not in row:
                timed = run_variant(args.config, args.nproc, args.steps, ov, True, args.data, gpu, args.timeout)
                row.update({k: v for k, v in timed.items() if k.startswith("time_")})
        finally:
            free_gpus.put(gpu)
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(args.concurrent) as pool:
        jobs = [pool.submit(measure, name, overrides, mb) for name, overrides in variants for mb in args.micro_batch]
        results = [job.result() for job in jobs]
    _print_table(args, results, device)
    _write(args, results, device)


def _print_table(args: argparse.Namespace, results: list[dict], device: str) -> None:
    tokens = any(r.get("tokens_per_sec_per_gpu", 0) > r.get("samples_per_sec_per_gpu", 0) for r in results)
    unit = "tokens/s/gpu" if tokens else "img/s/gpu"
    header = f"{'variant':<22}{'mb':>5}{unit:>13}{'mfu':>7}{'step s':>9}{'data s':>8}{'mem GiB':>9}"
    if args.phases:
        header += "".join(f"{ph[:12]:>14}" for ph in PHASES)
    batch = f"global batch {args.global_batch}" if args.global_batch else "no accumulation"
    print(f"\n{args.config} on {args.nproc} x {device}, {args.steps} timed steps, {batch}\n{header}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<22}{r['micro_batch']:>5}  FAILED: {error_headline(r['error'])[:100]}")
            continue
        rate = r["tokens_per_sec_per_gpu"] if tokens else r["samples_per_sec_per_gpu"]
        line = (
            f"{r['variant']:<22}{r['micro_batch']:>5}{rate:>13.0f}"
            f"{100 * r.get('mfu', float('nan')):>6.1f}%{r['step_time']:>9.4f}{r['data_wait']:>8.4f}"
            f"{r['peak_mem_gib']:>9.1f}"
        )
        if args.phases:
            line += "".join(f"{r.get('time_' + ph, float('nan')):>14.4f}" for ph in PHASES)
        print(line)


def _write(args: argparse.Namespace, results: list[dict], device: str) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path = out / f"{args.config}-{args.nproc}gpu-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "config": args.config,
                "device": device,
                "nproc": args.nproc,
                "date": stamp,
                "command": " ".join(shlex.quote(a) for a in sys.argv),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"\nwrote {path}")
    if os.environ.get("OUT"):  # on the device machine, also keep a copy where results come back from
        (Path(os.environ["OUT"]) / path.name).write_text(path.read_text())


if __name__ == "__main__":
    main()
