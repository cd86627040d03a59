#!/usr/bin/env bash
# The JPEG measurement with the training loop's gc.freeze() (core/training/garbage_collection.py), and the
# same runs without it (the probe patch `nogcfreeze`), in one call on one GPU: the shipped ViT-B on synthetic images,
# on the JPEG folder and its shards decoded on the GPU with 6 loader workers, on the folder decoded by PIL in 16
# workers; one DALI run for comparison. Each run times its garbage collections (`gctime`) and the GPU's gaps between
# graph replays (`replaytimes`). Logged to $OUT/measure.log:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-gc-freeze-h200/measure.sh
set -uo pipefail
PATCH=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/patch
LOG=$OUT/measure.log
export PYTHONUNBUFFERED=1 REPLAY_TIMES_FILE=$OUT/replay_times.txt
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$LOG"
if [[ ! -d /tmp/jpeg_shards ]]; then
  python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 --classes 10 --workers 16 \
    > /dev/null 2>&1
  python3 scripts/shard_images.py --root /tmp/jpegs --out /tmp/jpeg_shards 2>&1 | tail -2 >> "$LOG"
fi
date -u >> "$LOG"
folder="data=imagefolder data.root=/tmp/jpegs"
shards="data=shards data.root=/tmp/jpeg_shards"
run() {  # name, JPEG_PATCH, overrides
  echo "== $1 (JPEG_PATCH=$2): $3" >> "$LOG"
  JPEG_PATCH="$2" PYTHONPATH="$PATCH:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-8} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out "$OUT" --timeout 200 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -3 >> "$LOG"
}
run synthetic replaytimes,gctime "data=synthetic data.num_workers=16"
run folder_gpu6 replaytimes,gctime "$folder data.decode_on=device data.num_workers=6"
run folder_gpu6_nofreeze replaytimes,gctime,nogcfreeze "$folder data.decode_on=device data.num_workers=6"
run shards_gpu6 replaytimes,gctime "$shards data.decode_on=device data.num_workers=6"
run folder_pil16 replaytimes,gctime "$folder data.decode_on=workers data.num_workers=16"
run synthetic_nofreeze replaytimes,gctime,nogcfreeze "data=synthetic data.num_workers=16"
python3 -c "import nvidia.dali" 2>/dev/null && \
  run folder_gpu6_dali replaytimes,gctime,dali "$folder data.decode_on=device data.num_workers=6"
run shards_gpu6_nofreeze replaytimes,gctime,nogcfreeze "$shards data.decode_on=device data.num_workers=6"
cat "$OUT/replay_times.txt" >> "$LOG"
date -u >> "$LOG"
