"""The training loop's building blocks, by concern (docs/architecture.md walks through them):

config/         schemas (defaults and their documentation), validation
distributed/    processes, devices and the device mesh; launcher glue; stop signals
layers/         TransformerEngine layers or their plain-torch twins; tensor-parallel splits; weight init
parallel/       data-parallel backends; parallelize() (TP, recompute, compile, shard)
data/           sampling the global batch, loaders, deterministic dataset utilities and their checker
training/       optimizer and schedule, precision, the non-finite policy, evaluation, the train state
checkpointing/  DCP checkpoints: layout, state parts, staging, retention, manager, conversion
metrics/        logger, throughput meter, profiler
generation/     generate.py's decoding (KV cache, sampling), prompts and output file, for any recipe
runtime.py      every device and backend decision, made once
session.py      the setup every entry point (train, predict) shares
"""
