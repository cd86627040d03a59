#!/usr/bin/env bash
# Run on the GPU machine (2 GPUs) from the repository root: GPU tests, then ViT-B/16 throughput on 1 and 2 GPUs.
# Everything is logged to ${OUT:-benchmarks/results}.
# Usage: bash benchmarks/gpu_evidence.sh [tests|smoke|bench|all|perf|gpt|vit|graphs_small|graphs_large|graphs_shipped|
#                                       graphs_gpt_1b|graphs_gpt_125m|graphs_losses|jpeg|jpeg_data|jpeg_decoders|
#                                       esm2|esm2_finetune|esm2_finetune_profile|esm2_profile|esm2_3b|sft|packing_gap|memory_rows|jpeg_queues|esm2_peer PEER_RECIPE_DIR|revisions OTHER_CHECKOUT|
#                                       two_gpus_vit|two_gpus_gpt|tests_1gpu 1|2|tests_2gpus 1|2|3|node_scaling|node_8b|node_esm2_3b|node_cp]
# perf (1 GPU, ~17 min): the performance issue's remaining measurements (docs/performance.md).
# gpt (1 GPU, ~8 min): gpt_1b MFU as the config trains it (global batch 128: 8 micro-batches of 16 per
# optimizer step on one GPU) against one micro-batch per step, micro-batch 32, sequence 4096, FP8; the
# attention backends at the recipes' shapes; a profiled gpt_1b step.
# vit (1 H200, ~6 min): ViT-B/16 bf16 and FP8 from micro-batch 512 to 2048 (118 GiB: an H200, not an
# H100), and the compiled FSDP2 baseline at 1024.
# esm2 (1 GPU, ~5 min): esm2_650m as configured (packs of 8,192 tokens, 8 per optimizer step here) packed bf16,
# with fp32 compute weights, FP8, eager, at most 40 sequences a pack (fewer empty attention slots), and padded (rows of 1,024, the same tokens per step); tokens/s and MFU count real tokens.
# esm2_peer PEER_RECIPE_DIR (1 GPU, ~6 min): the bionemo-recipes peer (benchmarks/esm2_peer/run.sh; Megatron-FSDP
# and FSDP2 scripts) and ours at its settings (one optimizer step per 8,192-token pack), then ours as configured.
# esm2_profile (1 GPU, ~1 min): where an eager esm2_650m step's GPU time goes, by kernel kind and kernel.
# revisions (1 GPU, ~8 min): the shipped vit_base_patch16_224 and gpt_1b configs (their own global batch)
# with this checkout and OTHER_CHECKOUT (e.g. the previous commit, `git archive REV | tar -x -C DIR`),
# alternating, twice each: a code change that should not change speed, checked within run-to-run noise.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
fp8="precision=fp8_delayed precision.param_dtype=bf16"
# Where a gpt_1b step's GPU time goes (3 profiled steps of one micro-batch of 16), summarised by kernel kind
# and idle gaps: $OUT/<prefix>_profile.log, _trace_gaps.txt, _profile_summary.txt.
profile_gpt_1b() {
  rm -rf /tmp/gpt_prof
  python3 train.py --config-name gpt_1b "${@:2}" training.steps=12 training.global_batch_size=16 training.val_every_n_steps=0 \
    training.val_at_end=false checkpoint.save_final=false logger.progress_bar=never hydra.run.dir=/tmp/gpt_prof \
    checkpoint.path=/tmp/gpt_prof/ckpt training.profile.enabled=true training.profile.start_step=9 training.profile.steps=3 \
    > "$OUT/$1_profile.log" 2>&1
  python3 benchmarks/trace_gaps.py /tmp/gpt_prof/profile/rank0.trace.json > "$OUT/$1_trace_gaps.txt" 2>&1
  cp /tmp/gpt_prof/profile/rank0.summary.txt "$OUT/$1_profile_summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_info.txt"
python3 -c "import torch, transformer_engine, megatron_fsdp; print('torch', torch.__version__, '| TE', transformer_engine.__version__, '| megatron-fsdp', getattr(megatron_fsdp, '__version__', '0.6.1?'))" | tee -a "$OUT/gpu_info.txt"
# tests [PYTEST ARGS ...]: the whole GPU suite (`pytest -m gpu`), or the part the arguments select (paths, -k): on
# 2 GPUs the suite takes longer than one 10-minute call of the GPU machine: tests_2gpus, below;
# smoke: its quick subset (`pytest -m gpu_smoke`); each timed, logged under a name made from the arguments.
gpu_tests() {
  local start=$SECONDS marker=$1
  shift
  local log="$OUT/${marker}_tests${1:+_$(printf "%s" "$*" | sed 's#tests/##g; s#\.py##g' | tr -c 'A-Za-z0-9_-' '_' | cut -c1-80)}.log"
  python3 -m pytest -m "$marker" -q -rA -p no:cacheprovider --durations=30 "$@" 2>&1 | tee "$log" | tail -45
  echo "pytest -m $marker $*: $((SECONDS - start)) s wall, $(date -u +%FT%TZ), $(git describe --always --dirty 2>/dev/null) (-dirty: the files differ from that commit)" \
    | tee -a "$log"
}
if [[ $what == tests || $what == all ]]; then
  gpu_tests gpu "${@:2}"
fi
# tests_2gpus 1|2|3: the whole GPU suite on 2 GPUs in three parts, each within one 10-minute call (times in
# docs/testing.md): gpu/test_te_and_megatron_fsdp.py but its two longest tests; those two, then every GPU test outside that file and
# gpu/test_cuda_graphs.py; gpu/test_cuda_graphs.py.
if [[ $what == tests_2gpus ]]; then
  longest="tensor_parallel_gpt_125m or fp8_checkpoint_resumes_on_2"
  case ${2:-} in
    1) gpu_tests gpu tests/gpu/test_te_and_megatron_fsdp.py -k "not ($longest)" ;;
    2) gpu_tests gpu tests/gpu/test_te_and_megatron_fsdp.py -k "$longest"
       gpu_tests gpu tests/ --ignore=tests/gpu/test_te_and_megatron_fsdp.py --ignore=tests/gpu/test_cuda_graphs.py ;;
    3) gpu_tests gpu tests/gpu/test_cuda_graphs.py ;;
    *) echo "tests_2gpus takes the part: 1, 2 or 3" >&2; exit 2 ;;
  esac
fi
# tests_1gpu 1|2: the whole GPU suite on one GPU in two parts, each within one 10-minute call (docs/testing.md).
first_part=(tests/gpu/test_esm2.py tests/gpu/test_context_parallel.py tests/gpu/test_gpt_packing.py
  tests/gpu/test_cuda_graphs.py tests/gpu/test_esm2_finetune.py tests/gpu/test_jpeg_decoding.py)
if [[ $what == tests_1gpu ]]; then
  case ${2:-} in
    1) gpu_tests gpu "${first_part[@]}" ;;
    2) gpu_tests gpu tests "${first_part[@]/#/--ignore=}" ;;
    *) echo "tests_1gpu takes the part: 1 or 2" >&2; exit 2 ;;
  esac
fi
if [[ $what == smoke ]]; then
  gpu_tests gpu_smoke
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
if [[ $what == gpt ]]; then
  python3 benchmarks/attention_backends.py 2>&1 | tee "$OUT/attention_backends.log"
  profile_gpt_1b gpt
  gpt=(--config gpt_1b --data gpt_mock --nproc 1 --out "$OUT" --timeout 300)
  python3 benchmarks/throughput.py "${gpt[@]}" --steps 4 --micro-batch 16 --variant "recipe=" 2>&1 | tee "$OUT/gpt_no_accumulation.log" | tail -3
  python3 benchmarks/throughput.py "${gpt[@]}" --steps 3 --micro-batch 16 32 --global-batch 128 --variant "recipe=" \
    2>&1 | tee "$OUT/gpt_global128.log" | tail -4
  python3 benchmarks/throughput.py "${gpt[@]}" --steps 3 --micro-batch 8 --global-batch 64 \
    --variant "seq4096=model.seq_length=4096" --variant "seq4096_fp8=model.seq_length=4096 $fp8" \
    2>&1 | tee "$OUT/gpt_seq4096.log" | tail -4
  NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1 python3 benchmarks/throughput.py "${gpt[@]}" --steps 3 \
    --micro-batch 16 --global-batch 128 --variant "cudnn_norms=" 2>&1 | tee "$OUT/gpt_cudnn_norms.log" | tail -3
  python3 benchmarks/throughput.py "${gpt[@]}" --steps 3 --micro-batch 16 --global-batch 128 \
    --variant "fp8_delayed=$fp8" 2>&1 | tee "$OUT/gpt_fp8.log" | tail -3
fi
if [[ $what == vit ]]; then
  vit=(--config vit_base_patch16_224 --nproc 1 --out "$OUT" --timeout 200)
  python3 benchmarks/throughput.py "${vit[@]}" --steps 15 --micro-batch 512 768 1024 \
    --variant "recipe=" --variant "fp8=$fp8" 2>&1 | tee "$OUT/vit_batch.log" | tail -8
  python3 benchmarks/throughput.py "${vit[@]}" --steps 8 --micro-batch 1536 2048 \
    --variant "recipe=" --variant "fp8=$fp8" 2>&1 | tee "$OUT/vit_batch_large.log" | tail -6
  python3 benchmarks/throughput.py "${vit[@]}" --steps 10 --micro-batch 1024 \
    --variant "fsdp2+torch+compile=distributed=fsdp2 model.backend=torch training.compile=true precision.param_dtype=bf16" \
    2>&1 | tee "$OUT/vit_baseline.log" | tail -3
fi
if [[ $what == perf ]]; then
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --steps 20 --nproc 1 --micro-batch 256 384 512 --out "$OUT" \
    --variant "recipe=" --variant "recipe+fp8_delayed=$fp8" \
    --variant "fsdp2+torch+compile=distributed=fsdp2 model.backend=torch training.compile=true precision.param_dtype=bf16" \
    2>&1 | tee "$OUT/perf_vit.log" | tail -9
  python3 benchmarks/throughput.py --config gpt_1b --data gpt_mock --steps 8 --nproc 1 --micro-batch 8 16 32 --out "$OUT" \
    --variant "recipe=" --variant "recipe+fp8_delayed=$fp8" 2>&1 | tee "$OUT/perf_gpt.log" | tail -9
  profile_gpt_1b perf_gpt
  # A second bf16 seed shows how far two bf16 runs drift apart on their own.
  python3 benchmarks/loss_curves.py --config vit_base_patch16_224 --steps 200 --variant "bf16=" \
    --variant "bf16_seed1235=seed=1235" --variant "fp8_delayed=$fp8" \
    --extra "training.global_batch_size=256" --out "$OUT" 2>&1 | tee "$OUT/perf_fp8_loss_curves.log" | tail -6
  # Saves 20 steps apart: an async write (~2.5 s for ViT-B) finishes before the next save is due.
  python3 benchmarks/checkpoint_stall.py --config vit_base_patch16_224 --steps 80 --every 20 --out "$OUT" \
    2>&1 | tee "$OUT/perf_checkpoint_stall.log" | tail -3
  python3 benchmarks/te_layers.py --micro-batch 256 2>&1 | tee "$OUT/te_layers_mb256.log" | tail -40
  python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 20000 --val 1000 --classes 10 --workers 16
  for decode in workers device; do  # PIL in 4-12 loader workers, or nvJPEG on the GPU
    python3 benchmarks/input_pipeline.py --config vit_base_patch16_224 --batches 20 --out "$OUT" --device cuda \
      --workers $([[ $decode == workers ]] && echo 4 8 12 || echo 2 4 8) \
      -- data=imagefolder data.root=/tmp/jpegs data.num_classes=10 data.decode_on=$decode \
      2>&1 | tee "$OUT/perf_jpeg_decode_on_$decode.log" | tail -5
  done
fi
# graphs_small, graphs_large (1 H200, ~5 min each): ViT-B/16 img/s from micro-batch 32 to 2048, eager and with
# CUDA graphs, against the compiled FSDP2 baseline; graphs_shipped (~4 min): the shipped vit_base_patch16_224 as
# typed (256 x 8 accumulated) and gpt_125m at its global batch, eager and graphed.
eager_graphed_compiled=(--variant "eager=training.cuda_graphs=none"
  --variant "graphed=training.cuda_graphs=forward_backward"
  --variant "fsdp2+compile=distributed=fsdp2 model.backend=torch training.compile=true precision.param_dtype=bf16")
if [[ $what == graphs_small ]]; then
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps 10 --micro-batch 32 64 128 256 \
    --out "$OUT" --timeout 200 "${eager_graphed_compiled[@]}" 2>&1 | tee "$OUT/graphs_vit_small.log" | tail -14
fi
if [[ $what == graphs_large ]]; then
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps 6 --micro-batch 512 1024 2048 \
    --out "$OUT" --timeout 240 "${eager_graphed_compiled[@]}" 2>&1 | tee "$OUT/graphs_vit_large.log" | tail -11
fi
if [[ $what == graphs_shipped ]]; then
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps 4 --micro-batch 256 --global-batch 2048 \
    --out "$OUT" --timeout 200 --variant "eager=training.cuda_graphs=none" --variant "as_typed=" \
    2>&1 | tee "$OUT/graphs_vit_shipped.log" | tail -4
  python3 benchmarks/throughput.py --config gpt_125m --data gpt_mock --nproc 1 --steps 6 --micro-batch 8 --global-batch 64 \
    --out "$OUT" --timeout 200 --variant "eager=training.cuda_graphs=none" \
    --variant "graphed=training.cuda_graphs=forward_backward" 2>&1 | tee "$OUT/graphs_gpt_125m.log" | tail -4
fi
# graphs_gpt_1b (1 H200, ~4 min): gpt_1b at its global batch (8 micro-batches of 16), bf16 and FP8, eager and
# graphed. graphs_gpt_125m (~4 min): gpt_125m tokens/s from micro-batch 4 to 32, eager and graphed.
# graphs_losses (~3 min): 50 steps of ViT-B on the shipped digits, eager and graphed from one seed, and eager
# from another seed (how far two eager runs drift apart on their own).
if [[ $what == graphs_gpt_1b ]]; then
  python3 benchmarks/throughput.py --config gpt_1b --data gpt_mock --nproc 1 --steps 3 --micro-batch 16 --global-batch 128 \
    --out "$OUT" --timeout 240 --variant "eager=training.cuda_graphs=none" \
    --variant "graphed=training.cuda_graphs=forward_backward" --variant "fp8_eager=$fp8 training.cuda_graphs=none" \
    --variant "fp8_graphed=$fp8 training.cuda_graphs=forward_backward" 2>&1 | tee "$OUT/graphs_gpt_1b.log" | tail -6
fi
if [[ $what == graphs_gpt_125m ]]; then
  python3 benchmarks/throughput.py --config gpt_125m --data gpt_mock --nproc 1 --steps 6 --micro-batch 4 8 16 32 \
    --out "$OUT" --timeout 200 --variant "eager=training.cuda_graphs=none" \
    --variant "graphed=training.cuda_graphs=forward_backward" 2>&1 | tee "$OUT/graphs_gpt_125m_sweep.log" | tail -10
fi
if [[ $what == graphs_losses ]]; then
  python3 benchmarks/loss_curves.py --config vit_base_patch16_224 --steps 50 --window 5 --out "$OUT" \
    --extra "training.micro_batch_size=128 training.global_batch_size=256 training.val_every_n_steps=0" \
    --variant "eager=training.cuda_graphs=none" --variant "graphed=training.cuda_graphs=forward_backward" \
    --variant "eager_seed1235=training.cuda_graphs=none seed=1235" 2>&1 | tee "$OUT/graphs_losses.log" | tail -6
fi
# jpeg (1 GPU, ~5 min): the shipped vit_base_patch16_224 as typed (256 x 8 accumulated, CUDA graphs) on synthetic
# images and on 20,000 generated ImageNet-sized JPEGs, from the folder and from tar shards (the files as they
# are): decoded by PIL in 16 loader workers (the default way), or on the GPU (nvImageCodec; DALI, which must be
# installed there) with 6 workers that only read the files; all in one run. jpeg_decoders (~2 min): the decoders alone and beside a
# stand-in step (benchmarks/jpeg_decoders.py), with the queues a decoding run sets and with the driver's default.
# jpeg_data: the 20,000 JPEGs and their shards alone (jpeg makes them when /tmp/jpeg_shards is not there yet),
# so that the measurement itself fits one call of the GPU machine.
if [[ $what == jpeg || $what == jpeg_data ]] && [[ ! -d /tmp/jpeg_shards ]]; then
  { python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 20000 --val 1000 --classes 10 --workers 16
    python3 scripts/shard_images.py --root /tmp/jpegs --out /tmp/jpeg_shards; } > "$OUT/jpeg_data.log" 2>&1
  tail -3 "$OUT/jpeg_data.log"
fi
if [[ $what == jpeg ]]; then
  folder="data=imagefolder data.root=/tmp/jpegs"
  shards="data=shards data.root=/tmp/jpeg_shards"
  pil="data.decode_on=workers data.num_workers=16"
  gpu="data.decode_on=device data.num_workers=6"
  python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 --steps ${JPEG_STEPS:-10} --micro-batch 256 \
    --global-batch 2048 --data "" --extra "data.num_classes=10" --out "$OUT" --timeout 300 \
    --variant "synthetic=data=synthetic data.num_workers=16" \
    --variant "folder_pil16=$folder $pil" \
    --variant "shards_pil16=$shards $pil" \
    --variant "folder_gpu6=$folder $gpu" \
    --variant "shards_gpu6=$shards $gpu" \
    --variant "folder_dali6=$folder $gpu data.device_decoder=dali" \
    --variant "shards_dali6=$shards $gpu data.device_decoder=dali" \
    2>&1 | tee "$OUT/jpeg_training.log" | tail -16
fi
# jpeg_queues (1 GPU, ~6 min with the data): the shipped ViT-B decoding real JPEGs on the GPU with 6 loader workers,
# with the 32 CUDA queues a decoding run asks for and with the driver's 8 (CUDA_DEVICE_MAX_CONNECTIONS set outside
# wins), each beside synthetic images, twice, in one call: whether the queues matter to training at all.
if [[ $what == jpeg_queues ]]; then
  [[ -d /tmp/jpegs/train ]] || python3 scripts/make_jpeg_imagefolder.py --out /tmp/jpegs --train 20000 --val 1000 \
    --classes 10 --workers 16 > "$OUT/jpeg_data.log" 2>&1
  for round in 1 2; do
    for queues in 32 8; do
      CUDA_DEVICE_MAX_CONNECTIONS=$queues python3 benchmarks/throughput.py --config vit_base_patch16_224 --nproc 1 \
        --steps ${JPEG_STEPS:-10} --micro-batch 256 --global-batch 2048 --data "" --extra "data.num_classes=10" \
        --out "$OUT/queues${queues}_round$round" --timeout 300 \
        --variant "synthetic=data=synthetic data.num_workers=16" \
        --variant "folder_gpu6=data=imagefolder data.root=/tmp/jpegs data.decode_on=device data.num_workers=6" \
        2>&1 | tee "$OUT/jpeg_queues${queues}_round$round.log" | tail -4
    done
  done
fi
if [[ $what == jpeg_decoders ]]; then
  for connections in 32 0; do
    python3 benchmarks/jpeg_decoders.py --out "$OUT" --step vit --connections $connections \
      --decoders nvimgcodec-hw nvimgcodec-hw+reuse+crop loop 2>&1 | tee "$OUT/jpeg_decoders_$connections.log" | tail -4
  done
fi
# memory_rows (1 GPU, ~2 min): the shipped configs whose memory plan has no measured row yet, as typed for a few
# steps: the plan's line and the peak torch allocated (docs/performance.md "Memory plan").
if [[ $what == memory_rows ]]; then
  for config in esm2_8m esm2_150m; do
    rm -rf "/tmp/mem_$config"
    python3 train.py --config-name $config training.steps=6 training.log_every_n_steps=3 training.val_every_n_steps=0 \
      training.val_at_end=false checkpoint.save_final=false logger.progress_bar=never hydra.run.dir="/tmp/mem_$config" \
      checkpoint.path="/tmp/mem_$config/ckpt" > "$OUT/memory_$config.log" 2>&1
    grep -h "memory plan per GPU" "$OUT/memory_$config.log" | tail -1
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(sys.argv[2], 'peak_mem_gib', max(x.get('peak_mem_gib', 0) for x in r))" \
      "/tmp/mem_$config/metrics.jsonl" $config
  done
fi
if [[ $what == revisions ]]; then
  other=${2:?usage: gpu_evidence.sh revisions OTHER_CHECKOUT}
  for round in 1 2; do
    for repo in "$other" .; do
      tag=$([[ $repo == . ]] && echo this || echo other)
      mkdir -p "$OUT/$tag"
      python3 "$repo/benchmarks/throughput.py" --config vit_base_patch16_224 --nproc 1 --steps 10 --micro-batch 256 \
        --global-batch 512 --out "$OUT/$tag" --timeout 300 2>&1 | tee "$OUT/revisions_vit_${tag}_$round.log" | tail -2
      python3 "$repo/benchmarks/throughput.py" --config gpt_1b --data gpt_mock --nproc 1 --steps 3 --micro-batch 16 \
        --global-batch 128 --out "$OUT/$tag" --timeout 300 2>&1 | tee "$OUT/revisions_gpt_${tag}_$round.log" | tail -2
    done
  done
fi
# two_gpus_vit (2 GPUs, ~5 min): the shipped vit_base_patch16_224 as typed (256 x 8 per step on 1 GPU, 256 x 4 on
# each of 2; ZeRO-0, CUDA graphs) on synthetic images, on 1 GPU and on 2; on 2 also the previous multi-GPU settings
# (ZeRO-2, eager), graphed ZeRO-0 on the shipped digits, and compiled FSDP2 at micro-batch 256, all in one call.
# two_gpus_gpt (2 GPUs, ~5 min): gpt_1b as typed (16 x 8 per step on 1 GPU, 16 x 4 on each of 2) on 1 and 2 GPUs,
# with ZeRO-3 (as typed), ZeRO-2 and ZeRO-0 on 2.
if [[ $what == two_gpus_vit ]]; then
  vit=(--config vit_base_patch16_224 --steps ${VIT_STEPS:-5} --micro-batch 256 --global-batch 2048 --out "$OUT" --timeout 300)
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/throughput.py "${vit[@]}" --nproc 1 --variant "as_typed=" \
    2>&1 | tee "$OUT/two_gpus_vit_1gpu.log" | tail -3
  python3 benchmarks/throughput.py "${vit[@]}" --nproc 2 --variant "as_typed=" \
    --variant "eager_zero2=training.cuda_graphs=none distributed.mfsdp.zero_dp_strategy=2" \
    --variant "fsdp2+torch+compile=distributed=fsdp2 model.backend=torch training.compile=true precision.param_dtype=bf16" \
    2>&1 | tee "$OUT/two_gpus_vit_2gpus.log" | tail -5
  python3 benchmarks/throughput.py "${vit[@]}" --nproc 2 --data "" --variant "as_typed_digits=" \
    2>&1 | tee "$OUT/two_gpus_vit_2gpus_digits.log" | tail -3
fi
if [[ $what == two_gpus_gpt ]]; then
  gpt=(--config gpt_1b --data gpt_mock --steps ${GPT_STEPS:-3} --micro-batch 16 --global-batch 128 --out "$OUT" --timeout 300)
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/throughput.py "${gpt[@]}" --nproc 1 --variant "as_typed=" \
    2>&1 | tee "$OUT/two_gpus_gpt_1gpu.log" | tail -3
  python3 benchmarks/throughput.py "${gpt[@]}" --nproc 2 --variant "as_typed=" \
    --variant "zero2=distributed.mfsdp.zero_dp_strategy=2" --variant "zero0=distributed.mfsdp.zero_dp_strategy=0" \
    2>&1 | tee "$OUT/two_gpus_gpt_2gpus.log" | tail -5
fi
# The node-scale measurements on ${NODE_GPUS:-4} GPUs, each mode within one 10-minute call (not yet run):
# node_scaling: the shipped vit_base_patch16_224 (256 x 2048 a step), gpt_1b (16 x 128) and esm2_650m (packs, 8 a
# step per GPU) on 1 GPU (the first of CUDA_VISIBLE_DEVICES, or 0) and on all of them: the per-GPU throughput ratio.
# node_8b: gpt_8b in bf16 and FP8 (MFU on the bf16 peak; peak memory against its plan), 4 micro-batches a step per
# GPU (as typed: 16). node_esm2_3b: esm2_3b (real-token MFU), 4 packs a step per GPU.
# node_cp: gpt_1b at 32,768 tokens a row with context parallelism over all the GPUs, and over half of them (4 or more).
node=${NODE_GPUS:-4}
quiet="training.val_every_n_steps=0 training.val_at_end=false"
if [[ $what == node_scaling ]]; then
  first=${CUDA_VISIBLE_DEVICES:-0}
  for n in 1 $node; do
    gpus=(--nproc $n --steps ${NODE_STEPS:-4} --out "$OUT" --timeout 150 --extra "$quiet" --variant "as_typed=")
    one=(); [[ $n == 1 ]] && one=(env CUDA_VISIBLE_DEVICES=${first%%,*})
    "${one[@]}" python3 benchmarks/throughput.py --config vit_base_patch16_224 --micro-batch 256 --global-batch 2048 \
      "${gpus[@]}" 2>&1 | tee "$OUT/node_vit_${n}gpus.log" | tail -2
    "${one[@]}" python3 benchmarks/throughput.py --config gpt_1b --data gpt_mock --micro-batch 16 --global-batch 128 \
      "${gpus[@]}" 2>&1 | tee "$OUT/node_gpt_1b_${n}gpus.log" | tail -2
    "${one[@]}" python3 benchmarks/throughput.py --config esm2_650m --data "" --micro-batch 1 --global-batch $((8 * n)) \
      "${gpus[@]}" 2>&1 | tee "$OUT/node_esm2_650m_${n}gpus.log" | tail -2
  done
fi
if [[ $what == node_8b ]]; then
  python3 benchmarks/throughput.py --config gpt_8b --data gpt_mock --nproc $node --steps ${NODE_STEPS:-3} --out "$OUT" \
    --timeout 280 --micro-batch 1 --global-batch $((4 * node)) --extra "$quiet" --variant "as_typed=" \
    --variant "fp8=$fp8" 2>&1 | tee "$OUT/node_gpt_8b.log" | tail -3
fi
if [[ $what == node_esm2_3b ]]; then
  python3 benchmarks/throughput.py --config esm2_3b --data "" --nproc $node --steps ${NODE_STEPS:-3} --out "$OUT" \
    --timeout 500 --micro-batch 1 --global-batch $((4 * node)) --extra "$quiet data.num_workers=4" \
    --variant "as_typed=" 2>&1 | tee "$OUT/node_esm2_3b.log" | tail -2
fi
if [[ $what == node_cp ]]; then
  (( node >= 2 )) || { echo "node_cp: NODE_GPUS=$node; needs 2 or more"; exit 2; }
  long="model.seq_length=32768 $quiet"
  variants=(--variant "cp$node=$long distributed.cp=$node")  # cp over all the GPUs, and over half of them
  (( node >= 4 )) && variants+=(--variant "cp$((node / 2))=$long distributed.cp=$((node / 2))")
  python3 benchmarks/throughput.py --config gpt_1b --data gpt_mock --nproc $node --steps ${NODE_STEPS:-3} --out "$OUT" \
    --timeout 280 --micro-batch 1 --global-batch $node "${variants[@]}" 2>&1 | tee "$OUT/node_cp.log" | tail -3
fi
if [[ $what == esm2_profile ]]; then
  rm -rf /tmp/esm2_prof
  python3 train.py --config-name esm2_650m training.steps=6 training.global_batch_size=2 training.val_every_n_steps=0 \
    training.val_at_end=false training.cuda_graphs=none checkpoint.save_final=false logger.progress_bar=never \
    hydra.run.dir=/tmp/esm2_prof checkpoint.path=/tmp/esm2_prof/ckpt training.profile.enabled=true \
    training.profile.start_step=4 training.profile.steps=2 > "$OUT/esm2_profile.log" 2>&1
  python3 benchmarks/trace_gaps.py /tmp/esm2_prof/profile/rank0.trace.json > "$OUT/esm2_trace_gaps.txt" 2>&1
  cp /tmp/esm2_prof/profile/rank0.summary.txt "$OUT/esm2_profile_summary.txt"
  head -60 "$OUT/esm2_trace_gaps.txt"; head -45 "$OUT/esm2_profile_summary.txt"
fi
esm=(--config esm2_650m --data "" --nproc 1 --out "$OUT" --timeout 300
     --extra "training.val_every_n_steps=0 training.val_at_end=false data.num_workers=4")
if [[ $what == esm2 ]]; then
  esm+=(--steps ${ESM2_STEPS:-5})
  python3 benchmarks/throughput.py "${esm[@]}" --micro-batch 1 --global-batch 8 --variant "packed_bf16=" \
    --variant "packed_fp32_weights=precision.param_dtype=fp32" --variant "packed_fp8=$fp8" \
    --variant "packed_bf16_eager=training.cuda_graphs=none" --variant "packed_40seqs=data.max_sequences_per_pack=40" \
    2>&1 | tee "$OUT/esm2_packed.log" | tail -7
  python3 benchmarks/throughput.py "${esm[@]}" --micro-batch 8 --global-batch 64 --variant "padded_bf16=data.packing=false" \
    2>&1 | tee "$OUT/esm2_padded.log" | tail -3
fi
# esm2_3b (1 GPU, ~2 min): esm2_3b as configured (packs of 8,192 tokens, 8 per optimizer step here; one GPU runs
# ZeRO-0 and CUDA graphs, as the config does on several): real tokens/s, MFU and the peak memory.
if [[ $what == esm2_3b ]]; then
  python3 benchmarks/throughput.py --config esm2_3b --data "" --nproc 1 --out "$OUT" --timeout 300 --steps ${ESM2_STEPS:-3} \
    --extra "training.val_every_n_steps=0 training.val_at_end=false data.num_workers=4" --micro-batch 1 --global-batch 8 \
    --variant "as_typed=" 2>&1 | tee "$OUT/esm2_3b.log" | tail -3
fi
# esm2_finetune (1 GPU, ~5 min): esm2_650m fine-tuned on the shipped sanity task's sequences (packed, bf16, from a
# fresh init: the speed does not depend on the weights): full fine-tuning, frozen backbone and LoRA side by side;
# tokens/s and MFU count real tokens and each mode's own FLOPs (recipes/esm2_finetune/recipe.py:work).
if [[ $what == esm2_finetune ]]; then
  eager=(--variant "full_eager=finetune.mode=full training.cuda_graphs=none"
         --variant "lora_eager=finetune.mode=lora training.cuda_graphs=none")
  ((${ESM2FT_EAGER:-1})) || eager=()  # ESM2FT_EAGER=0: the graphed variants only
  python3 benchmarks/throughput.py --config esm2_finetune --data "" --nproc 1 --out "$OUT" --timeout 300 \
    --extra "training.val_every_n_steps=0 training.val_at_end=false data.num_workers=4 checkpoint.init_from=null" \
    --steps ${ESM2_STEPS:-5} --micro-batch 1 --global-batch 8 --variant "full=finetune.mode=full" \
    --variant "frozen=finetune.mode=frozen" --variant "lora=finetune.mode=lora" \
    "${eager[@]}" 2>&1 | tee "$OUT/esm2_finetune.log" | tail -8
fi
# esm2_finetune_profile (1 GPU, ~2 min): where a graphed step of full fine-tuning and of LoRA spends its GPU time (two
# profiled optimizer steps of two packs each): $OUT/esm2ft_<mode>_trace_gaps.txt and _profile_summary.txt.
if [[ $what == esm2_finetune_profile ]]; then
  for mode in full lora; do
    rm -rf /tmp/esm2ft_prof
    python3 train.py --config-name esm2_finetune finetune.mode=$mode checkpoint.init_from=null training.steps=6 \
      training.global_batch_size=2 training.val_every_n_steps=0 training.val_at_end=false checkpoint.save_final=false \
      logger.progress_bar=never hydra.run.dir=/tmp/esm2ft_prof checkpoint.path=/tmp/esm2ft_prof/ckpt \
      training.profile.enabled=true training.profile.start_step=4 training.profile.steps=2 \
      > "$OUT/esm2ft_${mode}_profile.log" 2>&1 || tail -5 "$OUT/esm2ft_${mode}_profile.log"
    python3 benchmarks/trace_gaps.py /tmp/esm2ft_prof/profile/rank0.trace.json > "$OUT/esm2ft_${mode}_trace_gaps.txt" 2>&1
    cp /tmp/esm2ft_prof/profile/rank0.summary.txt "$OUT/esm2ft_${mode}_profile_summary.txt"
    echo "== $mode"; sed -n 1,12p "$OUT/esm2ft_${mode}_trace_gaps.txt"
  done
fi
# sft (1 GPU, ~9 min): issue 52's SFT speed on a chat set with real instruction data's lengths
# (benchmarks/chat_lengths.py: median ~700 tokens, a long tail to 4,000; byte tokenizer, random weights: the speed does
# not depend on them). gpt_1b rows of 4,096 tokens packed with document masks against one conversation per row padded to
# 4,096 (the longest); gpt_1b pretraining (mock documents) with document masks against without; the Llama-3-8B shape
# with LoRA on rows of 4,096 (llama_sft as shipped but its data). Real tokens; MFU counts what each mode trains.
if [[ $what == sft ]]; then
  python3 benchmarks/chat_lengths.py /tmp/chats/train.jsonl --rows 20000 | tee "$OUT/sft_chat_set.txt"
  chats="data=chat_sanity data.tokenizer=byte data.train_path=/tmp/chats/train.jsonl data.val_path=null data.num_workers=4"
  quiet="training.val_every_n_steps=0 training.val_at_end=false checkpoint.init_from=null finetune.head=[]"
  python3 benchmarks/throughput.py --config gpt_1b --data "" --nproc 1 --out "$OUT" --timeout 400 --steps ${SFT_STEPS:-5} \
    --extra "$chats $quiet model.seq_length=4096 model.vocab_size=50304" --micro-batch 4 --global-batch 32 \
    --variant "sft_packed=data.packing=true data.max_documents_per_sample=64" --variant "sft_padded=data.packing=false" \
    2>&1 | tee "$OUT/sft_gpt_1b.log" | tail -4
  python3 benchmarks/throughput.py --config gpt_1b --data "" --nproc 1 --out "$OUT" --timeout 400 --steps ${SFT_STEPS:-5} \
    --extra "training.val_every_n_steps=0 training.val_at_end=false" --micro-batch 16 --global-batch 128 \
    --variant "pretrain_unmasked=" --variant "pretrain_document_masks=data.packing=true" \
    2>&1 | tee "$OUT/pretrain_gpt_1b.log" | tail -4
  python3 benchmarks/throughput.py --config llama_sft --data "" --nproc 1 --out "$OUT" --timeout 500 --steps ${SFT_STEPS:-5} \
    --extra "$chats $quiet model.vocab_size=128256" --micro-batch 1 --global-batch 8 --variant "llama3_8b_lora=finetune.mode=lora" \
    2>&1 | tee "$OUT/sft_llama3_8b_lora.log" | tail -3
fi
# packing_gap (1 GPU, ~7 min): what document masks cost gpt_1b pretraining (mock documents, sequence 2,048): unmasked
# against masked with 64 (as configured), 16 and 4 document slots a row, in one run; then a profiled step of the
# unmasked and of the masked run (which attention backend TE picks: *_profile.log, NVTE_DEBUG).
# GAP_QUICK=1 (~2 min): unmasked against masked as configured, no profiles.
if [[ $what == packing_gap ]]; then
  fewer=(--variant "masks_16=data.packing=true data.max_documents_per_sample=16"
         --variant "masks_4=data.packing=true data.max_documents_per_sample=4")
  ((${GAP_QUICK:-0})) && fewer=()
  python3 benchmarks/throughput.py --config gpt_1b --data "" --nproc 1 --out "$OUT" --timeout 500 --steps ${GAP_STEPS:-5} \
    --extra "training.val_every_n_steps=0 training.val_at_end=false" --micro-batch 16 --global-batch 64 \
    --variant "unmasked=" --variant "masks_64=data.packing=true" "${fewer[@]}" \
    2>&1 | tee "$OUT/packing_gap.log" | tail -6
  if ! ((${GAP_QUICK:-0})); then
    NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 profile_gpt_1b packing_gap_unmasked
    NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 profile_gpt_1b packing_gap_masks_64 data.packing=true
    for v in unmasked masks_64; do echo "== $v"; sed -n 1,14p "$OUT/packing_gap_${v}_trace_gaps.txt"; done
  fi
fi
if [[ $what == esm2_peer ]]; then
  peer=${2:?usage: gpu_evidence.sh esm2_peer PEER_RECIPE_DIR (bionemo-recipes/recipes/esm2_native_te)}
  # (PEER_PYTHONPATH: packages at the peer commit's versions, see benchmarks/esm2_peer/run.sh; PEER_OVERRIDES:
  # its Hydra overrides, e.g. dataset.num_workers=4 use_torch_compile=false)
  data=$PWD/data/uniref90_sample/uniref90_1000.parquet
  # The peer's settings: one optimizer step per pack of 8,192 tokens; ours as well, then as configured (8 per step).
  python3 benchmarks/throughput.py "${esm[@]}" --steps 30 --micro-batch 1 --global-batch 1 \
    --variant "ours_bf16_1pack=" --variant "ours_fp8_1pack=$fp8" 2>&1 | tee "$OUT/esm2_ours_1pack.log" | tail -4
  for script in ${PEER_SCRIPTS:-mfsdp fsdp2}; do
    rm -f "$OUT/peer_$script.jsonl"
    PEER_METRICS_JSONL=$OUT/peer_$script.jsonl timeout ${PEER_TIMEOUT:-400} bash benchmarks/esm2_peer/run.sh "$peer" $script "$data" \
      ${PEER_STEPS:-60} bf16 ${PEER_OVERRIDES:-} > "$OUT/peer_$script.log" 2>&1 || echo "peer $script failed: $(tail -3 "$OUT/peer_$script.log")"
  done
  python3 benchmarks/esm2_peer/summary.py --skip ${PEER_SKIP:-10} "$OUT"/peer_*.jsonl 2>&1 | tee "$OUT/peer_summary.txt"
  python3 benchmarks/throughput.py "${esm[@]}" --steps 5 --micro-batch 1 --global-batch 8 \
    --variant "ours_bf16_8packs=" 2>&1 | tee "$OUT/esm2_ours_8packs.log" | tail -3
fi
