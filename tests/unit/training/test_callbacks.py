"""Callbacks (core/training/callbacks.py): training.callbacks names them (a bad entry is one line naming the key),
and the shipped EarlyStopping stops a real run, which the same command then resumes exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.config.errors import ConfigError
from core.training.callbacks import build_callbacks
from core.training.early_stopping import EarlyStopping
from tests.support.checkpoint_harness import phase, run_phases
from tests.support.helpers import run_workers, validated_config

EARLY_STOPPING = "core.training.early_stopping.EarlyStopping"


@pytest.mark.parametrize(
    "entry,message",
    [
        ("nowhere.Thing", "training.callbacks[0]=nowhere.Thing: cannot import nowhere (No module named 'nowhere')"),
        (
            "core.training.callbacks.Nothing",
            "training.callbacks[0]=core.training.callbacks.Nothing: core.training.callbacks has no Nothing",
        ),
        ("Thing", "training.callbacks[0]=Thing: expected an import path package.module.Name"),
        (
            "{monitor:val/loss}",
            "training.callbacks[0]: a mapping needs _target_: <package.module.Name> (it has: monitor)",
        ),
    ],
)
def test_a_callback_that_cannot_be_imported_is_one_line_naming_the_key(entry, message):
    with pytest.raises(ConfigError) as error:
        validated_config("vit_sanity", ["checkpoint.path=unused", f"training.callbacks=[{entry}]"])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_callbacks_are_made_from_import_paths_and_mappings():
    cfg = validated_config(
        "vit_sanity",
        [
            "checkpoint.path=unused",
            f"training.callbacks=[{EARLY_STOPPING},{{_target_:{EARLY_STOPPING},monitor:val/top1,mode:max,patience:2}}]",
        ],
    )
    plain, configured = build_callbacks(cfg.training.callbacks)
    assert (plain.monitor, plain.patience, plain.mode) == ("val/loss", 3, "min")
    assert (configured.monitor, configured.patience, configured.mode) == ("val/top1", 2, "max")
    with pytest.raises(
        ConfigError,
        match=r"training.callbacks\[0\]=core.training.callbacks.build_callbacks: a "
        r"function, expected a subclass of core.training.callbacks.Callback",
    ):
        build_callbacks(["core.training.callbacks.build_callbacks"])
    with pytest.raises(
        ConfigError,
        match=r"training.callbacks\[0\]: core.training.early_stopping.EarlyStopping\("
        r"patience\): patience=0: expected a whole number >= 1",
    ):
        build_callbacks([{"_target_": EARLY_STOPPING, "patience": 0}])
    with pytest.raises(ConfigError, match=r"training.callbacks\[0\]: .*unexpected keyword argument 'patient'"):
        build_callbacks([{"_target_": EARLY_STOPPING, "patient": 2}])


def _stops(callback: EarlyStopping, values: list[float], metric: str = "loss") -> list[int]:
    """The validations (1-based) after which `callback` asked the run to stop."""
    asked = []
    run = SimpleNamespace(request_stop=lambda reason: asked.append(reason))
    stopped_at = []
    for i, value in enumerate(values, 1):
        callback.on_validation_end(run, i, {metric: value})
        if asked:
            stopped_at.append(i)
            asked.clear()
    return stopped_at


def test_early_stopping_counts_validations_without_improvement():
    assert _stops(EarlyStopping(patience=2), [1.0, 0.9, 0.95, 0.91, 0.8]) == [4]  # 0.95, 0.91: no better than 0.9
    # min_delta: 0.97 and 0.96 are no improvement on 1.0, 0.49 and 0.48 none on 0.5
    assert _stops(EarlyStopping(patience=2, min_delta=0.05), [1.0, 0.97, 0.96, 0.5, 0.49, 0.48]) == [3, 6]
    assert _stops(EarlyStopping("val/top1", patience=1, mode="max"), [0.5, 0.6, 0.6], "top1") == [3]
    assert _stops(EarlyStopping(patience=1), [1.0, float("nan")]) == [2]  # NaN never improves
    with pytest.raises(
        ConfigError, match="monitor='val/los' is not a validation metric of this run; there are: val/loss"
    ):
        _stops(EarlyStopping("val/los"), [1.0])
    with pytest.raises(ConfigError, match="EarlyStopping watches val/loss, but this run does not validate"):
        EarlyStopping().on_train_start(SimpleNamespace(data=SimpleNamespace(val_loader=None)))


@pytest.mark.slow
def test_early_stopping_stops_a_run_that_resumes_exactly(tmp_path):
    """A validation every step; min_delta so large that no validation improves: with patience 1, the second
    validation (step 2) asks to stop, so the run saves step 3 and stops. The same run resumed (without the
    callback) continues an uninterrupted run's losses bit for bit."""
    validating = ["training.val_every_n_steps=1"]
    stopping = validating + [
        f"training.callbacks=[{{_target_:{EARLY_STOPPING},monitor:val/loss,patience:1,min_delta:1000}}]"
    ]
    ref, stopped, resumed = run_workers(
        1,
        run_phases,
        [
            phase(tmp_path, "ref", "ckpt_ref", validating),
            phase(tmp_path, "stopped", "ckpt", stopping),
            phase(tmp_path, "resumed", "ckpt", validating),
        ],
    )[0]
    assert stopped["stopped_by"].startswith("early stopping (val/loss") and sorted(stopped["losses"]) == [1, 2, 3]
    assert (tmp_path / "ckpt" / "step_3" / "COMPLETE").exists()
    assert resumed["start_step"] == 3 and resumed["stopped_by"] is None
    assert stopped["losses"] | resumed["losses"] == ref["losses"] and sorted(ref["losses"]) == list(range(1, 9))
