"""What an entry point's command line says before Hydra composes anything: the config it names
(`--config-name`), the configs there are to name, and the usage `--help` shows.

    python train.py
    config error: train.py needs a config: --config-name <name>, one of esm2_150m, esm2_650m, ...
    python predict.py checkpoint.init_from=outputs/vit_sanity/checkpoints     # the config it was trained with

Hydra alone would compose an empty config for a command without --config-name and answer every key with
"not in struct" and advice to add it with `+`; its --help lists the schemas Hydra's store holds as options.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
SHARED_CONFIGS = ("train_defaults",)  # what the configs build on, never run by itself
# Hydra's own options, which need no config of ours.
HYDRA_FLAGS = ("--hydra-help", "--version", "--shell-completion", "-sc", "--info", "-i")
HELP_FLAGS = ("--help", "-h")
SCHEMA_SUFFIX = "_schema"  # the recipes' schemas, stored in the model and data groups (core/config/validation.py)


def schema_name(recipe: str, group: str) -> str:
    """The one place that names a recipe's `group` (model | data) schema: how core/config/validation.py stores it in
    Hydra's ConfigStore, and what a group option's `defaults:` list names to build on it (`gpt_data_schema`)."""
    return f"{recipe}_{group}{SCHEMA_SUFFIX}"


def recipe_of_schema_name(group: str, name: str) -> Optional[str]:
    """The recipe of a `group` schema's stored name (schema_name's inverse; a .yaml suffix allowed), or None."""
    suffix = schema_name("", group)
    name = name.removesuffix(".yaml")
    return name.removesuffix(suffix) if name.endswith(suffix) and name != suffix else None


def config_name(argv: list[str]) -> Optional[str]:
    """The config a command line names with --config-name (or -cn), the last one winning; None if none."""
    name = None
    for i, arg in enumerate(argv):
        for flag in ("--config-name", "-cn"):
            if arg == flag and i + 1 < len(argv):
                name = argv[i + 1]
            elif arg.startswith(flag + "="):
                name = arg.split("=", 1)[1]
    return name


def configs() -> list[str]:
    """The configs a command can name: configs/*.yaml but the shared defaults."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml") if p.stem not in SHARED_CONFIGS)


def group_options() -> dict[str, list[str]]:
    """{group: its options} for the config groups under configs/ (hydra/ and the recipes' schemas left out)."""
    groups = {}
    for folder in sorted(p for p in CONFIGS_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        groups[folder.name] = sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.endswith(SCHEMA_SUFFIX))
    return groups


@functools.lru_cache(maxsize=None)  # the repository's files, read once per process
def schema_of_option(group: str, option: str) -> Optional[str]:
    """The schema a group option builds on (its `defaults:` list names it: `gpt_data_schema`), or None."""
    from omegaconf import OmegaConf

    try:
        defaults = OmegaConf.to_container(OmegaConf.load(CONFIGS_DIR / group / f"{option}.yaml")).get("defaults") or []
    except Exception:  # noqa: BLE001 - a file Hydra refuses with its own message
        return None
    named = [d for d in defaults if isinstance(d, str) and d.endswith(SCHEMA_SUFFIX)]
    return named[0] if named else None


def options_for(group: str, recipe: str) -> list[str]:
    """The options of `group` made for `recipe` (built on its schema, `<recipe>_<group>_schema`)."""
    return [
        option
        for option in group_options().get(group, [])
        if schema_of_option(group, option) == schema_name(recipe, group)
    ]


@functools.lru_cache(maxsize=None)
def recipe_of_config(name: str, depth: int = 0) -> Optional[str]:
    """The recipe a config trains: its `recipe:`, else that of the config its `defaults:` list builds on
    (vit_predict: vit_base_patch16_224's); None where it does not say."""
    from omegaconf import OmegaConf

    try:
        tree = OmegaConf.to_container(OmegaConf.load(CONFIGS_DIR / f"{name}.yaml"))
    except Exception:  # noqa: BLE001 - a missing or broken config Hydra refuses with its own message
        return None
    if isinstance(tree.get("recipe"), str):
        return tree["recipe"]
    bases = [d for d in tree.get("defaults") or [] if isinstance(d, str) and d in configs()]
    return recipe_of_config(bases[0], depth + 1) if bases and depth < 8 else None


def other_recipes_option(group: str, given: str, owner: str, recipe: str) -> str:
    """The refusal of `given` (`data=moby_dick`, or the group's name), an option of the `owner` recipe's group, in a
    config of `recipe`."""
    return (
        f"{given} is {group} of the {owner} recipe, but this config trains the {recipe} recipe: choose "
        f"{group}=<one of {', '.join(options_for(group, recipe)) or 'none shipped'}>, or a config of the {owner} "
        "recipe (--config-name)"
    )


def check_group_choices(argv: list[str]) -> None:
    """ConfigError for a `model=` or `data=` choice on the command line made for another recipe than the one it
    runs (`recipe=` on the command line, else its config's); Hydra would compose it into a config that fails on
    keys the user never set."""
    from core.config.errors import ConfigError

    name = config_name(argv)
    recipe = override_value(argv, "recipe") or (recipe_of_config(name) if name else None)
    if recipe is None:
        return
    for group in ("model", "data"):
        option = override_value(argv, group)
        schema = schema_of_option(group, option) if option else None
        owner = recipe_of_schema_name(group, schema) if schema else None
        if owner is not None and owner != recipe:
            raise ConfigError(other_recipes_option(group, f"{group}={option}", owner, recipe))


def override_value(argv: list[str], key: str) -> Optional[str]:
    """The value the command line's last override of `key` (also `+key=`, `++key=`) gives it, as Hydra parses
    it; None if none sets it, or sets it to null. An override Hydra cannot parse is left for Hydra to refuse."""
    from hydra.errors import HydraException

    parser, value = _parser(), None
    for arg in argv:
        if "=" not in arg or arg.startswith("-") or arg.lstrip("+~").split("=", 1)[0] != key:
            continue
        try:
            parsed = parser.parse_override(arg)
        except HydraException:
            continue
        given = parsed.value()
        value = None if given is None or parsed.is_delete() else str(given)
    return value


@functools.lru_cache(maxsize=1)
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def wants_help(argv: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def needs_no_config(argv: list[str]) -> bool:
    """Whether the command line asks Hydra something that needs no config (--hydra-help, --version, ...)."""
    return any(arg in HYDRA_FLAGS or arg.startswith("--shell-completion=") for arg in argv)


def missing_config(script: str, from_checkpoint: bool) -> str:
    """The one line for a command that names no config."""
    also = (
        " (or checkpoint.init_from=<step folder | run's checkpoint folder>: the config it was trained with)"
        if from_checkpoint
        else ""
    )
    return f"{script} needs a config: --config-name <name>{also}, one of {', '.join(configs())}"


def usage(script: str, from_checkpoint: bool, config: Optional[str] = None) -> str:
    """What `<script> --help` prints: how to call it, the configs and the groups' options (`config`: the one the
    command line names, whose values --cfg job prints)."""
    lines = [f"usage: python {script} --config-name <name> [key=value ...]"]
    if script != "generate.py":  # which runs in one process
        lines.append(f"       torchrun --nproc-per-node <N> {script} --config-name <name> [key=value ...]")
    if from_checkpoint:
        lines.append(
            f"       python {script} checkpoint.init_from=<step folder | run's checkpoint folder> [key=value ...]"
            "   (the config the checkpoint was trained with)"
        )
    if script == "train.py":
        lines.append(f"       python {script} -m --config-name <name> key=a,b ...   (a sweep: one job per value)")
    lines += [
        "",
        "configs (--config-name):",
        "  " + ", ".join(configs()),
        "",
        "config groups (group=option on the command line, e.g. precision=fp32):",
    ]
    lines += [f"  {group}: {', '.join(options)}" for group, options in group_options().items()]
    lines += [
        "",
        "Any key of the config: key=value (e.g. training.steps=600 optim.lr=3e-4); every key and its default:",
        "core/config/schema.py and the recipes' config.py. A config with its values:",
        f"python {script} --config-name {config or '<name>'} --cfg job. Hydra's own options: --hydra-help.",
    ]
    return "\n".join(lines)


def composition_error(error: BaseException) -> Optional[str]:
    """One line for an error Hydra meets while composing the config from the command line (a value of the wrong
    type, an option a group lacks, an override it cannot parse), which it would print over several lines with
    exit code 1; None for any other error."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(error, MissingConfigException):
        missing = str(error.missing_cfg_file or "")
        group, _, option = missing.rpartition("/")
        named = f"{group}={option}: no such option of {group}" if group else f"{missing}: no such config"
        options = sorted(o for o in (error.options or []) if not o.endswith("_schema"))
        return named + (f"; choose one of {', '.join(options)}" if options else "")
    if isinstance(error, OverrideParseException):
        return f"{error.override}: {unparsable(error.override, str(error))}"
    if isinstance(error, ConfigCompositionException):
        cause = error.__cause__
        first = str(error).strip().splitlines()[0].removeprefix("Error merging override ")
        if isinstance(cause, OmegaConfBaseException):
            return f"{first}: {str(getattr(cause, 'msg', cause)).strip().splitlines()[0]}"
        return " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
    return None


# Where Hydra's override grammar is described; its parse errors end with this link.
GRAMMAR_URL = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"
LEXER_ERROR = "LexerNoViableAltException: "


def unparsable(override: str, message: str) -> str:
    """Why Hydra cannot parse `override`, from its error `message`, in words a user can act on: Hydra's own message
    ends with a link, which alone names nothing (the reason is on the lines before it), and for a character its
    lexer refuses (a quote, a byte that is not UTF-8) it gives only a caret under the override."""
    lines = [line for line in message.splitlines() if line.strip()]
    caret = next((line for line in lines if line.strip() == "^"), None)
    if caret is not None and lines[0].startswith(LEXER_ERROR):
        at = caret.index("^") - len(LEXER_ERROR)
        char = override[at] if 0 <= at < len(override) else ""
        if "\udc80" <= char <= "\udcff":  # how Python keeps a byte of argv that is not UTF-8
            what = f"the byte 0x{ord(char) - 0xDC00:02x} (not UTF-8) at position {at}"
        else:
            what = f"{char!r} at position {at}" if char else f"position {at}"
    else:
        reasons = [line for line in lines if not line.startswith(("Error parsing override", "See ", LEXER_ERROR))]
        what = reasons[0].strip() if reasons else "a character it does not expect"
    return (
        f"Hydra cannot parse this override ({what}); quote a value with special characters in it, e.g. "
        f"'key=\"a value (1)\"' ({GRAMMAR_URL})"
    )
