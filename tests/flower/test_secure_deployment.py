"""docs/federated.md, "A consortium's deployment": TLS and SuperNode authentication on Flower 1.42 (issue 52, item 2).

The section's commands run as written on localhost (``<server>`` -> ``127.0.0.1``, ``<tracking-uri>`` -> a SQLite
file of the test); while the run trains, two intruders try to join: a SuperNode whose key nobody registered and a
SuperNode without TLS. Neither may receive a message. Every process has a bounded life.
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
BACKGROUND = ("flower-superlink", "flower-supernode")
SECTION = "## A consortium's deployment: TLS and node authentication"


def consortium_section(tracking_uri: str, keys: str = "/tmp/keys") -> tuple[list[list[str]], str]:
    """The section's commands and its TOML block (the connection), placeholders filled."""
    return docs_section(SECTION, {"<server>": SERVER, "<tracking-uri>": tracking_uri, "<keys>": keys})


def test_the_section_is_secure_by_its_own_commands():
    """No --insecure anywhere; the SuperLink asks for TLS and node authentication, every node gives the CA and a key,
    every site's key is registered; the connection verifies the CA."""
    commands, toml = consortium_section("sqlite:////tmp/x.db")
    flat = " ".join(" ".join(c) for c in commands) + toml
    assert "--insecure" not in flat and "insecure" not in toml
    superlink = next(c for c in commands if c[0] == "flower-superlink")
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth"):
        assert flag in superlink
    nodes = [c for c in commands if c[0] == "flower-supernode"]
    registered = {c[3] for c in commands if c[:3] == ["flwr", "supernode", "register"]}
    assert len(nodes) == 2 and len(registered) == 2
    for node in nodes:
        key = node[node.index("--auth-supernode-private-key") + 1]
        assert f"{key}.pub" in registered and "--root-certificates" in node
    assert 'root-certificates = "/tmp/keys/ca.pem"' in toml


def _start(argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)


def test_the_consortium_commands_train_and_keep_intruders_out(tmp_path):
    from lightning_dp.flower.server import INSECURE_WARNING

    db = tmp_path / "records" / "mlflow.db"
    db.parent.mkdir()
    tracking_uri = f"sqlite:///{db}"
    commands, toml = consortium_section(tracking_uri, str(tmp_path / "keys"))
    ports = [int(c[c.index("--port") + 1]) for c in commands if c[0] in BACKGROUND]
    intruder_ports = [9096, 9097]
    taken = [p for p in ports + intruder_ports if not port_free(p)]
    if taken:  # the section names fixed ports (Flower's defaults); another process holds one of them here
        pytest.skip(f"ports {taken} of the documented commands are in use on this machine")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = next(c for c in commands if c[0] == "flower-superlink")
    port = port[port.index("--port") + 1]
    # the section's connection, and one without TLS to the same SuperLink (an attacker's flwr)
    (home / "config.toml").write_text(toml + f'\n[superlink.plain]\naddress = "{SERVER}:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("MLFLOW_TRACKING_URI", "LIGHTNING_DP_NOISE_SEED"):
        env.pop(name, None)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    outputs = []

    def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)

    try:
        for i, argv in enumerate(commands):
            if argv[0] in BACKGROUND:
                procs.append(_start(argv, logs / f"{i}-{argv[0]}.log", env, tmp_path))
                if argv[0] == "flower-superlink":
                    wait_port(int(port), timeout=60)
                continue
            if argv[:2] == ["flwr", "run"]:  # before the run: the intruders knock
                assert run(["lightning-dp", "flower-keys", "--out", "keys/", "--site", "intruder"]).returncode == 0
                procs.append(_start(["flower-supernode", "--superlink", f"{SERVER}:{port}", "--root-certificates",
                                     "keys/ca.pem", "--auth-supernode-private-key", "keys/intruder/node.key",
                                     "--port", str(intruder_ports[0]), "--node-config",
                                     "partition-id=0 num-partitions=2"], logs / "intruder-key.log", env, tmp_path))
                procs.append(_start(["flower-supernode", "--insecure", "--superlink", f"{SERVER}:{port}", "--port",
                                     str(intruder_ports[1]), "--node-config", "partition-id=1 num-partitions=2"],
                                    logs / "intruder-plain.log", env, tmp_path))
                plain = run(["flwr", "ls", "plain"], timeout=60)
                assert "unavailable" in plain.stdout + plain.stderr, plain.stdout + plain.stderr
            out = run(argv, timeout=500)
            outputs.append(out.stdout + out.stderr)
            assert out.returncode == 0, f"{shlex.join(argv)} failed:\n{outputs[-1][-3000:]}\n{log_tail(logs)}"
        streamed = outputs[-1]
        runs = json.loads(run(["flwr", "ls", "consortium", "--format", "json"]).stdout)["runs"]
        assert [r["status"] for r in runs] == ["finished:completed"], streamed[-3000:] + log_tail(logs)
        nodes = json.loads(run(["flwr", "supernode", "list", "consortium", "--format", "json"]).stdout)["nodes"]
        assert len(nodes) == 2, nodes  # the two registered sites, nobody else
    finally:
        stop_processes(procs)
    keyed, plain_log = (logs / "intruder-key.log").read_text(), (logs / "intruder-plain.log").read_text()
    assert "Failed to activate SuperNode" in keyed, keyed[-2000:]
    assert "Connection attempt failed" in plain_log, plain_log[-2000:]
    for log in (keyed, plain_log):
        assert "Receiving:" not in log and "SuperNode ID:" not in log
    sites = [p.read_text() for p in sorted(logs.glob("*-flower-supernode.log"))]
    assert len(sites) == 2 and all("Receiving:" in log for log in sites)
    assert INSECURE_WARNING not in streamed
    # the server's record: where the app's tracking URI says
    import mlflow

    match = re.search(r"MLflow run ([0-9a-f]{32}) \(experiment id", streamed)
    assert match, streamed[-3000:]
    assert tracking_uri in streamed
    run_record = mlflow.MlflowClient(tracking_uri).get_run(match.group(1))
    assert run_record.data.metrics["privacy/epsilon"] > 0
    assert not (tmp_path / "mlruns").exists()  # nothing in the SuperLink's working directory's default store
    for secret in (tmp_path / "keys").rglob("*.key"):  # the private keys were never readable by others
        assert secret.stat().st_mode & 0o077 == 0, secret
