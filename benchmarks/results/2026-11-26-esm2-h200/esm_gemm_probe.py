# Where ESM-2 650M's micro-batch time goes, without Megatron-FSDP: TE model, bf16 autocast, one packed row of
# 8,192 tokens, forward + backward; the slowest kernels with the shapes of the ops that launched them.
import sys, time, torch
sys.path.insert(0, ".")
from core.layers.namespace import get_layers
from recipes.esm2.recipe import ESM2Recipe
from recipes.esm2.masking import Masking
from recipes.esm2.packing import PackedSequences
from recipes.esm2.sequences import read_store
from tests.support.helpers import validated_config
import numpy as np
S = "data/uniref90_sample/uniref90_1000.parquet"
cfg = validated_config("esm2_650m", ["checkpoint.path=unused", f"data.path={S}"])
model = ESM2Recipe(cfg).build_model(get_layers("te"), torch.device("cuda"))
packs = PackedSequences(read_store(S), np.arange(1000), 8192, 1024, 64, Masking(), 1, 2)
b = {k: v[None].cuda() for k, v in packs[0].items()}
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(b["tokens"], b["cu_seqlens"], labels=b["labels"]).sum()
    loss.backward()
for _ in range(3): step()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): step()
torch.cuda.synchronize(); print(f"bare TE model fwd+bwd: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms per 8192-token row")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
    step(); torch.cuda.synchronize()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60, max_shapes_column_width=90))
