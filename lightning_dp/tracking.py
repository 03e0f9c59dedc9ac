"""MLflow defaults and helpers: where runs are recorded and how callbacks log artifacts.

Default store (DESIGN.md, "Tracking"): an embedded SQLite database
``./mlruns/mlflow.db`` with artifacts under ``./mlruns/artifacts``. MLflow 3 refuses
the plain file store (``file:./mlruns``) that Lightning's own ``MLFlowLogger`` falls
back to, so this module's :class:`MLFlowLogger` points at the database instead. When
the ``MLFLOW_TRACKING_URI`` environment variable is set it wins, and the tracking
server chooses where artifacts go.

Helpers for callbacks (:func:`log_figure`, :func:`log_text`, :func:`log_artifact`,
:func:`log_params`) act on global rank zero only, on every MLflow logger of the
trainer, and do nothing when the trainer has none, so a callback can call them
unconditionally. In a private run every name they write passes the record's gate
(:mod:`lightning_dp.gate`) first.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from lightning_dp.tracking import MLFlowLogger, ui_command
    >>> logger = MLFlowLogger(experiment_name="mnist-dp")  # doctest: +SKIP
    >>> trainer = Trainer(logger=logger)  # doctest: +SKIP
    >>> print(ui_command())  # doctest: +SKIP
    mlflow ui --backend-store-uri sqlite:////home/me/project/mlruns/mlflow.db
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import shlex
import subprocess
from argparse import Namespace
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union
from urllib.parse import unquote, urlparse

from lightning.pytorch.loggers import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lightning_dp.gate import admit, admit_metrics

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

# jsonargparse runs every ``if TYPE_CHECKING:`` block of a module whose class signatures it reads (the logger's, for
# any ``lightning-dp fit`` help or run): importing MLflow there cost 1.3-1.5 s of each ``--*.help`` on 2 shared cores
# (docs/benchmarks.md). These are only types, so mypy reads them under another name of the same constant.
_ANNOTATIONS_ONLY = TYPE_CHECKING
if _ANNOTATIONS_ONLY:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

__all__ = [
    "DEFAULT_EXPERIMENT_NAME",
    "MLFlowLogger",
    "PRIVATE_TAG",
    "artifact_location_for",
    "default_artifact_location",
    "default_tracking_uri",
    "library_versions",
    "redact_secrets",
    "log_artifact",
    "log_figure",
    "log_params",
    "log_public_checkpoint",
    "log_text",
    "mlflow_loggers",
    "plot_series",
    "public_checkpoint",
    "refuse_checkpoint_uploads",
    "set_tags",
    "share_table_view",
    "tracking_uri_of",
    "ui_command",
]

DEFAULT_EXPERIMENT_NAME = "lightning-dp"
#: Tag of every run fitted by ``lightning-dp``: "true" when a component reports a privacy spend and none releases
#: without protection, else "false" (written by :class:`~lightning_dp.callbacks.RunArtifacts`, read by
#: ``lightning-dp compare`` to tell private runs from non-private baselines).
PRIVATE_TAG = "lightning_dp.private"
# Experiment tag read by the MLflow 3 UI to choose its view (the JS bundle's `useExperimentKind`);
# "custom_model_development" is its classic training view ("Machine learning": runs, charts, compare).
_EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
_TRAINING_EXPERIMENT_KIND = "custom_model_development"
# The runs table's view that ``MLFlowLogger`` shares on its experiment (the MLflow UI's "share view": the experiment
# tag ``mlflow.sharedViewState.<key>`` holds the view as JSON, opened by ``?viewStateShareKey=<key>``; the JS bundle's
# ``useSharedExperimentViewState``). MLflow offers no other way for a run to choose the table's columns: its default
# table shows no metric, so a user saw neither epsilon nor validation accuracy until adding both by hand.
SHARED_VIEW_KEY = "lightning-dp"
_SHARED_VIEW_TAG = "mlflow.sharedViewState." + SHARED_VIEW_KEY
#: The metrics shown as columns of the shared view, in this order, where a run of the experiment logged them.
TABLE_METRICS = ("privacy/epsilon", "privacy/client_epsilon_max", "privacy/record_epsilon_max", "val/acc",
                 "val/loss", "val/perplexity", "test/acc", "test/loss", "test/perplexity")
_DB_FILENAME = "mlflow.db"
_ARTIFACTS_DIRNAME = "artifacts"
# Distributions reported by `library_versions`, in this order; missing ones are skipped.
_TRACKED_DISTRIBUTIONS = (
    "lightning-dp",
    "torch",
    "lightning",
    "torchmetrics",
    "mlflow",
    "dp-accounting",
    "opacus",
    "numpy",
    "scikit-learn",
    "fairlearn",
    "transformers",
    "peft",
    "flwr",
    "flwr-datasets",
)


def default_tracking_uri(root: str | os.PathLike[str] = "mlruns") -> str:
    """Return the MLflow tracking URI to use when none is given.

    Args:
        root: Folder of the embedded store, relative to the working directory or
            absolute. Created if missing (only when the embedded store is used).

    Returns:
        ``os.environ["MLFLOW_TRACKING_URI"]`` when set, else
        ``sqlite:///<absolute root>/mlflow.db``.
    """
    from_env = os.environ.get("MLFLOW_TRACKING_URI")
    if from_env:
        return from_env
    folder = Path(root).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(folder / _DB_FILENAME).as_posix()}"


def artifact_location_for(tracking_uri: str) -> Optional[str]:
    """Where a new experiment of ``tracking_uri`` keeps its artifacts, as :class:`MLFlowLogger` chooses it: the
    ``artifacts/`` beside the SQLite database (the embedded default's ``./mlruns/artifacts``); None (the server
    decides) for any other store."""
    db_path = _sqlite_path(tracking_uri)
    return None if db_path is None else (db_path.expanduser().resolve().parent / _ARTIFACTS_DIRNAME).as_uri()


def default_artifact_location(root: str | os.PathLike[str] = "mlruns") -> Optional[str]:
    """Return the artifact location of new experiments in the embedded store.

    Args:
        root: Folder of the embedded store (see :func:`default_tracking_uri`).

    Returns:
        ``file://<absolute root>/artifacts``, or ``None`` when ``MLFLOW_TRACKING_URI``
        is set (the tracking server then decides).
    """
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    return (Path(root).expanduser().resolve() / _ARTIFACTS_DIRNAME).as_uri()


def _sqlite_path(tracking_uri: str) -> Optional[Path]:
    """Return the database file of a ``sqlite:///`` URI, or None for other URIs."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    path = tracking_uri[len(prefix) :]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def _store_lock(tracking_uri: str) -> Iterator[None]:
    """Serializes the creation of an SQLite store between processes (and the shared view's read-modify-write).

    Lightning's logger builds an ``MlflowClient`` in every process, and each client
    creates or migrates the SQLite schema: two DDP ranks doing it at once fail with
    ``sqlite3.OperationalError: duplicate column name``. A file lock next to the
    database makes the second process wait and find the schema ready.
    """
    db_path = _sqlite_path(tracking_uri)
    if db_path is None:
        yield
        return
    from filelock import FileLock  # a dependency of torch

    db_path.expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db_path.expanduser().resolve()) + ".lock"):
        yield


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Raise a library logger's level to ERROR for the block (its INFO/WARNING lines are expected there)."""
    import logging

    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tag_training_experiment(client: MlflowClient, experiment_id: str) -> None:
    """Set ``mlflow.experimentKind`` to the training view on an experiment that has no such tag.

    A user's explicit value is kept. A store that refuses the tag (e.g. a tracking server where
    this user may log runs but not edit the experiment) leaves the experiment as it is.
    """
    from mlflow.exceptions import MlflowException

    try:
        if _EXPERIMENT_KIND_TAG not in client.get_experiment(experiment_id).tags:
            client.set_experiment_tag(experiment_id, _EXPERIMENT_KIND_TAG, _TRAINING_EXPERIMENT_KIND)
    except MlflowException:
        pass  # cosmetic (the UI's default view): never worth failing or warning a training run over


def share_table_view(client: MlflowClient, experiment_id: str, metrics: Sequence[str]) -> bool:
    """Add the :data:`TABLE_METRICS` among ``metrics`` to the columns of the experiment's shared runs-table view.

    The view (tag ``mlflow.sharedViewState.lightning-dp``, opened by the link :func:`run_locations` prints) keeps the
    columns earlier runs added, so the private run and its baseline show side by side. Its columns are these metrics
    alone (run name, start and duration always show): the UI's default Source, Models and Dataset columns pushed
    them out of a 1280-pixel window. It names metrics only (public names, no values). A store that refuses the tag
    leaves the experiment as it is.

    Returns:
        Whether the experiment has the view afterwards.
    """
    import json

    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_experiment(experiment_id).tags
        try:
            view = json.loads(tags.get(_SHARED_VIEW_TAG, "{}"))
            columns = list(view.get("selectedColumns", []))
        except (ValueError, AttributeError, TypeError):  # not ours, or edited by hand: started again
            view, columns = {}, []
        added = [f"metrics.`{name}`" for name in TABLE_METRICS if name in metrics]
        missing = [column for column in added if column not in columns]
        if missing or _SHARED_VIEW_TAG not in tags:
            view.update(selectedColumns=columns + missing, orderByKey="attributes.start_time", orderByAsc=False)
            client.set_experiment_tag(experiment_id, _SHARED_VIEW_TAG, json.dumps(view))
        return True
    except MlflowException:
        return False  # cosmetic, as _tag_training_experiment


def has_table_view(client: MlflowClient, experiment_id: Optional[str]) -> bool:
    """Whether ``experiment_id`` has the runs-table view :func:`share_table_view` writes."""
    from mlflow.exceptions import MlflowException

    if experiment_id is None:
        return False
    try:
        return _SHARED_VIEW_TAG in client.get_experiment(experiment_id).tags
    except MlflowException:
        return False


class MLFlowLogger(_LightningMLFlowLogger):
    """Lightning's ``MLFlowLogger`` with the embedded SQLite store as default.

    Same arguments as :class:`lightning.pytorch.loggers.MLFlowLogger`, with these
    differences:

    - ``tracking_uri=None`` (the default) means :func:`default_tracking_uri` evaluated
      when the logger is built (Lightning reads ``MLFLOW_TRACKING_URI`` once, at import,
      and otherwise falls back to the ``file:./mlruns`` store that MLflow 3 refuses).
    - ``artifact_location=None`` means :func:`default_artifact_location` for the
      embedded store, ``<folder of the database>/artifacts`` for any other
      ``sqlite:///`` URI, and the server's choice otherwise. It only applies when the
      experiment is created.
    - ``save_dir`` is the folder of the embedded store (the record: database and
      artifacts, safe to share); ``local_dir`` (default ``./checkpoints``) is the local
      folder Lightning writes files into, reported as the logger's ``save_dir``
      (``ModelCheckpoint`` saves resume checkpoints under
      ``<local_dir>/<experiment_id>/<run_id>/checkpoints``). Resume checkpoints hold secret
      noise seeds, so they live outside the record and are never uploaded (see
      :func:`refuse_checkpoint_uploads`). Lightning's logger reports no ``save_dir`` for a
      database URI, which puts checkpoints in the working directory and breaks
      ``LightningCLI``'s ``SaveConfigCallback``.
    - ``experiment_name`` defaults to ``"lightning-dp"``.
    - The experiment it logs into (created, or existing without the tag) gets the tag
      ``mlflow.experimentKind = "custom_model_development"``, so the MLflow 3 UI shows it in
      its classic training view (runs, metric charts, compare) instead of the GenAI view,
      where training runs hide under "Evaluations"; a value already set is kept. Newer UIs
      (3.17) let the sidebar switch "GenAI / Model training" decide instead: choose "Model
      training", or open ``/#/experiments/<id>/runs?workflowType=machine_learning``.
    - When the run ends, its epsilon and validation metrics (:data:`TABLE_METRICS`) are added as columns to the
      experiment's shared runs-table view (:func:`share_table_view`), which the link that ``lightning-dp`` prints
      opens (MLflow's default table shows no metric).

    In a ``lightning-dp`` config::

        trainer:
          logger:
            class_path: lightning_dp.tracking.MLFlowLogger
            init_args: {experiment_name: mnist-dp, run_name: sigma-1.0}

    Args:
        experiment_name: MLflow experiment; created if missing.
        run_name: Name of the new run (MLflow picks one if None).
        tracking_uri: Tracking URI; None for :func:`default_tracking_uri`.
        tags: Tags of the new run.
        save_dir: Folder of the embedded store (None: ``./mlruns``).
        local_dir: Folder of local files, resume checkpoints above all (see above). None
            for no local folder (``ModelCheckpoint`` then falls back to the trainer's
            ``default_root_dir``).
        log_model: Log ``ModelCheckpoint`` checkpoints as artifacts (Lightning's semantics).
        prefix: Prefix of every metric name.
        artifact_location: Artifact location of a newly created experiment.
        run_id: Resume logging into this existing run.
        synchronous: Block on every logging call (MLflow's ``synchronous``).

    Raises:
        ValueError: If ``log_model`` is not one of True, False, "all".
    """

    def __init__(
        self,
        experiment_name: str = DEFAULT_EXPERIMENT_NAME,
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        tags: Optional[dict[str, Any]] = None,
        save_dir: Optional[str] = "mlruns",
        local_dir: Optional[str] = "checkpoints",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: Optional[str] = None,
        run_id: Optional[str] = None,
        synchronous: Optional[bool] = None,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise ValueError(f"log_model={log_model!r} must be True, False or 'all' (see Lightning's MLFlowLogger).")
        root = "mlruns" if save_dir is None else save_dir
        if not tracking_uri:
            tracking_uri = default_tracking_uri(root)
            if artifact_location is None:
                artifact_location = default_artifact_location(root)
        if artifact_location is None:
            db_path = _sqlite_path(tracking_uri)
            if db_path is not None:
                artifact_location = (db_path.expanduser().resolve().parent / _ARTIFACTS_DIRNAME).as_uri()
        self._local_dir = None if local_dir is None else str(Path(local_dir).expanduser().resolve())
        with _store_lock(tracking_uri):
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name,
                tracking_uri=tracking_uri,
                tags=tags,
                save_dir=save_dir,
                log_model=log_model,
                prefix=prefix,
                artifact_location=artifact_location,
                run_id=run_id,
                synchronous=synchronous,
            )

    @property
    def tracking_uri(self) -> str:
        """The tracking URI this logger writes to."""
        return self._tracking_uri

    @property
    def experiment(self) -> MlflowClient:
        """Lightning's ``MlflowClient`` (see above); on first use the experiment is tagged for the training view."""
        first_use = not self._initialized
        with _quiet("lightning.pytorch.loggers.mlflow"):  # "Experiment ... not found. Creating it.": expected here
            client = super().experiment
        if first_use and self._initialized and self._experiment_id is not None:  # rank zero, once
            _tag_training_experiment(client, self._experiment_id)
        return client

    @property
    def save_dir(self) -> Optional[str]:
        """Absolute local folder for files written next to the run (resume checkpoints, profiles): ``local_dir``."""
        if self._tracking_uri.startswith("file:"):
            return super().save_dir
        return self._local_dir

    @override
    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Lightning's (the run ends), then the run's :data:`TABLE_METRICS` join the experiment's shared view."""
        super().finalize(status)
        if not self._initialized or self.run_id is None or self._experiment_id is None:
            return
        from mlflow.exceptions import MlflowException

        client = self._mlflow_client
        with _store_lock(self._tracking_uri):  # runs ending together (a grid's) add their columns in turn
            try:
                metrics = list(client.get_run(self.run_id).data.metrics)
            except MlflowException:
                return
            share_table_view(client, self._experiment_id, metrics)

    @override
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace]) -> None:
        """Lightning's, without ``_instantiator`` (LightningCLI's loader hook kept in the hparams, not a parameter)."""
        params = dict(vars(params) if isinstance(params, Namespace) else params)
        params.pop("_instantiator", None)
        super().log_hyperparams(params)


# --------------------------------------------------------------------------- helpers


def mlflow_loggers(trainer: Trainer) -> list[_LightningMLFlowLogger]:
    """Return the MLflow loggers of ``trainer`` (Lightning's class or a subclass), possibly empty."""
    return [logger for logger in trainer.loggers if isinstance(logger, _LightningMLFlowLogger)]


def tracking_uri_of(logger: _LightningMLFlowLogger) -> str:
    """Return the tracking URI of any MLflow logger (Lightning's keeps it private)."""
    return getattr(logger, "tracking_uri", None) or logger._tracking_uri


def _active(trainer: Trainer) -> list[_LightningMLFlowLogger]:
    """MLflow loggers to write to from this process: all of them on global rank zero, none elsewhere."""
    return mlflow_loggers(trainer) if trainer.is_global_zero else []


def log_figure(trainer: Trainer, figure: Figure, artifact_file: str) -> None:
    """Log a matplotlib figure as an image artifact (e.g. ``"plots/epsilon.png"``) of every MLflow run.

    Args:
        trainer: The trainer whose MLflow loggers receive the figure.
        figure: A matplotlib figure, e.g. from :func:`plot_series`.
        artifact_file: Path of the image inside the run's artifacts; its extension
            picks the format.
    """
    for logger in _active(trainer) if admit(trainer, artifact_file, "artifact") else []:
        logger.experiment.log_figure(logger.run_id, figure, artifact_file)


def log_text(trainer: Trainer, text: str, artifact_file: str) -> None:
    """Log ``text`` as the artifact file ``artifact_file`` (e.g. ``"config.yaml"``) of every MLflow run."""
    for logger in _active(trainer) if admit(trainer, artifact_file, "artifact") else []:
        logger.experiment.log_text(logger.run_id, text, artifact_file)


def set_tags(trainer: Trainer, tags: Mapping[str, Any]) -> None:
    """Set the tags ``tags`` (values as text) on every MLflow run of the trainer (global rank zero only)."""
    tags = admit_metrics(trainer, tags, "tag")
    for logger in _active(trainer):
        for key, value in tags.items():
            logger.experiment.set_tag(logger.run_id, key, str(value))


def log_artifact(
    trainer: Trainer, local_path: str | os.PathLike[str], artifact_path: Optional[str] = None
) -> None:
    """Copy a local file (or a folder's content) into the artifacts of every MLflow run.

    Args:
        trainer: The trainer whose MLflow loggers receive the file.
        local_path: File or folder to copy.
        artifact_path: Folder inside the run's artifacts (None for the root); the file
            keeps its name.
    """
    local_path = os.fspath(local_path)
    name = os.path.basename(local_path.rstrip(os.sep))
    if not admit(trainer, f"{artifact_path}/{name}" if artifact_path else name, "artifact"):
        return
    for logger in _active(trainer):
        if os.path.isdir(local_path):
            logger.experiment.log_artifacts(logger.run_id, local_path, artifact_path)
        else:
            logger.experiment.log_artifact(logger.run_id, local_path, artifact_path)


#: Parts of a Lightning checkpoint that only serve to resume training: left out of uploaded checkpoints.
RESUME_ONLY_KEYS = ("callbacks", "optimizer_states", "lr_schedulers")


def public_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What of a Lightning checkpoint may leave the machine: no resume state, no secret.

    Drops :data:`RESUME_ONLY_KEYS` (callback states such as DPSGD's, optimizer and
    scheduler states) and every entry under :data:`lightning_dp.privacy.seeds.SECRET_KEY`
    (e.g. the federated module's noise seed). The result loads with
    ``Module.load_from_checkpoint`` and serves ``lightning-dp test --ckpt_path``; it does
    not resume training.
    """
    from lightning_dp.privacy.seeds import strip_secrets

    return strip_secrets({k: v for k, v in checkpoint.items() if k not in RESUME_ONLY_KEYS})


def log_public_checkpoint(trainer: Trainer, source: str | os.PathLike[str] | Mapping[str, Any],
                          artifact_path: str, filename: str) -> None:
    """Log :func:`public_checkpoint` of a checkpoint (a file or a dict) as ``artifact_path/filename``.

    Acts on global rank zero only, like the other helpers; the only way lightning-dp uploads
    checkpoints.
    """
    active = _active(trainer)
    if not active or not admit(trainer, f"{artifact_path}/{filename}", "artifact"):
        return
    import tempfile

    import torch

    # our own or ModelCheckpoint's file, written by this run: trusted, and hyperparameters need full unpickling
    checkpoint = torch.load(source, map_location="cpu", weights_only=False) if isinstance(source, (str, os.PathLike)) \
        else source
    with tempfile.TemporaryDirectory(prefix="lightning-dp-ckpt-") as tmp_dir:
        path = os.path.join(tmp_dir, filename)
        torch.save(public_checkpoint(checkpoint), path)
        for logger in active:
            logger.experiment.log_artifact(logger.run_id, path, artifact_path)


def refuse_checkpoint_uploads(trainer: Trainer, component: str) -> None:
    """Raises if a logger of ``trainer`` would upload ``ModelCheckpoint`` files (``log_model``).

    Those files are resume checkpoints: they hold the secret noise seeds of ``component``.
    Loggers signal the upload by their ``log_model`` setting (MLflow, Weights & Biases,
    LitLogger keep it as ``_log_model``).
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    for logger in trainer.loggers:
        if getattr(logger, "_log_model", False):
            raise MisconfigurationException(
                f"{type(logger).__name__}(log_model={getattr(logger, '_log_model')!r}) uploads every ModelCheckpoint "
                f"file, and those resume checkpoints hold {component}'s secret noise seed: anyone with the upload "
                "could regenerate the noise and remove it. Set log_model=False; lightning-dp's RunArtifacts uploads "
                "the final model stripped of its secrets (artifact model/final.ckpt), and RestoreBestWeights the best.")


def log_params(trainer: Trainer, params: Mapping[str, Any]) -> None:
    """Log ``params`` through ``log_hyperparams`` of every logger of the trainer (not only MLflow).

    MLflow keeps the first value of a parameter: logging another value under the same
    name into the same run raises ``MlflowException``.
    """
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_hyperparams(dict(params))


def plot_series(
    steps: Sequence[float], values: Sequence[float], *, xlabel: str, ylabel: str, title: str
) -> Figure:
    """Return a line plot of ``values`` against ``steps`` as a matplotlib figure.

    The figure is built on the Agg canvas without ``pyplot``, so no display is needed
    and no global figure is left open.

    Args:
        steps: x values (e.g. optimizer steps).
        values: y values, same length as ``steps``.
        xlabel: x-axis label.
        ylabel: y-axis label.
        title: Figure title.

    Raises:
        ValueError: If ``steps`` and ``values`` differ in length.

    Example:
        >>> fig = plot_series([1, 2, 3], [0.1, 0.4, 0.9], xlabel="step", ylabel="epsilon", title="privacy spend")
        >>> fig.axes[0].get_ylabel()
        'epsilon'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps, values = list(steps), list(values)
    if len(steps) != len(values):
        raise ValueError(
            f"steps has {len(steps)} entries but values has {len(values)}; pass one value per step."
        )
    figure = Figure(figsize=(6.0, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(steps, values, marker="." if len(steps) <= 50 else None)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    return figure


def _secret_arguments(class_path: Any) -> tuple[str, ...]:
    """``SECRET_ARGUMENTS`` of the class a config names (none if it cannot be imported)."""
    if not isinstance(class_path, str) or "." not in class_path:
        return ()
    module_name, _, name = class_path.rpartition(".")
    try:
        import importlib

        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return ()
    return tuple(getattr(cls, "SECRET_ARGUMENTS", ()))


def redact_secrets(config_text: str) -> str:
    r"""A YAML config with every secret constructor argument set to null, for logging.

    A component lists its secret arguments in ``SECRET_ARGUMENTS`` (DPSGD's ``seed``, the
    federated module's ``noise_seed``: whoever knows them regenerates the privacy noise).
    The logged config then reproduces the run except its noise, which a null seed draws
    afresh; a comment at the top says what was redacted. Header comments are kept.

    Example:
        >>> print(redact_secrets("trainer:\n  callbacks:\n  - class_path: lightning_dp.callbacks.DPSGD\n"
        ...                      "    init_args:\n      seed: 7\n"))
        # redacted (secret noise seeds, set to null): trainer.callbacks.0.init_args.seed
        trainer:
          callbacks:
          - class_path: lightning_dp.callbacks.DPSGD
            init_args:
              seed: null
        <BLANKLINE>
    """
    import yaml

    config = yaml.safe_load(config_text)
    redacted: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            args = node.get("init_args")
            if isinstance(args, dict):
                for name in _secret_arguments(node.get("class_path")):
                    if args.get(name) is not None:
                        args[name] = None
                        redacted.append(f"{path}init_args.{name}")
            for key, value in node.items():
                walk(value, f"{path}{key}.")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}{i}.")

    walk(config, "")
    if not redacted:
        return config_text
    header = [line for line in config_text.splitlines() if line.startswith("#")]
    note = f"# redacted (secret noise seeds, set to null): {', '.join(redacted)}"
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    return "\n".join([*header, note, body])


def library_versions() -> dict[str, str]:
    """Return the installed versions of the libraries a result depends on.

    Returns:
        ``{distribution name: version}`` for lightning-dp, torch, lightning, torchmetrics, mlflow, dp-accounting,
        opacus, numpy, scikit-learn, fairlearn, transformers, peft, flwr and flwr-datasets, skipping the ones that
        are not installed; plus ``lightning-dp-commit`` (:func:`source_commit`) when lightning-dp runs from a git
        checkout.
    """
    versions = {}
    for name in _TRACKED_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    commit = source_commit()
    if commit is not None:
        versions["lightning-dp-commit"] = commit
    return versions


def source_commit(root: str | os.PathLike[str] | None = None) -> Optional[str]:
    """Return the git commit of the lightning-dp source this process runs, ``+dirty`` appended when a tracked file
    of the package differs from it; None when the source is not a git checkout of lightning-dp (an installed wheel,
    an archive, a repository that merely contains it) or git cannot tell.

    Why: ``versions/lightning-dp`` is the same for every commit of a checkout, and a result table that pools runs
    of two versions of a command cannot be told apart from one that does not (it happened: docs/results_mia.md,
    "Repeatability"). The commit is public: it names code, not data.

    The package's own checkout (``root`` None) is read once per process, at the first call (a run's fit start):
    the code this process loaded, not a later edit or checkout made while a grid runs.

    Args:
        root: a checkout's root to read now; None for the one holding this package.
    """
    if root is None:
        return _own_commit()
    return _checkout_commit(Path(root))


@functools.lru_cache(maxsize=1)
def _own_commit() -> Optional[str]:
    return _checkout_commit(Path(__file__).resolve().parent.parent)


def _checkout_commit(root: Path) -> Optional[str]:
    if not (root / ".git").exists():  # the package's own checkout, never a repository that contains site-packages
        return None
    # a git hook's GIT_DIR / GIT_WORK_TREE would name another repository: git reads only root here
    env = {name: value for name, value in os.environ.items() if not name.startswith("GIT_")}

    def git(*args: str) -> str:
        # --no-optional-locks: status must not refresh the index (parallel runs, DDP ranks, a user's commit)
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              timeout=10, check=True, env=env)
        return done.stdout.decode("utf-8", "replace").strip()

    try:
        git("ls-files", "--error-unmatch", "--", "lightning_dp/__init__.py")  # lightning-dp's repository
        head = git("rev-parse", "--verify", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "lightning_dp")
    except (OSError, subprocess.SubprocessError):  # no git, not a repository git accepts, no commit yet
        return None
    return head + ("+dirty" if changed else "")


def ui_command(tracking_uri: Optional[str] = None) -> str:
    """Return what a person runs to browse and compare the runs of ``tracking_uri``.

    Args:
        tracking_uri: The store; None for :func:`default_tracking_uri`.

    Returns:
        ``mlflow ui --backend-store-uri <uri>`` for a database or file store (the
        embedded default gives ``mlflow ui --backend-store-uri
        sqlite:////abs/path/mlruns/mlflow.db``). For an ``http(s)://`` tracking server
        there is nothing to start: the server is the UI, and its URL is returned.
    """
    uri = tracking_uri or default_tracking_uri()
    if urlparse(uri).scheme in ("http", "https"):
        return uri
    if uri.startswith("file:") and not uri.startswith("file://"):  # file:./mlruns -> a path `mlflow ui` accepts
        uri = unquote(uri[len("file:") :])
    return f"mlflow ui --backend-store-uri {shlex.quote(uri)}"


def run_locations(run_id: Optional[str], experiment_id: Optional[str], tracking_uri: str, what: str = "MLflow run",
                  artifacts: Sequence[str] = (), table_view: bool = False) -> str:
    """Where a run is recorded, as every command prints it: run id, tracking URI, how to browse it, and the
    link that opens the experiment in MLflow's training view (MLflow 3 opens in its GenAI view otherwise), with
    the runs table's epsilon and validation columns where ``table_view`` (:func:`share_table_view`).

    >>> print(run_locations("abc", "1", "sqlite:////tmp/mlruns/mlflow.db"))  # doctest: +NORMALIZE_WHITESPACE
    MLflow run abc (experiment id 1)
      tracking URI: sqlite:////tmp/mlruns/mlflow.db
      browse runs:  mlflow ui --backend-store-uri sqlite:////tmp/mlruns/mlflow.db
      then open:    http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning  (MLflow 3's training view)
    """
    server = urlparse(tracking_uri).scheme in ("http", "https")
    base = tracking_uri.rstrip("/") if server else "http://127.0.0.1:5000"
    lines = [f"{what} {run_id} (experiment id {experiment_id})", f"  tracking URI: {tracking_uri}"]
    if artifacts:
        lines.append(f"  artifacts:    {', '.join(artifacts)}")
    link = f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if table_view:
        link += f"&viewStateShareKey={SHARED_VIEW_KEY}"
    lines += [f"  browse runs:  {ui_command(tracking_uri)}",
              f"  then open:    {link}  (MLflow 3's training view"
              + (", with the epsilon and validation columns)" if table_view else ")")]
    return "\n".join(lines)
