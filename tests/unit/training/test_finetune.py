"""finetune.mode on a model (core/training/finetune.py), the learning-rate groups it asks of the optimizer
(core/training/optim.py:param_groups) and their ratios through the schedule and a resume."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from core.config.errors import ConfigError
from core.config.schema import FinetuneConfig, OptimConfig, SchedulerConfig
from core.layers import torch_twins
from core.parallel.parallelize import _to_param_dtype
from core.training import finetune, optim
from core.training.state import TrainState


class Tiny(nn.Module):
    """Embeddings, two twin transformer blocks, a final norm and a head: the shape of a fine-tuned encoder."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 16)
        self.layers = nn.ModuleList(
            torch_twins.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True)
            for _ in range(2)
        )
        self.final_norm = torch_twins.LayerNorm(16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, tokens):
        x = self.embedding(tokens).transpose(0, 1)  # sbhd
        for block in self.layers:
            x = block(x)
        return self.head(self.final_norm(x))


def _cfg(**kw) -> FinetuneConfig:
    lora = kw.pop("lora", {})
    cfg = OmegaConf.structured(FinetuneConfig)
    cfg.merge_with({**kw, "lora": lora})
    return cfg


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_full_leaves_the_model_alone():
    model = Tiny()
    assert finetune.apply(model, _cfg(), 0, torch.bfloat16) is None
    assert _trainable(model) == {n for n, _ in model.named_parameters()}


def test_frozen_trains_the_head_only_and_no_backward_reaches_the_backbone():
    model = Tiny()
    line = finetune.apply(model, _cfg(mode="frozen"), 0, torch.bfloat16)
    assert _trainable(model) == {"head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"}
    assert line.startswith("finetune.mode=frozen: 0.000M of") and "the head ['head']" in line
    assert model.embedding.weight.dtype == torch.float32  # only lora stores frozen weights narrower
    out = model(torch.randint(0, 10, (2, 5)))
    assert out.grad_fn is not None
    hidden = model.final_norm(model.layers[1](model.layers[0](model.embedding(torch.randint(0, 10, (2, 5))))))
    assert not hidden.requires_grad  # autograd records nothing through the frozen backbone


def test_a_head_that_names_nothing_is_refused_with_the_top_level_modules():
    with pytest.raises(
        ConfigError, match=r"finetune.head=\['classifier'\]: no parameter .* embedding, final_norm, head, layers"
    ):
        finetune.apply(Tiny(), _cfg(mode="frozen", head=["classifier"]), 0, None)


@pytest.mark.parametrize("mode", ["full", "frozen", "lora"])
def test_frozen_prefixes_stay_frozen_in_every_mode(mode):
    """finetune.frozen over every mode: the embedding and block 0 (LoRA adapters there too) never train; in full
    mode the rest still does, and the line says what is kept frozen."""
    model = Tiny()
    head = ["head"] if mode == "lora" else ["head", "layers"]  # frozen: block 0 is frozen though in the head
    cfg = _cfg(mode=mode, frozen=["embedding", "layers.0."], head=head, lora={"target_modules": ["proj"]})
    line = finetune.apply(model, cfg, 0, None)
    trainable = _trainable(model)
    assert trainable and not any(n.startswith(("embedding.", "layers.0.")) for n in trainable)
    assert "kept frozen: embedding, layers.0." in line
    if mode == "full":
        assert trainable == {n for n, _ in model.named_parameters() if not n.startswith(("embedding.", "layers.0."))}
    if mode == "lora":
        assert hasattr(model.layers[0].self_attention.proj, "lora_A")  # placed by head and lora alone, kept frozen
        assert "layers.1.self_attention.proj.lora_A.weight" in trainable
    model(torch.randint(0, 10, (2, 5))).sum().backward()
    assert model.embedding.weight.grad is None and model.layers[0].self_attention.proj.weight.grad is None
    assert any(p.grad is not None for n, p in model.named_parameters() if n.startswith("layers.1."))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_frozen_prefix_that_names_nothing_is_refused(mode):
    with pytest.raises(ConfigError, match=r"finetune.frozen=\['embeddings'\]: no parameter .* embedding, final_norm"):
        finetune.apply(Tiny(), _cfg(mode=mode, frozen=["embedding", "embeddings"]), 0, None)


def test_lora_trains_adapters_and_head_and_stores_the_rest_in_the_compute_dtype():
    model = Tiny()
    line = finetune.apply(model, _cfg(mode="lora", lora={"rank": 2}), 0, torch.bfloat16)
    trainable = _trainable(model)
    assert trainable == {n for n, _ in model.named_parameters() if "lora_" in n or n.startswith("head.")}
    assert "layers.1.self_attention.layernorm_qkv.lora_A.weight" in trainable
    assert "layers.0.self_attention.proj.lora_B.weight" in trainable
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in trainable else torch.bfloat16), name
    assert "LoRA rank 2 on 4 modules (layernorm_qkv, proj)" in line and "stored in bfloat16" in line
    _to_param_dtype(model, torch.float32)  # what ddp and mfsdp apply: the frozen weights stay narrow
    assert model.layers[0].self_attention.proj.weight.dtype == torch.bfloat16
    assert model.head[0].weight.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 10, (2, 5))).float().sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable


def test_lora_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match="finetune.mode=lora with distributed.tp=2"):
        finetune.apply(Tiny(), _cfg(mode="lora"), 0, None, tp_size=2)


BLOCKS = ["layers.0", "layers.1"]


def _groups(model, **kw):
    return optim.param_groups(model.named_parameters(), 0.1, set(), 1e-3, _cfg(**kw), BLOCKS)


def test_default_groups_are_the_two_weight_decay_groups():
    groups = _groups(Tiny())
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert all("lr" not in g and "lr_scale" not in g for g in groups)


def test_layer_decay_and_backbone_scale_give_each_part_its_learning_rate():
    model = Tiny()
    groups = _groups(model, backbone_lr_scale=0.5, layer_decay=0.8)
    by_name = {g["name"]: g for g in groups}
    assert list(by_name) == [
        "head.decay", "head.no_decay", "embeddings.decay", "block0.decay", "block0.no_decay",
        "block1.decay", "block1.no_decay", "backbone.no_decay",
    ]  # fmt: skip
    assert by_name["head.decay"]["lr"] == 1e-3 and by_name["head.no_decay"]["weight_decay"] == 0.0
    assert by_name["embeddings.decay"]["lr"] == pytest.approx(1e-3 * 0.5 * 0.8**3)
    assert by_name["block0.decay"]["lr"] == pytest.approx(1e-3 * 0.5 * 0.8**2)
    assert by_name["block1.no_decay"]["lr"] == pytest.approx(1e-3 * 0.5 * 0.8)
    assert by_name["backbone.no_decay"]["lr"] == pytest.approx(1e-3 * 0.5)  # the final norm, after the blocks
    assert by_name["backbone.no_decay"]["params"] == [model.final_norm.weight, model.final_norm.bias]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    only_scale = {g["name"]: g["lr_scale"] for g in _groups(Tiny(), backbone_lr_scale=0.1)}
    assert only_scale == {"head.decay": 1.0, "head.no_decay": 1.0, "backbone.decay": 0.1, "backbone.no_decay": 0.1}


def test_schedule_and_resume_keep_each_groups_share_of_the_learning_rate():
    sched = OmegaConf.structured(SchedulerConfig(warmup_steps=2))
    opt_cfg = OmegaConf.structured(OptimConfig(lr=1e-3))
    model = Tiny()
    optimizer = optim.build_optimizer(_groups(model, backbone_lr_scale=0.5, layer_decay=0.8), opt_cfg)
    scheduler = optim.build_scheduler(optimizer, sched, 10)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    ratios = [g["lr"] / optimizer.param_groups[0]["lr"] for g in optimizer.param_groups]
    assert ratios[0] == 1 and ratios[2] == pytest.approx(0.5 * 0.8**3)
    saved = (optimizer.state_dict(), scheduler.state_dict())
    again = optim.build_optimizer(_groups(model, backbone_lr_scale=0.5, layer_decay=0.8), opt_cfg)
    resumed = optim.build_scheduler(again, sched, 10)
    again.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    notes = optim.resume_schedule(again, resumed, opt_cfg, sched, TrainState(step=3, schedule_steps=10), 10)
    assert notes == []
    assert [g["lr"] for g in again.param_groups] == pytest.approx([g["lr"] for g in optimizer.param_groups])
    assert resumed.base_lrs == pytest.approx([1e-3 * r for r in ratios])


def test_esm2_with_lora_gives_the_logits_of_its_merged_weights():
    from core.layers.lora import merge_lora_weights
    from core.layers.namespace import get_layers
    from recipes.esm2.model import ESM2
    from tests.support.helpers import validated_config

    overrides = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2"]
    overrides += ["model.ffn_hidden_size=64", "model.max_seq_length=64", "checkpoint.path=/tmp/unused"]
    m = validated_config("esm2_sanity", overrides).model
    layers = get_layers("torch")
    torch.manual_seed(0)
    adapted = ESM2(m, layers).eval()
    finetune.apply(adapted, _cfg(mode="lora", head=["lm_head"], lora={"rank": 4, "alpha": 8}), 0, None)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    merged = ESM2(m, layers).eval()
    merged.load_state_dict(merge_lora_weights(adapted.state_dict(), scale=8 / 4))
    tokens = torch.randint(4, 24, (2, 20))
    cu = torch.tensor([[0, 7, 20], [0, 12, 20]], dtype=torch.int32)
    unmerged_logits = adapted(tokens, cu)
    torch.testing.assert_close(unmerged_logits, merged(tokens, cu), rtol=1e-5, atol=1e-5)
    base = ESM2(m, layers).eval()
    base.load_state_dict({k: v for k, v in adapted.state_dict().items() if "lora_" not in k})
    assert (base(tokens, cu) - unmerged_logits).abs().max() > 1e-3  # the adapters do change the logits
