"""Background pushes of each cycle's final checkpoints to the Hub, recorded in the comparison's state.

One pusher (and repo) per model; commits are named after the cycle ("cycle 2: 400M tokens"). The pushes run in
background threads while the next cycle trains; `sync()`, called from the main thread between stages, writes
what finished to the state, so a push that did not finish is retried by the next start of the same run.
"""

from __future__ import annotations

import logging

from trainer_ext.comparison.state import CompareState
from trainer_ext.hub.push import BackgroundPusher, cycle_commit_message

logger = logging.getLogger(__name__)


class CyclePushes:
    """`repos`: the Hub repo of each model; `private`: create them private (None: the Hub's default)."""

    def __init__(self, repos: dict[str, str], private: bool | None, state: CompareState):
        self.state = state
        self.repos = repos
        self.private = private
        self.pushers: dict[str, BackgroundPusher] = {}
        self.jobs: dict[str, list[tuple[int, str]]] = {model: [] for model in repos}  # (cycle, commit message)
        self.recorded: dict[str, int] = {model: 0 for model in repos}

    def submit(self, cycle: int, model: str, final_dir: str, tokens_seen: int) -> None:
        if model not in self.pushers:
            self.pushers[model] = BackgroundPusher(self.repos[model], private=self.private)
        message = cycle_commit_message(cycle, tokens_seen)
        self.jobs[model].append((cycle, message))
        self.pushers[model].submit(final_dir, message)

    @property
    def pending(self) -> int:
        return sum(pusher.pending for pusher in self.pushers.values())

    def sync(self) -> None:
        """Record the pushes finished since the last call in the state."""
        for model, pusher in self.pushers.items():
            commits, errors = list(pusher.commits), list(pusher.errors)  # both grow in submission order
            failed = {e.commit_message for e in errors}
            finished = self.jobs[model][:len(commits) + len(errors)]
            successes = iter(commits)
            for index, (cycle, message) in enumerate(finished):
                if message in failed:
                    continue
                commit = next(successes)
                if index >= self.recorded[model]:
                    self.state.mark_pushed(cycle, model, repo_id=self.repos[model], commit=commit.oid)
            self.recorded[model] = len(finished)

    def wait(self) -> list[str]:
        """Block until every push finished; the failures, one line each."""
        if self.pending:
            logger.info("Waiting for %d checkpoint push(es) to finish.", self.pending)
        for pusher in self.pushers.values():
            pusher.close()
        self.sync()
        return [f"{f.local_dir} ({f.commit_message}): {f.error}" for p in self.pushers.values() for f in p.errors]
