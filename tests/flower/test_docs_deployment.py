"""docs/federated.md, "From simulation to deployment": its commands, as written, start a Flower 1.42 deployment on
localhost that completes (issue 50, item 13: the commands of an older Flower left the nodes retrying forever).

Only the placeholder ``<server>`` is replaced (by ``127.0.0.1``); the connection's TOML block is written to
``$FLWR_HOME/config.toml`` as the section says. Every process has a bounded life: the SuperLink and SuperNodes are
killed with their process groups at the end, every command has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.flower.localhost import docs_section, log_tail, port_free, stop_processes, wait_port

pytestmark = [pytest.mark.skipif(shutil.which("flower-superlink") is None, reason="Flower's CLI is not installed"),
              pytest.mark.xdist_group("flower-deployment")]

REPO = Path(__file__).resolve().parents[2]
SERVER = "127.0.0.1"
BACKGROUND = ("flower-superlink", "flower-supernode")  # the long-running processes of the block


def deployment_section() -> tuple[list[list[str]], str]:
    """The section's commands (``<server>`` replaced) and its TOML block (the connection)."""
    return docs_section("## From simulation to deployment (Flower)", {"<server>": SERVER})


def test_the_section_uses_flower_1_42s_ports():
    commands, toml = deployment_section()
    names = [c[0] for c in commands]
    assert names == ["lightning-dp", "flower-superlink", "flower-supernode", "flower-supernode", "flwr"]
    superlink = commands[1]
    port = superlink[superlink.index("--port") + 1]
    assert all(c[c.index("--superlink") + 1] == f"{SERVER}:{port}" for c in commands[2:4])
    assert f'address = "{SERVER}:{port}"' in toml and "insecure = true" in toml
    assert not any(old in " ".join(" ".join(c) for c in commands) + toml for old in (":9091", ":9092", ":9093"))


def test_the_documented_commands_run_a_deployment_to_its_end(tmp_path):
    commands, toml = deployment_section()
    ports = [int(c[c.index("--port") + 1]) for c in commands if c[0] in BACKGROUND]
    taken = [p for p in ports if not port_free(p)]
    if taken:  # the section names fixed ports (Flower's defaults); another process holds one of them here
        pytest.skip(f"ports {taken} of the documented commands are in use on this machine")
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the commands name examples/... from the checkout
    home = tmp_path / "flwr_home"
    home.mkdir()
    (home / "config.toml").write_text(toml)
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("MLFLOW_TRACKING_URI", "LIGHTNING_DP_NOISE_SEED"):  # the run lands in the SuperLink's folder
        env.pop(name, None)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    outputs = []
    try:
        for i, argv in enumerate(commands):
            if argv[0] in BACKGROUND:
                log = open(logs / f"{i}-{argv[0]}.log", "w")
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                              start_new_session=True))
                if argv[0] == "flower-superlink":
                    wait_port(int(argv[argv.index("--port") + 1]), timeout=60)
            else:
                out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=500)
                outputs.append(out.stdout + out.stderr)
                assert out.returncode == 0, f"{shlex.join(argv)} failed:\n{outputs[-1][-3000:]}\n{log_tail(logs)}"
        streamed = outputs[-1]
        listed = subprocess.run(["flwr", "ls", "deployment", "--format", "json"], capture_output=True, text=True,
                                env=env, cwd=tmp_path, timeout=60)
        runs = json.loads(listed.stdout)["runs"]
        assert [r["status"] for r in runs] == ["finished:completed"], streamed[-3000:] + log_tail(logs)
    finally:
        stop_processes(procs)
    # the server's record: in ./mlruns of the SuperLink's working directory, its id in what flwr run --stream shows
    import mlflow

    match = re.search(r"MLflow run ([0-9a-f]{32}) \(experiment id", streamed)
    assert match, streamed[-3000:]
    assert f"sqlite:///{tmp_path}/mlruns/mlflow.db" in streamed
    from lightning_dp.flower.server import INSECURE_WARNING

    assert INSECURE_WARNING in streamed  # the trial's --insecure, said first thing in what flwr run shows
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = client.get_run(match.group(1))
    assert run.info.run_name == "dp-fedavg" and run.data.metrics["privacy/epsilon"] > 0


def test_flower_app_help_shows_the_sections_commands():
    """``lightning-dp flower-app --help`` gives the same Flower 1.42 commands as the docs (one line each)."""
    from lightning_dp.commands.flower_app import build_parser

    text = build_parser().format_help()
    commands, _ = deployment_section()
    for argv in commands:
        assert shlex.join(argv).replace(SERVER, "<server>") in text.replace('"', "'"), argv  # shlex quotes with '

    assert ":9092" not in text and ":9093" not in text
