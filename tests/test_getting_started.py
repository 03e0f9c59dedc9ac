"""docs/getting_started.md: every code block runs as written (issue 26, item 6).

The install block is what ``.ci/run`` runs before this suite, and ``mlflow ui`` (a server) is driven by
``tests/test_browser_ui.py``; every other block runs here, in an empty folder that sees the repository's
``examples/``: shell lines one by one (each must exit 0), Python blocks in a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting_started.md"
RUN_ELSEWHERE = ("pip install", "mlflow ui")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def _lines(block: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_page_has_the_sections_users_need():
    text = PAGE.read_text()
    for heading in ("Install", "The first command", "Reading the runs in MLflow", "Making your own LightningModule",
                    "Choosing epsilon, C and the batch size", "Federated quick start"):
        assert re.search(rf"^## \d\. {re.escape(heading)}", text, flags=re.M), heading
    skipped = [b for b in _blocks("bash") if _lines(b)[0].startswith(RUN_ELSEWHERE)]
    assert len(skipped) == 2  # the install and the UI, exercised elsewhere (module docstring)


def test_every_shell_block_runs(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    script = Path(sys.executable).with_name("lightning-dp")
    outputs = {}
    for block in _blocks("bash"):
        for line in _lines(block):
            if line.startswith(RUN_ELSEWHERE):
                continue
            assert line.startswith("lightning-dp "), line
            command = ([str(script)] if script.is_file() else [sys.executable, "-m", "lightning_dp"]) + line.split()[1:]
            done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            outputs[line] = done.stdout
    compare = outputs["lightning-dp compare --experiment dpsgd-digits"]
    assert "| dpsgd-digits-eps3 | 1 | 2.978 |" in compare  # the page's table, up to the accuracies
    assert "| digits-nonprivate-baseline | 1 | non-private |" in compare
    calibrated = outputs["lightning-dp epsilon --dataset-size 1257 --batch-size 64 --epochs 30 --target-epsilon 3"]
    assert "noise_multiplier = 1.9358" in calibrated and "1.9358" in PAGE.read_text()
    assert "DPSGD: 600 private steps" in outputs["lightning-dp fit --config examples/dpsgd_digits.yaml"]


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_every_python_block_runs(index, tmp_path):
    done = subprocess.run([sys.executable, "-c", _blocks("python")[index]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "epsilon " in done.stdout and "<= 3" in done.stdout
