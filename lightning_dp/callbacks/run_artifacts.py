"""Record what a run needs to be reproduced: library versions and the final (public) model."""

from __future__ import annotations

import os
import tempfile

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dp import tracking

__all__ = ["RunArtifacts"]


class RunArtifacts(Callback):
    """Log library versions and the final model to every MLflow run of the trainer.

    - At fit start: the versions of :func:`lightning_dp.tracking.library_versions` as
      parameters ``versions/<distribution>`` (through every logger's ``log_hyperparams``).
    - At the end of training: the artifact ``model/final.ckpt``, a PUBLIC checkpoint: the
      weights, hyperparameters and module state (``trainer.save_checkpoint(weights_only=True)``:
      no optimizer, no callback states) with every secret removed
      (:func:`lightning_dp.tracking.public_checkpoint`; the federated module keeps its noise
      seed there). It loads with ``Module.load_from_checkpoint`` and serves
      ``lightning-dp test --ckpt_path``. It does not resume training: resume from the local
      checkpoints of ``ModelCheckpoint``, which hold the secret noise seeds and never leave the
      machine (see ``docs/privacy.md``, "Secrets"). This runs in ``on_train_end``, the last hook
      before Lightning tears the strategy down, because ``save_checkpoint`` is a collective
      call (a barrier under DDP): every rank calls it, global rank zero writes and logs it.

    Without an MLflow logger (or under ``fast_dev_run``) nothing is written.
    The ``lightning-dp`` CLI adds this callback to every run.

    Args:
        log_checkpoint: Set False to skip the final model (e.g. for large models).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_dp.tracking import MLFlowLogger
        >>> trainer = Trainer(logger=MLFlowLogger(), callbacks=[RunArtifacts()])  # doctest: +SKIP
    """

    ARTIFACT_PATH = "model"
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
        self._log_final_model(trainer)

    def _log_final_model(self, trainer: Trainer) -> None:
        with tempfile.TemporaryDirectory(prefix="lightning-dp-model-") as tmp_dir:
            path = os.path.join(tmp_dir, self.FILENAME)
            trainer.save_checkpoint(path, weights_only=True)  # collective: every rank calls it, rank zero writes
            tracking.log_public_checkpoint(trainer, path, self.ARTIFACT_PATH, self.FILENAME)
