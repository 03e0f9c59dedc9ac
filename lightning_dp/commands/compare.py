"""The privacy-utility picture: a task metric against epsilon, over runs, with the non-private baseline.

``lightning-dp compare`` (:func:`main`) writes ``privacy_utility.png`` and ``privacy_utility.md`` to a new MLflow
run, ``privacy-utility``, in the experiment ``<experiment>-compare`` (:func:`compare_experiment`), and prints the
table. The picture itself is :mod:`lightning_dp.grid.utility`, whose names
(and :data:`PRIVATE_TAG`) are re-exported here. How runs are grouped and what counts as a baseline:
docs/getting_started.md, "Reading the runs in MLflow".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_dp.grid.utility import (
    METRIC_PREFERENCE,
    GridSpend,
    Group,
    Outcome,
    choose_metric,
    curve_key,
    grid_outcomes,
    group_outcomes,
    utility_figure,
    utility_table,
)

__all__ = ["COMPARE_SUFFIX", "COMPARE_TAG", "GridSpend", "Group", "Outcome", "PRIVATE_TAG", "choose_metric", "compare_experiment", "grid_outcomes",
           "grid_spends", "group_labels", "group_outcomes", "is_grid_parent", "main", "mixed_versions",
           "utility_figure", "utility_table"]

#: Tag of the runs ``lightning-dp compare`` creates (never compared themselves).
COMPARE_TAG = "lightning_dp.compare.runs"
#: The experiment of the runs ``lightning-dp compare`` creates: the compared runs' experiment's name and this suffix.
COMPARE_SUFFIX = "-compare"
#: The epsilon of a run: its first final metric among these (example level, then a federated client's worst).
EPSILON_METRICS = ("privacy/epsilon", "privacy/client_epsilon_max")


def __getattr__(name: str) -> Any:  # PEP 562: PRIVATE_TAG is tracking's; read there on first use, as before here
    if name == "PRIVATE_TAG":
        from lightning_dp.tracking import PRIVATE_TAG

        return PRIVATE_TAG
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _short(key: str) -> str:
    return key.rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def _labels(params: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """A short, unique label per group from the settings that differ between groups (``key=value, ...``).

    A setting that some groups lack (a baseline has no ``privacy/*`` parameter) names no group by itself being
    absent: only settings whose values differ among the groups that have them name groups, unless that leaves two
    groups with one label.
    """
    keys = sorted({k for p in params.values() for k in p})
    differ = [k for k in keys if len({p[k] for p in params.values() if k in p}) > 1]
    present = [k for k in keys if k not in differ and len({p.get(k) for p in params.values()}) > 1]

    def label(p: Mapping[str, str], varying: Sequence[str]) -> str:
        return ", ".join(f"{_short(k)}={p[k]}" for k in varying if k in p)

    labels = {group: label(p, differ) for group, p in params.items()}
    if len(set(labels.values())) < len(labels) and present:
        labels = {group: label(p, sorted(differ + present)) for group, p in params.items()}
    if len(set(labels.values())) < len(labels):  # still equal (or empty): number them
        labels = {group: f"{text or 'group'} [{i + 1}]" for i, (group, text) in enumerate(labels.items())}
    return labels


def _one_name(names: set[str]) -> Optional[str]:
    """The run name of a group whose runs share one, else None."""
    return next(iter(names)) if len(names) == 1 else None


def _is_seed(key: str) -> bool:
    leaf = key.replace("/", ".").rsplit(".", 1)[-1]
    return leaf in ("seed", "seed_everything") or leaf.endswith("_seed")


def group_labels(params: Mapping[str, Mapping[str, str]], names: Mapping[str, set[str]],
                 private: Mapping[str, bool]) -> dict[str, str]:
    """Labels of the groups (``{group: settings}``, their run names, whether private).

    When every group has one run name of its own, the names (they say more than the parameters). Otherwise private
    groups are named by the settings that differ between the private groups only, and a baseline keeps its run name
    (when it is a single group with one name): its settings differ from every private group's anyway.
    """
    if len(params) == 1:
        return {next(iter(params)): "all runs"}
    if all(len(n) == 1 for n in names.values()) and len({next(iter(n)) for n in names.values()}) == len(names):
        return {group: next(iter(n)) for group, n in names.items()}
    labels: dict[str, str] = {}
    for kind, fallback in ((True, "private"), (False, "non-private")):
        members = {group: p for group, p in params.items() if private[group] == kind}
        if len(members) == 1:
            (group,) = members
            labels[group] = _one_name(names[group]) or fallback
        elif members:
            labels.update(_labels(members))
    if len(set(labels.values())) < len(labels):  # a baseline named like a private group: number them
        labels = {group: f"{text} [{i + 1}]" for i, (group, text) in enumerate(labels.items())}
    return labels


def runs_outcomes(runs: Sequence[Any], metric: Optional[str] = None) -> tuple[str, list[Outcome], list[str]]:
    """Outcomes of MLflow runs (``mlflow.entities.Run``): the metric chosen, the outcomes, the runs left out (why).

    Runs are grouped by their parameters without the seeds (and the library versions): a group is one setting
    repeated over seeds, labelled by :func:`group_labels`. Private groups whose settings differ only in the privacy
    axis (:data:`~lightning_dp.grid.utility.PRIVACY_AXES`) form one curve (joined by a line in the figure).
    """
    from lightning_dp.tracking import PRIVATE_TAG

    chosen = choose_metric([set(r.data.metrics) for r in runs], metric)
    skipped, kept = [], []
    for r in runs:
        private = r.data.tags.get(PRIVATE_TAG)
        eps = next((r.data.metrics[m] for m in EPSILON_METRICS if m in r.data.metrics), None)
        if chosen not in r.data.metrics:
            skipped.append(f"{r.info.run_name} ({r.info.run_id[:8]}): no {chosen}")
        elif eps is None and private != "false":
            skipped.append(f"{r.info.run_name} ({r.info.run_id[:8]}): no epsilon logged and not marked non-private")
        else:  # marked non-private: a baseline, whatever epsilon it logged (an unsanitized release claims none)
            kept.append((r, None if private == "false" else eps))
    params: dict[str, dict[str, str]] = {}
    names: dict[str, set[str]] = {}
    is_private: dict[str, bool] = {}
    key_of = {}
    for r, eps in kept:
        setting = {k: v for k, v in r.data.params.items() if not _is_seed(k) and not k.startswith("versions/")}
        key = repr(sorted(setting.items()))
        params.setdefault(key, setting)
        names.setdefault(key, set()).add(r.info.run_name or r.info.run_id[:8])
        is_private.setdefault(key, eps is not None)
        key_of[r.info.run_id] = key
    labels = group_labels(params, names, is_private)
    outcomes = [Outcome(r.info.run_id, labels[key_of[r.info.run_id]], eps, float(r.data.metrics[chosen]),
                        None if eps is None else curve_key(params[key_of[r.info.run_id]]))
                for r, eps in kept]
    return chosen, outcomes, skipped


def is_grid_parent(run: Any) -> bool:
    """The parent run of a ``lightning-dp grid`` (tag ``grid.id``, no parent itself): the grid's record, not a
    training run."""
    return "grid.id" in run.data.tags and "mlflow.parentRunId" not in run.data.tags


def grid_spends(client: Any, runs: Sequence[Any]) -> list[GridSpend]:
    """What each grid search among ``runs`` spent in all: its parent run's ``grid/epsilon`` (per repetition of a
    budgeted grid), ``grid/epsilon_all_repetitions``, ``grid/delta`` and ``grid/budget_epsilon``
    (:meth:`lightning_dp.grid.run.ParentRuns.finish` logs them), one :class:`GridSpend` per grid."""
    spends = []
    for pid in dict.fromkeys(r.data.tags["mlflow.parentRunId"] for r in runs
                             if "grid.id" in r.data.tags and "mlflow.parentRunId" in r.data.tags):
        parent = client.get_run(pid)
        metrics, tags = parent.data.metrics, parent.data.tags
        if "grid/epsilon" in metrics:
            epsilon = float(metrics["grid/epsilon"])
        elif tags.get("grid/epsilon") == "inf":  # a grid with a run that released unsanitized
            epsilon = math.inf
        else:  # a grid that failed, or one without an example- or client-level epsilon
            continue
        children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{pid}'")
        spends.append(GridSpend(f"grid {tags.get('grid.id', pid[:8])}", epsilon, metrics.get("grid/delta"),
                                len(children), metrics.get("grid/epsilon_all_repetitions"),
                                metrics.get("grid/budget_epsilon")))
    return spends


def mixed_versions(groups: Mapping[str, Sequence[Mapping[str, str]]]) -> list[str]:
    """One note per group whose runs were made by different code: ``{group: [each run's params]}`` -> notes naming
    the ``versions/*`` parameters (the lightning-dp commit, a library's version) that differ within the group.

    A group is one setting repeated over seeds; pooling runs of two versions of the code into its mean and std
    mixes two experiments (docs/results_mia.md, "Repeatability"). A run that did not record a version is not
    counted against it; two ``+dirty`` runs of one commit may still differ (their changes are not recorded).
    """
    notes = []
    for group, runs in groups.items():
        seen: dict[str, set[str]] = {}
        for params in runs:
            for key, value in params.items():
                if key.startswith("versions/"):
                    seen.setdefault(key[len("versions/"):], set()).add(value)
        mixed = {name: sorted(values) for name, values in sorted(seen.items()) if len(values) > 1}
        if mixed:
            notes.append(f"{group}: pools runs of different code ("
                         + "; ".join(f"{name} {' / '.join(values)}" for name, values in mixed.items()) + ")")
    return notes


def compare_experiment(client: Any, experiment_id: str, uri: str) -> str:
    """The id of the experiment ``<name>-compare`` beside the compared runs' experiment ``<name>`` (created, tagged
    ``lightning_dp.compare.of = <name>``, on first use): the runs ``lightning-dp compare`` makes live there, so they
    are never listed, charted or counted among the training runs."""
    from lightning_dp import tracking

    name = client.get_experiment(experiment_id).name + COMPARE_SUFFIX
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage == "deleted":  # deleted in the UI: a run cannot be created in it until restored
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    return client.create_experiment(name, artifact_location=tracking.artifact_location_for(uri),
                                    tags={"lightning_dp.compare.of": name[:-len(COMPARE_SUFFIX)]})


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp compare``; returns the exit code (2 for bad input)."""
    import os
    import sys

    from lightning_dp.commands.errors import ShortArgumentParser

    parser = ShortArgumentParser(prog="lightning-dp compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", metavar="RUN_ID", help="MLflow run ids (or give --experiment)")
    parser.add_argument("--experiment", metavar="NAME", help="every finished run of this experiment")
    parser.add_argument("--metric", metavar="METRIC", help=f"the task metric (default: the first of "
                                                           f"{', '.join(METRIC_PREFERENCE)} that a run logged)")
    parser.add_argument("--output", metavar="DIR", help="also write privacy_utility.png and .md to this folder")
    parser.add_argument("--no-log", action="store_true", help="do not create the MLflow run (print only)")
    args = parser.parse_args(list(argv))
    if bool(args.runs) == bool(args.experiment):
        parser.error("give run ids (lightning-dp compare RUN_ID RUN_ID ...) or --experiment NAME, not both")

    import logging

    if not os.environ.get("MLFLOW_TRACKING_URI") and not os.path.isfile(os.path.join("mlruns", "mlflow.db")):
        parser.error("no runs here: ./mlruns/mlflow.db does not exist (run lightning-dp fit in this folder first, or "
                     "set MLFLOW_TRACKING_URI to your tracking server)")
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):  # as LightningDPCLI's quiet_third_party
        logging.getLogger(name).setLevel(logging.WARNING)
    from lightning_dp import tracking

    uri = tracking.default_tracking_uri()
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    try:
        if args.experiment:
            experiment = client.get_experiment_by_name(args.experiment)
            if experiment is None:
                names = [e.name for e in client.search_experiments()]
                from lightning_dp.commands.errors import closest

                near = closest(args.experiment, names)
                parser.error(f"--experiment {args.experiment}: not in {uri}" + (
                    f"; did you mean {' or '.join(near)}?" if near else f"; experiments: {names}"))
            runs = [r for r in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'")
                    if COMPARE_TAG not in r.data.tags and not is_grid_parent(r)]
        else:
            runs = [client.get_run(run_id) for run_id in args.runs]
    except MlflowException as err:
        parser.error(f"{str(err).splitlines()[0]} (tracking URI {uri})")
    if not runs:
        parser.error("no finished runs to compare")
    try:
        metric, outcomes, skipped = runs_outcomes(runs, args.metric)
        groups = group_outcomes(outcomes)
    except ValueError as err:
        parser.error(str(err))
    if not groups:
        parser.error("no run has both the metric and an epsilon (or the non-private mark): " + "; ".join(skipped))
    params_by_id = {r.info.run_id: dict(r.data.params) for r in runs}
    by_group: dict[str, list[Mapping[str, str]]] = {}
    for outcome in outcomes:
        by_group.setdefault(outcome.group, []).append(params_by_id.get(outcome.run_id, {}))
    kept_ids = {o.run_id for o in outcomes}
    try:
        spends = grid_spends(client, [r for r in runs if r.info.run_id in kept_ids])
    except MlflowException as err:
        parser.error(f"{str(err).splitlines()[0]} (tracking URI {uri})")
    table = utility_table(groups, metric, spends)
    notes = mixed_versions(by_group)
    if notes:  # in the printed table and in its artifact: a reader of either must see it
        table += "".join(f"\nNote: {note}.\n" for note in notes)  # one Markdown paragraph each
    figure = utility_figure(groups, metric, spends=spends)
    print(table, end="")
    for note in skipped:
        print(f"left out: {note}")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        figure.savefig(os.path.join(args.output, "privacy_utility.png"), dpi=120)
        with open(os.path.join(args.output, "privacy_utility.md"), "w", encoding="utf-8") as handle:
            handle.write(table)
    if not args.no_log:
        try:
            experiment_id = compare_experiment(client, runs[0].info.experiment_id, uri)
        except MlflowException as err:
            parser.error(f"{str(err).splitlines()[0]} (tracking URI {uri})")
        run = client.create_run(experiment_id, run_name="privacy-utility",
                                tags={COMPARE_TAG: ",".join(o.run_id for o in outcomes), "metric": metric})
        client.log_figure(run.info.run_id, figure, "privacy_utility.png")
        client.log_text(run.info.run_id, table, "privacy_utility.md")
        client.set_terminated(run.info.run_id)
        print(tracking.run_locations(run.info.run_id, experiment_id, uri, what="MLflow run privacy-utility",
                                     artifacts=["privacy_utility.png", "privacy_utility.md"]), file=sys.stdout)
    return 0
