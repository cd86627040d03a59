#!/usr/bin/env bash
# Probe (kept as run): the shipped ViT-B decoding real JPEGs on the GPU with 6 loader workers, profiled, and an A/B
# of probe-only patches (patch/sitecustomize.py) inside training. From the repo root on a GPU machine:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-profile-h200/training_probe.sh
set -uo pipefail
HERE=benchmarks/results/2026-12-02-jpeg-profile-h200
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_info.txt"
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 20000 --val 1000 \
  --classes 10 --workers 16 > "$OUT/jpeg_data.log" 2>&1
folder="data=imagefolder data.root=/tmp/jpegs data.num_classes=10 data.decode_on=device data.num_workers=6"
rm -rf /tmp/vit_prof
timeout 240 python3 train.py --config-name vit_base_patch16_224 $folder training.steps=14 training.val_every_n_steps=0 \
  training.val_at_end=false checkpoint.save_final=false logger.progress_bar=never hydra.run.dir=/tmp/vit_prof \
  checkpoint.path=/tmp/vit_prof/ckpt training.profile.enabled=true training.profile.start_step=11 \
  training.profile.steps=3 > "$OUT/profile_train.log" 2>&1
tail -3 "$OUT/profile_train.log"
python3 $HERE/trace_threads.py /tmp/vit_prof/profile/rank0.trace.json 2>&1 | tee "$OUT/profile_threads.txt" | head -40
python3 benchmarks/trace_gaps.py /tmp/vit_prof/profile/rank0.trace.json > "$OUT/profile_trace_gaps.txt" 2>&1
gzip -c /tmp/vit_prof/profile/rank0.trace.json > "$OUT/profile_rank0.trace.json.gz"
run() {  # name, JPEG_PATCH, overrides
  JPEG_PATCH="$2" PYTHONPATH="$HERE/patch:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-6} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out "$OUT/ab_$1" --timeout 240 --variant "$1=$3" 2>&1 | tee "$OUT/ab_$1.log" | tail -2
}
run synthetic "" "data=synthetic data.num_workers=16"
run gpu6 "" "$folder"
run gpu6_ownstream ownstream "$folder"
run gpu6_cputhreads4 cputhreads=4 "$folder"
run gpu6_threads2 "" "$folder data.decode_threads=2"
run gpu6_again "" "$folder"
