#!/usr/bin/env bash
# The A/B of the bound on queued CUDA-graph replays (core/training/cuda_graphs.py, QueueBound) inside training:
# the shipped ViT-B on synthetic images and on real JPEGs decoded on the GPU with 6 loader workers, each with the
# bound (as committed) and without it (patch/sitecustomize.py: unbounded), alternating, in one call.
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-profile-h200/training_ab.sh
set -uo pipefail
HERE=benchmarks/results/2026-12-02-jpeg-profile-h200
export PYTHONUNBUFFERED=1
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train ${JPEG_IMAGES:-12000} \
  --val 500 --classes 10 --workers 16 > /dev/null 2>&1
folder="data=imagefolder data.root=/tmp/jpegs data.num_classes=10 data.decode_on=device data.num_workers=6"
run() {  # name, JPEG_PATCH, overrides
  JPEG_PATCH="$2" PYTHONPATH="$HERE/patch:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-4} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out /tmp/ab_$1 --timeout 200 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -2 | head -1
}
run synthetic_bounded "" "data=synthetic data.num_workers=16"
run gpu6_bounded "" "$folder"
run gpu6_unbounded unbounded "$folder"
run synthetic_unbounded unbounded "data=synthetic data.num_workers=16"
