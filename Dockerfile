# GPU image: NVIDIA's NGC PyTorch container ships CUDA, cuDNN, NCCL, PyTorch and TransformerEngine.
# Pick a release whose TransformerEngine is 2.8 or newer (tested: TE 2.20 with PyTorch 2.11):
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<yy.mm>-py3 -t recipes .
#   docker run --gpus all --ipc=host -it --rm -v $PWD/outputs:/workspace/recipes/outputs recipes \
#       torchrun --nproc-per-node 8 train.py --config-name vit_base_patch16_224 training.micro_batch_size=64
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/recipes
COPY requirements.txt .
# The container pins its own torch (PIP_CONSTRAINT), so this adds only what it lacks.
RUN python -m pip install --no-cache-dir -r requirements.txt
COPY . .
RUN python -c "import transformer_engine.pytorch, megatron_fsdp, hydra; print('image ok')"
