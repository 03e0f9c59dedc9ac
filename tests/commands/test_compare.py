"""``lightning-dp compare`` and the privacy-utility picture: groups over seeds, the baseline, what is left out."""

from __future__ import annotations

import math

import mlflow
import pytest

from lightning_dp import cli
from lightning_dp.tracking import default_tracking_uri
from tests.helpers import seed_store
from lightning_dp.commands.compare import (COMPARE_TAG, PRIVATE_TAG, Outcome, choose_metric, group_outcomes, utility_figure,
                                  utility_table)


def test_groups_are_means_with_sample_stds_and_baselines_last():
    outcomes = [Outcome("a", "eps=8", 7.9, 0.90), Outcome("b", "eps=8", 7.9, 0.92), Outcome("c", "eps=8", 7.9, 0.94),
                Outcome("d", "eps=1", 0.99, 0.6), Outcome("e", "base", None, 0.97), Outcome("f", "base", None, 0.99)]
    groups = group_outcomes(outcomes)
    assert [g.label for g in groups] == ["eps=1", "eps=8", "base"]
    eight = groups[1]
    assert eight.value == pytest.approx(0.92) and eight.value_std == pytest.approx(0.02)  # sample std (n - 1)
    assert groups[0].value_std == 0.0 and groups[2].epsilon is None
    table = utility_table(groups, "val/acc")
    assert "| eps=8 | 3 | 7.9 ± 0 | 0.92 ± 0.02 |" in table and "| base | 2 | non-private | 0.98 ± 0.014 |" in table
    fig = utility_figure(groups, "val/acc")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "val/acc" and ax.get_xlim()[0] == 0
    assert any("non-private" in t.get_text() for t in fig.legends[0].get_texts())  # below the axes
    with pytest.raises(ValueError, match="mixes private and non-private"):
        group_outcomes([Outcome("a", "x", 1.0, 0.5), Outcome("b", "x", None, 0.6)])


def test_metric_choice_prefers_the_task_metric_and_suggests():
    assert choose_metric([{"val/loss", "val/acc"}, {"val/acc"}]) == "val/acc"
    assert choose_metric([{"val/perplexity", "val/loss"}]) == "val/perplexity"
    with pytest.raises(ValueError, match="did you mean val/acc"):
        choose_metric([{"val/acc"}], "val/accc")
    with pytest.raises(ValueError, match="no task metric"):
        choose_metric([{"privacy/epsilon"}])


def _run(client, experiment_id, name, metrics, params, tags):
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    for k, v in metrics.items():
        client.log_metric(run.info.run_id, k, v)
    for k, v in params.items():
        client.log_param(run.info.run_id, k, v)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_compare_command_groups_seeds_draws_the_baseline_and_leaves_out_unmarked_runs(workdir, store_template,
                                                                                      capsys):
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    client = mlflow.MlflowClient(default_tracking_uri())
    eid = client.create_experiment("cmp", artifact_location=(workdir / "art").as_uri())
    for seed, acc in ((0, 0.80), (1, 0.84), (2, 0.82)):
        _run(client, eid, f"dp-{seed}", {"privacy/epsilon": 2.96, "val/acc": acc},
             {"target_epsilon": "3", "seed_everything": str(seed)}, {PRIVATE_TAG: "true"})
    _run(client, eid, "dp8", {"privacy/epsilon": 7.9, "val/acc": 0.9},
         {"target_epsilon": "8", "seed_everything": "0"}, {PRIVATE_TAG: "true"})
    _run(client, eid, "base", {"val/acc": 0.95}, {"target_epsilon": "none", "seed_everything": "0"},
         {PRIVATE_TAG: "false"})
    _run(client, eid, "old", {"val/acc": 0.99}, {"seed_everything": "0"}, {})  # no epsilon, no mark: left out
    assert cli.main(["compare", "--experiment", "cmp", "--output", str(workdir / "out")]) == 0
    out = capsys.readouterr().out
    assert "| target_epsilon=3 | 3 | 2.96 ± 0 | 0.82 ± 0.02 |" in out
    assert "| base | 1 | non-private | 0.95 |" in out  # the baseline keeps its run name
    assert "left out: old" in out and "not marked non-private" in out
    assert (workdir / "out" / "privacy_utility.png").stat().st_size > 0
    assert client.search_runs([eid], "attributes.run_name = 'privacy-utility'") == []  # not among the training runs
    own = client.get_experiment_by_name("cmp-compare")  # issue 50, item 8: its own experiment, beside them
    assert own.tags["lightning_dp.compare.of"] == "cmp"
    assert own.artifact_location == (workdir / "mlruns" / "artifacts").as_uri()
    (made,) = client.search_runs([own.experiment_id], "attributes.run_name = 'privacy-utility'")
    assert len(made.data.tags[COMPARE_TAG].split(",")) == 5
    assert sorted(a.path for a in client.list_artifacts(made.info.run_id)) == ["privacy_utility.md",
                                                                              "privacy_utility.png"]
    # a second compare leaves the first compare run out, and reuses the experiment
    assert cli.main(["compare", "--experiment", "cmp"]) == 0
    assert "| privacy-utility" not in capsys.readouterr().out
    assert len(client.search_runs([own.experiment_id])) == 2


def test_compare_notes_a_group_that_pools_runs_of_different_code(workdir, store_template, capsys):
    """Seeds of one setting made by two lightning-dp commits (or library versions) are one group, as before, and the
    table (printed and the artifact) says so; runs that recorded no version, or the same, give no note."""
    from lightning_dp.commands.compare import mixed_versions

    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    client = mlflow.MlflowClient(default_tracking_uri())
    eid = client.create_experiment("mixed", artifact_location=(workdir / "art").as_uri())
    for seed, commit, torch in ((0, "aaa", "2.13.0"), (1, "bbb+dirty", "2.13.0"), (2, "aaa", "2.13.0")):
        _run(client, eid, f"dp-{seed}", {"privacy/epsilon": 2.96, "val/acc": 0.8},
             {"target_epsilon": "3", "seed_everything": str(seed), "versions/lightning-dp-commit": commit,
              "versions/torch": torch}, {PRIVATE_TAG: "true"})
    for seed in (0, 1):
        _run(client, eid, f"dp8-{seed}", {"privacy/epsilon": 7.9, "val/acc": 0.9},
             {"target_epsilon": "8", "seed_everything": str(seed), "versions/torch": "2.13.0"}, {PRIVATE_TAG: "true"})
    assert cli.main(["compare", "--experiment", "mixed", "--output", str(workdir / "out")]) == 0
    out = capsys.readouterr().out
    assert "| target_epsilon=3 | 3 |" in out  # still one group
    note = "Note: target_epsilon=3: pools runs of different code (lightning-dp-commit aaa / bbb+dirty)."
    assert note in out and note in (workdir / "out" / "privacy_utility.md").read_text()
    assert "target_epsilon=8: pools" not in out
    assert mixed_versions({"g": [{"versions/numpy": "2.4"}, {}, {"versions/numpy": "2.5", "x": "1"}]}) == [
        "g: pools runs of different code (numpy 2.4 / 2.5)"]
    assert mixed_versions({"g": [{"versions/numpy": "2.4"}, {}]}) == []


def test_compare_refuses_in_three_lines(workdir, store_template, capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--experiment", "nope"])
    assert "./mlruns/mlflow.db does not exist" in capsys.readouterr().err
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    for args, text in ((["compare"], "give run ids"), (["compare", "--experiment", "nope"], "not in"),
                       (["compare", "--metrc", "x"], "did you mean --metric")):
        with pytest.raises(SystemExit) as info:
            cli.main(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and text in err and len(err.strip().splitlines()) <= 3, err


def test_outcome_epsilon_of_a_grid_point_that_released_unsanitized_is_a_baseline():
    from lightning_dp.commands.compare import grid_outcomes
    from lightning_dp.grid.points import GridPoint

    points = [GridPoint({"nu": 0, "seed": 0}, "r0", {"test/acc": 0.9}, {"epsilon": math.inf}),
              GridPoint({"nu": 1, "seed": 0}, "r1", {"test/acc": 0.7}, {"epsilon": 2.0}),
              GridPoint({"nu": 1, "seed": 1}, "r2", {"test/acc": 0.8}, {"epsilon": 2.0})]
    metric, outcomes = grid_outcomes(points, None, "seed")
    groups = group_outcomes(outcomes)
    assert metric == "test/acc" and [(g.label, g.epsilon, len(g.runs)) for g in groups] == [
        ("nu=1", 2.0, 2), ("nu=0", None, 1)]


def test_compare_groups_by_setting_not_by_name_and_marks_unprotected_runs(workdir, store_template, capsys):
    """Review findings: runs of one config at three epsilons share a run name (three rows, not one); seeds with
    MLflow's generated names are one row; a run tagged non-private is a baseline whatever epsilon it logged."""
    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    client = mlflow.MlflowClient(default_tracking_uri())
    eid = client.create_experiment("grp", artifact_location=(workdir / "art").as_uri())
    for eps, acc in ((1, 0.7), (3, 0.8), (8, 0.9)):
        _run(client, eid, "same-name", {"privacy/epsilon": eps * 0.99, "val/acc": acc},
             {"target_epsilon": str(eps), "seed_everything": "0"}, {PRIVATE_TAG: "true"})
    _run(client, eid, "noiseless", {"privacy/epsilon": 0.99, "val/acc": 0.95}, {"target_epsilon": "1", "x": "y"},
         {PRIVATE_TAG: "false"})  # NoiselessDPSGD: its logged epsilon is a claim, not a guarantee
    assert cli.main(["compare", "--experiment", "grp", "--no-log"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 3 |" not in out and out.count("| 1 |") >= 3  # three settings, one run each
    assert "non-private | 0.95 |" in out
    eid2 = client.create_experiment("seeds", artifact_location=(workdir / "art2").as_uri())
    for s, acc in ((0, 0.80), (1, 0.84), (2, 0.82)):
        _run(client, eid2, f"gentle-owl-{s}", {"privacy/epsilon": 2.96, "val/acc": acc},
             {"target_epsilon": "3", "seed_everything": str(s)}, {PRIVATE_TAG: "true"})
    assert cli.main(["compare", "--experiment", "seeds", "--no-log"]) == 0
    assert "| all runs | 3 | 2.96 ± 0 | 0.82 ± 0.02 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["compare", "--experiment", "seeds", "--metric", "nonprivate/train_loss", "--no-log"])
    assert "not covered by epsilon" in capsys.readouterr().err


def test_compare_after_a_grid_names_groups_by_what_differs_and_shows_the_searchs_spend(workdir, store_template, capsys):
    """Issue 50, item 7: a budgeted grid over lr (2 seeds each) beside the non-private baseline. Groups are named by
    the settings that differ between the private groups (not every parameter the baseline lacks, cut at 60
    characters), the baseline keeps its name, no line joins two learning rates, the legend stays off the axes, and
    the grid's composed spend (its parent run's grid/epsilon, per repetition and over both) is in table and figure."""
    import matplotlib.lines

    seed_store(store_template, workdir / "mlruns" / "mlflow.db")
    client = mlflow.MlflowClient(default_tracking_uri())
    eid = client.create_experiment("dg", artifact_location=(workdir / "art").as_uri())
    parent = client.create_run(eid, run_name="grid-abcd1234 dpsgd-digits-eps3", tags={"grid.id": "abcd1234"})
    pid = parent.info.run_id
    for name, value in (("grid/epsilon", 2.976), ("grid/delta", 1e-5), ("grid/budget_epsilon", 3.0),
                        ("grid/epsilon_all_repetitions", 4.334)):
        client.log_metric(pid, name, value)
    client.set_terminated(pid)
    common = {"momentum": "0.0", "privacy/accountant": "pld", "privacy/accumulate_grad_batches": "1",
              "privacy/noise_multiplier": "1.14", "data/batch_size": "64", "versions/torch": "2.13.0"}
    for lr, accs in (("0.2", (0.48, 0.56)), ("0.4", (0.58, 0.78))):
        for seed, acc in enumerate(accs):
            _run(client, eid, f"dpsgd-digits-eps3 lr={lr} seed_everything={seed}",
                 {"privacy/epsilon": 2.074, "val/acc": acc}, {**common, "lr": lr, "seed_everything": str(seed)},
                 {PRIVATE_TAG: "true", "grid.id": "abcd1234", "mlflow.parentRunId": pid})
    _run(client, eid, "digits-nonprivate-baseline", {"val/acc": 0.95},
         {"lr": "0.05", "momentum": "0.9", "data/batch_size": "64", "seed_everything": "0"}, {PRIVATE_TAG: "false"})
    assert cli.main(["compare", "--experiment", "dg", "--no-log"]) == 0
    out = capsys.readouterr().out
    assert "| lr=0.2 | 2 | 2.074 ± 0 |" in out and "| lr=0.4 | 2 | 2.074 ± 0 |" in out
    assert "| digits-nonprivate-baseline | 1 | non-private | 0.95 |" in out
    assert "accountant" not in out and "..." not in out
    assert "grid abcd1234 (4 runs) spent epsilon = 2.976 per repetition, 4.334 over all repetitions" in out
    assert "epsilon column is each run's own spend" in out
    assert "left out" not in out  # the grid's parent run is its record, not a run without val/acc

    from lightning_dp.commands.compare import grid_spends, group_outcomes, runs_outcomes

    runs = [r for r in client.search_runs([eid]) if "mlflow.parentRunId" in r.data.tags or "grid.id" not in r.data.tags]
    metric, outcomes, _ = runs_outcomes(runs)
    groups = group_outcomes(outcomes)
    fig = utility_figure(groups, metric, spends=grid_spends(client, runs))
    ax = fig.axes[0]
    fig.draw_without_rendering()  # the constrained layout places the legend
    joined = [line for line in ax.get_lines() if len(line.get_xdata()) > 1 and line.get_linestyle() == "-"]
    assert joined == []  # two learning rates are two settings, not a privacy-utility curve
    vertical = {round(float(line.get_xdata()[0]), 3) for line in ax.get_lines()
                if isinstance(line, matplotlib.lines.Line2D) and line.get_label().startswith("grid abcd1234")}
    assert vertical == {2.976, 4.334} and ax.get_xlim()[1] > 4.334
    assert ax.get_legend() is None and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())  # it can cover no point
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "digits-nonprivate-baseline: non-private (n=1)" in texts
    assert any("the search spent 4.334 (all repetitions)" in t for t in texts)


def test_points_of_one_setting_at_several_epsilons_are_one_curve():
    """A line joins groups that differ only along the privacy axis (target_epsilon here), in epsilon order."""
    from lightning_dp.grid.utility import curve_key

    a, b = curve_key({"lr": "0.1", "privacy/target_epsilon": "8"}), curve_key({"lr": "0.1", "privacy/target_epsilon": "1"})
    other = curve_key({"lr": "0.2", "privacy/target_epsilon": "3"})
    outcomes = [Outcome("a", "eps=8", 7.9, 0.9, a), Outcome("b", "eps=1", 0.99, 0.6, b),
                Outcome("c", "lr=0.2", 2.9, 0.7, other)]
    ax = utility_figure(group_outcomes(outcomes), "val/acc").axes[0]
    (joined,) = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
    assert list(joined.get_xdata()) == [0.99, 7.9]


def test_the_compare_experiment_is_restored_when_the_user_deleted_it(tmp_path):
    """A user who deleted `<experiment>-compare` in the UI gets it back (MLflow refuses runs in a deleted one)."""
    from lightning_dp.commands.compare import compare_experiment

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    training = client.create_experiment("digits")
    first = compare_experiment(client, training, uri)
    client.delete_experiment(first)
    again = compare_experiment(client, training, uri)
    assert again == first and client.get_experiment(again).lifecycle_stage == "active"
    client.create_run(again)  # a run can be made in it
