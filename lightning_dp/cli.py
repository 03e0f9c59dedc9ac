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

import sys
from collections.abc import Callable, Sequence
from typing import Optional

from lightning_dp import __version__
from lightning_dp.lightning_cli import LightningDPCLI, MLflowSaveConfigCallback
from lightning_dp.tracking import redact_secrets  # noqa: F401  (part of this module's API since 0.2)

__all__ = ["EXTRA_COMMANDS", "LightningDPCLI", "MLflowSaveConfigCallback", "main", "redact_secrets"]


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
