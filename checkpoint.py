"""Checkpoints of this repository's runs, on the command line (the functions it calls: core/checkpointing/).

Torch DCP step folders `<checkpoint.path>/step_<N>/` (layout: core/checkpointing/layout.py), resumed
automatically, kept by the `checkpoint.keep_*` rules, and converted to and from plain weight files:

  python checkpoint.py to-torch <step_dir> <out.pt>                 # {name: tensor}, torch.load-able
  python checkpoint.py to-safetensors <step_dir> <out.safetensors>
  python checkpoint.py from-torch <file.pt|file.safetensors> <step_dir>   # weights only: a fresh start
  python checkpoint.py to-hf <step_dir> <out_dir>                   # GPT -> LlamaForCausalLM (LoRA merged, the
                                                                    # tokenizer and chat template copied), ESM-2
                                                                    # -> EsmForMaskedLM, esm2_finetune ->
                                                                    # EsmFor*Classification
  python checkpoint.py to-hf <step_dir> <out_dir> --adapter         # a GPT's or esm2_finetune's LoRA -> a PEFT adapter
  python checkpoint.py to-hf <file.pt|file.safetensors> <out_dir> --config <the run's config.yaml>
  python checkpoint.py from-hf <hf_dir> <out.safetensors|step_dir>  # a Llama or ESM folder -> GPT, ESM-2 or
                                                                    # esm2_finetune weights (by config.json)
  python checkpoint.py from-hf <adapter_dir> <out> --base <hf_dir>  # a PEFT LoRA adapter on that model (Llama, ESM)

One process, no GPU needed. Reading a step folder runs no code from it (DCP's index is read from index.json, or
from the pickle by PyTorch's weights_only unpickler: core/checkpointing/dcp_index.py; its config.yaml is read as
plain data and checked against the recipe's schemas: core/checkpointing/saved_config.py) and checks every file against
the CRC-32 recorded when it was written (`--skip-checksums` to read a damaged checkpoint anyway). to-hf takes the model
settings from the step folder's config.yaml; a `--config` whose model settings differ from it is refused.
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import yaml

from core.checkpointing.conversion import from_torch, to_safetensors, to_torch
from core.checkpointing.layout import CheckpointError


def _check_writable(out: str) -> None:
    """An OSError naming `out` if it exists (a file of the user's, or of the checkpoint being read) or cannot be
    written (a missing folder, no permission): torch.save and safetensors report that as a RuntimeError of their
    own, after the weights are read."""
    path = Path(out)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if path.exists() or path.is_symlink():
        raise FileExistsError(f"{path} exists; choose a new path")
    with open(path, "xb"):
        pass
    path.unlink()


def run_recipe(source: Path, config: Optional[str]) -> Optional[str]:
    """The `recipe:` of the run a step folder (its config.yaml) or --config belongs to, read as plain data; None when
    neither says (the conversion then names what is missing)."""
    from core.checkpointing.layout import resolve_checkpoint
    from core.checkpointing.saved_config import CONFIG_FILE

    source = resolve_checkpoint(source)
    for file in (Path(config) if config else None, source / CONFIG_FILE if source.is_dir() else None):
        if file is not None and file.is_file():
            try:
                recipe = yaml.safe_load(file.read_text()).get("recipe")
            except (yaml.YAMLError, AttributeError, UnicodeDecodeError, RecursionError):  # (Recursion: nested deeply)
                continue  # the conversion reads the file again and says what is wrong with it
            return recipe if isinstance(recipe, str) else None
    return None


def exporter(source: Path, config: Optional[str]) -> ModuleType:
    """The Hugging Face conversion of the run `source` belongs to (recipes/registry.py:hf_conversions)."""
    from recipes.registry import hf_conversions

    conversions, recipe = hf_conversions(), run_recipe(source, config)
    if recipe is not None and recipe not in conversions:
        raise CheckpointError(
            f"{source}: a checkpoint of the {recipe} recipe; to-hf exports those of the "
            f"{listed(sorted(conversions))} recipe{'s' if len(conversions) > 1 else ''}"
        )
    # With no recipe to be read, any export refuses the run first, naming what is missing (core/checkpointing/
    # hf_folders.py:read_run); a sorted pick keeps that message the same from run to run.
    return conversions[recipe] if recipe is not None else conversions[min(conversions)]


def importer(hf_dir: str, out: str, adapter: bool = False) -> ModuleType:
    """The Hugging Face conversion (recipes/registry.py:hf_conversions) whose HF_MODEL_TYPES holds the folder's
    config.json model_type, and, where several recipes read that model_type, whose HF_ARCHITECTURES (optional: all
    when absent) holds its architectures; `adapter`: one that reads PEFT adapters on such a folder
    (import_adapter_from_hf). The folder, the output path and config.json are checked first, as the import does."""
    from core.checkpointing.hf_folders import read_hf_config
    from recipes.registry import hf_conversions

    folder, _, config = read_hf_config(hf_dir, out)
    conversions = {n: c for n, c in hf_conversions().items() if not adapter or hasattr(c, "import_adapter_from_hf")}
    readers: dict[str, list[str]] = {}
    for name, module in conversions.items():
        for model_type in module.HF_MODEL_TYPES:
            readers.setdefault(model_type, []).append(name)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in readers:
        supported = [f"{t!r} ({recipes_named(names)})" for t, names in sorted(readers.items())]
        raise ValueError(
            f"{folder / 'config.json'}: model_type={model_type!r}; from-hf reads model_type {listed(supported, 'or')}"
        )
    names = readers[model_type]
    architectures = config.get("architectures")
    architectures = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    # The recipe that names one of the folder's architectures, else the one that names none (reads any).
    named = [n for n in names if set(architectures) & set(getattr(conversions[n], "HF_ARCHITECTURES", ()))]
    fits = named or [n for n in names if not hasattr(conversions[n], "HF_ARCHITECTURES")]
    fits = names if adapter and len(names) == 1 else fits  # an adapter's base: the model it adapts (EsmForMaskedLM)
    if len(fits) != 1:
        known = [f"{a} ({recipes_named([n])})" for n in names for a in getattr(conversions[n], "HF_ARCHITECTURES", ())]
        raise ValueError(
            f"{folder / 'config.json'}: architectures={architectures!r}; from-hf reads model_type {model_type!r} "
            f"as {listed(known, 'or')}"
        )
    return conversions[fits[0]]


def recipes_named(names: list[str]) -> str:
    return f"the {listed(names)} recipe{'s' if len(names) > 1 else ''}"


def listed(names: list[str], conjunction: str = "and") -> str:
    """`a`, `a and b`, `a, b and c`."""
    return f" {conjunction} ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Convert checkpoints of this repository's training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help in (
        ("to-torch", "step folder -> one torch.save file of the full model weights"),
        ("to-safetensors", "step folder -> one .safetensors file of the full model weights"),
    ):
        command = sub.add_parser(name, help=help)
        command.add_argument("step_dir")
        command.add_argument("out")
        command.add_argument(
            "--skip-checksums",
            action="store_true",
            help="do not check the files against the checksums recorded when they were written",
        )
    command = sub.add_parser("from-torch", help=".pt/.safetensors model weights -> a step folder")
    command.add_argument("source")
    command.add_argument("step_dir")
    command = sub.add_parser(
        "to-hf", help="a GPT or ESM-2 step folder -> a Hugging Face LlamaForCausalLM or EsmForMaskedLM folder"
    )
    command.add_argument("step_dir", help="a step folder, or a .pt/.safetensors file of to-torch/to-safetensors")
    command.add_argument("out_dir")
    command.add_argument(
        "--config",
        help="the run's config.yaml: needed for a weights file; a step folder's own is the "
        "default, and a --config whose model settings differ from it is refused",
    )
    command.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the written weights")
    command.add_argument(
        "--skip-checksums",
        action="store_true",
        help="do not check the files against the checksums recorded when they were written",
    )
    command.add_argument(
        "--adapter",
        action="store_true",
        help="a fine-tuning run's LoRA (finetune.mode=lora) and head (esm2_finetune) as a PEFT adapter "
        "(adapter_config.json + adapter_model.safetensors) for the Hugging Face model the run started from",
    )
    command = sub.add_parser(
        "from-hf",
        help="a Hugging Face Llama, ESM or ESM classification folder (or a PEFT adapter with --base) -> GPT, ESM-2 "
        "or esm2_finetune weights for checkpoint.init_from",
    )
    command.add_argument("hf_dir", help="a Hugging Face model folder, or a PEFT adapter folder (with --base)")
    command.add_argument("out", help="a .safetensors or .pt file, or a new step folder")
    command.add_argument("--base", help="for a PEFT adapter: the Hugging Face folder of the model it adapts")
    command.add_argument("--unfused-qkv", action="store_true", help="for model.fuse_qkv_params=false")
    args = parser.parse_args(argv)
    try:
        if args.command in ("to-torch", "to-safetensors"):
            _check_writable(args.out)
            convert = to_torch if args.command == "to-torch" else to_safetensors
            convert(args.step_dir, args.out, verify_checksums=not args.skip_checksums)
        elif args.command == "from-torch":
            from_torch(args.source, args.step_dir)
        elif args.command == "to-hf":
            export = exporter(Path(args.step_dir), args.config)
            if args.adapter and not hasattr(export, "export_adapter"):
                raise ValueError(f"--adapter: {args.step_dir} is not a run with LoRA (gpt, esm2_finetune)")
            export.export_to_hf(
                args.step_dir,
                args.out_dir,
                verify_checksums=not args.skip_checksums,
                dtype=args.dtype,
                config=args.config,
                **({"adapter": True} if args.adapter else {}),
            )
        else:
            from_hf(args)
    except (CheckpointError, ValueError, OSError) as e:  # OSError: an output that cannot be written, a missing input
        raise CommandFailed(f"error: {e}", 3 if isinstance(e, CheckpointError) else 2) from None


def from_hf(args: argparse.Namespace) -> None:
    fuse_qkv = not args.unfused_qkv
    if args.base is None and (Path(args.hf_dir) / "adapter_config.json").is_file():
        raise ValueError(f"{args.hf_dir}: a PEFT adapter (adapter_config.json): name the model it adapts with --base")
    if args.base is None:
        importer(args.hf_dir, args.out).import_from_hf(args.hf_dir, args.out, fuse_qkv=fuse_qkv)
    else:
        reader = importer(args.base, args.out, adapter=True)
        reader.import_adapter_from_hf(args.hf_dir, args.base, args.out, fuse_qkv=fuse_qkv)


class CommandFailed(SystemExit):
    """Ends the command with its line on stderr and `code` (2: an input or output to fix, 3: a checkpoint);
    str() is the line, for callers from Python."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.code = code  # what the interpreter exits with (it prints nothing more for an int)
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
