"""Record what a run needs to be reproduced and compared: library versions, the final (public) model, a summary."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from typing import Optional

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dp import tracking
from lightning_dp.callbacks.summary import print_summary

__all__ = ["SUMMARY_METRICS", "RunArtifacts", "baseline_rows", "run_summary"]

#: Final metric -> summary tag (when the run logged it).
SUMMARY_METRICS = {
    "privacy/epsilon": "summary.epsilon",
    "privacy/client_epsilon_max": "summary.client_epsilon_max",
    "val/acc": "summary.val_acc",
    "val/loss": "summary.val_loss",
    "test/acc": "summary.test_acc",
}


def run_summary(metrics: Mapping[str, float], *, target_epsilon: Optional[float] = None) -> dict[str, str]:
    """The summary tags of a run from its final metrics (4 significant digits).

    ``summary.budget_used`` is ``privacy/epsilon / target_epsilon`` as a percentage, when both are known.

    Example:
        >>> run_summary({"privacy/epsilon": 2.9841, "val/acc": 0.8125, "nonprivate/train_loss": 0.3}, target_epsilon=3.0)
        {'summary.epsilon': '2.984', 'summary.val_acc': '0.8125', 'summary.budget_used': '99.5%'}
    """
    tags = {tag: f"{metrics[name]:.4g}" for name, tag in SUMMARY_METRICS.items() if name in metrics}
    epsilon = metrics.get("privacy/epsilon")
    if epsilon is not None and target_epsilon and math.isfinite(target_epsilon):
        tags["summary.budget_used"] = f"{100 * epsilon / target_epsilon:.1f}%"
    return tags


def baseline_rows(metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """The summary rows of a run with no private component: that it is not private, and its final metrics.

    Example:
        >>> baseline_rows({"val/acc": 0.9612, "val/loss": 0.1234, "epoch": 9.0})[1:]
        [('val/acc', '0.9612'), ('val/loss', '0.1234')]
    """
    rows = [("privacy", "none: no DP callback or private module; the model and its metrics are not private")]
    rows += [(name, f"{metrics[name]:.4g}") for name in sorted(metrics)
             if name.startswith(("val/", "test/")) and math.isfinite(metrics[name])]
    return rows


class RunArtifacts(Callback):
    """Log library versions and the final model to every MLflow run of the trainer.

    - At fit start: the versions of :func:`lightning_dp.tracking.library_versions` as
      parameters ``versions/<distribution>``, and ``versions/lightning-dp-commit`` from a git checkout
      (through every logger's ``log_hyperparams``).
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

    - When fit ends: the run's summary as tags (:func:`run_summary`): ``summary.epsilon``,
      ``summary.budget_used`` (epsilon over the target of a DP-SGD callback), the federated
      ``summary.client_epsilon_max`` and the final ``summary.val_acc`` / ``summary.val_loss`` /
      ``summary.test_acc``. Tags are shown as columns of the MLflow runs table, so runs compare
      at a glance without opening each one; the per-step values stay metrics. A run with no private
      component (no :func:`~lightning_dp.privacy.spend.reporters_of`: the non-private baseline) also prints
      its summary (:func:`baseline_rows`), as DPSGD and the federated round print theirs.

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
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or getattr(trainer, "fast_dev_run", False):
            return
        # the one DP-SGD-like component (DPSGD and subclasses): its spend after the last step (the logged value
        # may be older) and its target; with none or several, the logged metrics alone
        private = [obj for obj in [*trainer.callbacks, pl_module]  # type: ignore[attr-defined]
                   if isinstance(getattr(obj, "epsilon", None), (int, float)) and hasattr(obj, "noise_multiplier")]
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()
                   if getattr(value, "numel", lambda: 0)() == 1}
        target = None
        if len(private) == 1:
            metrics["privacy/epsilon"] = float(private[0].epsilon)
            goal = getattr(private[0], "target_epsilon", None)
            target = float(goal) if isinstance(goal, (int, float)) else None
        tracking.set_tags(trainer, run_summary(metrics, target_epsilon=target))
        from lightning_dp.privacy.spend import reporters_of, spends_of

        components = [*trainer.callbacks, pl_module]  # type: ignore[attr-defined]
        reporting = bool(reporters_of(components))
        # private: some component accounts the run and none releases without protection (NoiselessDPSGD, an
        # unsanitized round: their logged epsilon is a claim, not a guarantee); lightning-dp compare reads it
        is_private = reporting and not any(s.unsanitized for s in spends_of(components))
        tracking.set_tags(trainer, {tracking.PRIVATE_TAG: str(is_private).lower()})  # lightning-dp compare reads it
        if not reporting:
            # a private component prints its own summary (DPSGD, the federated round); a run without one says so
            epochs = trainer.current_epoch
            print_summary(trainer, f"Non-private training: {trainer.global_step} steps ({epochs} epoch"
                          f"{'' if epochs == 1 else 's'})", baseline_rows(metrics))

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
