"""Fixtures shared by the command-line tests (tests/test_cli.py, tests/commands/test_grid.py), and the thread share of
a pytest-xdist worker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's cpuset, ``taskset``), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per usable core. pytest-xdist's own count is the host's physical cores (psutil), which
    on a machine that gives this process fewer cores starts more workers, each loading torch, than can run.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides where set (None hands the count to pytest-xdist)."""
    return None if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else _usable_cores()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n auto``, the README's command), give each worker its share of the cores: torch and the
    OpenMP/MKL pools of the worker and of the subprocesses its tests start (the end-to-end CLI and deployment tests)
    otherwise each take every core, and N workers oversubscribe the machine N times. A smaller thread count already
    set in the environment is kept."""
    worker = getattr(config, "workerinput", None)  # set on xdist workers only (not on the controller)
    if worker is None:
        return
    share = max(1, _usable_cores() // int(worker["workercount"]))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        given = os.environ.get(name, "").split(",")[0].strip()
        os.environ[name] = str(min(share, int(given)) if given.isdigit() and int(given) > 0 else share)
    import torch  # here, after the environment: the pools read it when torch first starts them

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Empty working directory, no MLFLOW_TRACKING_URI, no pytest arguments in sys.argv."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    return tmp_path.resolve()


@pytest.fixture(scope="module")
def store_template(tmp_path_factory) -> Path:
    """An MLflow database created once (creating the tables takes seconds); tests start from copies
    (tests.helpers.seed_store)."""
    import mlflow  # here, not at the top: the GPU machine runs the device tests without MLflow installed

    root = tmp_path_factory.mktemp("store-template").resolve()
    mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db").search_experiments()
    return root / "mlflow.db"
