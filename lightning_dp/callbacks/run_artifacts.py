"""Record what a run needs to be reproduced: library versions and the final checkpoint."""

from __future__ import annotations

import os
import tempfile

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dp import tracking

__all__ = ["RunArtifacts"]


class RunArtifacts(Callback):
    """Log library versions and the final checkpoint to every MLflow run of the trainer.

    - At fit start: the versions of :func:`lightning_dp.tracking.library_versions` as
      parameters ``versions/<distribution>`` (through every logger's ``log_hyperparams``).
    - At the end of training: ``trainer.save_checkpoint`` into a temporary folder, logged
      as the artifact ``checkpoints/final.ckpt``: a full checkpoint (optimizer, loops and
      callback states such as a privacy accountant's spend), so a run can be resumed
      from it with ``ckpt_path``. This runs in ``on_train_end``, the last
      hook before Lightning tears the strategy down and finalizes the loggers, because
      ``save_checkpoint`` is a collective call (a barrier under DDP): every rank calls it,
      global rank zero writes the file and logs it.

    Without an MLflow logger (or under ``fast_dev_run``) no checkpoint is written.
    The ``lightning-dp`` CLI adds this callback to every run.

    Args:
        log_checkpoint: Set False to skip the final checkpoint (e.g. for large models).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_dp.tracking import MLFlowLogger
        >>> trainer = Trainer(logger=MLFlowLogger(), callbacks=[RunArtifacts()])  # doctest: +SKIP
    """

    ARTIFACT_PATH = "checkpoints"
    FILENAME = "final.ckpt"

    def __init__(self, log_checkpoint: bool = True) -> None:
        if not isinstance(log_checkpoint, bool):
            raise ValueError(f"log_checkpoint={log_checkpoint!r} must be True or False.")
        self.log_checkpoint = log_checkpoint

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tracking.log_params(
            trainer, {f"versions/{name}": version for name, version in tracking.library_versions().items()}
        )

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.log_checkpoint or not tracking.mlflow_loggers(trainer):
            return
        self._log_final_checkpoint(trainer)

    def _log_final_checkpoint(self, trainer: Trainer) -> None:
        with tempfile.TemporaryDirectory(prefix="lightning-dp-ckpt-") as tmp_dir:
            path = os.path.join(tmp_dir, self.FILENAME)
            # Full checkpoint (callback states included, e.g. a privacy accountant's spend), so
            # that a run can resume from it. Collective: every rank calls it, rank zero writes.
            trainer.save_checkpoint(path, weights_only=False)
            tracking.log_artifact(trainer, path, self.ARTIFACT_PATH)  # global rank zero only
