"""Megatron-Core, imported quietly. Without TransformerEngine, Apex or a CUDA runtime (a CPU machine) its import warns
about what it falls back to ("No CUDA runtime is found, using CUDA_HOME=...", "Transformer Engine and Apex are not
installed", "Detected Megatron Core"), none of which concerns the dataset classes this recipe takes from it. Every
import of `megatron.core` in the recipe calls `import_quietly()` first; later imports of its modules find them
loaded."""

from __future__ import annotations

import functools
import logging
import warnings


@functools.cache
def import_quietly() -> None:
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # CUDA_HOME without a CUDA runtime
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # index building: a screenful per split
    logging.getLogger("megatron_fsdp").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        import megatron.core  # noqa: F401
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
        import megatron.core.datasets.indexed_dataset  # noqa: F401
