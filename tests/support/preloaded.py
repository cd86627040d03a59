"""What the test fork server imports once (tests/support/helpers.py: run_workers), so that each worker forked from it
starts with the training stack in memory instead of importing it anew: seconds per process, and GPT workers pay
several more for Megatron-Core's package. None of it starts a thread or a process.

Only on machines without GPUs: on a GPU machine an import that asked CUDA anything (Megatron-Core's modules,
TransformerEngine through them) would leave the fork server's children unable to use CUDA. torch's device_count
asks NVML there, which starts no CUDA."""

import torch

if torch.cuda.device_count() == 0:
    import predict  # noqa: F401
    import train  # noqa: F401  (the loop, the session, checkpointing, the parallel backends)
    from recipes.gpt import preprocess  # noqa: F401
    from recipes.gpt.data import megatron_datasets
    from recipes.registry import all_recipes

    all_recipes()
    megatron_datasets()
