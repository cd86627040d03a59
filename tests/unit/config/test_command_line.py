"""What a command line says before Hydra composes (core/config/command_line.py): the config it names, the configs to
choose from, the usage --help shows, and a model or data choice made for another recipe, refused in one line."""

from __future__ import annotations

import pytest

from core.config import command_line
from core.config.errors import ConfigError
from core.config.validation import validate
from recipes.registry import recipe_names
from tests.support.helpers import compose_config


def test_the_config_a_command_line_names():
    assert command_line.config_name(["--config-name", "vit_sanity", "training.steps=3"]) == "vit_sanity"
    assert command_line.config_name(["-cn=gpt_sanity"]) == "gpt_sanity"
    assert command_line.config_name(["checkpoint.init_from=x", "--config-name=a", "-cn", "b"]) == "b"
    assert command_line.config_name(["checkpoint.init_from=x"]) is None


def test_the_configs_to_choose_from_and_the_usage():
    configs = command_line.configs()
    assert {"vit_sanity", "gpt_sanity", "esm2_sanity", "mnist_predict", "vit_predict"} <= set(configs)
    assert "train_defaults" not in configs
    usage = command_line.usage("predict.py", from_checkpoint=True)
    assert "python predict.py --config-name <name>" in usage and "checkpoint.init_from=<step folder" in usage
    assert ", ".join(configs) in usage
    assert "_schema" not in usage and "== Config ==" not in usage  # Hydra's store, not configs one can choose
    assert (
        "  data: chat_sanity, digits, esm2_finetune_sanity, gpt_indexed" in usage
        and "  scheduler: constant, cosine, linear, wsd" in usage
    )
    line = command_line.missing_config("train.py", from_checkpoint=False)
    assert line.startswith("train.py needs a config: --config-name <name>, one of ") and "\n" not in line


def test_the_value_an_override_gives():
    argv = ["--config-name", "x", "checkpoint.init_from=a/b", "+checkpoint.init_from='c d'", "optim.lr=1"]
    assert command_line.override_value(argv, "checkpoint.init_from") == "c d"
    assert command_line.override_value(argv, "checkpoint") is None
    assert command_line.override_value(["checkpoint.init_from=null"], "checkpoint.init_from") is None


def _options_of_other_recipes(recipe: str) -> list[tuple[str, str, str]]:
    """(group, option, its recipe) for every model and data option made for another recipe than `recipe`."""
    found = []
    for group in ("model", "data"):
        for option in command_line.group_options()[group]:
            owner = command_line.recipe_of_schema_name(group, command_line.schema_of_option(group, option))
            if owner != recipe:
                found.append((group, option, owner))
    return found


@pytest.mark.parametrize("config", command_line.configs())
def test_every_config_refuses_the_model_and_data_of_other_recipes(config):
    """`vit_sanity data=moby_dick` and every other combination that cannot work: one line naming the choice, the
    recipe it is for and the options there are for this config's recipe; this recipe's own options pass."""
    recipe = command_line.recipe_of_config(config)
    assert recipe in recipe_names(), config
    others = _options_of_other_recipes(recipe)
    assert others
    for group, option, owner in others:
        with pytest.raises(ConfigError) as error:
            command_line.check_group_choices(["--config-name", config, f"{group}={option}"])
        message = str(error.value)
        assert message.startswith(
            f"{group}={option} is {group} of the {owner} recipe, but this config trains the "
            f"{recipe} recipe: choose {group}=<one of "
        )
        assert all(o in message for o in command_line.options_for(group, recipe)) and "\n" not in message
    for group in ("model", "data"):
        for option in command_line.options_for(group, recipe):
            command_line.check_group_choices(["--config-name", config, f"{group}={option}"])
    # recipe= on the command line decides: gpt's data in a vit config that runs the gpt recipe is not refused here
    command_line.check_group_choices(["--config-name", config, "recipe=gpt", "data=moby_dick"])


def test_a_composed_config_with_another_recipes_data_is_refused_naming_it():
    """What Hydra composed (a config file that combines them, or a caller from Python): refused by validate, before
    model.num_classes's interpolation of a data key the gpt data lacks fails."""
    cfg = compose_config("vit_sanity", ["data=moby_dick", "checkpoint.path=unused"])
    with pytest.raises(
        ConfigError,
        match=r"^data is data of the gpt recipe, but this config trains the vit recipe: "
        r"choose data=<one of digits, imagefolder, shards, synthetic, tiny_imagenet>",
    ):
        validate(cfg)


def test_an_override_hydra_cannot_parse_says_why_and_where():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    def line(override: str) -> str:
        with pytest.raises(OverrideParseException) as e:
            OverridesParser.create().parse_overrides([override])
        return command_line.composition_error(e.value)

    # Hydra's message is several lines ending with a link; the reason was on the lines before it.
    assert line("optim.lr=1e-3)").startswith(
        "optim.lr=1e-3): Hydra cannot parse this override (extraneous input ')' expecting <EOF>); quote a value"
    )
    # A path with a byte that is not UTF-8 (Python keeps it as a lone surrogate in argv), or with a quote in it.
    assert "(the byte 0xff (not UTF-8) at position 24)" in line("checkpoint.path=/tmp/bad\udcff")
    assert """("'" at position 17)""" in line("checkpoint.path=a'b")
    assert "\n" not in line("optim.betas=[0.9,")
