#!/usr/bin/env bash
# Where the shipped ViT-B loses time when it decodes real JPEGs on the GPU with 6 loader workers (0.84x synthetic
# after 7f0f62c): a profiled run of each (GPU busy and idle time per step, benchmarks/trace_gaps.py), then an A/B
# of probe-only patches (patch/sitecustomize.py), one call, everything logged to $OUT/probe.log:
#   OUT=/tmp/out bash benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/probe.sh
set -uo pipefail
HERE=benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200
LOG=$OUT/probe.log
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1; } | tee "$LOG"
[[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 12000 --val 500 \
  --classes 10 --workers 16 > /dev/null 2>&1
folder="data=imagefolder data.root=/tmp/jpegs data.decode_on=device data.num_workers=6"
synthetic="data=synthetic data.num_workers=16"
profile() {  # name, overrides
  rm -rf /tmp/prof_$1
  echo "== profile $1: $2" >> "$LOG"
  timeout 150 python3 train.py --config-name vit_base_patch16_224 $2 data.num_classes=10 training.steps=14 \
    training.val_every_n_steps=0 training.val_at_end=false checkpoint.save_final=false logger.progress_bar=never \
    hydra.run.dir=/tmp/prof_$1 checkpoint.path=/tmp/prof_$1/ckpt training.profile.enabled=true \
    training.profile.start_step=11 training.profile.steps=3 2>&1 | grep "step 1[04] |" >> "$LOG"
  python3 benchmarks/trace_gaps.py /tmp/prof_$1/profile/rank0.trace.json --top 8 >> "$LOG" 2>&1
}
run() {  # name, JPEG_PATCH, overrides
  echo "== A/B $1 (JPEG_PATCH=$2): $3" >> "$LOG"
  JPEG_PATCH="$2" PYTHONPATH="$HERE/patch:." python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
    --steps ${JPEG_STEPS:-4} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
    --out /tmp/ab_$1 --timeout 200 --variant "$1=$3" 2>&1 | grep -v "^$" | tail -3 >> "$LOG"
}
profile synthetic "$synthetic"
profile gpu6 "$folder"
run synthetic "" "$synthetic"
run gpu6 "" "$folder"
run gpu6_trainprio trainprio "$folder"
run gpu6_switch switch=0.0005 "$folder"
run gpu6_again "" "$folder"
date -u >> "$LOG"
