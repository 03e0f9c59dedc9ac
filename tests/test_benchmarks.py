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


def test_the_handwritten_floor_releases_what_lightning_dp_releases():
    """bench_dp_step.handwritten_release (the floor of the digits MLP's private step, written out with no engine) is
    the DP-SGD release the engine computes, for the same noise: forward, the gradients by hand, norms, clipping, sums,
    normalization. Float64, one and two hidden layers, a clipping norm that clips some examples and not others."""
    import torch
    from torch import nn

    from lightning_dp.privacy import GradSampleEngine, clip_factors, derive_generator, noisy_mean

    bench = load("bench_dp_step")
    torch.manual_seed(0)
    for hidden in ([128], [32, 16]):
        widths = [64, *hidden, 10]
        mods: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            mods += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
        model = nn.Module()
        model.net = nn.Sequential(*mods).double()
        model.forward = model.net.forward
        x, y = torch.randn(24, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (24,))
        layers = bench._mlp_layers(model)
        params = [t for layer in layers for t in (layer.weight, layer.bias)]
        engine = GradSampleEngine(model)
        engine.probe(lambda n: nn.functional.cross_entropy(model(x[:n]), y[:n]))
        with engine.record(batch_size=24):
            nn.functional.cross_entropy(model(x), y).backward()
        norms = engine.per_sample_norms()
        clip = float(norms.median())  # half the examples clipped
        sums = engine.clipped_sum(clip_factors(norms, clip))
        expected = torch.cat([g.reshape(-1) for g in noisy_mean(
            sums, noise_multiplier=1.5, max_grad_norm=clip, expected_batch_size=20.0,
            generator=derive_generator(0, 2, 7))])
        noise = torch.randn(expected.numel(), generator=derive_generator(0, 2, 7), dtype=torch.float64).mul_(1.5 * clip)
        got = bench.handwritten_release([p.detach() for p in params], x, y, noise, clip, 20.0)
        assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
        engine.remove()


def test_the_handwritten_floors_run_for_the_digits_mlp_only(capsys, tmp_path):
    bench = load("bench_dp_step")
    out = tmp_path / "floor.json"
    bench.main(["--model", "digits_mlp", "--methods", "nonprivate,handwritten,handwritten_compiled", "--rounds", "1",
                "--steps", "1", "--no-memory", "--threads", "1", "--json", str(out)])
    assert not json.loads(out.read_text())["errors"]
    bench.main(["--model", "mnist_cnn", "--batch-size", "8", "--methods", "nonprivate,handwritten", "--rounds", "1",
                "--steps", "1", "--no-memory", "--threads", "1", "--json", str(out)])
    assert "digits MLP" in json.loads(out.read_text())["errors"]["handwritten"]


def test_the_step_benchmark_parametrizes_every_layer(capsys):
    """--parametrize: the plain and the private step on the same weight-normed model."""
    bench = load("bench_dp_step")
    bench.main(["--model", "digits_mlp", "--methods", "nonprivate,lightning_dp", "--rounds", "1", "--steps", "1",
                "--no-memory", "--threads", "1", "--parametrize", "weight_norm"])
    assert "digits_mlp (weight_norm)" in capsys.readouterr().out
    model = bench._parametrized(bench.DigitsMLP())
    assert [n for n, _ in model.named_parameters()] == [
        "net.1.bias", "net.1.parametrizations.weight.original0", "net.1.parametrizations.weight.original1",
        "net.3.bias", "net.3.parametrizations.weight.original0", "net.3.parametrizations.weight.original1"]


def test_the_layer_breakdown_times_every_recorded_layer(capsys):
    """--layers: per recorded layer, the plain weight gradient and the private per-sample work (a convolution, a
    linear layer, an LSTM whose module returns a tuple, an embedding)."""
    bench = load("bench_dp_step")
    rows = bench.layer_breakdown("mnist_cnn", 8, "cpu", rounds=1) + bench.layer_breakdown("lstm", 4, "cpu", rounds=1)
    assert [r["type"] for r in rows] == ["Conv2d", "Conv2d", "Linear", "Linear", "Embedding", "LSTM", "Linear"]
    assert all(r["plain"] > 0 and r["private"] > 0 for r in rows)
    bench.main(["--model", "digits_mlp", "--layers", "--threads", "1", "--clock", "cpu"])
    assert "all layers" in capsys.readouterr().out


def test_the_step_benchmark_runs_the_gru(tmp_path):
    """--model gru: the LSTM classifier with nn.GRU (Opacus: DPGRU), every method reporting a time."""
    bench = load("bench_dp_step")
    out = tmp_path / "gru.json"
    bench.main(["--model", "gru", "--batch-size", "4", "--methods", "nonprivate,lightning_dp,opacus_hooks", "--rounds",
                "1", "--steps", "1", "--no-memory", "--threads", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert not result["errors"] and set(result["ratio"]) == {"nonprivate", "lightning_dp", "opacus_hooks"}


def test_bench_probe_times_the_batch_probe():
    """benchmarks/bench_probe.py: the batch probe ran in each of the three fits (no time is asserted)."""
    assert load("bench_probe").main(["digits_mlp"])["digits_mlp"] > 0
