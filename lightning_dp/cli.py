"""The ``lightning-dp`` command: LightningCLI with MLflow tracking by default.

Usage::

    lightning-dp fit --config examples/digits_nonprivate.yaml
    lightning-dp fit --config run.yaml --trainer.max_epochs=3 --model.init_args.lr=0.05
    lightning-dp test --config run.yaml --ckpt_path=path/to/final.ckpt
    lightning-dp fit --help

A config names its classes (``model: {class_path: ...}``, ``data: {class_path: ...}``);
any ``LightningModule`` and ``LightningDataModule`` can be used. Compared with plain
``LightningCLI``:

- the trainer logs to :class:`lightning_dp.tracking.MLFlowLogger` (embedded SQLite
  store under ``./mlruns`` unless ``MLFLOW_TRACKING_URI`` is set) unless the config sets
  ``trainer.logger``;
- :class:`~lightning_dp.callbacks.run_artifacts.RunArtifacts` is always added (library
  versions as params, the public ``model/final.ckpt`` as artifact);
- the resolved config is logged as the run's ``config.yaml`` artifact;
- ``seed_everything`` defaults to 0;
- after the command, rank zero prints the run id, the tracking URI and the
  ``mlflow ui`` command to browse the runs.

Subcommands: ``fit``, ``validate``, ``test``, ``audit`` (:mod:`lightning_dp.audit.command`: DLG against
sanitized client releases; ``audit mia``, :mod:`lightning_dp.audit.mia_command`: membership inference),
``epsilon`` (:mod:`lightning_dp.calculator`: epsilon of a DP-SGD run, or sigma for a target) and ``grid`` (:mod:`lightning_dp.grid`: one
config over a grid of overrides, nested MLflow runs, the grid's composed privacy cost).
Top-level commands outside LightningCLI register in :data:`EXTRA_COMMANDS`; they are
dispatched by :func:`main` before LightningCLI parses the arguments.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

from lightning_dp import __version__, tracking
from lightning_dp.callbacks.run_artifacts import RunArtifacts
from lightning_dp.tracking import redact_secrets  # noqa: F401  (part of this module's API since 0.2)

__all__ = ["EXTRA_COMMANDS", "LightningDPCLI", "MLflowSaveConfigCallback", "main", "redact_secrets"]

DEFAULT_LOGGER = {"class_path": "lightning_dp.tracking.MLFlowLogger"}

def _grid(argv: list[str]) -> Optional[int]:
    from lightning_dp import grid

    return grid.main(argv)


def _audit(argv: list[str]) -> Optional[int]:
    if argv and argv[0] == "mia":  # lightning-dp audit mia --config ...: membership inference
        from lightning_dp.audit import mia_command

        return mia_command.main(argv[1:])
    from lightning_dp.audit import command  # lightning-dp audit [dlg] --config ...: gradient inversion

    return command.main(argv[1:] if argv and argv[0] == "dlg" else argv)


def _epsilon(argv: list[str]) -> Optional[int]:
    from lightning_dp import calculator

    return calculator.main(argv)


#: Top-level commands handled outside LightningCLI: name -> function(argv) -> exit code.
#: ``grid``: one config over a grid of overrides, with the grid's privacy cost (:mod:`lightning_dp.grid`).
#: ``audit``: Deep Leakage from Gradients against sanitized client releases (:mod:`lightning_dp.audit.command`);
#: ``audit mia``: membership inference, loss / shadow / noisy neighbours (:mod:`lightning_dp.audit.mia_command`).
#: ``epsilon``: the epsilon of a DP-SGD run, or sigma for a target epsilon (:mod:`lightning_dp.calculator`).
EXTRA_COMMANDS: dict[str, Callable[[list[str]], Optional[int]]] = {"grid": _grid, "audit": _audit,
                                                                   "epsilon": _epsilon}


class MLflowSaveConfigCallback(SaveConfigCallback):
    """Log the resolved config as the artifact ``config.yaml`` of every MLflow run.

    When the trainer has an MLflow logger the config is only logged to MLflow (no
    ``config.yaml`` is written into the shared ``./mlruns`` folder). Without one it
    falls back to LightningCLI's behaviour: a file in ``trainer.log_dir``, overwritten if
    it exists (``overwrite=True`` by default, since several runs share a log dir), and
    skipped when the logger has no local folder (LightningCLI would fail an
    ``assert log_dir is not None`` there). Both copies have secret seeds redacted
    (:func:`redact_secrets`).

    Args:
        parser: The parser of the subcommand.
        config: The parsed config of the subcommand.
        config_filename: Name of the file and of the artifact.
        overwrite: Overwrite an existing file in the log dir.
        multifile: Keep the structure of several config files (local copy only).
        save_to_log_dir: Write the local copy when there is no MLflow logger.
    """

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Any,
        config_filename: str = "config.yaml",
        overwrite: bool = True,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        super().__init__(
            parser,
            config,
            config_filename=config_filename,
            overwrite=overwrite,
            multifile=multifile,
            save_to_log_dir=save_to_log_dir,
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.save_to_log_dir and (tracking.mlflow_loggers(trainer) or trainer.log_dir is None):
            self.save_to_log_dir = False
        if self.save_to_log_dir and not self.already_saved:
            # LightningCLI would write the parser's dump, secret seeds included: write the redacted text instead
            path = os.path.join(trainer.log_dir, self.config_filename)
            if trainer.is_global_zero:
                if not self.overwrite and os.path.isfile(path):
                    raise RuntimeError(f"{type(self).__name__} expected {path} to NOT exist; delete it or pass "
                                       "save_config_kwargs={'overwrite': True}")
                os.makedirs(trainer.log_dir, exist_ok=True)
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(redact_secrets(self.parser.dump(self.config, skip_none=False)))
            self.save_to_log_dir = False  # written: the base class must not write the unredacted dump
        super().setup(trainer, pl_module, stage)

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        text = redact_secrets(self.parser.dump(self.config, skip_none=False))
        tracking.log_text(trainer, text, self.config_filename)


class LightningDPCLI(LightningCLI):
    """LightningCLI of ``lightning-dp``; see the module docstring for what it adds.

    The arguments are LightningCLI's; these defaults differ: ``model_class=None`` and
    ``datamodule_class=None`` with subclass mode (configs name their classes),
    ``save_config_callback=MLflowSaveConfigCallback`` with ``overwrite=True``,
    ``seed_everything_default=0``, and ``trainer_defaults`` that set the logger to
    :class:`lightning_dp.tracking.MLFlowLogger` and add
    :class:`~lightning_dp.callbacks.run_artifacts.RunArtifacts` (given
    ``trainer_defaults`` are merged over these; given callbacks are added to RunArtifacts).

    Example:
        >>> LightningDPCLI(args=["fit", "--config", "examples/digits_nonprivate.yaml"])  # doctest: +SKIP
    """

    def __init__(
        self,
        model_class: Any = None,
        datamodule_class: Any = None,
        save_config_callback: Optional[type[SaveConfigCallback]] = MLflowSaveConfigCallback,
        save_config_kwargs: Optional[dict[str, Any]] = None,
        trainer_defaults: Optional[dict[str, Any]] = None,
        seed_everything_default: bool | int = 0,
        subclass_mode_model: bool = True,
        subclass_mode_data: bool = True,
        args: Any = None,
        **kwargs: Any,
    ) -> None:
        defaults: dict[str, Any] = {"logger": dict(DEFAULT_LOGGER), "callbacks": [RunArtifacts()]}
        for key, value in (trainer_defaults or {}).items():
            if key == "callbacks":
                defaults["callbacks"] += list(value) if isinstance(value, (list, tuple)) else [value]
            else:
                defaults[key] = value
        super().__init__(
            model_class=model_class,
            datamodule_class=datamodule_class,
            save_config_callback=save_config_callback,
            save_config_kwargs={"overwrite": True, **(save_config_kwargs or {})},
            trainer_defaults=defaults,
            seed_everything_default=seed_everything_default,
            subclass_mode_model=subclass_mode_model,
            subclass_mode_data=subclass_mode_data,
            args=args,
            **kwargs,
        )

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser; dumped configs start with the Lightning and lightning-dp versions."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}", f"lightning-dp=={__version__}"])
        return super().init_parser(**kwargs)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test`` (LightningCLI's, without ``predict``)."""
        return {
            name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate", "test")
        }

    def after_fit(self) -> None:
        """Print where the run is recorded."""
        self.print_run_locations()

    def after_validate(self) -> None:
        """Print where the run is recorded."""
        self.print_run_locations()

    def after_test(self) -> None:
        """Print where the run is recorded."""
        self.print_run_locations()

    def print_run_locations(self) -> None:
        """On global rank zero, print run id, tracking URI and ``mlflow ui`` command of each MLflow logger."""
        if not self.trainer.is_global_zero:
            return
        for logger in tracking.mlflow_loggers(self.trainer):
            if logger.run_id is None:
                continue
            uri = tracking.tracking_uri_of(logger)
            print(
                f"MLflow run {logger.run_id} (experiment id {logger.experiment_id})\n"
                f"  tracking URI: {uri}\n"
                f"  browse runs:  {tracking.ui_command(uri)}",
                flush=True,
            )


def main(args: Optional[Sequence[str]] = None) -> Optional[int]:
    """Entry point of the ``lightning-dp`` console script.

    Args:
        args: Command-line arguments without the program name; None reads ``sys.argv``.

    Returns:
        None on success (the console script then exits with status 0), or the exit code
        of an :data:`EXTRA_COMMANDS` handler.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv in (["--version"], ["-V"]):
        print(f"lightning-dp {__version__}")
        return 0
    if argv and argv[0] in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[argv[0]](argv[1:])
    LightningDPCLI(args=None if args is None else argv)
    return None


if __name__ == "__main__":
    sys.exit(main())
