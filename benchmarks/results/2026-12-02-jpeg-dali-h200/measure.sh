#!/usr/bin/env bash
# The JPEG measurement with data.device_decoder=dali (recipes/vit/dali_crops.py) in one call on one GPU: the
# shipped ViT-B on synthetic images; on the JPEG folder and its shards decoded by DALI with 6 loader workers; the
# folder by nvImageCodec (data.device_decoder=auto) with 6 workers and by PIL in 16 workers. Then the JPEG GPU tests.
# Logged to $OUT/measure.log:   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-dali-h200/measure.sh
set -uo pipefail
LOG=$OUT/measure.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } | tee "$LOG"
if [[ ! -d /tmp/jpeg_shards ]]; then
  python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 --classes 10 --workers 16 \
    > /dev/null 2>&1
  python3 scripts/shard_images.py --root /tmp/jpegs --out /tmp/jpeg_shards 2>&1 | tail -1 >> "$LOG"
fi
date -u >> "$LOG"
folder="data=imagefolder data.root=/tmp/jpegs"
shards="data=shards data.root=/tmp/jpeg_shards"
python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps ${JPEG_STEPS:-8} --micro-batch 256 \
  --global-batch 2048 --data "" --extra "data.num_classes=10" --out "$OUT" --timeout 200 \
  --variant "synthetic=data=synthetic data.num_workers=16" \
  --variant "folder_dali6=$folder data.decode_on=device data.device_decoder=dali data.num_workers=6" \
  --variant "shards_dali6=$shards data.decode_on=device data.device_decoder=dali data.num_workers=6" \
  --variant "folder_nvimgcodec6=$folder data.decode_on=device data.num_workers=6" \
  --variant "folder_pil16=$folder data.decode_on=workers data.num_workers=16" 2>&1 | grep -v "^$" | tail -8 >> "$LOG"
date -u >> "$LOG"
python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_jpeg_decoding.py 2>&1 | tail -15 >> "$LOG"
echo "pytest -m gpu tests/gpu/test_jpeg_decoding.py: $(date -u +%FT%TZ)" >> "$LOG"
