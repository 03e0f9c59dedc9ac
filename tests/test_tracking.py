"""MLflow defaults (embedded SQLite store, MLFLOW_TRACKING_URI wins) and the helpers callbacks use."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import mlflow
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_dp import tracking
from lightning_dp.tracking import MLFlowLogger


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in an empty working directory with no MLFLOW_TRACKING_URI."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path.resolve()


@pytest.fixture(scope="module")
def store_template(tmp_path_factory) -> Path:
    """An empty MLflow database created once by MLFlowLogger's defaults (creating the tables takes seconds).

    Tests copy it instead of creating their own; it holds no experiment of ours.
    """
    root = tmp_path_factory.mktemp("store-template").resolve()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        logger = MLFlowLogger(save_dir=str(root / "mlruns"))
    assert logger.tracking_uri == f"sqlite:///{root}/mlruns/mlflow.db"
    logger._mlflow_client.search_experiments()  # creates the tables, not the experiment
    return root / "mlruns" / "mlflow.db"


def _seed(template: Path, folder: Path) -> None:
    """Give ``folder`` a ready MLflow database (a copy of the template) named mlflow.db."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, folder / "mlflow.db")


class _NoClient:
    """Stands in for MlflowClient where a test only checks URIs (no database is created)."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri


def _artifact_paths(client: mlflow.MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= _artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


def test_default_store_is_sqlite_under_mlruns(in_tmp: Path) -> None:
    uri = tracking.default_tracking_uri()
    assert uri == f"sqlite:///{in_tmp}/mlruns/mlflow.db"
    assert (in_tmp / "mlruns").is_dir()
    assert tracking.default_artifact_location() == (in_tmp / "mlruns" / "artifacts").as_uri()
    assert tracking.default_artifact_location().startswith("file:///")
    assert tracking.default_tracking_uri(in_tmp / "elsewhere") == f"sqlite:///{in_tmp}/elsewhere/mlflow.db"
    assert tracking.ui_command() == f"mlflow ui --backend-store-uri sqlite:///{in_tmp}/mlruns/mlflow.db"


def test_environment_variable_wins(in_tmp: Path, monkeypatch) -> None:
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", _NoClient)
    target = f"sqlite:///{in_tmp}/server/other.db"
    (in_tmp / "server").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", target)
    assert tracking.default_tracking_uri() == target
    assert tracking.default_artifact_location() is None
    assert not (in_tmp / "mlruns").exists()  # nothing created for the embedded store
    logger = MLFlowLogger()
    assert logger.tracking_uri == target
    assert tracking.ui_command() == f"mlflow ui --backend-store-uri {target}"
    # An explicit argument beats the environment.
    explicit = f"sqlite:///{in_tmp}/explicit.db"
    assert MLFlowLogger(tracking_uri=explicit).tracking_uri == explicit
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking.ui_command() == "http://mlflow.example:5000"


def test_logger_records_metric_param_and_artifact(in_tmp: Path, store_template: Path) -> None:
    _seed(store_template, in_tmp / "mlruns")
    logger = MLFlowLogger(run_name="smoke")
    assert logger.tracking_uri == f"sqlite:///{in_tmp}/mlruns/mlflow.db"
    assert logger.save_dir == str(in_tmp / "checkpoints")  # local files (resume checkpoints) stay out of the record
    logger.log_hyperparams({"lr": 0.1, "network": {"activation": "tanh"}})
    logger.log_metrics({"train/loss": 1.5}, step=3)
    local = in_tmp / "note.txt"
    local.write_text("hello")
    logger.experiment.log_artifact(logger.run_id, str(local), "notes")
    logger.finalize("success")

    client = mlflow.MlflowClient(logger.tracking_uri)
    run = client.get_run(logger.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "lightning-dp"
    assert run.info.run_name == "smoke"
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "network/activation": "tanh"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(3, 1.5)]
    assert _artifact_paths(client, run.info.run_id) == {"notes/note.txt"}
    assert run.info.artifact_uri.startswith((in_tmp / "mlruns" / "artifacts").as_uri())
    assert (in_tmp / "mlruns" / "artifacts" / run.info.run_id / "artifacts" / "notes" / "note.txt").is_file()


def test_helpers_reach_every_logger_on_rank_zero(in_tmp: Path, store_template: Path) -> None:
    _seed(store_template, in_tmp / "mlruns")
    mlf = MLFlowLogger(experiment_name="helpers")
    csv = CSVLogger(in_tmp / "csv")
    trainer = L.Trainer(logger=[csv, mlf], enable_progress_bar=False, enable_model_summary=False)
    assert tracking.mlflow_loggers(trainer) == [mlf]

    tracking.log_params(trainer, {"versions/torch": "x.y"})
    tracking.log_text(trainer, "a: 1\n", "config.yaml")
    figure = tracking.plot_series([0, 1, 2], [0.0, 0.5, 0.7], xlabel="step", ylabel="epsilon", title="spend")
    tracking.log_figure(trainer, figure, "plots/epsilon.png")
    checkpoint = in_tmp / "final.ckpt"
    checkpoint.write_bytes(b"\x00" * 8)
    tracking.log_artifact(trainer, checkpoint, "checkpoints")
    folder = in_tmp / "audit"
    folder.mkdir()
    (folder / "histogram.txt").write_text("1 2 3")
    tracking.log_artifact(trainer, folder, "audit")

    client = mlflow.MlflowClient(mlf.tracking_uri)
    assert client.get_run(mlf.run_id).data.params == {"versions/torch": "x.y"}
    assert csv.experiment.hparams == {"versions/torch": "x.y"}
    assert _artifact_paths(client, mlf.run_id) == {
        "config.yaml",
        "plots/epsilon.png",
        "checkpoints/final.ckpt",
        "audit/histogram.txt",
    }
    text = Path(client.download_artifacts(mlf.run_id, "config.yaml", str(in_tmp))).read_text()
    assert text == "a: 1\n"
    png = Path(client.download_artifacts(mlf.run_id, "plots/epsilon.png", str(in_tmp))).read_bytes()
    assert png.startswith(b"\x89PNG")


def test_helpers_do_nothing_without_mlflow_or_off_rank_zero(in_tmp: Path, monkeypatch) -> None:
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", _NoClient)
    no_logger = L.Trainer(logger=False, enable_progress_bar=False)
    assert tracking.mlflow_loggers(no_logger) == []
    for trainer in (no_logger, SimpleNamespace(loggers=[MLFlowLogger()], is_global_zero=False)):
        tracking.log_text(trainer, "x", "x.txt")
        tracking.log_params(trainer, {"a": 1})
        tracking.log_artifact(trainer, in_tmp / "missing-file", None)
        tracking.log_figure(trainer, None, "x.png")
    off_rank_logger = trainer.loggers[0]
    assert off_rank_logger._initialized is False  # the experiment (MLflow client) was never touched


def test_plot_series_and_library_versions() -> None:
    figure = tracking.plot_series(range(4), [1, 2, 3, 4], xlabel="round", ylabel="eps", title="t")
    (axes,) = figure.axes
    assert (axes.get_xlabel(), axes.get_ylabel(), axes.get_title()) == ("round", "eps", "t")
    assert list(axes.lines[0].get_ydata()) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="steps has 2 entries but values has 3"):
        tracking.plot_series([0, 1], [1, 2, 3], xlabel="x", ylabel="y", title="t")

    versions = tracking.library_versions()
    assert {"torch", "lightning", "torchmetrics", "mlflow", "numpy", "lightning-dp"} <= set(versions)
    assert versions["lightning"] == L.__version__
    assert all(isinstance(v, str) and v for v in versions.values())


def test_source_commit_names_the_checkout_and_its_changes(tmp_path: Path, monkeypatch) -> None:
    """versions/lightning-dp-commit: the HEAD of the package's checkout, +dirty when a tracked file of the package
    differs, staged or not (an untracked file or a change outside the package does not count); None outside a git
    checkout, for a repository without the package, and without a commit; a GIT_DIR in the environment (a git
    hook's) names another repository and is not followed."""
    import os
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    # git here must touch only tmp_path: no inherited GIT_* (a hook's GIT_DIR would commit into that repository), no
    # user or system configuration (signing, hooks)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")

    def git(repo: Path, *args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True, env=env, timeout=60).stdout.strip()

    def commit(repo: Path) -> str:
        git(repo, "add", ".")
        git(repo, "commit", "-q", "--no-verify", "--no-gpg-sign", "-m", "c")
        return git(repo, "rev-parse", "HEAD")

    assert tracking.source_commit(tmp_path) is None  # not a checkout
    other = tmp_path / "other"  # a repository without lightning_dp/__init__.py
    other.mkdir()
    (other / "a.txt").write_text("a\n")
    git(other, "init", "-q")
    other_head = commit(other)
    assert tracking.source_commit(other) is None

    repo = tmp_path / "repo"
    package = repo / "lightning_dp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (repo / "README.md").write_text("readme\n")
    git(repo, "init", "-q")
    assert tracking.source_commit(repo) is None  # no commit yet
    head = commit(repo)
    assert tracking.source_commit(repo) == head
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    assert tracking.source_commit(repo) == head != other_head
    monkeypatch.delenv("GIT_DIR")
    (package / "new.py").write_text("untracked\n")
    (repo / "README.md").write_text("changed outside the package\n")
    assert tracking.source_commit(repo) == head
    (package / "__init__.py").write_text("x = 2\n")
    assert tracking.source_commit(repo) == head + "+dirty"
    git(repo, "add", "lightning_dp/__init__.py")  # staged, not committed: still not the commit's code
    assert tracking.source_commit(repo) == head + "+dirty"
    # the package's own commit is read once per process: a later edit or checkout does not change what runs record
    assert tracking.source_commit() == tracking.source_commit()


def test_logger_rejects_bad_log_model(in_tmp: Path) -> None:
    with pytest.raises(ValueError, match="log_model='some'"):
        MLFlowLogger(log_model="some")


def test_experiments_open_in_the_training_view_of_the_mlflow_ui(in_tmp: Path, store_template: Path) -> None:
    """MLflow 3's UI picks its view from the tag mlflow.experimentKind: training, unless the user chose."""
    _seed(store_template, in_tmp / "mlruns")
    client = mlflow.MlflowClient(f"sqlite:///{in_tmp}/mlruns/mlflow.db")
    untagged_id = client.create_experiment("untagged")  # e.g. made by an older lightning-dp
    client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    resumed_id = client.create_experiment("resumed")
    resumed_run = client.create_run(resumed_id).info.run_id

    loggers = [MLFlowLogger(experiment_name=name) for name in ("new", "untagged", "chosen")]
    loggers.append(MLFlowLogger(experiment_name="ignored-when-resuming", run_id=resumed_run))
    for logger in loggers:
        logger.log_metrics({"privacy/epsilon": 0.5}, step=1)  # first use of the experiment
    assert loggers[1].experiment_id == untagged_id and loggers[3].experiment_id == resumed_id

    kinds = {e.name: e.tags.get("mlflow.experimentKind") for e in client.search_experiments()}
    assert kinds.pop("Default", None) is None  # MLflow's own experiment is not ours to tag
    assert kinds == {"new": "custom_model_development", "untagged": "custom_model_development",
                     "chosen": "genai_development", "resumed": "custom_model_development"}


def test_runs_add_their_epsilon_and_validation_columns_to_the_experiments_shared_view(in_tmp: Path,
                                                                                      store_template: Path) -> None:
    """Issue 50, item 8: MLflow's default runs table shows no metric. Each run adds the TABLE_METRICS it logged to
    the experiment's shared view (a tag the UI reads for ?viewStateShareKey=lightning-dp); earlier columns stay,
    a view edited into something else is started again, and the printed link opens it only where it exists."""
    import json

    _seed(store_template, in_tmp / "mlruns")
    client = mlflow.MlflowClient(f"sqlite:///{in_tmp}/mlruns/mlflow.db")
    tag = "mlflow.sharedViewState." + tracking.SHARED_VIEW_KEY

    private = MLFlowLogger(experiment_name="views")
    private.log_metrics({"privacy/epsilon": 1.5, "val/acc": 0.8, "nonprivate/train_loss": 0.3}, step=1)
    assert not tracking.has_table_view(client, private.experiment_id)
    private.finalize("success")
    view = json.loads(client.get_experiment(private.experiment_id).tags[tag])
    assert view["selectedColumns"] == ["metrics.`privacy/epsilon`", "metrics.`val/acc`"]
    assert (view["orderByKey"], view["orderByAsc"]) == ("attributes.start_time", False)

    baseline = MLFlowLogger(experiment_name="views")
    baseline.log_metrics({"val/loss": 0.4, "val/acc": 0.9}, step=1)
    baseline.finalize("success")
    columns = json.loads(client.get_experiment(private.experiment_id).tags[tag])["selectedColumns"]
    assert columns == ["metrics.`privacy/epsilon`", "metrics.`val/acc`", "metrics.`val/loss`"]
    assert tracking.has_table_view(client, private.experiment_id)

    client.set_experiment_tag(private.experiment_id, tag, "not json")
    again = MLFlowLogger(experiment_name="views")
    again.log_metrics({"test/acc": 0.7}, step=1)
    again.finalize("success")
    assert json.loads(client.get_experiment(private.experiment_id).tags[tag])["selectedColumns"] == [
        "metrics.`test/acc`"]

    link = tracking.run_locations("abc", private.experiment_id, private.tracking_uri, table_view=True)
    assert f"/runs?workflowType=machine_learning&viewStateShareKey={tracking.SHARED_VIEW_KEY}  " in link
    assert "viewStateShareKey" not in tracking.run_locations("abc", "1", private.tracking_uri)
