#!/usr/bin/env bash
# The peer of the ESM-2 recipe: NVIDIA bionemo-recipes' esm2_native_te (NVIDIA/bionemo-framework,
# bionemo-recipes/recipes/esm2_native_te), trained on one GPU, offline, with the esm2_650m shape, THD sequence
# packing in micro-batches of 8,192 tokens (sequences truncated to 1,024), on a local parquet file (a `sequence`
# column). Its own scripts and configs, unchanged; only command-line overrides.
#
#   bash benchmarks/esm2_peer/run.sh PEER_RECIPE_DIR mfsdp|fsdp2 /abs/path/data.parquet [steps=60] [bf16|fp8] [override ...]
#
# Needs the peer's requirements (transformers, datasets, torchdata, torchmetrics, wandb, nvtx, nvdlfw-inspect) beside
# TransformerEngine and Megatron-FSDP. Every logged step's metrics (wandb.log, here disabled) go, at full precision,
# to $PEER_METRICS_JSONL through this folder's sitecustomize.py; the real-token rate is
# `train/unpadded_tokens_per_second_per_gpu` (tokens other than padding, <cls>/<eos> included, as ours count).
# PEER_LOG_EVERY (default 1): its logger.frequency (each log reads the loss back: a host sync).
# The peer takes one optimizer step per micro-batch (no accumulation). PEER_PYTHONPATH, if set, comes first on
# PYTHONPATH: packages at the versions of the peer's commit where the installed ones have moved on (for its
# commit of 2026-05-15: transformers 5.8.1, megatron-fsdp 0.3.1, and an empty `megatron` package that keeps
# megatron-fsdp from taking an installed Megatron-Core's newer config class; benchmarks/results/2026-11-27-*).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECIPE=$(cd "${1:?usage: run.sh PEER_RECIPE_DIR mfsdp|fsdp2 DATA.parquet [steps] [bf16|fp8] [overrides]}" && pwd)
SCRIPT=train_${2:?mfsdp or fsdp2}.py
DATA=${3:?an absolute path to a parquet file}
STEPS=${4:-60}
PRECISION=${5:-bf16}
shift $(( $# < 5 ? $# : 5 ))
[[ -f $RECIPE/$SCRIPT ]] || { echo "no $SCRIPT in $RECIPE" >&2; exit 2; }
[[ $DATA == /* && -f $DATA ]] || { echo "DATA must be an absolute path to a file: $DATA" >&2; exit 2; }
[[ $PRECISION == bf16 || $PRECISION == fp8 ]] || { echo "precision: bf16 or fp8, not $PRECISION" >&2; exit 2; }

# The peer ships only the 8M model's config; the 650M one has the same fields with ESM-2 650M's shapes.
CONFIG=${TMPDIR:-/tmp}/esm2_peer_650m
mkdir -p "$CONFIG"
python3 - "$RECIPE/model_configs/nvidia/esm2_t6_8M_UR50D/config.json" "$CONFIG/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config.update(hidden_size=1280, intermediate_size=5120, num_hidden_layers=33, num_attention_heads=20)
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY

cd "$RECIPE"  # its configs name ./tokenizers and ./model_configs relative to the working directory
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled WANDB_SILENT=true
export TOKENIZERS_PARALLELISM=false PYTHONPATH="${PEER_PYTHONPATH:+$PEER_PYTHONPATH:}$HERE${PYTHONPATH:+:$PYTHONPATH}"
# THD packing needs a streaming dataset, and micro_batch_size null beside token_micro_batch_size (not in its yaml:
# hence the +); the data file is listed 10 times so that epochs (a pass over 1,000 sequences) restart rarely.
files="[$(printf "'%s'," "$DATA"{,,,,,,,,,} | sed 's/,$//')]"
set -x
python3 "$SCRIPT" --config-name L0_sanity config_name_or_path="$CONFIG" dataset.tokenizer_name=./tokenizers/esm2 \
  num_train_steps="$STEPS" use_sequence_packing=true dataset.micro_batch_size=null +dataset.token_micro_batch_size=8192 \
  dataset.max_seq_length=1024 dataset.load_dataset_kwargs.path=parquet dataset.load_dataset_kwargs.split=train \
  "dataset.load_dataset_kwargs.data_files=$files" dataset.load_dataset_kwargs.streaming=true logger.frequency=${PEER_LOG_EVERY:-1} \
  wandb_init_args.mode=disabled checkpoint.ckpt_dir=null checkpoint.save_final_model=false \
  checkpoint.resume_from_checkpoint=false fp8_config.enabled=$([[ $PRECISION == fp8 ]] && echo true || echo false) \
  "hydra.run.dir=${TMPDIR:-/tmp}/esm2_peer_runs/${SCRIPT%.py}_$$" "$@"
