"""A Flower deployment on localhost for the tests: one SuperLink and SuperNodes, each its own process
(Flower's Deployment Engine, insecure mode), then ``flwr run`` of an app directory, waited to its end."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:g} s")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def docs_section(heading: str, fill: dict[str, str]) -> tuple[list[list[str]], str]:
    """The commands of docs/federated.md's section ``heading`` (its ``bash`` block as argv lists: continuations
    joined, comments dropped) and its ``toml`` block, with the placeholders of ``fill`` replaced; any placeholder
    left fails the test."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "federated.md").read_text("utf-8")
    section = text[text.index(heading):]
    section = section[:section.index("\n## ", 10)] if "\n## " in section[10:] else section
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    for key, value in fill.items():
        bash, toml = bash.replace(key, value), toml.replace(key, value)
    commands = [argv for line in bash.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]
    leftover = re.findall(r"<[a-z-]+>", " ".join(" ".join(c) for c in commands) + toml)
    assert not leftover, f"placeholders the test does not know how to fill: {leftover}"
    return commands, toml


def log_tail(logs: Path, chars: int = 3000) -> str:
    """The end of every log file in ``logs``: what a failed assertion shows."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-chars:]}" for p in sorted(logs.glob("*.log")))


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SuperNodes first, then the SuperLink (started in that order reversed); each with its process group (Flower's
    superexec children), SIGTERM then SIGKILL for whatever outlived its parent."""
    for proc in reversed(procs):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LocalDeployment:
    """``with LocalDeployment(tmp, node_configs, env) as d: d.run(app_dir)``: the processes stop on exit."""

    def __init__(self, root: Path, node_configs: list[str], env: dict[str, str] | None = None,
                 started: list[int] | None = None) -> None:
        self.root, self.node_configs = Path(root), node_configs
        self.started = list(range(len(node_configs))) if started is None else list(started)  # the others: later
        self.home = self.root / "flwr_home"
        self.logs = self.root / "logs"
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                           start_new_session=True))

    def __enter__(self) -> "LocalDeployment":
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                               f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self._start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                                  "--disable-runtime-dependency-installation"], self.env)
        wait_port(self.port)
        for i in self.started:
            self.start_node(i)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            logs = [(self.logs / f"supernode{i}.log").read_text() for i in self.started]
            if all("SuperNode ID:" in log for log in logs):
                break
            time.sleep(0.3)
        else:
            raise TimeoutError("the SuperNodes did not register:\n" + self.log_tail())
        return self

    def start_node(self, i: int, log_name: str | None = None) -> None:
        """Start SuperNode ``i`` (again, after :meth:`kill_node`: a new process with the same node config)."""
        node_env = {k: v for k, v in self.env.items() if k != "LIGHTNING_DP_NOISE_SEED"}  # the server's secret
        self.nodes = getattr(self, "nodes", {})
        self._start(log_name or f"supernode{i}", ["flower-supernode", "--insecure", "--superlink",
                                                  f"127.0.0.1:{self.port}", "--host", "127.0.0.1", "--port",
                                                  str(free_port()), "--node-config", self.node_configs[i]], node_env)
        self.nodes[i] = self.procs[-1]

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and its process group (a machine that dies: no goodbye to the SuperLink)."""
        proc = self.nodes[i]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)

    def flwr(self, *args: str, timeout: float = 60) -> str:
        out = subprocess.run(["flwr", *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                             cwd=self.root)
        if out.returncode:
            raise RuntimeError(f"flwr {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def run(self, app: Path, timeout: float = 600) -> tuple[str, str]:
        """``flwr run`` the app and wait for its end: ``(status, log)``."""
        return self.wait(self.start_run(app), timeout)

    def start_run(self, app: Path) -> int:
        """``flwr run`` the app; its Flower run id."""
        return int(json.loads(self.flwr("run", str(app), "local", "--format", "json"))["run-id"])

    def wait(self, run_id: int, timeout: float = 600) -> tuple[str, str]:
        """Wait for the run's end: ``(status, log)``."""
        end = time.monotonic() + timeout
        status = ""
        while time.monotonic() < end:
            listed = json.loads(self.flwr("ls", "local", "--run-id", str(run_id), "--format", "json"))
            if "runs" not in listed:  # a transient error reply of the Control API (seen under load): ask again
                status = f"flwr ls answered {listed}"
                time.sleep(1)
                continue
            status = listed["runs"][0]["status"]
            if status.startswith("finished:"):
                break
            time.sleep(1)
        log = subprocess.run(["flwr", "log", str(run_id), "local", "--show"], capture_output=True, text=True,
                             env=self.env, timeout=60, cwd=self.root).stdout
        return status, log

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.logs, chars)

    def __exit__(self, *exc: object) -> None:
        stop_processes(self.procs)
