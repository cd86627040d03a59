#!/usr/bin/env bash
# data.device_decoder=dali with settings that might close its gap to PIL in 16 workers (0.969x against 0.991x on
# 2026-12-02): every image to the hardware JPEG engines (dalihw=1.0; DALI's default 0.65 sends a third to the CUDA
# decoder on the SMs, which the step fills), 8 pipeline host threads, two decode threads; beside synthetic and PIL,
# folder and shards, one call, one GPU. Needs DALI staged (../2026-12-02-jpeg-host-or-gpu-h200/prepare_dali.sh).
#   OUT=/tmp/out bash benchmarks/results/2026-12-03-jpeg-dali-h200/probe.sh
set -uo pipefail
PATCH=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/patch
LOG=$OUT/probe.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$LOG"
if [[ ! -d /tmp/jpeg_shards ]]; then
  python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 --classes 10 --workers 16 > /dev/null 2>&1
  python3 scripts/shard_images.py --root /tmp/jpegs --out /tmp/jpeg_shards 2>&1 | tail -1 >> "$LOG"
fi
folder="data=imagefolder data.root=/tmp/jpegs"
dali="data.decode_on=device data.device_decoder=dali data.num_workers=6"
run() {  # name, JPEG_PATCH, overrides
  echo "== $1 (JPEG_PATCH=$2): $3" >> "$LOG"
  JPEG_PATCH="$2" PYTHONPATH="$PATCH:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-16} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out "$OUT" --timeout 150 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -3 | head -2 >> "$LOG"
}
run synthetic "" "data=synthetic data.num_workers=16"
run folder_pil16 "" "$folder data.decode_on=workers data.num_workers=16"
run folder_dali "" "$folder $dali"
run folder_dali_hw1 dalihw=1.0 "$folder $dali"
run folder_dali_threads8 dalithreads=8 "$folder $dali"
run folder_dali_hw1_threads8 dalihw=1.0,dalithreads=8 "$folder $dali"
run folder_dali_hw1_2threads dalihw=1.0 "$folder $dali data.decode_threads=2"
run shards_dali "" "data=shards data.root=/tmp/jpeg_shards $dali"
run shards_dali_hw1 dalihw=1.0 "data=shards data.root=/tmp/jpeg_shards $dali"
date -u >> "$LOG"
cat "$LOG"
