"""Every config under examples/ instantiates (class paths and arguments valid) without reading data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_dp.cli import LightningDPCLI

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("config", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_instantiates(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(config), "--trainer.logger=false"])
    assert cli.model is not None and cli.datamodule is not None
    header = config.read_text().splitlines()[0]
    assert header.startswith("#"), f"{config.name} should start with a comment saying what it runs"


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"dpsgd_digits.yaml", "fl_synthetic.yaml", "fl_hospital.yaml", "fl_femnist.yaml"} <= names
