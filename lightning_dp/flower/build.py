"""The round of a config, built the same way on the server and on every node."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["build_from_yaml", "check_shareable", "read_secret", "refuse_budgets_for_sites", "refuse_unsupported",
           "secret_settings", "uses_budgets"]


def secret_settings(cli: Any) -> list[str]:
    """The secret arguments a built config sets (the dotted paths; never their values): what
    :func:`~lightning_dp.tracking.redact_secrets` would redact from the parsed config (every component's
    ``SECRET_ARGUMENTS``: the round's ``noise_seed``, a DPSGD or audit ``seed``, however the YAML spelled them), and
    a noise seed the round was given."""
    from lightning_dp.tracking import redact_secrets

    dump = cli.parser.dump(cli.config, skip_none=False)
    redacted = redact_secrets(dump)
    found = []
    if redacted != dump:
        line = next(row for row in redacted.splitlines() if row.startswith("# redacted"))
        found = line.split(": ", 1)[1].split(", ")
    if getattr(cli.model, "_noise_seed_given", False) and not any(p.endswith("noise_seed") for p in found):
        found.append("model.init_args.noise_seed")
    return found


def check_shareable(cli: Any, where: str = "the config") -> None:
    """Refuse a built config that sets a secret (:func:`secret_settings`): a Flower app's config goes to every node."""
    found = secret_settings(cli)
    if found:
        raise ValueError(
            f"{where} sets {', '.join(found)}, secret: a Flower app's config goes to the SuperLink and to every "
            "SuperNode. Remove it; give the server its noise seed as the environment variable "
            "LIGHTNING_DP_NOISE_SEED of the SuperLink's process, and each site its own with "
            "flower-supernode --node-config 'noise-seed=...' (or leave both out: fresh secrets from the operating "
            "system).")


def build_from_yaml(text: str, args: Sequence[str] = (), *, where: str = "the app's config") -> Any:
    """``LightningDPCLI(run=False)`` of a config's text (plus overrides): its model must be a ``FederatedRound``,
    and it may set no secret (:func:`check_shareable`)."""
    from lightning_dp.config.lightning_cli import LightningDPCLI  # the commands (and lightning_dp.cli) are above us
    from lightning_dp.federated import FederatedRound

    handle, path = tempfile.mkstemp(suffix=".yaml", prefix="lightning-dp-flower-")
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        cli = LightningDPCLI(run=False, args=["--config", path, *args])
    finally:
        os.unlink(path)
    check_shareable(cli, where)
    if not isinstance(cli.model, FederatedRound):
        raise ValueError("a Flower deployment runs a federated round: the config's model is "
                         f"{type(cli.model).__name__}, "
                         "not a lightning_dp.federated.FederatedRound (or a preset such as "
                         "PersonalizedFederatedModule)")
    from lightning_dp.tracking import mlflow_loggers

    if mlflow_loggers(cli.trainer):  # the server's build (the nodes' have no logger): say where its record goes
        cli.trainer.callbacks.append(_run_location_callback()())  # type: ignore[attr-defined]  # set by Lightning
    return cli


@functools.cache
def _run_location_callback() -> type:
    """The callback class, defined on first use: Lightning is imported only by a build, not by this module."""
    from lightning.pytorch.callbacks import Callback

    class RunLocation(Callback):
        """Prints, when fitting starts, the MLflow run of each MLflow logger and its tracking URI: on a deployment
        the server's output is what ``flwr run --stream`` and ``flwr log`` show, and the run lands wherever the
        SuperLink's environment points (``MLFLOW_TRACKING_URI``, else ``./mlruns`` of its working directory)."""

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            from lightning_dp import tracking

            if trainer.is_global_zero:
                for logger in tracking.mlflow_loggers(trainer):
                    print(tracking.run_locations(logger.run_id, logger.experiment_id, tracking.tracking_uri_of(logger),
                                                 what="MLflow run"), flush=True)

    return RunLocation


def read_secret(value: Any, where: str) -> int:
    """A noise seed given as text (an environment variable, a node config), checked without ever echoing it: an
    error's text travels to the server's logs."""
    try:
        seed = int(str(value).strip())
    except ValueError:
        seed = -1
    if seed < 0:
        raise ValueError(f"{where} is not a non-negative integer (its value is not shown: it is a secret)")
    return seed


def refuse_unsupported(module: Any) -> None:
    """Refuse, before any node computes, what a deployment cannot run (each with the reason)."""
    if module.diagnostics:
        raise ValueError("not supported on a Flower deployment: diagnostics=True compares the clients' unsanitized "
                         "updates, which never leave their nodes (run the diagnostics in simulation)")


def uses_budgets(module: Any) -> bool:
    """Whether the round assigns per-client budgets (``local_dp_sgd`` with ``budgets``, PFA's revealed budgets):
    the assignment is a function of the whole client list, which only nodes that serve partitions of one shared
    list hold (:func:`refuse_budgets_for_sites`)."""
    return getattr(module.update, "budgets", None) is not None or getattr(module.aggregator, "needs_budgets", False)


def refuse_budgets_for_sites(module: Any) -> None:
    """Per-client budgets are drawn over the whole client list: every node of a partitioned deployment holds it and
    plans its clients' budgets as the server does; a site that serves only its own clients cannot."""
    if uses_budgets(module):
        raise ValueError("per-client budgets (local_dp_sgd budgets=..., aggregator pfa) are assigned over the whole "
                         "client list, which no site of a deployment of sites with their own clients holds: run them "
                         "with nodes serving partitions of one client list (partition-id, num-partitions)")
