#!/usr/bin/env bash
# Run on the GPU machine (2 GPUs) from the repository root: GPU tests, then ViT-B/16 throughput on 1 and 2 GPUs.
# Everything is logged to ${OUT:-benchmarks/results}. Usage: bash benchmarks/gpu_evidence.sh [tests|bench|all]
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_info.txt"
python3 -c "import torch, transformer_engine, megatron_fsdp; print('torch', torch.__version__, '| TE', transformer_engine.__version__, '| megatron-fsdp', getattr(megatron_fsdp, '__version__', '0.6.1?'))" | tee -a "$OUT/gpu_info.txt"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m gpu -q -rA --timeout 400 tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
  common=(--config vit_base_patch16_224 --steps 20 --phases --out "$OUT")
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/throughput.py "${common[@]}" --nproc 1 --micro-batch 64 128 256 \
    --variant "mfsdp+te=distributed=mfsdp model.backend=te" 2>&1 | tee "$OUT/bench_1gpu.log" | tail -8
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/throughput.py "${common[@]}" --nproc 1 --micro-batch 128 \
    --variant "fsdp2+torch=distributed=fsdp2 model.backend=torch" --variant "ddp+te=distributed=ddp model.backend=te" 2>&1 | tee "$OUT/bench_1gpu_other.log" | tail -6
  python3 benchmarks/throughput.py "${common[@]}" --nproc 2 --micro-batch 128 256 \
    --variant "mfsdp+te=distributed=mfsdp model.backend=te" 2>&1 | tee "$OUT/bench_2gpu.log" | tail -7
fi
