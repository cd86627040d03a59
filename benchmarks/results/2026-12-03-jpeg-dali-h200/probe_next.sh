#!/usr/bin/env bash
# For the next lease (not run yet): is the step slower beside DALI because the GPU runs slower (its power limit: the
# JPEG engines draw power while the step already fills the SMs) or because the decoder's kernels take SM time?
# `nvidia-smi dmon` samples power, SM clock, SM and JPEG-engine use and the time held back by the power or thermal
# limit once a second through synthetic, PIL in 16 workers and DALI as shipped, each twice, alternating; clocks.py summarises each
# run's samples. Needs DALI staged (../2026-12-02-jpeg-host-or-gpu-h200/prepare_dali.sh). One call, one GPU:
#   OUT=/tmp/out bash benchmarks/results/2026-12-03-jpeg-dali-h200/probe_next.sh
set -uo pipefail
HERE=benchmarks/results/2026-12-03-jpeg-dali-h200
LOG=$OUT/probe_next.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv; } | tee "$LOG"
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 \
  --classes 10 --workers 16 > /dev/null 2>&1
nvidia-smi dmon -s pucv -o DT -d 1 > "$OUT/dmon.txt" 2>&1 &
dmon=$!
folder="data=imagefolder data.root=/tmp/jpegs"
run() {  # name, overrides
  echo "== $1: $2" >> "$LOG"
  echo "start $1 $(date -u +%T)" >> "$OUT/windows.txt"
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps ${JPEG_STEPS:-16} --micro-batch 256 \
    --global-batch 2048 --data "" --extra "data.num_classes=10" --out "$OUT" --timeout 150 --variant "$1=$2" 2>&1 \
    | grep -v "^$" | tail -3 | head -2 >> "$LOG"
  echo "end $1 $(date -u +%T)" >> "$OUT/windows.txt"
}
for round in 1 2; do
  run synthetic_$round "data=synthetic data.num_workers=16"
  run folder_pil16_$round "$folder data.decode_on=workers data.num_workers=16"
  run folder_dali_$round "$folder data.decode_on=device data.device_decoder=dali data.num_workers=6"
done
kill $dmon
python3 $HERE/clocks.py "$OUT/dmon.txt" "$OUT/windows.txt" >> "$LOG" 2>&1
date -u >> "$LOG"
cat "$LOG"
