#!/usr/bin/env bash
# Stage NVIDIA DALI 2.4.0 (CUDA 13) for the probe patch `dali` (patch/sitecustomize.py): its wheels (~240 MB) in one
# tar, split into 38 MiB parts under .device/dali1 ... (git-ignored), one device call each, like TransformerEngine's.
# nvImageCodec and nvJPEG, which DALI also needs, come with .device/extra (see the previous sessions' notes).
#   bash benchmarks/results/2026-12-02-jpeg-host-or-gpu-h200/prepare_dali.sh
# Device calls, back to back: carry [".device/daliK"], command `mkdir -p /root/dali && cp .device/daliK/* /root/dali/`
# for every part; then, with the last one: `cat /root/dali/part_* | tar -x -C /root/dali &&
#   python3 -m pip install -q --no-index --no-deps /root/dali/*.whl`.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
D=$ROOT/.device
rm -rf "$D"/dali* && mkdir -p "$D/dali_wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 312 --implementation cp --abi cp312 \
  --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$D/dali_wheels" nvidia-dali-cuda130==2.4.0 nvidia-libnvcomp-cu13==5.3.0.16 \
  nvidia-nvjpeg2k-cu13==0.11.0.51 nvidia-nvtiff-cu13==0.8.0.82 nvtx==0.2.17 optree==0.20.0 makefun==1.16.0 \
  libcst==1.9.0 astunparse==1.6.3 gast==0.7.0 six==1.17.0
tar -C "$D/dali_wheels" -cf "$D/dali.tar" .
split -b 38m -d -a 2 "$D/dali.tar" "$D/dali_part_"
i=0
for part in "$D"/dali_part_*; do
  i=$((i + 1)); mkdir -p "$D/dali$i"; mv "$part" "$D/dali$i/part_$(printf %02d $i)"
done
rm -rf "$D/dali.tar" "$D/dali_wheels"
ls -d "$D"/dali[0-9]* | tr '\n' ' '; echo "($i parts)"
