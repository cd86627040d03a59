"""Layers: `namespace.py` chooses between TransformerEngine modules (`te_transformer_layer.py` tunes
TE's TransformerLayer, `qkv_rope.py` its Q/K/V split with RoPE in Triton) and their plain-torch twins
(`torch_twins.py`); `weight_init.py` draws weights deterministically by name; `tensor_parallel.py` says
which parameters the layers split over tensor-parallel ranks and where a rank's piece lies in the full
tensor."""
