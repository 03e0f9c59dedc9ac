"""The round of a config, built the same way on the server and on every node."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["build_from_yaml", "read_secret", "refuse_unsupported"]


def build_from_yaml(text: str, args: Sequence[str] = (), *, where: str = "the app's config") -> Any:
    """``LightningDPCLI(run=False)`` of a config's text (plus overrides): its model must be a ``FederatedRound``,
    and it may set no secret (:func:`~lightning_dp.flower.app.check_shareable`)."""
    from lightning_dp.cli import LightningDPCLI
    from lightning_dp.federated import FederatedRound
    from lightning_dp.flower.app import check_shareable

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
    return cli


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
    """Refuse, before any node computes, what the deployment does not run yet (each with the reason)."""
    problems = []
    if module.update.accountable:
        problems.append(f"update {module.update.name!r}: record-level DP-SGD inside the clients plans every client's "
                        "noise from the whole population at the start, which the server cannot do without the "
                        "clients' data (run it in simulation)")
    if module.diagnostics:
        problems.append("diagnostics=True: the cosines compare the clients' unsanitized updates, which stay on the "
                        "nodes")
    if getattr(module.aggregator, "needs_budgets", False):
        problems.append(f"aggregator {module.aggregator.name!r} with revealed budgets: not carried by the messages yet")
    if module.test_every_check:
        problems.append("test_every_check=True: the server holds no test clients (evaluation on the nodes is not "
                        "built yet)")
    if problems:
        raise ValueError("not supported on a Flower deployment yet:\n  - " + "\n  - ".join(problems))
