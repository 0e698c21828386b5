"""Pushing checkpoints to the Hugging Face Hub: synchronously with retries, or in the background while training
goes on (the Trainer's per-save pushes are in `trainer_ext.hub.callbacks`).

    push_checkpoint("outputs/r3b/cycle-2", "me/r3b", cycle_commit_message(2, 400_000_000))  # "cycle 2: 400M tokens"

    pusher = BackgroundPusher("me/r3b")
    pusher.submit("outputs/r3b/cycle-2", "cycle 2: 400M tokens")   # returns at once
    ...
    pusher.wait(); assert not pusher.errors

Pushing only reads the checkpoint: a failed push never deletes or changes a local file. The token (argument,
`HF_TOKEN` or the stored login) goes to the HTTP client only; it is never written to a file, a card or a log.
"""

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from huggingface_hub import CommitInfo, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from trainer_ext.hub.model_card import REPO_ID, format_count

logger = logging.getLogger(__name__)

# Never uploaded: the pickled TrainingArguments can hold a Hub token, and our own staging/temp files.
ALWAYS_IGNORE = ["training_args.bin", "*.tmp.*", ".*.tmp", ".hub-push-*", ".hub-push-*/**"]
# Only what resuming training needs, large and of no use to someone loading the model.
TRAINING_STATE = ["optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state*.pth", "global_step*",
                  "global_step*/**"]
MAX_BACKOFF_SECONDS = 60.0


class HubPushError(RuntimeError):
    """A push that failed for good (after retries, or at once for errors that retrying cannot fix)."""


def _commit_message(title: str, tokens_seen: int | None) -> str:
    return title + (f": {format_count(tokens_seen)} tokens" if tokens_seen is not None else "")


def cycle_commit_message(cycle: int, tokens_seen: int | None = None) -> str:
    """'cycle 2: 400M tokens' (the comparison pipeline's commits)."""
    return _commit_message(f"cycle {cycle}", tokens_seen)


def checkpoint_commit_message(step: int, tokens_seen: int | None = None) -> str:
    """'step 1200: 9.83M tokens' (the Trainer callbacks' commits)."""
    return _commit_message(f"step {step}", tokens_seen)


def _redact(text: str, token: str | None) -> str:
    for secret in {token, get_token()}:
        if secret:
            text = text.replace(secret, "<token>")
    return text


def _transport_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub talks HTTP through httpx (1.x) or httpx2 (2.x): their connection and timeout errors.
    errors = [module.TransportError for name in ("httpx", "httpx2")
              if (module := sys.modules.get(name)) is not None and hasattr(module, "TransportError")]
    return (ConnectionError, TimeoutError, *errors)


def _is_transient(error: BaseException) -> bool:
    """Worth retrying: server errors, rate limits, timeouts, dropped connections. Not: auth, missing repo, bad
    request, local file errors."""
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        return status is None or status >= 500 or status in (408, 429)
    return isinstance(error, _transport_errors())


def _check_push_args(local_dir: str, repo_id: str, commit_message: str, max_retries: int) -> None:
    if not os.path.isdir(local_dir):
        raise ValueError(f"push_checkpoint: local_dir {local_dir!r} is not a directory; save the checkpoint first.")
    if not os.path.isfile(os.path.join(local_dir, "config.json")):
        raise ValueError(f"push_checkpoint: {local_dir!r} has no config.json; push a saved checkpoint directory "
                         "(save_pretrained / trainer.save_model output).")
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"push_checkpoint: repo_id {repo_id!r} is not a Hub repository id; use 'namespace/name'.")
    if not commit_message or not commit_message.strip():
        raise ValueError("push_checkpoint: commit_message is empty; name the commit (e.g. 'cycle 2: 400M tokens').")
    if not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"push_checkpoint: max_retries={max_retries!r} must be an integer >= 0.")


def push_checkpoint(
    local_dir: str,
    repo_id: str,
    commit_message: str,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    max_retries: int = 3,
    *,
    path_in_repo: str | None = None,
    include_training_state: bool = False,
    commit_description: str | None = None,
    endpoint: str | None = None,
    backoff_seconds: float = 2.0,
    log_name: str | None = None,
) -> CommitInfo:
    """Upload a saved checkpoint directory as one commit to `repo_id` (created if missing, `private` then applies).

    `revision`: a branch (created from main if missing). `path_in_repo`: a subfolder instead of the repo root.
    Resume-only files (optimizer, scheduler, RNG state) are left out unless `include_training_state`;
    `training_args.bin` is never uploaded. Transient failures are retried `max_retries` times with exponential
    backoff (`backoff_seconds`, doubling, at most a minute); other failures raise `HubPushError` at once.
    `log_name` names the checkpoint in messages (default `local_dir`).
    """
    _check_push_args(local_dir, repo_id, commit_message, max_retries)
    name = log_name or local_dir
    api = HfApi(endpoint=endpoint, token=token)
    ignore = ALWAYS_IGNORE + ([] if include_training_state else TRAINING_STATE)
    for attempt in range(max_retries + 1):
        try:
            repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
            if revision not in (None, "main"):
                api.create_branch(repo_url.repo_id, branch=revision, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_url.repo_id, folder_path=local_dir, path_in_repo=path_in_repo,
                commit_message=commit_message, commit_description=commit_description, revision=revision,
                ignore_patterns=list(ignore))
            logger.info("Pushed %s to %s: %s", name, repo_url.repo_id, commit_message)
            return commit
        except Exception as error:  # noqa: BLE001  (sorted into transient / permanent below)
            message = _redact(f"{type(error).__name__}: {error}", token)
            if not _is_transient(error):
                raise HubPushError(f"Pushing {name} to {repo_id} failed: {message}") from error
            if attempt == max_retries:
                raise HubPushError(
                    f"Pushing {name} to {repo_id} failed after {attempt + 1} attempts: {message}") from error
            wait = min(backoff_seconds * 2**attempt, MAX_BACKOFF_SECONDS)
            logger.warning("Push of %s to %s failed (attempt %d of %d), retrying in %.1fs: %s",
                           name, repo_id, attempt + 1, max_retries + 1, wait, message)
            time.sleep(wait)
    raise AssertionError("unreachable")


# -- background pushing


def _stage(local_dir: str) -> str | None:
    """A hard-linked copy of `local_dir` next to it: costs no space or time, and keeps the files readable for the
    upload even if the Trainer rotates the checkpoint away (save_total_limit) meanwhile. None if the
    filesystem cannot link (the upload then reads `local_dir` itself)."""
    local_dir = os.path.abspath(local_dir)
    stage = None
    try:
        stage = tempfile.mkdtemp(prefix=f".hub-push-{os.path.basename(local_dir)}-", dir=os.path.dirname(local_dir))
        for root, _, files in os.walk(local_dir):
            target = os.path.join(stage, os.path.relpath(root, local_dir))
            os.makedirs(target, exist_ok=True)
            for name in files:
                os.link(os.path.join(root, name), os.path.join(target, name))
        return stage
    except OSError as error:
        logger.debug("Could not stage %s with hard links (%s); uploading it in place.", local_dir, error)
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        return None


@dataclass
class PushJob:
    local_dir: str
    commit_message: str
    path_in_repo: str | None = None
    include_training_state: bool = False
    staged_dir: str | None = None  # our hard-linked snapshot, removed after the push


@dataclass
class PushFailure:
    local_dir: str
    commit_message: str
    error: str  # the token, if any, is redacted


class BackgroundPusher:
    """Pushes checkpoints from a worker thread, one at a time, in submission order, so training continues.

    `coalesce`: a submitted job replaces a still-waiting one for the same `path_in_repo` (a slow uplink then
    pushes the newest checkpoint instead of falling ever further behind). Failures are logged and collected in
    `errors`; they never raise into the training loop. Call `wait()` (or `close()`) before exiting.
    """

    def __init__(self, repo_id: str, token: str | None = None, private: bool | None = None,
                 revision: str | None = None, max_retries: int = 3, *, endpoint: str | None = None,
                 backoff_seconds: float = 2.0, coalesce: bool = False, snapshot: bool = True):
        if not REPO_ID.match(repo_id or ""):
            raise ValueError(f"BackgroundPusher: repo_id {repo_id!r} is not a Hub repository id; use 'namespace/name'.")
        self.repo_id = repo_id
        self._push_kwargs = dict(token=token, private=private, revision=revision, max_retries=max_retries,
                                 endpoint=endpoint, backoff_seconds=backoff_seconds)
        self._token = token
        self.coalesce = coalesce
        self.snapshot = snapshot
        self.errors: list[PushFailure] = []
        self.commits: list[CommitInfo] = []
        self._pending: list[PushJob] = []
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, local_dir: str, commit_message: str, *, path_in_repo: str | None = None,
               include_training_state: bool = False) -> None:
        """Queue `local_dir` for upload and return at once. Argument errors raise here, in the caller."""
        _check_push_args(local_dir, self.repo_id, commit_message, self._push_kwargs["max_retries"])
        job = PushJob(local_dir, commit_message, path_in_repo, include_training_state,
                      _stage(local_dir) if self.snapshot else None)
        with self._cond:
            if self._closed:
                raise RuntimeError("BackgroundPusher.submit after close().")
            if self.coalesce:
                for old in [j for j in self._pending if j.path_in_repo == path_in_repo]:
                    logger.info("Push of %s superseded by %s before it started.", old.local_dir, local_dir)
                    self._pending.remove(old)
                    self._discard_stage(old)
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hub-pusher", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished (waiting or uploading)."""
        with self._cond:
            return len(self._pending) + int(self._busy)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted push finished (succeeded or failed); False if `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued pushes, then stop the worker thread."""
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if done and self._thread is not None:
            self._thread.join()
        return done

    def __enter__(self) -> "BackgroundPusher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _discard_stage(job: PushJob) -> None:
        if job.staged_dir is not None:
            shutil.rmtree(job.staged_dir, ignore_errors=True)  # only our links; the checkpoint keeps its files

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending.pop(0)
                self._busy = True
            try:
                commit = push_checkpoint(job.staged_dir or job.local_dir, self.repo_id, job.commit_message,
                                         path_in_repo=job.path_in_repo, log_name=job.local_dir,
                                         include_training_state=job.include_training_state, **self._push_kwargs)
                self.commits.append(commit)
            except Exception as error:  # noqa: BLE001  (a failed push must not stop training)
                message = _redact(str(error), self._token)
                logger.error("Push of %s (%s) to %s failed: %s", job.local_dir, job.commit_message, self.repo_id,
                             message)
                self.errors.append(PushFailure(job.local_dir, job.commit_message, message))
            finally:
                self._discard_stage(job)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


__all__ = ["BackgroundPusher", "HubPushError", "PushFailure", "checkpoint_commit_message", "cycle_commit_message",
           "push_checkpoint"]
