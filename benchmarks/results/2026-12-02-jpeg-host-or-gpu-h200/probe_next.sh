#!/usr/bin/env bash
# For the next GPU lease (not run yet): whether the replays themselves take longer beside the decoder (GPU-side) or
# the GPU waits between them (host-side), how much of the loss is nvImageCodec's decode at all (`nodecode`:
# headers parsed, no decode, the crop kernel kept), and whether its memory pool giving memory back to the driver at
# every synchronize costs the step (`poolkeep`); and, where DALI is staged (prepare_dali.sh), DALI's batched decode,
# crop, resize and normalization instead (`dali`, with DALI's default share for the hardware decoder and with all of it).
# The shipped ViT-B, one GPU, two calls (a: nvImageCodec suspects; b: DALI), logged to $OUT/probe_next.log:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/probe_next.sh a|b
set -uo pipefail
HERE=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200
LOG=$OUT/probe_next.log
export PYTHONUNBUFFERED=1 REPLAY_TIMES_FILE=$OUT/replay_times.txt
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1; } | tee "$LOG"
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 \
  --classes 10 --workers 16 > /dev/null 2>&1
folder="data=imagefolder data.root=/tmp/jpegs data.decode_on=device data.num_workers=6"
run() {  # name, JPEG_PATCH, overrides
  echo "== $1 (JPEG_PATCH=$2): $3" >> "$LOG"
  JPEG_PATCH="$2" PYTHONPATH="$HERE/patch:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-6} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out /tmp/ab_$1 --timeout 200 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -3 >> "$LOG"
}
run synthetic replaytimes "data=synthetic data.num_workers=16"
if [[ ${1:-a} == a ]]; then
  run gpu6 replaytimes "$folder"
  run gpu6_poolkeep replaytimes,poolkeep "$folder"
  run gpu6_nodecode replaytimes,nodecode "$folder"
else  # DALI staged: prepare_dali.sh
  run gpu6_dali replaytimes,dali "$folder"
  run gpu6_dali_hw1 replaytimes,dali,daliload=1.0 "$folder"
  run gpu6 replaytimes "$folder"
fi
cat "$OUT/replay_times.txt" >> "$LOG"
date -u >> "$LOG"
