"""The ``lightning-dp`` command: subcommands, focused help, short errors.

Usage::

    lightning-dp --help                  # every subcommand, one line each
    lightning-dp fit --config examples/dpsgd_digits.yaml
    lightning-dp fit --config run.yaml --trainer.max_epochs=3 --model.init_args.lr=0.05
    lightning-dp test --config run.yaml --ckpt_path=path/to/final.ckpt
    lightning-dp fit --help              # our options and this config's classes; --help-all: Lightning's 500 lines
    lightning-dp fit --config run.yaml --print_config

``fit``, ``validate`` and ``test`` run :class:`~lightning_dp.commands.fit.LightningDPCLI`
(LightningCLI with MLflow tracking by default; see :mod:`lightning_dp.commands.fit`). The other
subcommands register in :data:`EXTRA_COMMANDS` and are dispatched before LightningCLI parses
anything: ``grid`` (:mod:`lightning_dp.commands.grid`), ``audit`` (:mod:`lightning_dp.commands.audit_dlg`,
``audit mia``: :mod:`lightning_dp.commands.audit_mia`), ``epsilon`` (:mod:`lightning_dp.commands.epsilon`) and
``compare`` (:mod:`lightning_dp.commands.compare`). Nothing heavy is imported before a command needs it: ``--help``,
``--version`` and the argument errors of ``epsilon``, ``grid`` and ``compare`` answer without torch.

Errors: a refused value, an unknown option, subcommand or class path prints one message with a
"did you mean" (:mod:`lightning_dp.commands.errors`) and exits with status 2; so does a missing
dataset (:class:`~lightning_dp.datamodules.DatasetUnavailableError`) and a Lightning
``MisconfigurationException`` (our callbacks' refusals before training). ``LIGHTNING_DP_TRACEBACK=1``
shows the full traceback instead.

Threads: the training commands (:data:`TRAINING_COMMANDS`) give torch one thread per core that other jobs leave
free and say so in one line (:mod:`lightning_dp.config.threads`); ``LIGHTNING_DP_THREADS=N`` or ``OMP_NUM_THREADS``
choose instead. Memory: with glibc they keep freed memory in the process for the next step instead of faulting it
in again (:mod:`lightning_dp.config.allocator`); ``LIGHTNING_DP_MALLOC=system`` leaves the allocator as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

from lightning_dp import __version__
from lightning_dp.commands.errors import closest, is_user_error, short_error, show_tracebacks, suggest

# Nothing above imports torch, Lightning or MLflow (tests/commands/test_errors.py checks it): --version, --help and the
# argument errors answer in a fraction of a second; the classes below load when a command needs them.
_LAZY = {"LightningDPCLI": "lightning_dp.commands.fit", "MLflowSaveConfigCallback": "lightning_dp.commands.fit",
         "redact_secrets": "lightning_dp.tracking"}


def __getattr__(name: str) -> Any:  # PEP 562: the module's API, imported on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "EXTRA_COMMANDS", "LightningDPCLI", "MLflowSaveConfigCallback", "help_text", "main",
           "redact_secrets", "run_help"]

#: Every subcommand of ``lightning-dp`` and its one line in ``lightning-dp --help``.
COMMANDS: dict[str, str] = {
    "fit": "train the model of a config (DP-SGD, federated, ...), recorded in MLflow",
    "validate": "evaluate a config's model on its validation data (--ckpt_path for trained weights)",
    "test": "evaluate a config's model on its test data (--ckpt_path for trained weights)",
    "grid": "run one config over a grid of overrides, nested in MLflow, with the grid's privacy cost",
    "audit": "attack a model to audit its privacy: gradient inversion (audit dlg) or membership (audit mia)",
    "epsilon": "the epsilon of a DP-SGD or DP-FedAvg run for its size, batch, epochs and sigma (or sigma)",
    "compare": "the privacy-utility picture of runs: a metric against epsilon, with the non-private baseline",
    "flower-app": "the Flower app of a federated config: the same round on a deployment (SuperLink, SuperNodes)",
    "flower-keys": "the TLS certificates and SuperNode keys of a secure Flower deployment",
}

#: The commands that train or attack a model: torch's threads are capped to the free cores when they start
#: (:mod:`lightning_dp.config.threads`; ``LIGHTNING_DP_THREADS=N`` or ``OMP_NUM_THREADS`` choose instead). The
#: run says so in one line when it starts (``LightningDPCLI``). The C allocator keeps freed memory for the next
#: step (:mod:`lightning_dp.config.allocator`; ``LIGHTNING_DP_MALLOC=system`` leaves it as it is).
TRAINING_COMMANDS = ("fit", "validate", "test", "grid", "audit")


def _grid(argv: list[str]) -> Optional[int]:
    from lightning_dp.commands import grid

    return grid.main(argv)


def _audit(argv: list[str]) -> Optional[int]:
    if argv and argv[0] == "mia":  # lightning-dp audit mia --config ...: membership inference
        from lightning_dp.commands import audit_mia

        return audit_mia.main(argv[1:])
    from lightning_dp.commands import audit_dlg  # lightning-dp audit [dlg] --config ...: gradient inversion

    return audit_dlg.main(argv[1:] if argv and argv[0] == "dlg" else argv)


def _epsilon(argv: list[str]) -> Optional[int]:
    from lightning_dp.commands import epsilon

    return epsilon.main(argv)


def _compare(argv: list[str]) -> Optional[int]:
    from lightning_dp.commands import compare

    return compare.main(argv)


def _flower_app(argv: list[str]) -> Optional[int]:
    from lightning_dp.commands import flower_app

    return flower_app.main(argv)


def _flower_keys(argv: list[str]) -> Optional[int]:
    from lightning_dp.commands import flower_keys

    return flower_keys.main(argv)


#: Top-level commands handled outside LightningCLI: name -> function(argv) -> exit code.
#: ``grid``: one config over a grid of overrides, with the grid's privacy cost (:mod:`lightning_dp.grid`).
#: ``audit``: Deep Leakage from Gradients against sanitized client releases (:mod:`lightning_dp.commands.audit_dlg`);
#: ``audit mia``: membership inference, loss / shadow / noisy neighbours (:mod:`lightning_dp.commands.audit_mia`).
#: ``epsilon``: the epsilon of a DP-SGD run, or sigma for a target epsilon (:mod:`lightning_dp.commands.epsilon`).
#: ``compare``: a metric against epsilon over runs, with the non-private baseline (:mod:`lightning_dp.commands.compare`).
#: ``flower-app``: the Flower app of a federated config (:mod:`lightning_dp.commands.flower_app`, :mod:`lightning_dp.flower`).
#: ``flower-keys``: a secure deployment's certificates and keys (:mod:`lightning_dp.commands.flower_keys`).
EXTRA_COMMANDS: dict[str, Callable[[list[str]], Optional[int]]] = {"grid": _grid, "audit": _audit,
                                                                   "epsilon": _epsilon, "compare": _compare,
                                                                   "flower-app": _flower_app, "flower-keys": _flower_keys}


def help_text() -> str:
    """``lightning-dp --help``: every subcommand with its line, and where to start."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: lightning-dp <command> [options]      (lightning-dp {__version__})", "",
             "Differentially private and personalized federated learning for PyTorch Lightning, tracked in MLflow.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, line in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help     show this message", "  -V, --version  print the version", "",
              "Start with:  lightning-dp fit --config examples/dpsgd_digits.yaml",
              "Each command's options:  lightning-dp <command> --help"]
    return "\n".join(lines) + "\n"


def _config_paths(argv: Sequence[str]) -> list[str]:
    """The files named by ``--config`` / ``-c`` in ``argv``."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    return paths + [a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-c="))]


def _missing_config(argv: Sequence[str]) -> Optional[tuple[str, str]]:
    """The refusal and hint for a ``--config`` file that does not exist (before Lightning is imported), or None."""
    for path in _config_paths(argv):
        if not os.path.isfile(path):
            here = os.path.dirname(path) or "."
            near = [os.path.join(os.path.dirname(path), n) for n in
                    (sorted(os.listdir(here)) if os.path.isdir(here) else []) if n.endswith((".yaml", ".yml"))]
            hint = closest(path, near, n=2)
            return (f"--config {path}: no such file",
                    f"did you mean {' or '.join(hint)}?" if hint else "the examples are in examples/*.yaml")
    return None


def _config_classes(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(key, class_path)`` of the model, data and callbacks named by the ``--config`` files in ``argv``."""
    import yaml

    found: dict[str, str] = {}
    for path in _config_paths(argv):
        try:
            with open(path, encoding="utf-8") as handle:
                config = yaml.safe_load(handle) or {}
        except (OSError, yaml.YAMLError):
            continue
        for key in ("model", "data"):
            node = config.get(key)
            if isinstance(node, dict) and node.get("class_path"):
                found[key] = node["class_path"]
        trainer = config.get("trainer") or {}
        callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
        for node in callbacks if isinstance(callbacks, list) else [callbacks] if callbacks else []:
            if isinstance(node, dict) and node.get("class_path"):
                found[f"callback {node['class_path'].rsplit('.', 1)[-1]}"] = node["class_path"]
    return list(found.items())


def run_help(subcommand: str, argv: Sequence[str]) -> str:
    """``lightning-dp fit --help``: our options first, the config's classes, then how to see Lightning's."""
    prog = f"lightning-dp {subcommand}"
    lines = [f"usage: {prog} --config CONFIG [--config MORE] [--KEY=VALUE ...]", "",
             COMMANDS[subcommand][0].upper() + COMMANDS[subcommand][1:] + ".", "",
             "options:",
             "  -c, --config CONFIG        a YAML config (examples/*.yaml); repeat to compose configs",
             "  --KEY=VALUE                override any value of the config by its dotted key, e.g.",
             "                             --trainer.max_epochs=3 --model.init_args.lr=0.05",
             "  --print_config             print the resolved config (secrets included: keep it private) and exit",
             "  --seed_everything SEED     global seed of the run (default 0)",
             "  --ckpt_path PATH           checkpoint to resume from (fit) or to evaluate (validate, test)",
             "  --model.help CLASS         the options of a model class, e.g. lightning_dp.models.ImageClassifier",
             "  --data.help CLASS          the options of a data class, e.g. lightning_dp.datamodules.DigitsDataModule",
             "  --trainer.callbacks.help CLASS",
             "                             the options of a callback, e.g. lightning_dp.callbacks.DPSGD",
             "  -h, --help                 this message;  --help-all: every Lightning Trainer option (~500 lines)"]
    classes = _config_classes(argv)
    if classes:
        lines += ["", "this config's classes (their options: the --*.help commands):"]
        for key, path in classes:
            flag = "--trainer.callbacks.help" if key.startswith("callback") else f"--{key}.help"
            lines.append(f"  {key:<24} {path}\n  {'':<24} {prog} {flag} {path}")
    lines += ["", "Common Trainer options: --trainer.max_epochs, --trainer.max_steps, --trainer.accelerator,",
              "--trainer.devices, --trainer.strategy, --trainer.logger, --trainer.enable_progress_bar.",
              "Runs are recorded in ./mlruns (SQLite) unless MLFLOW_TRACKING_URI is set; see README.md."]
    return "\n".join(lines) + "\n"


def main(args: Optional[Sequence[str]] = None) -> Optional[int]:
    """Entry point of the ``lightning-dp`` console script.

    Args:
        args: Command-line arguments without the program name; None reads ``sys.argv``.

    Returns:
        None on success (the console script then exits with status 0), or an exit code:
        0 after help or the version, 2 for a refused command, or that of an
        :data:`EXTRA_COMMANDS` handler.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv in (["--version"], ["-V"]):
        print(f"lightning-dp {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(help_text())
        return 0 if argv else 2
    command = argv[0]
    if command in TRAINING_COMMANDS:
        from lightning_dp.config.allocator import apply_allocator_policy
        from lightning_dp.config.threads import apply_thread_policy

        try:
            apply_thread_policy()  # OMP_NUM_THREADS for torch to read; imports nothing, prints nothing
            apply_allocator_policy()  # glibc keeps freed memory for the next step (LIGHTNING_DP_MALLOC=system: not)
        except ValueError as err:
            sys.stderr.write(short_error(f"lightning-dp {command}", str(err)))
            return 2
    if command in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[command](argv[1:])
    if command not in ("fit", "validate", "test"):  # LightningDPCLI.subcommands(), without importing Lightning
        if not command.startswith("-"):
            hint = suggest(f"invalid choice: '{command}' (choose from {', '.join(map(repr, COMMANDS))})")
            sys.stderr.write(short_error("lightning-dp", f"unknown command {command!r}", hint or
                                         "commands: " + ", ".join(COMMANDS)))
            return 2
    elif any(a in ("-h", "--help") for a in argv[1:]):
        sys.stdout.write(run_help(command, argv[1:]))
        return 0
    elif "--help-all" in argv[1:]:
        argv = [a if a != "--help-all" else "--help" for a in argv]
    missing = _missing_config(argv[1:])
    if missing:
        sys.stderr.write(short_error(f"lightning-dp {command}", *missing))
        return 2
    from lightning_dp.commands.fit import LightningDPCLI

    try:
        LightningDPCLI(args=None if args is None and argv == sys.argv[1:] else argv)
    except Exception as err:
        if show_tracebacks() or not is_user_error(err):
            raise
        message = str(err).strip() or type(err).__name__
        sys.stderr.write(short_error(f"lightning-dp {command}", message, suggest(message)))
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
