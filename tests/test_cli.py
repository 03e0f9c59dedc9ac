"""The `lightning-dp` command: fit/validate/test from YAML, recorded in MLflow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp
from lightning_dp import cli
from lightning_dp.models import DigitsConvNet, ImageClassifier
from tests.helpers import seed_store

REPO_ROOT = Path(__file__).resolve().parents[1]


class TinyDigits(L.LightningDataModule):
    """64 random 1x8x8 images with labels in 0..9 (a stand-in for the digits)."""

    def __init__(self, n: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        n = self.hparams.n
        self.data = TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.hparams.batch_size)


CONFIG = {
    "model": {
        "class_path": "lightning_dp.models.ImageClassifier",
        "init_args": {"network": {"class_path": "lightning_dp.models.DigitsConvNet"}, "lr": 0.05},
    },
    "data": {"class_path": f"{__name__}.TinyDigits", "init_args": {"batch_size": 16}},
    "trainer": {
        "max_steps": 2,
        "log_every_n_steps": 1,
        "limit_val_batches": 1,
        "limit_test_batches": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
    },
}


def _write_config(path: Path, **trainer_overrides) -> Path:
    config = yaml.safe_load(yaml.safe_dump(CONFIG))
    config["trainer"].update(trainer_overrides)
    path.write_text(yaml.safe_dump(config))
    return path


def _runs(tracking_uri: str, experiment: str = "lightning-dp") -> list:
    client = mlflow.MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {tracking_uri}"
    return client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def _artifact_paths(client: mlflow.MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= _artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


def _assert_recorded_fit(tracking_uri: str, run, workdir: Path, lr: float = 0.05) -> None:
    client = mlflow.MlflowClient(tracking_uri)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["lr"] == str(lr)
    assert params["network_class"] == "lightning_dp.models.networks.DigitsConvNet"
    assert params["batch_size"] == "16"  # the datamodule's hyperparameters
    assert params["versions/torch"] == torch.__version__
    assert params["versions/lightning"] == L.__version__
    history = client.get_metric_history(run.info.run_id, "nonprivate/train_loss")
    assert [m.step for m in history] == [0, 1]
    assert _artifact_paths(client, run.info.run_id) >= {"config.yaml", "model/final.ckpt"}
    from lightning_dp.callbacks.run_artifacts import SUMMARY_METRICS

    for name, tag in SUMMARY_METRICS.items():
        assert (tag in run.data.tags) == (name in run.data.metrics), tag
    assert "summary.epsilon" not in run.data.tags  # a non-private run claims no epsilon
    text = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(workdir))).read_text()
    assert f"# lightning-dp=={lightning_dp.__version__}" in text.splitlines()[:3]
    config = yaml.safe_load(text)
    assert config["model"]["init_args"]["lr"] == lr
    assert config["model"]["init_args"]["network"]["class_path"] == "lightning_dp.models.DigitsConvNet"
    assert config["trainer"]["logger"]["class_path"] == "lightning_dp.MLFlowLogger"  # the top-level name


def test_fit_records_params_metrics_config_and_checkpoint(workdir: Path, store_template: Path, capsys) -> None:
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    config = _write_config(workdir / "run.yaml")
    assert cli.main(["fit", "--config", str(config)]) is None

    uri = f"sqlite:///{workdir}/mlruns/mlflow.db"
    (run,) = _runs(uri)
    _assert_recorded_fit(uri, run, workdir)
    printed = capsys.readouterr().out
    assert f"MLflow run {run.info.run_id}" in printed
    assert f"tracking URI: {uri}" in printed
    assert f"mlflow ui --backend-store-uri {uri}" in printed
    assert f"/#/experiments/{run.info.experiment_id}/runs?workflowType=machine_learning" in printed
    assert not (workdir / "mlruns" / "config.yaml").exists()  # the config goes to MLflow only

    # The final checkpoint is complete: it loads back and `test --ckpt_path` re-creates the model from it.
    client = mlflow.MlflowClient(uri)
    checkpoint = client.download_artifacts(run.info.run_id, "model/final.ckpt", str(workdir))
    model = ImageClassifier.load_from_checkpoint(checkpoint, network=DigitsConvNet())
    assert model.hparams.lr == 0.05
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 2

    # A second command in the same folder (config.yaml already logged, log dir reused) does not fail.
    cli.main(["test", "--config", str(config), "--ckpt_path", checkpoint])
    fit_run, test_run = _runs(uri)
    assert fit_run.info.run_id == run.info.run_id
    assert {"test/loss", "test/acc"} <= set(test_run.data.metrics)
    assert "config.yaml" in _artifact_paths(client, test_run.info.run_id)


def test_config_chooses_logger_and_command_line_overrides(workdir: Path, store_template: Path) -> None:
    seed_store(store_template, workdir / "store" / "mlflow.db")
    config = _write_config(
        workdir / "run.yaml",
        logger={
            "class_path": "lightning_dp.tracking.MLFlowLogger",
            "init_args": {"experiment_name": "custom", "run_name": "r1", "save_dir": "store"},
        },
    )
    cli.main(["fit", "--config", str(config), "--model.init_args.lr=0.02"])
    (run,) = _runs(f"sqlite:///{workdir}/store/mlflow.db", experiment="custom")
    assert run.info.run_name == "r1"
    assert run.data.params["lr"] == "0.02"
    assert not (workdir / "mlruns").exists()

    # Without a logger nothing is tracked, and nothing breaks.
    no_logger = _write_config(workdir / "plain.yaml", logger=False, enable_checkpointing=False)
    cli.main(["fit", "--config", str(no_logger)])
    assert not (workdir / "mlruns").exists()


def test_command_line_subprocess_uses_mlflow_tracking_uri(workdir: Path, store_template: Path) -> None:
    config = _write_config(workdir / "run.yaml")
    uri = f"sqlite:///{workdir}/server/tracking.db"
    seed_store(store_template, workdir / "server" / "tracking.db")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    executable = shutil.which("lightning-dp")
    command = [executable] if executable else [sys.executable, "-m", "lightning_dp.cli"]
    done = subprocess.run(
        [*command, "fit", "--config", str(config)], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = _runs(uri)
    _assert_recorded_fit(uri, run, workdir)
    assert f"MLflow run {run.info.run_id}" in done.stdout
    assert f"mlflow ui --backend-store-uri {uri}" in done.stdout
    assert not (workdir / "mlruns" / "mlflow.db").exists()  # ./mlruns only holds ModelCheckpoint's files
    output = done.stdout + done.stderr  # quiet by default: nothing the user cannot act on
    for noise in ("Tip:", "LeafSpec", "Creating initial MLflow database tables", "failed to converge",
                  "LightningCLI's args parameter", "not found. Creating it"):
        assert noise not in output, noise


def test_subcommands_and_reserved_extra_commands(workdir: Path, monkeypatch, capsys) -> None:
    assert set(cli.LightningDPCLI.subcommands()) == {"fit", "validate", "test"}
    assert cli.main(["predict", "--config", str(_write_config(workdir / "run.yaml"))]) == 2  # not offered
    assert "unknown command 'predict'" in capsys.readouterr().err
    calls = []
    monkeypatch.setitem(cli.EXTRA_COMMANDS, "grid", lambda argv: calls.append(argv) or 3)
    assert cli.main(["grid", "sweep.yaml", "--jobs=2"]) == 3
    assert calls == [["sweep.yaml", "--jobs=2"]]


def test_example_digits_baseline_runs(workdir: Path, store_template: Path) -> None:
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    pytest.importorskip("sklearn")
    datamodules = pytest.importorskip("lightning_dp.datamodules")
    if not hasattr(datamodules, "DigitsDataModule"):
        pytest.skip("DigitsDataModule is not available")
    example = REPO_ROOT / "examples" / "digits_nonprivate.yaml"
    cli.main(
        [
            "fit",
            "--config",
            str(example),
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
        ]
    )
    (run,) = _runs(f"sqlite:///{workdir}/mlruns/mlflow.db", experiment="dpsgd-digits")
    assert run.info.run_name == "digits-nonprivate-baseline"  # beside the DP-SGD runs, distinct name
    assert {"nonprivate/train_loss", "val/acc"} <= set(run.data.metrics)


def test_dpsgd_digits_example_records_privacy_in_mlflow(workdir: Path, store_template: Path, capsys) -> None:
    """The README's main job (examples/dpsgd_digits.yaml), shortened to 2 epochs."""
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    cli.main(["fit", "--config", str(REPO_ROOT / "examples" / "dpsgd_digits.yaml"), "--trainer.max_epochs=2",
              "--trainer.callbacks.init_args.epochs=2", "--trainer.enable_progress_bar=false",
              "--trainer.log_every_n_steps=7", "--trainer.callbacks.init_args.seed=7"])
    uri = f"sqlite:///{workdir}/mlruns/mlflow.db"
    (run,) = _runs(uri, "dpsgd-digits")
    client = mlflow.MlflowClient(uri)
    params = run.data.params
    assert params["privacy/target_epsilon"] == "3.0" and params["privacy/target_delta"] == "1e-05"
    assert params["privacy/accountant"] == "pld" and params["privacy/max_grad_norm"] == "0.5"
    sigma, q = float(params["privacy/noise_multiplier"]), float(params["privacy/sample_rate"])
    steps = 2 * int(params["privacy/steps_per_epoch"])
    eps = client.get_metric_history(run.info.run_id, "privacy/epsilon")
    # every 7th step as Lightning writes metrics, plus the final value at the last step
    assert [m.step for m in eps] == [s - 1 for s in range(7, steps + 1, 7)] + ([steps - 1] if steps % 7 else [])
    from lightning_dp.privacy import get_accountant

    acc = get_accountant("pld")
    acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert eps[-1].value == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12) and eps[-1].value <= 3.0
    assert client.get_metric_history(run.info.run_id, "val/acc")
    for name in ("privacy/delta", "privacy/noise_multiplier", "privacy/max_grad_norm"):  # fixed: params, not charts
        assert not client.get_metric_history(run.info.run_id, name), name
    artifacts = _artifact_paths(client, run.info.run_id)
    assert {"config.yaml", "model/final.ckpt", "privacy/epsilon.png"} <= artifacts
    tags = run.data.tags  # the summary, as columns of the runs table
    assert tags["summary.epsilon"] == f"{eps[-1].value:.4g}"
    assert tags["summary.budget_used"] == f"{100 * eps[-1].value / 3.0:.1f}%"
    assert tags["summary.val_acc"] == f"{run.data.metrics['val/acc']:.4g}"
    # Secrets stay on the machine: the uploaded model has no callback state (seed, accountant), the
    # logged config and params no seed; the local resume checkpoint (outside ./mlruns) keeps them.
    public = client.download_artifacts(run.info.run_id, "model/final.ckpt", str(workdir))
    ckpt = torch.load(public, weights_only=False)
    assert "callbacks" not in ckpt and "optimizer_states" not in ckpt and "state_dict" in ckpt
    assert b"secret" not in Path(public).read_bytes()
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(workdir))).read_text())
    (dp_config,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("DPSGD")]
    assert dp_config["init_args"]["seed"] is None
    assert not any("seed" in name and value == "7" for name, value in params.items())
    (local,) = (workdir / "checkpoints").rglob("*.ckpt")
    assert str(local).startswith(str(workdir / "checkpoints" / run.info.experiment_id / run.info.run_id))
    assert not list((workdir / "mlruns").rglob("*.ckpt"))[1:]  # one checkpoint in the record: the public model
    (state,) = [v for k, v in torch.load(local, weights_only=False)["callbacks"].items() if k.startswith("DPSGD")]
    assert state["accountant"]["history"] == [[sigma, q, steps]] and state["secret"]["seed"] == 7
    assert "mlflow ui --backend-store-uri" in capsys.readouterr().out


def test_federated_synthetic_example_records_rounds_and_privacy(workdir: Path, store_template: Path) -> None:
    """examples/fl_synthetic.yaml (the README's second main job), whole: the issue's acceptance test.

    Both final hypotheses within 0.5 of theta1* = [5, 6] and theta2* = [4, -4.5], every
    participation charged exactly n/nu = 2/5 = 0.4.
    """
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    # a fixed noise seed makes the test deterministic; the example itself draws a fresh secret one per run
    run_cli = cli.LightningDPCLI(args=["fit", "--config", str(REPO_ROOT / "examples" / "fl_synthetic.yaml"),
                                       "--model.init_args.noise_seed=1"])
    module = run_cli.model
    dist = torch.cdist(module.hypotheses, torch.tensor([[5.0, 6.0], [4.0, -4.5]]))
    assert dist.min(dim=0).values.max() < 0.5 and set(dist.argmin(dim=0).tolist()) == {0, 1}, module.hypotheses
    rounds = int(module.rounds)
    assert rounds < 1000  # stopped early
    for cid, spent in module.ledger.as_dict().items():
        assert spent == pytest.approx(0.4 * module.ledger.participations(cid), rel=1e-12)
    assert sum(module.ledger.participations(c) for c in module.ledger.as_dict()) == 7 * rounds
    uri = f"sqlite:///{workdir}/mlruns/mlflow.db"
    (run,) = _runs(uri, "fl-synthetic")
    client = mlflow.MlflowClient(uri)
    assert run.data.params["noise_multiplier"] == "5.0" and run.data.params["num_hypotheses"] == "2"
    assert run.data.params["best_checkpoint/monitor"] == "val/loss"
    assert len(client.get_metric_history(run.info.run_id, "round/participants")) == rounds
    med = client.get_metric_history(run.info.run_id, "privacy/client_epsilon_max")
    assert all(m.value == pytest.approx(0.4 * round(m.value / 0.4)) for m in med)  # multiples of n/nu
    paths = _artifact_paths(client, run.info.run_id)
    assert "model/best.ckpt" in paths
    assert {"privacy/client_epsilon_hist.png", "privacy/client_epsilon.tsv", "federated/parameters.png",
            "config.yaml", "model/final.ckpt"} <= _artifact_paths(client, run.info.run_id)


def test_config_written_for_another_logger_has_secret_seeds_redacted(workdir: Path) -> None:
    """Without an MLflow logger LightningCLI writes config.yaml into the log dir: without the noise seed too."""
    config = yaml.safe_load(yaml.safe_dump(CONFIG))
    config["trainer"]["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                   "init_args": {"save_dir": str(workdir / "logs")}}
    config["trainer"]["callbacks"] = [{"class_path": "lightning_dp.callbacks.DPSGD",
                                       "init_args": {"noise_multiplier": 1.0, "seed": 777777777777}}]
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    cli.main(["fit", "--config", str(workdir / "run.yaml")])
    (written,) = (workdir / "logs").rglob("config.yaml")
    text = written.read_text()
    assert "777777777777" not in text and "trainer.callbacks.0.init_args.seed" in text
    assert yaml.safe_load(text)["trainer"]["callbacks"][0]["init_args"]["seed"] is None


def test_params_hold_no_instantiator_hook(workdir: Path, store_template: Path) -> None:
    """LightningCLI keeps its loader hook (``_instantiator``) in the hparams; it is no parameter of the run."""
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    cli.main(["fit", "--config", str(_write_config(workdir / "run.yaml"))])
    (run,) = _runs(f"sqlite:///{workdir}/mlruns/mlflow.db")
    assert "_instantiator" not in run.data.params and run.data.params["lr"] == "0.05"
