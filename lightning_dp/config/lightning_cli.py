"""LightningCLI of ``lightning-dp``: one ``fit``/``validate``/``test`` run from a config, tracked in MLflow.

Compared with plain ``LightningCLI``:

- the trainer logs to :class:`lightning_dp.tracking.MLFlowLogger` (embedded SQLite
  store under ``./mlruns`` unless ``MLFLOW_TRACKING_URI`` is set) unless the config sets
  ``trainer.logger``;
- :class:`~lightning_dp.callbacks.run_artifacts.RunArtifacts` is always added (library
  versions as params, the public ``model/final.ckpt`` as artifact);
- the resolved config is logged as the run's ``config.yaml`` artifact, secret seeds redacted;
- ``seed_everything`` defaults to 0;
- after the command, rank zero prints the run id, the tracking URI and the
  ``mlflow ui`` command to browse the runs.

The ``lightning-dp`` command itself (subcommands, help, error messages) is :mod:`lightning_dp.cli`, and
``lightning-dp fit``, ``validate`` and ``test`` run this class (:mod:`lightning_dp.commands.fit`). It lives below
the commands because more than the commands build a config with it: a grid runs every point with it
(:mod:`lightning_dp.grid`) and a Flower deployment builds its round on the server and on every node with it
(:mod:`lightning_dp.flower`), neither of which may import the commands (docs/architecture.md).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

from lightning_dp import __version__, tracking
from lightning_dp.callbacks.run_artifacts import RunArtifacts
from lightning_dp.config.errors import ConfigurationError, is_refusal, root_message, show_tracebacks
from lightning_dp.config.parser import ShortErrorParser
from lightning_dp.config.threads import announce
from lightning_dp.tracking import redact_secrets

__all__ = ["DEFAULT_LOGGER", "LightningDPCLI", "MLflowSaveConfigCallback", "quiet_third_party"]

DEFAULT_LOGGER = {"class_path": "lightning_dp.tracking.MLFlowLogger"}


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_third_party() -> None:
    """Silence messages a user of the command cannot act on (issue 17: quiet by default).

    - Lightning's "💡 Tip: try installing litlogger / litmodels" advertisements;
    - torch's ``FutureWarning`` that Lightning itself still uses ``LeafSpec`` (Lightning's code,
      not the user's, and fixed upstream);
    - LightningCLI's warning that ``args`` and ``sys.argv`` are both given (``lightning-dp grid``
      runs every point with its own ``args``);
    - MLflow's and alembic's INFO lines while the embedded SQLite store creates or upgrades its tables.

    Warnings that a user can act on (Lightning's, ours) are left alone. Idempotent; used by
    :class:`LightningDPCLI`, not on import (a library must not change its host's logging).
    """
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # the grid and the audits build LightningDPCLI(args=...) inside a command that has its own sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


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
            log_dir = trainer.log_dir  # read once: the property broadcasts, and every rank must call it as often
            if log_dir is None:  # excluded just above
                raise RuntimeError(f"{type(self).__name__}: the Trainer has no log_dir (internal)")
            path = os.path.join(log_dir, self.config_filename)
            if trainer.is_global_zero:
                if not self.overwrite and os.path.isfile(path):
                    raise RuntimeError(f"{type(self).__name__} expected {path} to NOT exist; delete it or pass "
                                       "save_config_kwargs={'overwrite': True}")
                os.makedirs(log_dir, exist_ok=True)
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
    ``seed_everything_default=0``, ``parser_class=ShortErrorParser`` (a refused value is
    printed in a few lines, :mod:`lightning_dp.config.errors`), and ``trainer_defaults`` that set the logger to
    :class:`lightning_dp.tracking.MLFlowLogger` and add
    :class:`~lightning_dp.callbacks.run_artifacts.RunArtifacts` (given
    ``trainer_defaults`` are merged over these; given callbacks are added to RunArtifacts).
    An exception raised while the config's classes are built (a constructor refusing a value)
    is re-raised as :class:`~lightning_dp.config.errors.ConfigurationError` with the
    constructor's own message, the original as its cause.

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
        parser_class: type[LightningArgumentParser] = ShortErrorParser,
        **kwargs: Any,
    ) -> None:
        quiet_third_party()
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
            parser_class=parser_class,
            **kwargs,
        )

    @override
    def instantiate_classes(self) -> None:
        """LightningCLI's; a class that refuses its arguments raises :class:`ConfigurationError` with its message.

        Only refusals (:func:`~lightning_dp.config.errors.is_refusal`: a ``ValueError``, ``TypeError``,
        ``MisconfigurationException`` or jsonargparse ``ArgumentError`` at the root) are converted; any
        other exception (a bug) propagates unchanged, with its traceback.
        """
        try:
            super().instantiate_classes()
        except Exception as err:
            if show_tracebacks() or not is_refusal(err):
                raise
            raise ConfigurationError(root_message(err)) from err

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

    def before_fit(self) -> None:
        """Let every callback that can refuse the fit from its settings alone (``check_fit``: DPSGD and its
        subclasses) do so now, before any data is read, any MLflow run is started or any model summary printed;
        then say how many threads torch uses when ``lightning-dp`` capped them (:mod:`lightning_dp.config.threads`).
        """
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path") if self.subcommand else None
        for callback in self.trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning, undeclared
            check = getattr(callback, "check_fit", None)
            if callable(check):
                check(self.trainer, self.model, ckpt_path=ckpt_path)
        announce()

    def before_validate(self) -> None:
        """Say how many threads torch uses when ``lightning-dp`` capped them."""
        announce()

    def before_test(self) -> None:
        """Say how many threads torch uses when ``lightning-dp`` capped them."""
        announce()

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
            view = tracking.has_table_view(logger.experiment, logger.experiment_id)
            print(tracking.run_locations(logger.run_id, logger.experiment_id, tracking.tracking_uri_of(logger),
                                         table_view=view), flush=True)
