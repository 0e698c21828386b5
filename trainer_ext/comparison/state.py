"""Progress of a same-data comparison run, kept in one JSON file.

The file says which stages of which cycles are finished, with what they produced (checkpoint paths, metrics,
evaluation records), so a run killed at any point continues where it stopped and redoes no finished stage.
Every change rewrites the whole file through a temporary file and `os.replace`: a crash leaves the previous
version or the new one, never half of one. A stage is marked done only after everything it wrote is complete
on disk, so "done" in the file always means "its outputs exist".

    state = CompareState.open(path, identity, overwrite=False)   # ValueError if `identity` differs
    if not state.is_done(2, "train_recurrent"):
        ...
        state.mark_done(2, "train_recurrent", final_dir=..., train_loss=...)
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable

from trainer_ext.files import check_same_run, differing_fields, write_json

# Version 2: each model's cycles continue one training (one optimizer state, one learning-rate schedule over the
# planned cycles, `planned_cycles`). Version 1 runs started each cycle's optimizer afresh with a warm-up of its own;
# they cannot be continued as one training and are refused, naming the fix.
FORMAT_VERSION = 2
STATE_NAME = "compare_state.json"
# The models a comparison may train: "compute_baseline" only with --compute_baseline_preset (a second baseline).
MODELS = ("recurrent", "baseline", "compute_baseline")
# Per cycle, in order. The held-out set is prepared once, before the first cycle ("heldout"); "cache_teacher" runs
# only when the comparison distils from a per-cycle teacher cache, "train_compute_baseline" only with that baseline.
CYCLE_STAGES = ("prepare", "cache_teacher", "train_recurrent", "train_baseline", "train_compute_baseline", "evaluate",
                "cleanup")


def _now() -> dict:
    return {"done_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
            "done_unix": time.time()}


class CompareState:
    """The state file of one comparison output directory."""

    def __init__(self, path: str, data: dict):
        self.path = path
        self.data = data

    # -- opening

    @classmethod
    def open(cls, path: str, identity: dict, overwrite: bool = False,
             remove_outputs: Callable[[], None] | None = None) -> "CompareState":
        """Load the state at `path` if it was written with the same `identity`, or start one.

        `identity` is what makes two runs the same run (the arguments that change data, models or results). A
        state with another identity is refused unless `overwrite`: then `remove_outputs` deletes what that run
        wrote and a fresh state replaces it. A state with the same identity is always continued, so rerunning
        the very command that was interrupted (with or without --overwrite) never throws finished work away.
        """
        identity = json.loads(json.dumps(identity))  # as it will read back from JSON (tuples -> lists)
        if os.path.exists(path):
            data = cls._read(path, overwrite)
            if not overwrite:  # another run's state is refused, naming the fields that differ
                check_same_run(f"{path}: this output directory holds a comparison run", data.get("identity"),
                               identity, "Run the same command to continue it, pass --overwrite to discard it and "
                               "start again, or choose another --output_dir.")
                return cls(path, data)
            if data is not None and not differing_fields(data.get("identity"), identity):
                return cls(path, data)
            if data is not None:
                # Void the old state before deleting its outputs: a crash in between must not leave a state
                # that describes files which are gone.
                cls(path, {**data, "identity": {"discarded": True}}).save()
            if remove_outputs is not None:
                remove_outputs()
        state = cls(path, {"format_version": FORMAT_VERSION, "identity": identity, "created": _now()["done_at"],
                           "planned_cycles": None, "heldout": None, "cycles": {}})
        state.save()
        return state

    @classmethod
    def read(cls, path: str) -> "CompareState":
        """The state as the process that writes it left it (the others of a launch of several processes read it)."""
        return cls(path, cls._read(path, overwrite=False))

    @staticmethod
    def _read(path: str, overwrite: bool) -> dict | None:
        """The state's content; None for a file it cannot continue when `overwrite` (it is replaced anyway)."""
        fix = "pass --overwrite to start the run again"
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            version = data.get("format_version")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            if overwrite:
                return None
            raise ValueError(f"{path}: not a state file this code can continue ({err}); {fix}.") from err
        if version == FORMAT_VERSION:
            return data
        if overwrite:
            return None
        if version == 1:
            raise ValueError(f"{path}: a comparison run whose cycles each started the optimizer state and the "
                             "learning-rate warm-up afresh (an earlier version); cycles now continue one training "
                             "(one optimizer state, one schedule over all cycles) and cannot continue that run. Pass "
                             "--overwrite to start it again there (its outputs are deleted), or choose another "
                             "--output_dir (its results files stay as they are).")
        raise ValueError(f"{path}: not a state file this code can continue (format_version {version}, this code "
                         f"reads {FORMAT_VERSION}); {fix}.")

    def save(self) -> None:
        write_json(self.path, self.data)

    # -- the learning-rate schedule's length

    @property
    def planned_cycles(self) -> int | None:
        """The cycles each model's learning-rate schedule spans (None until the run records them)."""
        return self.data.get("planned_cycles")

    def plan_cycles(self, cycles: int) -> None:
        self.data["planned_cycles"] = cycles
        self.save()

    # -- stages

    def cycle(self, cycle: int) -> dict:
        return self.data["cycles"].setdefault(str(cycle), {})

    def is_done(self, cycle: int, stage: str) -> bool:
        assert stage in CYCLE_STAGES, stage
        return stage in self.data["cycles"].get(str(cycle), {})

    def stage(self, cycle: int, stage: str) -> dict:
        """What a finished stage recorded (KeyError if it is not finished)."""
        return self.data["cycles"][str(cycle)][stage]

    def mark_done(self, cycle: int, stage: str, **info) -> None:
        assert stage in CYCLE_STAGES, stage
        self.cycle(cycle)[stage] = {**_now(), **info}
        self.save()

    @property
    def heldout(self) -> dict | None:
        return self.data.get("heldout")

    def mark_heldout(self, **info) -> None:
        self.data["heldout"] = {**_now(), **info}
        self.save()

    def stages_done(self) -> int:
        """Finished stages, the held-out preparation included (what the progress bar counts)."""
        return int(self.heldout is not None) + sum(
            sum(stage in stages for stage in CYCLE_STAGES) for stages in self.data["cycles"].values())

    def completed_cycles(self) -> list[int]:
        """Cycles whose evaluation is recorded, in order."""
        return sorted(int(c) for c, stages in self.data["cycles"].items() if "evaluate" in stages)

    # -- hub pushes (not stages: they run in the background and are retried on the next start)

    def is_pushed(self, cycle: int, model: str) -> bool:
        return model in self.data["cycles"].get(str(cycle), {}).get("pushed", {})

    def mark_pushed(self, cycle: int, model: str, **info) -> None:
        self.cycle(cycle).setdefault("pushed", {})[model] = {**_now(), **info}
        self.save()
