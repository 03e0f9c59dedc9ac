"""DLG audit (lightning_dp.audit): the client's release, the attacker's gradient, the attack, the command.

Small and seeded: 1x8x8 digits from scikit-learn, SigmoidLeNet(image_size=8, num_classes=10)
(8,026 parameters), at most 50 L-BFGS steps per attack (the attack converges or stalls well
before on these images: 50 and 100 steps give identical results).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp import cli
from lightning_dp.audit import (
    EuclideanLaplaceSanitizer,
    GaussianSanitizer,
    Unsanitized,
    client_release,
    dlg_attack,
    make_sanitizer_factory,
    observed_gradient,
    run_dlg_audit,
)
from lightning_dp.audit._common import flatten_parameters, parameter_sizes
from lightning_dp.audit.dlg import gradient_matching_loss
from lightning_dp.audit.metrics import image_grid, mse, psnr
from lightning_dp.commands.audit_dlg import build_parser, input_scale, load_images
from lightning_dp.federated import FlatParams
from lightning_dp.models import SigmoidLeNet
from lightning_dp.privacy.mechanisms import sanitize_update
from tests.helpers import seed_store

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [REPO_ROOT / "examples" / "dlg_digits.yaml", REPO_ROOT / "examples" / "dlg_femnist.yaml"]


def make_model(seed: int = 0) -> SigmoidLeNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SigmoidLeNet(image_size=8, num_classes=10)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The first 4 scikit-learn digits, pixels in [0, 1], shape (4, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.data[:4], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    return x, torch.as_tensor(bunch.target[:4], dtype=torch.int64)


# --------------------------------------------------------------------------- the attack end to end


def test_dlg_reconstructs_without_noise_and_fails_with_large_noise(digits):
    """nu = 0: the image is reconstructed (MSE < 1e-4 on [0, 1] pixels; measured <= 4e-7) and the label
    recovered; nu = 10 (noise norm ten times the update, per layer): MSE > 0.1 (measured >= 0.38)."""
    x, y = digits
    result = run_dlg_audit(make_model(), x[:2], y[:2], noise_multipliers=(0.0, 10.0), lr=0.1, iterations=50, seed=0)
    clean = [row for row in result.rows if row.noise_multiplier == 0.0]
    noisy = [row for row in result.rows if row.noise_multiplier == 10.0]
    assert len(clean) == len(noisy) == 2
    for row in clean:
        assert row.mse < 1e-4 and row.psnr > 40 and row.label_recovered and row.match_loss < 1e-4, row
    for row in noisy:
        assert row.mse > 0.1, row
    assert result.reconstructions.shape == (2, 2, 1, 8, 8) and result.originals.shape == (2, 1, 8, 8)
    assert torch.equal(result.originals, x[:2])  # already on [0, 1]
    summary = result.summary()
    assert [s["noise_multiplier"] for s in summary] == [0.0, 10.0]
    assert summary[0]["label_recovered"] == 1.0
    assert summary[0]["mse"] == pytest.approx(sum(r.mse for r in clean) / 2)
    assert len(result.tsv().strip().splitlines()) == 1 + 4 and "| 10 |" in result.table()
    # reproducible: the same seed gives the same numbers
    again = run_dlg_audit(make_model(), x[:1], y[:1], noise_multipliers=(10.0,), lr=0.1, iterations=50, seed=0)
    assert again.rows[0].mse == noisy[0].mse and again.rows[0].match_loss == noisy[0].match_loss


def test_known_label_attack(digits):
    x, y = digits
    model = make_model()
    start, released = client_release(model, x[:1], y[:1], lr=0.1, sanitizer=Unsanitized(), generator=None)
    result = dlg_attack(model, observed_gradient(start, released, 0.1, model), input_shape=(1, 8, 8), num_classes=10,
                        iterations=50, generator=torch.Generator().manual_seed(0), known_label=int(y[0]))
    assert result.label == int(y[0]) and mse(result.reconstruction[0].clamp(0, 1), x[0]) < 1e-4


# --------------------------------------------------------------------------- the client and the attacker's estimate


def test_observed_gradient_of_one_unsanitized_step_is_the_gradient(digits):
    x, y = digits
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    start, released = client_release(model, x[:1], y[:1], lr=0.1, sanitizer=Unsanitized(), generator=None)
    expected = torch.autograd.grad(F.cross_entropy(model(x[:1]), y[:1]), list(model.parameters()))
    observed = observed_gradient(start, released, 0.1, model)
    assert [o.shape for o in observed] == [e.shape for e in expected]
    for o, e in zip(observed, expected):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model is not modified
    assert torch.equal(start, flatten_parameters(model))
    # nu = 0 releases the trained model as well
    _, same = client_release(model, x[:1], y[:1], lr=0.1, sanitizer=EuclideanLaplaceSanitizer.for_model(model, 0.0),
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(same, released)


def test_local_steps_are_sgd_steps(digits):
    x, y = digits
    model = make_model()
    _, released = client_release(model, x[:2], y[:2], lr=0.05, local_steps=2, sanitizer=Unsanitized(), generator=None)
    manual = make_model()
    optimizer = torch.optim.SGD(manual.parameters(), lr=0.05)
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(manual(x[:2]), y[:2]).backward()
        optimizer.step()
    torch.testing.assert_close(released, flatten_parameters(manual), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- sanitizers


@pytest.mark.parametrize("per_layer", [True, False])
def test_laplace_sanitizer_is_sanitize_update(digits, per_layer):
    x, y = digits
    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]  # the layout, written out
    assert parameter_sizes(model) == [p.numel() for p in trainable]
    assert torch.equal(flatten_parameters(model), torch.cat([p.detach().reshape(-1) for p in trainable]))
    start, trained = client_release(model, x[:1], y[:1], lr=0.1, sanitizer=Unsanitized(), generator=None)
    sanitizer = EuclideanLaplaceSanitizer.for_model(model, 3.0, per_layer=per_layer)
    released = sanitizer(start, trained, torch.Generator().manual_seed(7))
    expected = sanitize_update(trained, start, noise_multiplier=3.0, generator=torch.Generator().manual_seed(7),
                               per_layer_sizes=FlatParams.of(model).sizes if per_layer else None, min_delta_norm=1e-8)
    assert torch.equal(released, expected.released) and not torch.equal(released, trained)


def test_gaussian_sanitizer_noise_std_and_clipping():
    """Zero update: the observed gradient is the noise. With n = 200,000 coordinates the sample std has
    relative standard error 1/sqrt(2n) = 0.16%; the 1% tolerance is 6.3 standard errors (two-sided
    false-failure probability ~3e-10 for a random seed; this one is fixed)."""
    sigma, clip, lr, n = 1.5, 0.8, 0.25, 200_000
    sanitizer = GaussianSanitizer(clip, sigma, lr=lr)
    start = torch.zeros(n, dtype=torch.float64)
    released = sanitizer(start, start.clone(), torch.Generator().manual_seed(0))
    noise = (start - released) / lr
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.01)
    assert abs(float(noise.mean())) < 5 * sigma * clip / math.sqrt(n)
    # sigma = 0: the update-implied gradient is clipped to norm C, its direction kept
    update = torch.tensor([3.0, -4.0], dtype=torch.float64)
    clipped = (torch.zeros(2, dtype=torch.float64) - GaussianSanitizer(clip, 0.0, lr=lr)(
        torch.zeros(2, dtype=torch.float64), update, None)) / lr
    torch.testing.assert_close(clipped, -update / 5.0 * clip, atol=1e-5, rtol=0)
    small = torch.tensor([1e-3, 0.0], dtype=torch.float64)  # gradient norm 4e-3 < C: unchanged
    torch.testing.assert_close(GaussianSanitizer(clip, 0.0, lr=lr)(torch.zeros(2, dtype=torch.float64), small, None),
                               small)
    factory = make_sanitizer_factory("gaussian", model=nn.Linear(2, 1), lr=lr, max_grad_norm=clip)
    assert isinstance(factory(2.0), GaussianSanitizer) and factory(2.0).noise_multiplier == 2.0


# --------------------------------------------------------------------------- metrics


def test_mse_and_psnr_closed_forms():
    a = torch.zeros(2, 3)
    b = torch.full((2, 3), 0.1)
    assert mse(a, b) == pytest.approx(0.01)
    assert psnr(a, b) == pytest.approx(20.0)  # 10 log10(1 / 0.01)
    assert psnr(a, b, data_range=255.0) == pytest.approx(20.0 + 20.0 * math.log10(255.0))
    assert psnr(a, a) == math.inf and mse(a, a) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        mse(a, torch.zeros(6))
    with pytest.raises(ValueError, match="data_range=0"):
        psnr(a, b, data_range=0)


# --------------------------------------------------------------------------- restarts and divergence


def test_restarts_keep_the_lowest_matching_loss(digits):
    x, y = digits
    model = make_model()
    start, released = client_release(model, x[:1], y[:1], lr=0.1, sanitizer=EuclideanLaplaceSanitizer.for_model(
        model, 1.0), generator=torch.Generator().manual_seed(0))
    target = observed_gradient(start, released, 0.1, model)
    result = dlg_attack(model, target, input_shape=(1, 8, 8), num_classes=10, iterations=10,
                        generator=torch.Generator().manual_seed(1), restarts=3)
    losses = result.restart_losses
    assert len(losses) == 3 and len(set(losses)) >= 2  # different initializations, different ends
    assert result.match_loss == min(losses) and result.restart == losses.index(min(losses))
    # the returned reconstruction and label distribution are the winning restart's
    recomputed = float(gradient_matching_loss(model, target, result.reconstruction,
                                              result.label_probabilities.unsqueeze(0), soft_label=False))
    assert recomputed == pytest.approx(result.match_loss, rel=1e-4)
    assert len(result.history) == 10 and not result.diverged


class _LogInput(nn.Module):
    """log(x) before a linear layer: NaN for the negative entries of a N(0, 1) dummy."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.log(x).flatten(1))


def test_diverged_restarts_count_as_failed():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _LogInput()
    x, y = torch.rand(1, 1, 2, 2) + 0.5, torch.tensor([1])
    start, released = client_release(model, x, y, lr=0.1, sanitizer=Unsanitized(), generator=None)
    result = dlg_attack(model, observed_gradient(start, released, 0.1, model), input_shape=(1, 2, 2), num_classes=3,
                        iterations=5, generator=torch.Generator().manual_seed(0), restarts=2)
    assert result.diverged and result.match_loss == math.inf and result.restart_losses == [math.inf, math.inf]
    assert torch.isfinite(result.reconstruction).all()  # the last finite dummies, not NaN


# --------------------------------------------------------------------------- errors and the model


@pytest.mark.parametrize("build, message", [
    (lambda m: EuclideanLaplaceSanitizer(-1.0, per_layer=False), "noise_multiplier=-1.0"),
    (lambda m: EuclideanLaplaceSanitizer(1.0), "per_layer=True needs"),
    (lambda m: GaussianSanitizer(0.0, 1.0), "max_grad_norm=0.0"),
    (lambda m: GaussianSanitizer(1.0, -2.0), "noise_multiplier=-2.0"),
    (lambda m: make_sanitizer_factory("foo", model=m, lr=0.1), "sanitizer='foo'.*gaussian"),
    (lambda m: client_release(m, torch.zeros(1, 1, 8, 8), torch.tensor([0]), lr=0.0, sanitizer=Unsanitized(),
                              generator=None), "lr=0.0"),
    (lambda m: client_release(m, torch.zeros(1, 1, 8, 8), torch.tensor([0.5]), lr=0.1, sanitizer=Unsanitized(),
                              generator=None), "integer class index"),
    (lambda m: client_release(m, torch.zeros(1, 1, 8, 8), torch.tensor([0]), lr=0.1, sanitizer=lambda s, t, g: t[:3],
                              generator=None), "must return a flat tensor"),
    (lambda m: dlg_attack(m, [torch.zeros(3)], input_shape=(1, 8, 8), num_classes=10, generator=None),
     "one tensor per trainable parameter"),
    (lambda m: dlg_attack(m, [p.detach() for p in m.parameters()], input_shape=(1, 8, 8), num_classes=10,
                          iterations=0, generator=None), "iterations=0"),
    (lambda m: dlg_attack(m, [p.detach() for p in m.parameters()], input_shape=(1, 8, 8), num_classes=10,
                          generator=None, known_label=10), "known_label=10"),
    (lambda m: run_dlg_audit(m, torch.zeros(1, 1, 8, 8), torch.tensor([0]), noise_multipliers=[-1]),
     "noise_multipliers=\\[-1\\]"),
    (lambda m: run_dlg_audit(m, torch.zeros(1, 1, 8, 8), torch.tensor([0]), noise_multipliers=[1, 1.0]), "twice"),
    (lambda m: run_dlg_audit(m, torch.zeros(1, 1, 8, 8), torch.tensor([12]), noise_multipliers=[0]), "0..9"),
    (lambda m: SigmoidLeNet(image_size=0), "image_size=0"),
    (lambda m: SigmoidLeNet(init_range=-1.0), "init_range=-1.0"),
    (lambda m: m(torch.zeros(1, 1, 28, 28)), "image_size=28"),
])
def test_errors_name_the_value_and_the_fix(build, message):
    with pytest.raises(ValueError, match=message):
        build(make_model())


def test_sigmoid_lenet_parameter_count_formula():
    for c, s, k in [(1, 28, 62), (1, 8, 10), (3, 32, 100), (1, 7, 3)]:
        side = math.ceil(math.ceil(s / 2) / 2)
        expected = (300 * c + 12) + 2 * 3612 + (12 * side ** 2 + 1) * k
        net = SigmoidLeNet(in_channels=c, image_size=s, num_classes=k)
        assert sum(p.numel() for p in net.parameters()) == expected
        assert net(torch.zeros(2, c, s, s)).shape == (2, k)
        assert all(float(p.detach().abs().max()) <= 0.5 for p in net.parameters())  # U(-0.5, 0.5), the DLG code's init


def test_image_grid_layout():
    figure = image_grid(torch.rand(2, 1, 8, 8), torch.rand(2, 3, 1, 8, 8), [3, 5], noise_multipliers=[0, 0.1, 10],
                        mses=[[0.0, 0.01, 0.2], [0.0, 0.02, 0.3]])
    assert len(figure.axes) == 2 * 4
    assert figure.axes[0].get_title() == "original (y=3)" and figure.axes[2].get_title().startswith("nu=0.1\nMSE 0.01")
    with pytest.raises(ValueError, match="K = 2"):
        image_grid(torch.rand(2, 1, 8, 8), torch.rand(2, 3, 1, 8, 8), noise_multipliers=[0, 1])


def test_functional_core_does_not_import_lightning():
    code = "import sys, lightning_dp.audit.dlg; sys.exit(int(any(m.startswith('lightning.') for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


# --------------------------------------------------------------------------- data for the command


def _write_leaf(directory: Path, writers: dict[str, int]) -> None:
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        user_data = {w: {"x": torch.rand(n, 784, generator=generator).tolist(), "y": list(range(n))}
                     for w, n in writers.items()}
        data = {"users": list(writers), "num_samples": list(writers.values()), "user_data": user_data}
        (directory / split).mkdir(parents=True)
        (directory / split / "data.json").write_text(json.dumps(data))


def test_images_come_from_one_sample_per_validation_client(tmp_path):
    from lightning_dp.datamodules import FEMNISTDataModule

    _write_leaf(tmp_path, {f"w{i}": 3 for i in range(6)})
    data = FEMNISTDataModule(data_dir=tmp_path, val_fraction=0.5)
    x, y, sources = load_images(data, 2)
    assert x.shape == (2, 1, 28, 28) and y.tolist() == [0, 0]
    assert [s.split()[2].rstrip(",") for s in sources] == [c.client_id for c in data.val_clients[:2]]
    assert torch.equal(x[1], data.val_clients[1].x[0])
    assert input_scale(data) == (0.0, 1.0)
    with pytest.raises(ValueError, match="--num_images=4 but FEMNISTDataModule has 3 non-empty validation clients"):
        load_images(data, 4)


def test_input_scale_of_standardized_digits():
    from lightning_dp.datamodules import DigitsDataModule

    data = DigitsDataModule()
    x, _, sources = load_images(data, 3)
    assert input_scale(data) == (data.mean, data.std) and sources[0] == "validation sample 0"
    pixels = x * data.std + data.mean
    assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    assert input_scale(data, 0.0, 2.0) == (0.0, 2.0)


# --------------------------------------------------------------------------- the command


def test_example_configs_parse_and_instantiate():
    parser = build_parser()
    for config in EXAMPLES:
        assert config.read_text().splitlines()[0].startswith("#")
        cfg = parser.parse_args(["--config", str(config)])
        assert cfg.iterations == 300 and cfg.num_images == 4 and len(cfg.noise_multipliers) == 8
        assert cfg.restarts == 4 and cfg.sanitizer == "laplace_per_layer"
        init = parser.instantiate_classes(cfg)  # FEMNIST reads nothing before setup()
        assert isinstance(init.model, SigmoidLeNet)


@pytest.fixture
def audit_store(workdir, store_template, monkeypatch) -> str:
    uri = f"sqlite:///{workdir}/store/mlflow.db"
    seed_store(store_template, workdir / "store" / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.mark.parametrize("sanitizer", ["laplace_per_layer", "gaussian"])
def test_audit_command_records_one_mlflow_run(audit_store, capsys, sanitizer):
    code = cli.main(["audit", "--config", str(EXAMPLES[0]), "--iterations=5", "--num_images=2", "--restarts=2",
                     "--noise_multipliers=[0, 10]", "--run_name=tiny", f"--sanitizer={sanitizer}"])
    assert code == 0
    out = capsys.readouterr().out
    client = mlflow.MlflowClient(audit_store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "dlg-audit"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id in out and "| 10 |" in out and run.info.status == "FINISHED"
    assert run.info.run_name == "tiny"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "audit/mse")] == [0, 1]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "audit/noise_multiplier")] == [0.0, 10.0]
    metrics = run.data.metrics
    assert {"audit/psnr", "audit/label_recovered", "audit/match_loss", "audit/mse/nu_0", "audit/mse/nu_10"} <= set(
        metrics)
    assert metrics["audit/mse/nu_0"] == client.get_metric_history(run.info.run_id, "audit/mse")[0].value
    params = run.data.params
    assert params["audit/sanitizer"] == sanitizer and params["audit/noise_multipliers"] == "0,10"
    assert ("audit/max_grad_norm" in params) == (sanitizer == "gaussian")
    assert float(params["audit/input_std"]) != 1.0  # the digits are standardized: mapped back to pixels
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id, "audit")}
    assert {"audit/dlg.tsv", "audit/dlg_grid.png", "audit/dlg.md", "audit/images.tsv"} <= artifacts
    assert "config.yaml" in {f.path for f in client.list_artifacts(run.info.run_id)}
    table = Path(client.download_artifacts(run.info.run_id, "audit/dlg.tsv")).read_text().splitlines()
    assert table[0].startswith("image\tnoise_multiplier") and len(table) == 1 + 2 * 2


@pytest.mark.parametrize("args, message", [
    (["--sanitizer=foo"], "--sanitizer='foo': not supported; choose one of"),
    (["--noise_multipliers=[-1]", "--iterations=0"], "--iterations=0 is not allowed: --iterations must be a positive integer"),
    (["--noise_multipliers=[1, 1]"], "lists a value twice"),
    (["--model.init_args.image_size=28"], "--model.init_args.image_size=8"),
    (["--model.init_args.num_classes=62"], "--model.init_args.num_classes=10"),
    (["--num_images=1000"], "--num_images=1000 but the validation set of DigitsDataModule has 270 samples"),
])
def test_audit_command_errors(workdir, monkeypatch, capsys, args, message):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["audit", "--config", str(EXAMPLES[0]), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (workdir / "mlflow.db").exists()  # no run opened for bad input


def test_the_former_name_of_the_unsanitized_release_still_resolves_with_a_warning():
    import lightning_dp.audit as audit
    from lightning_dp.audit import sanitizers

    with pytest.warns(FutureWarning, match="now lightning_dp.audit.Unsanitized"):
        assert audit.NoSanitizer is Unsanitized
    with pytest.warns(FutureWarning):
        assert sanitizers.NoSanitizer is Unsanitized
