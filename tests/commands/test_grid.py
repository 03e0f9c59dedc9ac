"""lightning-dp grid: the Cartesian product of overrides, nested MLflow runs, the grid's composed privacy cost."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import torch
from lightning.pytorch import Callback

from lightning_dp import cli, grid
from lightning_dp.privacy.accounting import get_accountant
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.spend import Spend
from tests.helpers import seed_store

REPO_ROOT = Path(__file__).resolve().parents[2]


def _seed(template: Path, workdir: Path) -> str:
    seed_store(template, workdir / "mlruns" / "mlflow.db")
    return f"sqlite:///{workdir}/mlruns/mlflow.db"


def test_parse_set():
    assert grid.parse_set("model.init_args.lr=0.1, 0.2") == ("model.init_args.lr", [0.1, 0.2])
    assert grid.parse_set("--a.b=true,none_of_these,3") == ("a.b", [True, "none_of_these", 3])
    assert grid.parse_set("lr=logspace:-2.5:1.5:5") == ("lr", [0.00316228, 0.0316228, 0.316228, 3.16228, 31.6228])
    assert grid.parse_set("c=logspace:-2:2:9")[1] == [0.01, 0.0316228, 0.1, 0.316228, 1.0, 3.16228, 10.0, 31.6228,
                                                     100.0]
    assert grid.parse_set("g=linspace:0.1:0.9:5") == ("g", [0.1, 0.3, 0.5, 0.7, 0.9])
    for bad in ("model.lr", "=1,2", "a=", "a=1,,2", "a=logspace:1:2", "a=logspace(1,2,3)", "a=linspace:x:1:2",
                "a=logspace:1:2:0"):
        with pytest.raises(ValueError, match="--set"):
            grid.parse_set(bad)


def test_command_line_errors(workdir, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["grid", "--config", str(REPO_ROOT / "examples" / "fl_synthetic.yaml")])
    assert info.value.code == 2 and "at least one axis" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["grid", "--config", "missing.yaml", "--set", "a=1"])
    assert "no such file" in capsys.readouterr().err


def test_dpsgd_grid_composes_every_run(workdir, store_template):
    """Two DP-SGD runs on the same data: the grid's epsilon is that of both histories composed."""
    uri = _seed(store_template, workdir)
    result = grid.run_grid(
        [str(REPO_ROOT / "examples" / "dpsgd_digits.yaml")], [("model.init_args.lr", [0.1, 0.2])],
        extra=["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false"])
    points, totals, grid_id = result.points, result.totals, result.grid_id
    assert [p.values for p in points] == [{"model.init_args.lr": 0.1}, {"model.init_args.lr": 0.2}]
    reference = get_accountant("pld")
    for p in points:
        for sigma, q, steps in p.privacy["accountant"].history:
            reference.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert totals["grid/epsilon"] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
    assert totals["grid/epsilon"] > max(p.privacy["epsilon"] for p in points)
    assert totals["grid/delta"] == 1e-5
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dpsgd-digits")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`grid.id` = '{grid_id}'")
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parent) == 1 and len(children) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent[0].info.run_id}
    assert {r.data.tags["mlflow.runName"] for r in children} == {"dpsgd-digits-eps3 lr=0.1", "dpsgd-digits-eps3 lr=0.2"}
    assert parent[0].data.tags["mlflow.runName"] == f"grid-{grid_id} dpsgd-digits-eps3"
    # the parent exists from the first run's start, so the UI nests the grid while it runs
    assert parent[0].info.start_time <= min(r.info.start_time for r in children)
    assert parent[0].info.status == "FINISHED"
    assert {r.data.params["lr"] for r in children} == {"0.1", "0.2"}
    assert parent[0].data.metrics["grid/epsilon"] == pytest.approx(totals["grid/epsilon"])
    table = client.download_artifacts(parent[0].info.run_id, "grid.md", str(workdir))
    text = Path(table).read_text()
    assert "| lr |" in text and "grid/epsilon" in text and all(p.run_id in text for p in points)
    utility = Path(client.download_artifacts(parent[0].info.run_id, "privacy_utility.md", str(workdir))).read_text()
    assert "| lr=0.1 | 1 |" in utility and "| lr=0.2 | 1 |" in utility and "val/acc" in utility


def test_federated_grid_adds_ledgers_per_client(workdir, store_template, capsys):
    """nu = 5 and nu = 2 on the same clients: each client's grid spend is the sum of its two ledgers."""
    _seed(store_template, workdir)
    code = cli.main(["grid", "--config", str(REPO_ROOT / "examples" / "fl_synthetic.yaml"),
                     "--set", "model.init_args.noise_multiplier=5,2", "--set", "model.init_args.seed=0,1",
                     "--test", "--summary", "grid.md", "--mean-over", "model.init_args.seed",
                     "--plot", "test/loss", "--plot-x", "model.init_args.noise_multiplier",
                     "--plot-hue", "model.init_args.seed", "--plot-file", "bars.png",
                     "--", "--trainer.max_epochs=10"])
    assert code == 0
    assert (workdir / "bars.png").stat().st_size > 0
    client = mlflow.MlflowClient()
    parent = [r for r in client.search_runs([client.get_experiment_by_name("fl-synthetic").experiment_id])
              if r.info.run_name.startswith("grid-")]
    assert [a.path for a in client.list_artifacts(parent[0].info.run_id)] == [
        "grid.md", "grid_bars.png", "privacy_utility.md", "privacy_utility.png"]
    text = (workdir / "grid.md").read_text()
    assert "test/loss" in text and "client_epsilon_max" in text and "grid/client_epsilon_max" in text
    assert "Mean ± std over seed" in text and "| 5 |" in text and "0,1 |" in text
    assert text in capsys.readouterr().out


def _ledger(spent):
    ledger = PrivacyLedger()
    for cid, cost in spent.items():
        ledger.charge(cid, cost)
    return ledger


def _dp_point(acc):
    return grid.GridPoint({}, privacy={"spends": [Spend.accounted("example", acc, delta=1e-5)],
                                       "epsilon": acc.get_epsilon(1e-5)})


def test_a_grid_over_an_unsanitized_federated_run_is_infinite(workdir, store_template):
    """Reproduction 2 of issue 24: a grid over the sanitizer's noise 5 and 0 (the second releases the same clients'
    models unsanitized) reported grid/client_epsilon_max = 1.2 (the module has no noise_multiplier attribute the
    grid could read, so both runs counted as sanitized). The round now reports its spend itself."""
    _seed(store_template, workdir)
    result = grid.run_grid([str(REPO_ROOT / "examples" / "fl_synthetic.yaml")],
                           [("model.init_args.noise_multiplier", [5.0, 0.0])],
                           extra=["--trainer.max_epochs=2", "--trainer.check_val_every_n_epoch=2"])
    sanitized, unsanitized = result.points
    assert sanitized.privacy["client_epsilon_max"] > 0
    assert [s.level for s in sanitized.privacy["spends"]] == ["client_ledger"]
    assert [(s.level, s.unsanitized) for s in unsanitized.privacy["spends"]] == [("client", True)]
    assert result.totals["grid/client_epsilon_max"] == result.totals["grid/client_epsilon_median"] == float("inf")
    assert "client_epsilon_max" in grid.report(result)


def test_a_grid_of_dp_fedavg_runs_composes_their_client_level_accountants(workdir, store_template):
    """Reproduction 2: a grid of DP-FedAvg runs recorded no grid/epsilon at all. Under replacement with sector
    releases each run's epsilon is the smaller of two bounds (replace-one, disjoint-pair); the grid composes
    each bound over the runs and reports the smaller composition."""
    uri = _seed(store_template, workdir)
    result = grid.run_grid([str(REPO_ROOT / "examples" / "fl_sector_synthetic.yaml")],
                           [("model.init_args.server_privacy.init_args.noise_multiplier", [3.0, 6.0])],
                           extra=["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=3"])
    runs = [p.privacy["spends"] for p in result.points]
    assert all([s.level for s in spends] == ["client"] for spends in runs)
    bounds = []
    for name in ("main", "disjoint_pair"):
        composed = runs[0][0].accountants[name]
        for spends in runs[1:]:
            for z, q, n in spends[0].accountants[name].history:
                composed.step(noise_multiplier=z, sample_rate=q, num_steps=n)
        bounds.append(composed.get_epsilon(1e-5))
    assert result.totals["grid/epsilon"] == pytest.approx(min(bounds), rel=1e-12)
    assert result.totals["grid/epsilon"] > max(p.privacy["epsilon"] for p in result.points)
    assert result.totals["grid/privacy_level"] == "client"
    client = mlflow.MlflowClient(uri)
    parent = [r for r in client.search_runs([client.get_experiment_by_name("fl-synthetic").experiment_id])
              if r.info.run_name.startswith("grid-")][0]
    assert parent.data.metrics["grid/epsilon"] == pytest.approx(result.totals["grid/epsilon"])
    assert parent.data.tags["grid/privacy_level"] == "client"


class UnreportedNoise(Callback):
    """Not a privacy component of ours: it keeps a noise multiplier but reports no spend."""

    noise_multiplier = 1.0


def test_a_component_with_privacy_state_but_no_report_is_refused_before_any_run():
    from lightning_dp.privacy.spend import unreported_components

    from lightning_dp.callbacks import DPSGD
    from lightning_dp.federated import FederatedRound
    from lightning_dp.models import LinearRegression

    assert unreported_components([DPSGD(noise_multiplier=1.0), FederatedRound(LinearRegression())]) == []
    assert unreported_components([UnreportedNoise()]) == ["UnreportedNoise (has noise_multiplier)"]
    assert unreported_components([torch.nn.Linear(2, 2)]) == []  # no privacy state: a non-private run


def test_grid_refuses_an_unreported_component_through_the_command(workdir, store_template, capsys):
    _seed(store_template, workdir)
    with pytest.raises(ValueError, match="reports no spend"):
        grid.run_grid([str(REPO_ROOT / "examples" / "digits_nonprivate.yaml")],
                      [("model.init_args.lr", [0.1, 0.2])],
                      extra=["--trainer.callbacks+=tests.commands.test_grid.UnreportedNoise"])
    assert "1/2" not in capsys.readouterr().out  # refused before the first run


def test_grid_privacy_totals():
    ledger_a, ledger_b = _ledger({"a": 0.4, "b": 0.8}), _ledger({"a": 1.0, "c": 1.0})
    points = [grid.GridPoint({}, privacy={"spends": [Spend.per_client("client_ledger", ledger)]})
              for ledger in (ledger_a, ledger_b)]
    totals = grid.grid_privacy(points)
    assert totals["grid/client_epsilon_max"] == pytest.approx(1.4) and totals["grid/client_epsilon_median"] == 1.0
    # a run without sanitization (nu = 0): it reports its unsanitized release, or nothing at that level
    for unsanitized in ([Spend.unprotected("client", "nu = 0")], []):
        assert grid.grid_privacy(points + [grid.GridPoint({}, privacy={"spends": unsanitized})])[
            "grid/client_epsilon_max"] == float("inf")
    acc = get_accountant("rdp")
    acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=10)
    dp = _dp_point(acc)
    assert grid.grid_privacy([dp, dp])["grid/epsilon"] > dp.privacy["epsilon"]
    assert grid.grid_privacy([dp, grid.GridPoint({})])["grid/epsilon"] == float("inf")  # one non-private run


def test_mean_table_over_an_axis():
    pts = [grid.GridPoint({"k": 1, "seed": s}, metrics={"test/loss": 0.3 + 0.01 * s},
                          privacy={"client_epsilon_median": 3.0 + s, "client_epsilon_max": 5.0 + s, "spends": []})
           for s in range(3)]
    pts += [grid.GridPoint({"k": 3, "seed": s}, metrics={"test/loss": 0.2},
                           privacy={"spends": [Spend.unprotected("client_ledger", "nu = 0")]}) for s in range(3)]
    lines = grid.mean_table(pts, "seed").splitlines()
    assert lines[2] == "| 1 | 0.31 ± 0.01 | 4 ± 1 | 6 ± 1 | 0,1,2 |"
    assert lines[3] == "| 3 | 0.2 ± 0 | inf | inf | 0,1,2 |"
    with pytest.raises(ValueError, match="not a grid axis"):
        grid.mean_table(pts, "lr")


def test_budgeted_grid_spends_the_budget_over_all_runs(workdir, store_template, capsys):
    """--budget: one sigma for the grid, calibrated so that the runs (per seed) compose to the budget."""
    uri = _seed(store_template, workdir)
    code = cli.main(["grid", "--config", str(REPO_ROOT / "examples" / "dpsgd_digits.yaml"),
                     "--set", "model.init_args.lr=0.1,0.3", "--set", "data.init_args.seed=0,1",
                     "--budget", "3", "--select", "val/acc", "--mean-over", "data.init_args.seed", "--test",
                     "--summary", "grid.md", "--", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"])
    assert code == 0
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dpsgd-digits")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parent) == 1 and len(children) == 4  # planning created no run
    params = parent[0].data.params
    assert params["grid.budget_epsilon"] == "3.0" and params["grid.budget_delta"] == "1e-05"
    sigma = float(params["grid.noise_multiplier"])  # both seeds plan the same runs: one sigma
    # each seed's grid: 2 runs of 2 epochs (q = 64 / 1077 -> 17 steps per epoch) compose to epsilon 3
    q = float(children[0].data.params["privacy/sample_rate"])
    per_epoch = int(children[0].data.params["privacy/steps_per_epoch"])
    assert {float(r.data.params["privacy/noise_multiplier"]) for r in children} == {sigma}
    acc = get_accountant("pld")
    spent = acc.epsilon_after(1e-5, noise_multiplier=sigma, sample_rate=q, num_steps=2 * 2 * per_epoch)
    assert spent <= 3.0
    assert acc.epsilon_after(1e-5, noise_multiplier=sigma / 1.01, sample_rate=q, num_steps=4 * per_epoch) > 3.0
    assert parent[0].data.metrics["grid/epsilon"] == pytest.approx(spent, rel=1e-9)
    assert parent[0].data.metrics["grid/epsilon_all_repetitions"] > 3.0  # both seeds together: more than one grid
    # the run's own callback budget was replaced by its share of the grid's
    assert {r.data.params["privacy/target_epsilon"] for r in children} != {"3.0"}
    best = parent[0].data.tags["grid.best_runs"].split(",")
    assert len(best) == 2 and all(client.get_run(b).data.tags["grid.best"] == "true" for b in best)
    for seed in ("0", "1"):
        same_seed = [r for r in children if r.data.tags["grid.seed"] == seed]
        chosen = [r for r in same_seed if r.info.run_id in best]
        assert len(chosen) == 1
        assert chosen[0].data.metrics["val/acc"] == max(r.data.metrics["val/acc"] for r in same_seed)
    text = (workdir / "grid.md").read_text()
    assert "Budget of each grid: epsilon = 3" in text and "Best run by val/acc (max)" in text
    assert "Chosen runs over 2 repetitions" in text and "test/acc = " in text  # val/* kept through --test


def test_budgeted_grid_needs_a_dp_callback_in_every_run(workdir, store_template):
    _seed(store_template, workdir)
    with pytest.raises(ValueError, match="DP-SGD callbacks"):
        grid.run_grid([str(REPO_ROOT / "examples" / "digits_nonprivate.yaml")], [("model.init_args.lr", [0.1])],
                      budget=3.0, extra=["--trainer.max_epochs=1"])


def test_select_best_and_modes():
    pts = [grid.GridPoint({"lr": v}, metrics={"val/acc": a, "val/loss": l})
           for v, a, l in ((1, 0.5, 0.9), (2, 0.7, 0.4), (3, float("nan"), 0.1))]
    assert grid.select_best(pts, "val/acc", "max").values == {"lr": 2}
    assert grid.select_best(pts, "val/loss", "min").values == {"lr": 3}
    assert grid.default_mode("val/loss") == "min" and grid.default_mode("val/acc") == "max"
    with pytest.raises(ValueError, match="available"):
        grid.select_best(pts, "test/acc", "max")


def test_a_dpsgd_run_without_steps_counts_as_private():
    """A run whose DP callback released nothing spent epsilon 0; it must not make the grid's cost infinite."""
    acc = get_accountant("rdp")
    acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=10)
    ran, idle = _dp_point(acc), _dp_point(get_accountant("rdp"))
    assert grid.grid_privacy([ran, idle])["grid/epsilon"] == pytest.approx(ran.privacy["epsilon"])


def test_bar_plot_draws_means_and_stds_over_repetitions():
    pts = [grid.GridPoint({"nu": nu, "k": k, "seed": s}, metrics={"gap": 0.1 * k + nu + 0.01 * s})
           for nu in (0.1, 1) for k in (1, 2) for s in range(3)]
    fig = grid.bar_plot(pts, ["gap"], "nu", "k", "seed")
    ax = fig.axes[0]
    heights = [round(bar.get_height(), 9) for bar in ax.patches]
    assert heights == [0.21, 1.11, 0.31, 1.21]  # hue k=1 at nu 0.1, 1; then k=2; means over 3 seeds
    assert ax.get_title() == "gap" and [t.get_text() for t in ax.get_xticklabels()] == ["0.1", "1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["k=1", "k=2"]
    with pytest.raises(ValueError, match="not a grid axis"):
        grid.bar_plot(pts, ["gap"], "lr", "k", "seed")
    with pytest.raises(ValueError, match="several values"):
        grid.bar_plot(pts, ["gap"], "nu", "k")
    with pytest.raises(ValueError, match="no run has these metrics"):
        grid.bar_plot(pts, ["acc"], "nu", "k", "seed")
    with pytest.raises(ValueError, match="two different"):
        grid.bar_plot(pts, ["gap"], "nu", "nu", "seed")


def test_plot_command_line_errors(workdir, capsys):
    config = str(REPO_ROOT / "examples" / "fl_synthetic.yaml")
    for args, message in ((["--plot", "test/loss"], "needs --plot METRIC, --plot-x KEY and --plot-hue KEY"),
                          (["--plot", "m", "--plot-x", "a", "--plot-hue", "lr"], "not one of the --set keys"),
                          (["--plot", "m", "--plot-x", "a", "--plot-hue", "b"], "several values"),
                          (["--plot", "m", "--plot-x", "a", "--plot-hue", "a"], "two different")):
        with pytest.raises(SystemExit):
            cli.main(["grid", "--config", config, "--set", "a=1,2", "--set", "b=1", "--set", "c=1,2", *args])
        assert message in capsys.readouterr().err


def _record_noise_seeds(monkeypatch):
    """(component, secret seed, final parameters) of every fit, as the grid ran it."""
    from lightning_dp.callbacks import DPSGD
    from lightning_dp.federated import PersonalizedFederatedModule

    seen = []
    dp_end, fl_end = DPSGD.on_train_end, PersonalizedFederatedModule.on_train_end

    def dp_record(self, trainer, module):
        seen.append(("dpsgd", self._seed, [p.detach().clone() for p in module.parameters()]))
        dp_end(self, trainer, module)

    def fl_record(self):
        seen.append(("federated", self._noise_seed, [self.hypotheses.detach().clone()]))
        fl_end(self)

    monkeypatch.setattr(DPSGD, "on_train_end", dp_record)
    monkeypatch.setattr(PersonalizedFederatedModule, "on_train_end", fl_record)
    return seen


def test_every_run_of_a_grid_draws_its_own_noise(workdir, store_template, monkeypatch):
    """Two identical points of a config that fixes nothing else: before, both drew the config's seed-0 noise;
    the grid's composed epsilon assumes independent noise."""
    _seed(store_template, workdir)
    seen = _record_noise_seeds(monkeypatch)
    extra = ["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false", "--trainer.callbacks.init_args.seed=0"]
    grid.run_grid([str(REPO_ROOT / "examples" / "dpsgd_digits.yaml")], [("model.init_args.lr", [0.1, 0.1])],
                  extra=extra)
    (_, s1, p1), (_, s2, p2) = seen
    assert s1 != s2 and s1 != 0  # the config's fixed seed is replaced, per run
    assert not all(torch.equal(a, b) for a, b in zip(p1, p2))  # same init and data, different noise
    grid.run_grid([str(REPO_ROOT / "examples" / "fl_synthetic.yaml")],
                  [("model.init_args.noise_multiplier", [5, 5])], extra=["--trainer.max_epochs=2"])
    (_, f1, h1), (_, f2, h2) = seen[2:]
    assert f1 != f2 and not torch.equal(h1[0], h2[0])


def test_a_grid_seed_reproduces_the_grid_exactly(workdir, store_template, monkeypatch):
    _seed(store_template, workdir)
    seen = _record_noise_seeds(monkeypatch)
    for _ in range(2):
        code = cli.main(["grid", "--config", str(REPO_ROOT / "examples" / "dpsgd_digits.yaml"), "--seed", "5",
                         "--set", "model.init_args.lr=0.1,0.1", "--", "--trainer.max_epochs=1",
                         "--trainer.enable_progress_bar=false"])
        assert code == 0
    first, second = seen[:2], seen[2:]
    assert first[0][1] != first[1][1]  # independent within a grid ...
    from lightning_dp.privacy.seeds import derive_seed

    assert [s for _, s, _ in first] == [s for _, s, _ in second] == [derive_seed(5, 0, 0), derive_seed(5, 1, 0)]
    for (_, _, a), (_, _, b) in zip(first, second):  # ... and the same grid twice
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_refused_point_is_refused_before_any_run(workdir, store_template):
    """The second point's lr=-1 is refused when the grid checks every point, before the first run trains."""
    uri = _seed(store_template, workdir)
    with pytest.raises(Exception, match="lr=-1"):
        grid.run_grid([str(REPO_ROOT / "examples" / "dpsgd_digits.yaml"),
                       str(REPO_ROOT / "examples" / "digits_nonprivate.yaml")], [("model.init_args.lr", [0.1, -1])],
                      grid_id="refused", extra=["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false"])
    client = mlflow.MlflowClient(uri)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`grid.id` = 'refused'") == []


def test_a_failed_grid_marks_its_parent_failed(workdir, store_template):
    """The second run is refused (DPSGD refuses precision='16-true' from its settings, before the run's MLflow
    run exists): the first run stays nested under a parent that ends FAILED, and no empty child is left."""
    uri = _seed(store_template, workdir)
    with pytest.raises(Exception, match="16-true has no loss scaling"):
        grid.run_grid([str(REPO_ROOT / "examples" / "dpsgd_digits.yaml"),
                       str(REPO_ROOT / "examples" / "digits_nonprivate.yaml")],
                      [("trainer.precision", ["32-true", "16-true"])],
                      grid_id="failing", extra=["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false"])
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`grid.id` = 'failing'")
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert parent.info.status == "FAILED"
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.data.tags["mlflow.runName"] for r in children} == {  # named by the last config
        "digits-nonprivate-baseline precision=32-true"}


def test_nonprivate_grid_totals_follow_the_runs_switch():
    from lightning_dp.privacy.ledger import PrivacyLedger as Ledger

    ledger = Ledger()
    ledger.charge("x", 1.0)
    spend = Spend.per_client("client_ledger", ledger, secret_participation=True)
    on = grid.GridPoint({}, privacy={"spends": [spend], "nonprivate": True})
    off = grid.GridPoint({}, privacy={"spends": [spend], "nonprivate": False})
    assert "nonprivate/grid_client_epsilon_max" in grid.grid_privacy([on, on])
    assert grid.grid_privacy([on, off]) == {}


def _without_mlflow(tmp_path, root):
    """The environment of a subprocess that runs as on a GPU machine without MLflow (a sitecustomize hides it)."""
    import os

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None  # not installed\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(root)])}


def test_parallel_runner_fits_tests_and_accounts_every_point_without_mlflow(tmp_path):
    """benchmarks/run_configs_parallel.py (the grid's points spread over processes, for machines without MLflow):
    a point the grid would refuse stops the command before any training (exit 2, nothing written); otherwise one
    JSON line per point with its values, test metrics, the restored model's validation metrics, its accounted
    epsilon and its CSV log; a point that fails in fit leaves its error line, the others their rows, and exit 1."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = _without_mlflow(tmp_path, root)
    out = tmp_path / "points.jsonl"

    def run(axis):
        cmd = [sys.executable, str(root / "benchmarks" / "run_configs_parallel.py"), "--config",
               str(root / "examples" / "dpsgd_digits.yaml"), "--set", axis, "--processes", "2",
               "--log-dir", str(tmp_path / "csv"), "--out", str(out), "--", "--trainer.max_epochs=1"]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    done = run("model.init_args.num_classes=10,2")  # the network outputs 10: refused before training
    assert done.returncode == 2 and "num_classes=2" in done.stderr and not out.exists()
    done = run("trainer.callbacks.init_args.target_epsilon=3,1e-9")  # the second is unreachable, found in fit
    assert done.returncode == 1, done.stderr[-3000:]
    rows = {str(r["values"]["trainer.callbacks.init_args.target_epsilon"]): r
            for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"3", "1e-9"} and "unreachable" in rows["1e-9"]["error"]
    good = rows["3"]
    assert "error" not in good, good
    assert {"test/acc", "restored val/acc", "val/acc"} <= set(good["metrics"]) and good["epochs"] == 1
    assert 0 < good["privacy"]["epsilon"] <= 3.0 + 1e-6 and good["device"] == "cpu"
    assert (Path(good["log_dir"]) / "metrics.csv").is_file() and Path(good["log_dir"]).parent.name == "target_epsilon=3"


def test_parallel_runner_seed_replays_a_point(tmp_path):
    """benchmarks/run_configs_parallel.py --seed S derives each point's noise seed from (S, point index), as
    lightning-dp grid --seed S: the same command twice gives the same metrics; another S other ones (the noise
    differs: the data, the initialization and the sampling rate stay fixed by the config)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = _without_mlflow(tmp_path, root)

    def run(seed, name):
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, str(root / "benchmarks" / "run_configs_parallel.py"), "--config",
               str(root / "examples" / "dpsgd_digits.yaml"), "--set", "trainer.max_epochs=1", "--seed", str(seed),
               "--log-dir", str(tmp_path / name), "--out", str(out)]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"seeds derived from --seed {seed}" in done.stdout
        (row,) = map(json.loads, out.read_text().splitlines())
        assert row["seed"] == seed and row["index"] == 0  # what replays it
        return row["metrics"]

    import importlib.util

    spec = importlib.util.spec_from_file_location("runner", root / "benchmarks" / "run_configs_parallel.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    with pytest.raises(SystemExit) as refused:  # as lightning-dp grid --seed: a seed the grid never derives from
        runner.main(["--config", str(root / "examples" / "dpsgd_digits.yaml"), "--out", str(tmp_path / "x"),
                     "--seed", "-1"])
    assert refused.value.code == 2 and not (tmp_path / "x").exists()
    first, again, other = run(0, "a"), run(0, "b"), run(1, "c")
    assert first == again
    assert first["test/loss"] != other["test/loss"] and first["val/loss"] != other["val/loss"]


def test_a_grid_of_points_with_different_batch_shapes_is_refused_before_any_run(workdir, store_template, capsys):
    """Issue 53's review: a point with max_batch_size is another mechanism than one without (or with another
    bound); their spends do not compose, and the grid says so before the first run trains."""
    _seed(store_template, workdir)
    with pytest.raises(ValueError, match="different batch shapes"):
        grid.run_grid([str(REPO_ROOT / "examples" / "dpsgd_digits_static.yaml")],
                      [("trainer.callbacks.init_args.max_batch_size", ["auto", "null"])],
                      extra=["--trainer.max_epochs=1"])
    assert "1/2" not in capsys.readouterr().out
