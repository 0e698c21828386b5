"""Trainer callbacks: the model card written into every saved checkpoint, and the push of each save to the Hub.

    callback = HubPushCallback.from_training_args(training_args, info, tokens_per_optimizer_step(training_args, T))
    trainer = RecurrentTrainer(..., callbacks=[callback or ModelCardCallback(info, tokens_per_step)])

`tokens_per_optimizer_step` is in `hf_recurrent.cost`.
"""

import logging
import os
from dataclasses import replace

from transformers import TrainerCallback

from trainer_ext.hub.model_card import ModelCardInfo, write_model_card
from trainer_ext.hub.push import BackgroundPusher, checkpoint_commit_message

logger = logging.getLogger(__name__)

HUB_STRATEGIES = ("every_save", "checkpoint", "all_checkpoints", "end")


class ModelCardCallback(TrainerCallback):
    """Writes the model card into every checkpoint the Trainer saves (with the tokens seen so far)."""

    def __init__(self, info: ModelCardInfo | None = None, tokens_per_step: int | None = None):
        self.info = info or ModelCardInfo()
        self.tokens_per_step = tokens_per_step

    def tokens_seen(self, state) -> int | None:
        if getattr(state, "num_input_tokens_seen", 0):
            return int(state.num_input_tokens_seen)
        if self.tokens_per_step is not None:
            return state.global_step * self.tokens_per_step
        return self.info.tokens_seen

    def write_card(self, args, state, model=None) -> str | None:
        """The checkpoint directory the card went into, or None (not the main process, or no such directory)."""
        if not state.is_world_process_zero:
            return None
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(checkpoint):
            return None
        config = getattr(model, "config", None)
        write_model_card(checkpoint, config, replace(self.info, tokens_seen=self.tokens_seen(state)))
        return checkpoint

    def on_save(self, args, state, control, model=None, **kwargs):
        self.write_card(args, state, model)


class HubPushCallback(ModelCardCallback):
    """On every save: writes the model card into the checkpoint, then pushes it in the background, committed as
    'step N: X tokens'. `strategy` follows the Trainer's `hub_strategy`: `every_save` pushes the model (weights,
    config, code, tokenizer, card) to the repo root; `checkpoint` also pushes the whole checkpoint with its
    training state to `last-checkpoint/` (resumable from the Hub); `all_checkpoints` to `checkpoint-N/`;
    `end` pushes nothing on save (push the final model yourself). Waits for its pushes when training ends.
    """

    def __init__(self, repo_id: str, info: ModelCardInfo | None = None, tokens_per_step: int | None = None, *,
                 token: str | None = None, private: bool | None = None, revision: str | None = None,
                 strategy: str = "every_save", max_retries: int = 3, endpoint: str | None = None,
                 pusher: BackgroundPusher | None = None):
        strategy = getattr(strategy, "value", strategy)
        if strategy not in HUB_STRATEGIES:
            raise ValueError(f"HubPushCallback: strategy={strategy!r} is not allowed; choose one of "
                             f"{list(HUB_STRATEGIES)}.")
        info = info or ModelCardInfo()
        super().__init__(info if info.repo_id else replace(info, repo_id=repo_id), tokens_per_step)
        self.strategy = strategy
        # Newest checkpoint wins while an upload is slow; every pushed commit is still a complete checkpoint.
        self.pusher = pusher or BackgroundPusher(repo_id, token=token, private=private, revision=revision,
                                                 max_retries=max_retries, endpoint=endpoint, coalesce=True)

    @classmethod
    def from_training_args(cls, args, info: ModelCardInfo | None = None, tokens_per_step: int | None = None,
                           **kwargs) -> "HubPushCallback | None":
        """The callback for `--push_to_hub --hub_model_id ...` (None without --push_to_hub). Call it before
        building the Trainer: it takes the push over from the Trainer's own (whose README would replace this card,
        and whose per-save push leaves out the modeling code) by turning `args.push_to_hub` off, and moves
        `args.hub_token` into the callback so the token is not pickled into each checkpoint's training_args.bin."""
        if not args.push_to_hub:
            return None
        repo_id = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        token = args.hub_token
        args.push_to_hub = False
        args.hub_token = None
        return cls(repo_id, info, tokens_per_step, token=token, private=args.hub_private_repo,
                   revision=args.hub_revision, strategy=args.hub_strategy, **kwargs)

    def on_save(self, args, state, control, model=None, **kwargs):
        checkpoint = self.write_card(args, state, model)
        if checkpoint is None or self.strategy == "end":
            return
        message = checkpoint_commit_message(state.global_step, self.tokens_seen(state))
        self.pusher.submit(checkpoint, message)
        if self.strategy in ("checkpoint", "all_checkpoints"):
            folder = "last-checkpoint" if self.strategy == "checkpoint" else os.path.basename(checkpoint)
            self.pusher.submit(checkpoint, f"{message} (training state)", path_in_repo=folder,
                               include_training_state=True)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.pusher.pending:
            logger.info("Waiting for %d checkpoint push(es) to %s to finish.", self.pusher.pending,
                        self.pusher.repo_id)
        self.pusher.wait()
        if self.pusher.errors:
            logger.error("%d push(es) to %s failed; the checkpoints are intact on disk: %s", len(self.pusher.errors),
                         self.pusher.repo_id, ", ".join(f.local_dir for f in self.pusher.errors))


__all__ = ["HubPushCallback", "ModelCardCallback"]
