#!/usr/bin/env bash
# For the next lease (not run yet): data.device_decoder=dali's settings that might close the gap to PIL in 16 workers
# (0.969x against 0.991x here): every image to the hardware engines (hw_decoder_load 1.0; DALI's default 0.65 sends
# a third to the CUDA decoder on the SMs), more pipeline host threads; beside synthetic and PIL, in one call, one GPU.
# Needs DALI staged (../2026-12-02-jpeg-host-or-gpu-h200/prepare_dali.sh). Logged to $OUT/probe_next.log:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-dali-h200/probe_next.sh
set -uo pipefail
PATCH=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/patch
LOG=$OUT/probe_next.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1; } | tee "$LOG"
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 \
  --classes 10 --workers 16 > /dev/null 2>&1
dali="data=imagefolder data.root=/tmp/jpegs data.decode_on=device data.device_decoder=dali data.num_workers=6"
run() {  # name, JPEG_PATCH, overrides
  echo "== $1 (JPEG_PATCH=$2): $3" >> "$LOG"
  JPEG_PATCH="$2" PYTHONPATH="$PATCH:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-8} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out /tmp/dali_$1 --timeout 200 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -3 | head -2 >> "$LOG"
}
run synthetic "" "data=synthetic data.num_workers=16"
run dali "" "$dali"
run dali_hw1 dalihw=1.0 "$dali"
run dali_threads8 dalithreads=8 "$dali"
run dali_hw1_threads8 dalihw=1.0,dalithreads=8 "$dali"
run pil16 "" "data=imagefolder data.root=/tmp/jpegs data.decode_on=workers data.num_workers=16"
date -u >> "$LOG"
