"""lightning-dp epsilon: the printed epsilon equals dp-accounting's own accountants on the same DP-SGD event,
a calibrated sigma fits its target tightly, and bad input lists every problem and exits with 2; and the entry
points (``lightning-dp --version``, ``python -m lightning_dp``)."""

from __future__ import annotations

import re

import dp_accounting
import pytest

from lightning_dp import cli
from lightning_dp.calculator import epsilon_table


def _printed(capsys):
    out = capsys.readouterr().out
    return out, [float(x) for x in re.findall(r"\| \d+ \| [\d.]+ \| ([\d.]+) \|", out)]


def _library(accountant, sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.compose(event).get_epsilon(delta)


def test_epsilon_equals_dp_accountings_pld_and_rdp(capsys):
    assert cli.main(["epsilon", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "3",
                     "--noise-multiplier", "1.1"]) == 0
    out, table = _printed(capsys)
    steps = 3 * 235  # ceil(60000 / 256)
    want = _library(dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4), 1.1, 256 / 60000, steps,
                    1e-5)
    assert f"{steps} steps" in out and table[-1] == pytest.approx(want, abs=1e-4)  # printed to 4 decimals
    assert table == sorted(table)  # epsilon grows along the run
    rdp = epsilon_table(noise_multiplier=1.1, sample_rate=0.01, steps=500, delta=1e-5, accountant="rdp")
    want = _library(dp_accounting.rdp.RdpAccountant(), 1.1, 0.01, 500, 1e-5)
    assert rdp[-1] == (500, pytest.approx(want, rel=1e-3))


def test_a_calibrated_sigma_fits_its_target_within_one_percent(capsys):
    assert cli.main(["epsilon", "--sample-rate", "0.01", "--steps", "1000", "--target-epsilon", "2"]) == 0
    out, table = _printed(capsys)
    sigma = float(re.search(r"noise_multiplier = ([\d.]+)", out).group(1))
    assert table[-1] <= 2.0
    loose = epsilon_table(noise_multiplier=sigma / 1.011, sample_rate=0.01, steps=1000, delta=1e-5, fractions=(1,))
    assert loose[0][1] > 2.0  # 1 % less noise would exceed the target (calibration tolerance 1 %)


def test_replacement_adjacency_costs_more():
    add = epsilon_table(noise_multiplier=1.0, sample_rate=0.02, steps=200, delta=1e-5, fractions=(1,))
    rep = epsilon_table(noise_multiplier=1.0, sample_rate=0.02, steps=200, delta=1e-5, fractions=(1,),
                        adjacency="replace")
    assert rep[0][1] > add[0][1]


def test_bad_input_lists_every_problem_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["epsilon", "--epochs", "3", "--steps", "4", "--noise-multiplier", "-1", "--delta", "2",
                  "--adjacency", "replace", "--accountant", "rdp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for text in ("--sample-rate Q, or --dataset-size N", "exactly one of --epochs", "--noise-multiplier=-1.0",
                 "--delta=2.0", "needs --accountant pld"):
        assert text in err


def test_version_and_python_dash_m():
    import subprocess
    import sys

    import lightning_dp

    out = subprocess.run([sys.executable, "-m", "lightning_dp", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"lightning-dp {lightning_dp.__version__}"
    out = subprocess.run([sys.executable, "-m", "lightning_dp", "epsilon", "--sample-rate", "0.5", "--steps", "2",
                          "--noise-multiplier", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "epsilon = " in out.stdout
