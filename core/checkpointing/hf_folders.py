"""Hugging Face model folders and this repository's runs, for the recipes' to-hf / from-hf conversions: reading
a folder's config.json and weights (safetensors, sharded or not, or a weights-only torch file) without running
code from them, reading a run's settings and weights, and writing imported weights where
`checkpoint.init_from` takes them; PEFT LoRA adapters: their adapter_config.json checked, their safetensors read
(LoRA only on the modules target_modules takes), and a run's finetune.lora settings."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from core.checkpointing.pickle_guard import UnsafeCheckpoint, beyond_its_storage, beyond_their_storages, load_torch_file
from core.config.file_shape import NotThisKindOfFile, problems, read_small_file, shown
from core.config.schema import LoraConfig

MAX_JSON_BYTES = 64 << 20  # config.json, adapter_config.json, a shard index: kilobytes to a few megabytes


def _plain_file_name(name: str) -> str:
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError("should be the name of a file in the model folder (no '/', no '..')")
    return name


class ShardIndex(BaseModel):
    """model.safetensors.index.json: which shard file (in the same folder) holds each tensor."""

    model_config = ConfigDict(strict=True)
    weight_map: Annotated[dict[str, Annotated[str, AfterValidator(_plain_file_name)]], Field(min_length=1)]


JSON_OBJECT = TypeAdapter(dict[str, Any])


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; ValueError naming the file if it is not UTF-8 JSON text or not
    an object, or not a regular file of at most MAX_JSON_BYTES (a FIFO, a device, a sparse file of gigabytes)."""
    try:
        return JSON_OBJECT.validate_json(read_small_file(file, MAX_JSON_BYTES, follow_symlinks=True), strict=True)
    except NotThisKindOfFile as e:
        raise ValueError(f"{file}: {e}; nothing was imported") from None
    except ValidationError as e:
        raise ValueError(
            f"{file}: {problems(e)} (expected a JSON object, in UTF-8 text); nothing was imported"
        ) from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, else sharded safetensors (model.safetensors.index.json), else pytorch_model.bin: the order
    of transformers' from_pretrained, so a stale index or .bin beside model.safetensors is not read. ValueError for
    weights that hold NaN or infinite values."""
    if (folder / "model.safetensors").is_file():
        return check_finite(_load_safetensors(folder / "model.safetensors"), folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = ShardIndex.model_validate(read_json_object(index)).weight_map
        except ValidationError as e:
            raise ValueError(f"{index}: {problems(e)}; nothing was imported") from None
        return check_finite(_read_shards(index, weight_map), folder)
    if (folder / "pytorch_model.bin").is_file():
        return check_finite(_load_torch_weights(folder / "pytorch_model.bin"), folder)
    raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def check_finite(weights: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """`weights`, refused (ValueError naming `source` and the tensors) where a value is NaN or infinite: a model
    trained from them would only learn NaN."""
    bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ValueError(f"{source}: {shown(bad[0])}{more} hold NaN or infinite values; nothing was imported")
    return weights


def _read_shards(index: Path, weight_map: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each tensor from the shard weight_map names for it; ValueError naming the index, tensor and shards for a
    shard that holds a tensor the map gives to another shard (or to none: which copy is meant?) or lacks one it
    is given."""
    folder, shards = index.parent, sorted(set(weight_map.values()))
    absent = [shard for shard in shards if not (folder / shard).is_file()]
    if absent:
        raise ValueError(f"{index}: weight_map names {', '.join(absent)}, not a file in {folder}; nothing was imported")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = _load_safetensors(folder / shard)
        for name in sorted(tensors):
            if weight_map.get(name) != shard:
                given = f"gives it to {weight_map[name]}" if name in weight_map else "does not name it"
                raise ValueError(f"{index}: {shard} holds {shown(name)}, but weight_map {given}; nothing was imported")
        missing = sorted(name for name, where in weight_map.items() if where == shard and name not in tensors)
        if missing:
            raise ValueError(
                f"{index}: weight_map gives {shown(missing[0])} to {shard}, which does not hold it; "
                "nothing was imported"
            )
        weights |= tensors
    return weights


def _load_torch_weights(file: Path) -> dict[str, torch.Tensor]:
    """A state dict saved by torch.save; ValueError naming the file if it holds anything else (a list, a dict of
    numbers or of dicts), which the import would otherwise meet as an AttributeError. (safetensors files always
    hold a dict of tensor names to tensors.)"""
    try:  # weights_only, after the guard every checkpoint pickle passes: loading runs no code from the file
        weights = load_torch_file(file)
    except UnsafeCheckpoint as e:
        raise ValueError(f"{file}: refusing to load it: {e}; nothing was imported") from None
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"{file}: cannot read as torch weights ({type(e).__name__}: {e}); nothing was imported"
        ) from None
    if not isinstance(weights, dict):
        raise ValueError(
            f"{file}: holds {type(weights).__name__}, not a state dict (tensor names to tensors); nothing was imported"
        )
    for key, value in weights.items():
        what = (
            f"key {shown(key)} is not a string"
            if not isinstance(key, str)
            else f"{shown(key)} holds {type(value).__name__}, not a tensor"
            if not isinstance(value, torch.Tensor)
            else None
        )
        if what:
            raise ValueError(f"{file}: not a state dict (tensor names to tensors): {what}; nothing was imported")
        if beyond_its_storage(value):
            raise ValueError(
                f"{file}: refusing to load it: {shown(key)} is {beyond_its_storage(value)}; nothing was imported"
            )
    aliased = beyond_their_storages(weights.values())
    if aliased:
        raise ValueError(f"{file}: refusing to load it: {aliased}; nothing was imported")
    return weights


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 (safetensors' own error type is not a ValueError)
        raise ValueError(
            f"{file}: cannot read as safetensors ({type(e).__name__}: {e}); nothing was imported"
        ) from None


def read_run(
    source: Path,
    config: Optional[str],
    verify_checksums: bool,
    recipe: str,
    get_recipe: Callable,
    data_keys: tuple[str, ...] = (),
) -> tuple[Any, dict[str, torch.Tensor]]:
    """A `recipe` run's settings (a SavedConfig: the model and the `data_keys` settings) and full weights: a step
    folder (its config.yaml; `config`, when given too, must agree with it in every model setting) or a
    weights file (.pt/.safetensors of `checkpoint.py to-torch`/`to-safetensors`) with `config` (the run's
    config.yaml). A config is read as plain data and checked against the recipe's schemas (never resolved;
    `get_recipe`: the registry's, recipes/registry.py)."""
    from core.checkpointing.layout import CheckpointError, resolve_checkpoint
    from core.checkpointing.saved_config import CONFIG_FILE, read_saved_config
    from core.checkpointing.weights import load_weights_file, read_model_weights

    source = resolve_checkpoint(source)  # a run's checkpoint root (or <root>/last): its newest step folder
    if not source.exists():
        raise CheckpointError(f"{source}: no such step folder or weights file")
    if config is None and source.is_file():
        raise CheckpointError(
            f"{source} is a weights file, which holds no model settings: give the run's "
            "config with --config (a step folder's config.yaml or the run's resolved_config.yaml)"
        )
    folder_config = source / CONFIG_FILE if source.is_dir() and (source / CONFIG_FILE).is_file() else None
    files = [f for f in (folder_config, Path(config) if config is not None else None) if f is not None]
    if not files:
        raise CheckpointError(
            f"{source / CONFIG_FILE}: no such config (a step folder holds the run's settings in "
            "config.yaml; --config names another)"
        )
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: no such config")
    runs = [read_saved_config(file, get_recipe, expected_recipe=recipe, data_keys=data_keys) for file in files]
    saved = runs[0]  # the step folder's own, when it has one
    for other in runs[1:]:
        for key, value in saved.model_settings.items():
            if other.settings.get(key) != value:
                raise CheckpointError(
                    f"--config {other.file} has {key}={other.settings.get(key)!r}, but {saved.file} "
                    f"trained with {key}={value!r}: leave --config out (the step folder's "
                    "config.yaml is the default), or name the run's own"
                )
    weights = read_model_weights(source, verify_checksums) if source.is_dir() else load_weights_file(source)
    return saved, weights


def read_hf_config(hf_dir: str, out: str) -> tuple[Path, Path, dict[str, Any]]:
    """An import's settings: (the folder, the target path, its config.json); refuses a folder without config.json,
    a target that exists and a quantized model."""
    folder, target = Path(hf_dir), Path(out)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face model folder holds one)")
    if target.exists():
        raise FileExistsError(f"{target} exists; choose a new path")
    config = read_json_object(folder / "config.json")
    if config.get("quantization_config") is not None:
        raise ValueError(
            f"{folder / 'config.json'}: a quantized model (quantization_config "
            f"{shown(config['quantization_config'])}); import the unquantized weights; nothing was imported"
        )
    return folder, target, config


def read_hf_folder(hf_dir: str, out: str) -> tuple[Path, Path, dict[str, Any], dict[str, torch.Tensor]]:
    """An import's inputs: read_hf_config's, and the folder's weights in fp32 (our master weights' dtype)."""
    folder, target, config = read_hf_config(hf_dir, out)
    weights = read_hf_weights(folder)  # floats in fp32; anything else is kept as it is, for the check to name
    return folder, target, config, {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def weight_mismatches(
    hf: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], ignored: Callable[[str], bool], settings: str
) -> list[str]:
    """What keeps weights `hf` from being the `expected` tensors (name -> shape, from `settings`): missing,
    unexpected (but for those `ignored`), misshapen and not floating point (quantized) tensors, a few of each
    named; empty when they fit."""
    missing = sorted(set(expected) - set(hf))
    unexpected = sorted(k for k in set(hf) - set(expected) if not ignored(k))
    both = sorted(set(expected) & set(hf))
    shapes = [
        f"{k} {tuple(hf[k].shape)} ({settings}: {expected[k]})" for k in both if tuple(hf[k].shape) != expected[k]
    ]
    quantized = [k for k in both if not hf[k].is_floating_point()]
    return [
        f"{what}: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"
        for what, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("other shape", shapes),
            ("not floating point (quantized?)", quantized),
        )
        if names
    ]


def layer_count(weights: dict, prefix: str) -> int:
    """How many layers the names `<prefix><i>.` of `weights` hold: their distinct indices, never more than the
    tensors (a gap shows as missing tensors in the shape check that follows; the highest index + 1 would let one
    tensor named `layers.2147483646.` make that check build a table of billions)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({int(m[1]) for m in map(pattern.match, weights) if m})


def override(key: str, value: Any) -> str:
    """`key=value` as one shell word that Hydra reads back as the text of `value`: quoted for Hydra only where
    it would read something else (a comma makes a sweep, `1e5` a number, edge spaces are dropped), then for
    the shell (spaces)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    text = str(value)
    try:
        plain = OverridesParser.create().parse_override(f"{key}={text}").value() == text
    except HydraException:
        plain = False
    if not plain:  # Hydra's quoted strings: backslashes are escaped only before a quote or at the end
        text = '"' + re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), text) + '"'
    return shlex.quote(f"{key}={text}")


def write_weights(weights: dict[str, torch.Tensor], target: Path, source: str) -> None:
    """Imported weights as a .safetensors or .pt file, or (another path) a new step folder, all of which
    checkpoint.init_from reads."""
    from core.checkpointing.conversion import write_weights_step
    from core.checkpointing.output_files import save_safetensors, save_torch

    if target.suffix == ".safetensors":
        target.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(weights, target)
    elif target.suffix in (".pt", ".pth"):
        target.parent.mkdir(parents=True, exist_ok=True)
        save_torch(weights, target)
    else:
        write_weights_step(weights, target, source)


# --- PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) ------------------------------------------
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # before the base model's own tensor names


def peft_lora_config(
    lora: dict[str, Any],
    task_type: str,
    targets: list[str],
    base: Optional[str] = None,
    modules_to_save: Optional[list[str]] = None,
) -> dict[str, Any]:
    """A PEFT adapter_config.json for LoRA adapters of finetune.lora's rank, alpha and dropout on `targets` (plain
    LoRA: no bias, DoRA or rsLoRA), as PEFT writes one for `task_type` (CAUSAL_LM, SEQ_CLS, TOKEN_CLS)."""
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": targets,
        "modules_to_save": modules_to_save,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def check_adapter_config(config: dict[str, Any], file: Path) -> tuple[int, float]:
    """(r, lora_alpha) of a PEFT adapter_config.json whose LoRA we compute; ValueError naming the setting otherwise."""

    def need(condition: bool, what: str) -> None:
        if not condition:
            raise ValueError(f"{file}: {what}; not a LoRA adapter this recipe computes, nothing was imported")

    need(config.get("peft_type") == "LORA", f"peft_type={config.get('peft_type')!r}, expected 'LORA'")
    r, alpha = config.get("r"), config.get("lora_alpha")
    # finetune.lora's own ranges: a value they refuse (lora_alpha=1e400 is inf) would give a command that fails
    for key, value, rule in (("r", r, LoraConfig.RANGES["rank"]), ("lora_alpha", alpha, LoraConfig.RANGES["alpha"])):
        need(rule.accepts(value), f"{key}={shown(value)}: expected {rule.expected(key)}")
    for key, plain in (("bias", "none"), ("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
        need(config.get(key, plain) == plain, f"{key}={config.get(key)!r} (only {plain!r} is mapped)")
    for key in (
        "lora_bias",
        "layers_to_transform",
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
    ):
        need(not config.get(key), f"{key}={config.get(key)!r} (not mapped)")
    for key in ("rank_pattern", "alpha_pattern"):
        need(not config.get(key), f"{key}={config.get(key)!r}: one rank and alpha for every module are mapped")
    return r, float(alpha)


LORA_TENSOR = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_[AB]\.weight")  # group 1: the module's full name


def check_adapter_targets(config: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Every LoRA tensor of the adapter in `folder` on a module that its adapter_config.json's target_modules takes
    and exclude_modules leaves, matched as PEFT does (peft/tuners/tuners_utils.py check_target_module_exists);
    ValueError naming the file, tensor and target_modules otherwise: PEFT builds LoRA on those modules alone and
    leaves any other tensor of the file unused, without a warning."""
    config_file, targets, leave = folder / ADAPTER_CONFIG, config.get("target_modules"), config.get("exclude_modules")
    # "all-linear": every Linear but the output layer, which holds each module a recipe maps
    all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
    targeted = None if all_linear else _module_names(targets, "target_modules", config_file)
    excluded = _module_names(leave or [], "exclude_modules", config_file)
    for name in sorted(tensors):
        found = LORA_TENSOR.fullmatch(name)
        outside = found is not None and targeted is not None and not targeted(found[1])
        if outside or (found is not None and excluded(found[1])):
            why = f"outside target_modules={shown(targets)}" if outside else f"in exclude_modules={shown(leave)}"
            raise ValueError(
                f"{folder / ADAPTER_WEIGHTS}: {shown(name)}: LoRA on a module {why} of {ADAPTER_CONFIG} (PEFT builds "
                "no LoRA there and leaves the tensor unused); nothing was imported"
            )


def _module_names(value: Any, key: str, file: Path) -> Callable[[str], bool]:
    """Whether a module's full name is one that PEFT's `key` (target_modules, exclude_modules) names: a list of names
    takes a module whose full name is one of them or ends with "." and one; a string is a regular expression the
    full name must match whole."""
    if isinstance(value, str):
        try:
            pattern = re.compile(value)
        except re.error as e:
            raise ValueError(
                f"{file}: {key}={shown(value)}: not a regular expression ({e}); nothing was imported"
            ) from None
        return lambda module: pattern.fullmatch(module) is not None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError(
            f"{file}: {key}={shown(value)}: expected a list of module names or a regular expression (as PEFT saves "
            "them); nothing was imported"
        )
    return lambda module: any(module == name or module.endswith("." + name) for name in value)


def our_lora_alpha(r: int, alpha: float, rank: int, file: Path) -> float:
    """finetune.lora.alpha for an adapter's LoRA of PEFT rank `r` and lora_alpha `alpha`, read as one LoRA of rank
    `rank` (PEFT's fused q/k/v: a multiple of r), keeping PEFT's scale alpha / r; ValueError naming `file` if that
    rank or alpha is beyond finetune.lora's ranges (checked before anything is written: the settings printed
    for the import would be refused)."""
    ours = alpha * rank / r
    for key, value, rule in (("rank", rank, LoraConfig.RANGES["rank"]), ("alpha", ours, LoraConfig.RANGES["alpha"])):
        if not rule.accepts(value):
            raise ValueError(
                f"{file}: r={r}, lora_alpha={alpha:g} give finetune.lora.{key}={value:g}: expected "
                f"{rule.expected(key)}; nothing was imported"
            )
    return ours


def lora_settings(file: Path) -> dict[str, Any]:
    """finetune.lora of a run's config.yaml (read as plain data): rank, alpha, dropout."""
    from core.checkpointing.layout import CheckpointError
    from core.checkpointing.saved_config import read_config_file

    finetune = read_config_file(file).get("finetune")
    lora = finetune.get("lora") if isinstance(finetune, dict) else None
    if not isinstance(lora, dict):
        raise CheckpointError(f"{file}: no finetune.lora settings, but the weights hold LoRA matrices")
    rank, alpha, dropout = lora.get("rank"), lora.get("alpha"), lora.get("dropout", 0.0)
    for key, value, fits in (
        ("rank", rank, isinstance(rank, int) and not isinstance(rank, bool) and rank > 0),
        ("alpha", alpha, isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0),
        ("dropout", dropout, isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1),
    ):
        if not fits:
            raise CheckpointError(f"{file}: finetune.lora.{key}={value!r}")
    return {"rank": rank, "alpha": alpha, "dropout": dropout}


def read_adapter(folder: Path, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT adapter folder: (adapter_config.json, adapter_model.safetensors' tensors, the settings a recipe's export
    keeps in its metadata under `key`, or {}). A pickled adapter_model.bin is refused, never loaded, and so is a
    tensor that is not floating point (int8, bool: as base weights of such dtypes are), naming it."""
    from safetensors import safe_open

    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no {ADAPTER_CONFIG} (a PEFT adapter folder holds one)")
    if not weights.is_file():
        pickled = [f.name for f in (folder / "adapter_model.bin", folder / "adapter_model.pt") if f.is_file()]
        raise FileNotFoundError(
            f"{folder}: no {ADAPTER_WEIGHTS}"
            + (
                f" ({pickled[0]} is a pickle, which is never loaded: save the adapter as safetensors)"
                if pickled
                else ""
            )
        )
    try:
        with safe_open(str(weights), "pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # noqa: BLE001 (safetensors' own error type is not a ValueError)
        raise ValueError(
            f"{weights}: cannot read as safetensors ({type(e).__name__}: {e}); nothing was imported"
        ) from None
    for name, t in tensors.items():  # int8 or bool values cast to float would merge as weights they never were
        if not t.is_floating_point():
            raise ValueError(
                f"{weights}: {shown(name)} is {t.dtype}, not floating point (quantized?); nothing was imported"
            )
    check_finite(tensors, weights)
    try:
        ours = json.loads(metadata.get(key, "{}"))
    except (
        ValueError,
        RecursionError,
    ):  # not ours, or crafted (e.g. an integer of thousands of digits): read as an adapter of another tool
        ours = {}
    return read_json_object(config_file), tensors, ours if isinstance(ours, dict) else {}
