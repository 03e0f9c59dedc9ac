"""Early stopping's missing half: end ``fit`` with the weights of the best validation check.

Lightning's ``EarlyStopping`` stops ``patience`` checks after the best one, and the module
keeps the weights of the last round or step; Keras users know ``restore_best_weights``,
Lightning has no equivalent. With noisy releases (the federated module at nu = 5) the last
hypotheses can be far from the best ones (examples/fl_synthetic.yaml: the best check's within 0.50 of
theta* over 15 noise seeds; ``examples/fl_synthetic_report.py`` measures it).

Only the model's ``state_dict`` is restored, never training progress nor privacy
bookkeeping: a privacy ledger or accountant keeps the spend of every round that ran,
including those after the best check (restoring it would under-report epsilon), and the
module's round counter stays at the last round.
"""

from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_dp import tracking

__all__ = ["RestoreBestWeights"]


class RestoreBestWeights(Callback):
    """Load the best checkpoint's ``state_dict`` into the module when ``fit`` ends.

    The best checkpoint is the one of the trainer's ``ModelCheckpoint`` that monitors
    ``monitor`` (or of its only monitoring ``ModelCheckpoint`` when ``monitor`` is None).
    At the end of training the checkpoint is logged to MLflow as ``model/best.ckpt``, public
    (:func:`lightning_dp.tracking.public_checkpoint`: weights and hyperparameters, no resume
    state, no secret seed; the file itself stays local),
    with the parameters ``best_checkpoint/monitor``, ``best_checkpoint/score`` and
    ``best_checkpoint/path``; when ``fit`` has ended, the weights are loaded, so the module
    handed back to the caller (and to a following ``trainer.test(model)``) is the best one.

    Args:
        monitor: The metric of the ``ModelCheckpoint`` to follow, e.g. ``"val/loss"``.
        log_checkpoint: Also log the best checkpoint file as an MLflow artifact.

    Raises:
        MisconfigurationException: At fit start, if no ``ModelCheckpoint`` monitors a metric
            (or ``monitor``), or several do and ``monitor`` is not given.

    Example (YAML, with ``EarlyStopping`` and a monitoring ``ModelCheckpoint``)::

        callbacks:
          - class_path: lightning.pytorch.callbacks.ModelCheckpoint
            init_args: {monitor: val/loss, mode: min}
          - class_path: lightning_dp.callbacks.RestoreBestWeights
    """

    def __init__(self, monitor: Optional[str] = None, log_checkpoint: bool = True) -> None:
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"monitor={monitor!r} must be a metric name such as 'val/loss', or None")
        if not isinstance(log_checkpoint, bool):
            raise ValueError(f"log_checkpoint={log_checkpoint!r} must be True or False")
        self.monitor = monitor
        self.log_checkpoint = log_checkpoint

    def _checkpoint_callback(self, trainer: Trainer) -> ModelCheckpoint:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        found = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.monitor is not None
                 and (self.monitor is None or cb.monitor == self.monitor)]
        if len(found) == 1:
            return found[0]
        monitored = sorted({cb.monitor for cb in callbacks if isinstance(cb, ModelCheckpoint) and cb.monitor})
        if not found:
            want = f"monitor={self.monitor!r}" if self.monitor else "a monitor"
            raise MisconfigurationException(
                f"RestoreBestWeights needs a ModelCheckpoint with {want} (found monitors: {monitored or 'none'}); add "
                "e.g. ModelCheckpoint(monitor='val/loss', mode='min') to the trainer's callbacks.")
        raise MisconfigurationException(
            f"RestoreBestWeights: several ModelCheckpoints monitor {monitored}; choose one with "
            "RestoreBestWeights(monitor=...).")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._checkpoint_callback(trainer)  # fail before training, not after

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ckpt = self._checkpoint_callback(trainer)
        if not ckpt.best_model_path or not trainer.is_global_zero or not tracking.mlflow_loggers(trainer):
            return
        score = ckpt.best_model_score
        tracking.log_params(trainer, {"best_checkpoint/monitor": ckpt.monitor,
                                      "best_checkpoint/score": None if score is None else float(score),
                                      "best_checkpoint/path": ckpt.best_model_path})
        if self.log_checkpoint:  # public: ModelCheckpoint's file holds resume state and secret seeds
            tracking.log_public_checkpoint(trainer, ckpt.best_model_path, "model", "best.ckpt")

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ckpt = self._checkpoint_callback(trainer)
        if not ckpt.best_model_path:  # no validation ran (e.g. fewer rounds than check_val_every_n_epoch)
            rank_zero_info("RestoreBestWeights: no best checkpoint was saved; the module keeps its last weights")
            return
        device = next(iter(pl_module.state_dict().values()), torch.empty(0)).device
        state = torch.load(ckpt.best_model_path, map_location=device, weights_only=False)["state_dict"]
        pl_module.load_state_dict(state)
        rank_zero_info(f"RestoreBestWeights: restored {ckpt.best_model_path} ({ckpt.monitor}={ckpt.best_model_score})")
