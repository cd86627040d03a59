#!/usr/bin/env bash
# The JPEG measurement in one call (shipped ViT-B, one GPU): synthetic images, the JPEG folder and its
# shards decoded on the GPU with 6 loader workers, and the folder decoded by PIL in 16 workers, each run with CUDA
# events around every graph replay (patch/sitecustomize.py: replaytimes) to see whether the replays themselves
# take longer beside the decoder. Everything logged to $OUT/final.log:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/final.sh
set -uo pipefail
HERE=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200
LOG=$OUT/final.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$LOG"
if [[ ! -d /tmp/jpeg_shards ]]; then
  python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 --classes 10 --workers 16 \
    > /dev/null 2>&1
  python3 scripts/shard_images.py --root /tmp/jpegs --out /tmp/jpeg_shards 2>&1 | tail -2 >> "$LOG"
fi
date -u >> "$LOG"
folder="data=imagefolder data.root=/tmp/jpegs"
shards="data=shards data.root=/tmp/jpeg_shards"
REPLAY_TIMES_FILE=$OUT/replay_times.txt JPEG_PATCH=replaytimes PYTHONPATH="$HERE/patch:." python3 benchmarks/throughput.py \
  --config vit_base_patch16_224 --nproc 1 --steps ${JPEG_STEPS:-6} --micro-batch 256 --global-batch 2048 --data "" \
  --extra "data.num_classes=10" --out "$OUT" --timeout 200 \
  --variant "synthetic=data=synthetic data.num_workers=16" \
  --variant "folder_gpu6=$folder data.decode_on=device data.num_workers=6" \
  --variant "shards_gpu6=$shards data.decode_on=device data.num_workers=6" \
  --variant "folder_pil16=$folder data.decode_on=workers data.num_workers=16" 2>&1 | grep -v "^$" | tail -8 >> "$LOG"
cat "$OUT/replay_times.txt" >> "$LOG"
date -u >> "$LOG"
