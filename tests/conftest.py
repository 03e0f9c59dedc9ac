"""Fixtures shared by the command-line tests (tests/test_cli.py, tests/commands/test_grid.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


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
