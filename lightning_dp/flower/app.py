"""The Flower app directory of a ``lightning-dp`` config (``lightning-dp flower-app``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["check_tracking_uri", "write_app"]


def check_tracking_uri(uri: str) -> None:
    """Refuse a tracking URI with credentials in it: the app's config is shipped to every node."""
    from urllib.parse import urlsplit

    if "@" in urlsplit(str(uri).strip()).netloc:
        raise ValueError("--tracking-uri holds credentials (user:password@host): the app's config goes to every node. "
                         "Give the URI without them and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                         "MLFLOW_TRACKING_TOKEN) in the SuperLink's environment")

def write_app(config: str | Path, out: str | Path, *, min_nodes: int = 1, node_timeout: float = 600.0,
              name: str = "lightning-dp-round", save_to: str = "", tracking_uri: str = "",
              resume_from: str = "", checkpoint_dir: str = "") -> Path:
    """Write the Flower app directory that runs ``config`` on a deployment; return its ``pyproject.toml``.

    Args:
        config: a ``lightning-dp fit`` YAML whose model is a :class:`~lightning_dp.federated.FederatedRound` (or a
            preset of it).
        out: the app directory (created; ``flwr run <out> <connection>`` runs it).
        min_nodes: the server waits for this many SuperNodes before it asks them for their clients.
        node_timeout: seconds the server waits for the nodes' replies in one round before it fails the run.
        name: the app's (and package's) name.
        save_to: a path on the server's machine where the server writes the final public state (hypotheses,
            epsilon, rounds) with ``torch.save``; empty: none.
        tracking_uri: where the server records its MLflow run (a tracking server's URL, or ``sqlite:////abs/path.db``
            on the server's machine); empty: ``MLFLOW_TRACKING_URI`` of the SuperLink's environment, else ``./mlruns``
            of its working directory. It travels to every node with the app, so it may hold no credentials.
        resume_from: a checkpoint on the server's machine (the server's Lightning checkpoint, resume state and
            secrets included) to resume the run from: after a stop (a node lost), the run ends with the epsilon and
            model of an uninterrupted one. Only its path travels with the app.
        checkpoint_dir: where the server writes its checkpoint after every round (on its machine; empty:
            ``lightning-dp-checkpoints`` in the SuperLink's working directory).

    Raises:
        ValueError: If the config does not build a federated round, holds a secret
            (:func:`~lightning_dp.flower.build.check_shareable`), ``out`` holds other files (Flower ships every file
            of the app directory to every node), or an argument is out of range.
    """
    from lightning_dp.flower.build import build_from_yaml  # refuses a config with a secret (check_shareable)

    if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < 1:
        raise ValueError(f"min_nodes={min_nodes!r} is not allowed: pass a positive integer")
    if not float(node_timeout) > 0:
        raise ValueError(f"node_timeout={node_timeout!r} is not allowed: pass a number of seconds > 0")
    check_tracking_uri(tracking_uri)
    text = Path(config).read_text("utf-8")
    build_from_yaml(text, ["--trainer.logger=false"], where=str(config))  # builds as the nodes will, or refuses
    out = Path(out)
    package = name.replace("-", "_")
    ours = {out / "pyproject.toml", out / package, out / package / "__init__.py"}
    others = sorted(str(p) for p in out.rglob("*") if p not in ours) if out.exists() else []
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ValueError(f"--out {out} holds other files ({shown}): "
                         "Flower ships every file of an app directory to every node. Give a new or empty directory.")
    out.mkdir(parents=True, exist_ok=True)
    (out / package).mkdir(exist_ok=True)
    # the components are lightning-dp's, installed on every node; the app carries only the config
    (out / package / "__init__.py").write_text('"""A lightning-dp federated round as a Flower app."""\n')
    # JSON strings are TOML basic strings: the YAML travels verbatim
    pyproject = f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "The federated round of {Path(config).name}, from lightning-dp"
license = "Apache-2.0"
dependencies = ["lightning-dp", "flwr>=1.42"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "lightning-dp"

[tool.flwr.app.components]
serverapp = "lightning_dp.flower.server:app"
clientapp = "lightning_dp.flower.client:app"

[tool.flwr.app.config]
config-yaml = {json.dumps(text)}
config-name = {json.dumps(Path(config).name)}
min-nodes = {min_nodes}
node-timeout = {float(node_timeout)}
save-to = {json.dumps(str(save_to))}
tracking-uri = {json.dumps(str(tracking_uri).strip())}
resume-from = {json.dumps(str(resume_from).strip())}
checkpoint-dir = {json.dumps(str(checkpoint_dir).strip())}
"""
    path = out / "pyproject.toml"
    path.write_text(pyproject, "utf-8")
    return path
