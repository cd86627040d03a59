"""The loop's counters, saved with every checkpoint (`train_state.*`) so a run resumes where it stopped."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # position in the global sample stream (core/data/sampling.py)
    epoch: int = 0  # consumed_samples // dataset_len
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss (training.on_nonfinite=skip)
    dataset_len: int = 0  # the training set's size when saved (a changed dataset reorders the stream)
    world_size: int = 0  # the ranks it was saved on
    # What the training set's samples were when saved (core/data/fingerprint.py); 0: not recorded (a dataset without
    # a fingerprint, or a checkpoint of an earlier version).
    data_fingerprint: int = 0
    # The optimizer steps the learning-rate schedule spans (training.steps when the run started; a resumed run with
    # scheduler.on_extend=hold keeps it); 0: not recorded (a checkpoint of an earlier version).
    schedule_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in asdict(self).items()}

    def load_state_dict(self, state: dict) -> None:
        """Take the saved counters; ValueError naming the counter if one is not a whole number >= 0 (a
        checkpoint's values are data from a file: a negative step or a NaN must not steer the loop)."""
        for f in fields(self):
            if f.name in state:
                value = state[f.name]
                if type(value) is not int or not 0 <= value < 2**62:
                    raise ValueError(f"train_state.{f.name}={value!r}: expected a whole number >= 0")
                setattr(self, f.name, value)
        if self.skipped_steps > self.step:
            raise ValueError(f"train_state.skipped_steps={self.skipped_steps} > train_state.step={self.step}")
