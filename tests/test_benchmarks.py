"""The benchmark scripts run (tiny settings; no time is asserted): benchmarks/bench_dp_step.py's methods, the
operator counts and the profile, including issue 53's batches of one shape and its compiled private pass."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_step_benchmark_times_and_counts_every_lightning_dp_method(tmp_path, capsys):
    bench = load("bench_dp_step")
    out = tmp_path / "step.json"
    bench.main(["--model", "digits_mlp", "--methods", "nonprivate,lightning_dp,lightning_dp_static,lightning_dp_compiled",
                "--rounds", "1",
                "--steps", "1", "--no-memory", "--count-ops", "--threads", "1", "--clock", "cpu", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["ratio"]) == {"nonprivate", "lightning_dp", "lightning_dp_static", "lightning_dp_compiled"}
    assert not result["errors"]
    counts = result["op_counts"]
    # the private step dispatches more operators than the plain one; the padded one about as many as the dynamic
    assert 0 < counts["nonprivate"]["aten"] < counts["lightning_dp"]["aten"] <= counts["lightning_dp_static"]["aten"]
    # the compiled pass: its graph runs as one operator call (inductor's generated code) beside a few eager ones
    assert counts["lightning_dp_compiled"]["aten"] < counts["lightning_dp_static"]["aten"]
    assert "lightning_dp_compiled" in capsys.readouterr().out


def test_the_profile_prints_the_operators(capsys):
    bench = load("bench_dp_step")
    bench.profile("lightning_dp_static", "digits_mlp", 16, "cpu", steps=1)
    out = capsys.readouterr().out
    assert "lightning_dp_static on digits_mlp" in out and "aten::_local_scalar_dense" in out


def test_the_accounting_benchmark_compares_equal_distributions(capsys):
    """benchmarks/bench_accounting.py at a coarse grid: every case's distributions and epsilons equal (it exits
    otherwise)."""
    load("bench_accounting").main(["--interval", "1e-2", "--repeats", "1", "--no-fits"])
    out = capsys.readouterr().out
    assert out.count("equal)") == 4
