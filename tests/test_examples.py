"""Every config under examples/ instantiates (class paths and arguments valid) without reading data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_dp.cli import LightningDPCLI

ROOT = Path(__file__).resolve().parents[1] / "examples"
# whole LightningCLI configs (examples/oso holds dataset configs and strategy overlays, tested together below;
# dlg_*.yaml are `lightning-dp audit` configs, tested in tests/audit/test_dlg.py)
EXAMPLES = sorted(p for p in ROOT.glob("*.yaml") if not p.name.startswith("dlg_")) + sorted(
    (ROOT / "fairness").glob("*.yaml")) + sorted((ROOT / "pdpfl").glob("*.yaml")) + sorted(
    (ROOT / "user_level").glob("*.yaml"))


@pytest.mark.parametrize("config", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_example_instantiates(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(config), "--trainer.logger=false"])
    assert cli.model is not None and cli.datamodule is not None
    header = config.read_text().splitlines()[0]
    assert header.startswith("#"), f"{config.name} should start with a comment saying what it runs"


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"dpsgd_digits.yaml", "fl_synthetic.yaml", "fl_hospital.yaml", "fl_femnist.yaml"} <= names


@pytest.mark.parametrize("name", ["els_synthetic.yaml", "group_synthetic.yaml", "els_femnist.yaml",
                                  "uls_synthetic.yaml", "uls_femnist.yaml"])
def test_user_level_configs_pool_the_clients_as_users(name, tmp_path, monkeypatch):
    """examples/user_level: DPSGD at privacy_unit 'user' (the config's last callback) over a CentralizedView of a
    federated DataModule (its clients are the users), the mixture's PLD at the coarser 1e-3, logged to MLflow."""
    import yaml

    from lightning_dp.callbacks import DPSGD
    from lightning_dp.datamodules import CentralizedView, FederatedDataModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    config = ROOT / "user_level" / name
    cli = LightningDPCLI(run=False, args=["--config", str(config), "--trainer.logger=false"])
    assert isinstance(cli.datamodule, CentralizedView) and isinstance(cli.datamodule.federated, FederatedDataModule)
    (dp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, DPSGD)]
    assert dp.settings.privacy_unit == "user"
    assert dp.settings.user_accounting == {"group": "group", "uls": "users"}.get(name.split("_")[0], "mixture")
    assert dp.settings.sampling == ("user" if name.startswith("uls") else "example")
    raw = yaml.safe_load(config.read_text())
    assert raw["trainer"]["logger"]["class_path"] == "lightning_dp.tracking.MLFlowLogger"
    assert raw["trainer"]["callbacks"][-1]["init_args"]["accountant_kwargs"] == {"value_discretization_interval": 1e-3}


#: Pages that record how this workplace made its numbers (paths of its machines included), not steps a user follows.
_RECORDS = ("results_", "benchmarks.md", "reproductions.md")


def test_no_example_or_followed_page_names_the_development_layout():
    """A user's clone has no ../shared (issue 50, item 2): every example reads ./data/<dataset> (downloaded there
    where the dataset has an official download), and the pages a user follows say so."""
    repo = ROOT.parent
    pages = [repo / "README.md", *(p for p in sorted((repo / "docs").glob("*.md")) if not p.name.startswith(_RECORDS))]
    texts = (".yaml", ".yml", ".py", ".md", ".sh", ".txt")
    named = [str(p.relative_to(repo)) for p in [*sorted(ROOT.rglob("*")), *pages]
             if p.is_file() and p.suffix in texts and "../shared" in p.read_text()]
    assert named == []
    import yaml

    for name in ("fedavg_dp_mnist.yaml", "lm/gpt2_public_pretrain.yaml", "lm/dp_lora_wikitext2.yaml",
                 "lm/dp_full_wikitext2.yaml", "dpsgd_mnist_t10k.yaml"):
        data = yaml.safe_load((ROOT / name).read_text())["data"]["init_args"]
        assert data["data_dir"].startswith("./data/") and data["download"] is True, name
    assert "--data.init_args.data_dir=" in (repo / "docs" / "data.md").read_text()  # the one way to a local copy


OSO = Path(__file__).resolve().parents[1] / "examples" / "oso"
OSO_DATA = ["mnist_t10k.yaml", "mnist_t10k_thesis_model.yaml", "mnist.yaml", "fashion_mnist.yaml",
            "fashion_mnist_autoencoder.yaml", "../oso_agnews.yaml", "../oso_mnist_autoencoder.yaml"]
OSO_STRATEGIES = {"online.yaml": "OnlineSensitivity", "fixed_threshold.yaml": "DPSGD",
                  "fixed_quantile.yaml": "QuantileClipping", "adamwosm.yaml": "DPSGD"}


@pytest.mark.parametrize("strategy", sorted(OSO_STRATEGIES))
@pytest.mark.parametrize("data", OSO_DATA)
def test_thesis_strategy_configs_compose_with_every_dataset(data, strategy, tmp_path, monkeypatch):
    """examples/oso: a dataset config + one strategy config = one of the thesis' runs; the strategy's
    callback replaces the dataset config's (exactly one DP callback), AdamWOSM sets the optimizer."""
    from lightning_dp.callbacks import DPSGD

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(OSO / data), "--config", str(OSO / strategy),
                                          "--trainer.logger=false"])
    dp = [cb for cb in cli.trainer.callbacks if isinstance(cb, DPSGD)]
    assert [type(cb).__name__ for cb in dp] == [OSO_STRATEGIES[strategy]]
    assert cli.model.hparams.optimizer == ("adamwosm" if strategy == "adamwosm.yaml" else "sgd")
    assert cli.model.configure_optimizers() is not None
    sizes = {"fashion_mnist_autoencoder.yaml": 48_705, "mnist.yaml": 551_322, "mnist_t10k_thesis_model.yaml": 551_322,
             "../oso_agnews.yaml": 113_156}
    if data in sizes:  # the thesis' Tables 3.5-3.7 models, at their Table 3.1 sizes
        assert sum(p.numel() for p in cli.model.parameters()) == sizes[data]
    if data == "../oso_agnews.yaml":  # the data's features are the network's inputs
        assert cli.datamodule.input_shape == (cli.model.network.in_features,) == (750,)


def test_pdpfl_figures_redraw_from_their_tables(tmp_path):
    """examples/pdpfl/figures.py: every figure draws from a table of its own format (--replot), no runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pdpfl_figures", ROOT / "pdpfl" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    fig2 = [{"partition": p, "level": lvl, "seed": str(s), "round": str(r), "norm_mean": str(1.5 + s / 10),
             "norm_std": "0.1"} for s in (0, 1, 2) for p in figures.PARTITIONS for lvl, _, _ in figures.LEVELS
            for r in (1, 2)]
    fig2_one_run = [{k: v for k, v in row.items() if k != "seed"} for row in fig2 if row["seed"] == "0"]  # before 54
    fig3 = [{"partition": p, "distribution": d, "budget_seed": str(s), "split_accuracy": "1", "public_clients": "2"}
            for p in figures.PARTITIONS for d in figures.DISTRIBUTIONS for s in (0, 1)]
    fig4 = [{"method": m, "seed": str(s), "round": str(r), "val_acc": "0.5", "test_acc": "0.4"}
            for m, _ in figures.METHODS for s in (0, 1) for r in (1, 2, 3)]
    fig4_val_only = [{k: v for k, v in row.items() if k != "test_acc"} for row in fig4]  # tables before issue 27
    (tmp_path / "one_run").mkdir()
    for name, table, extra in (("fig2", fig2_one_run, ["--out", str(tmp_path / "one_run")]), ("fig2", fig2, []),
                               ("fig3", fig3, []), ("fig4", fig4_val_only, []),
                               ("fig4_niid2", fig4, ["--partition", "NIID(2)"]),
                               ("fig4_shards2_pfa_regime", fig4, ["--partition", "shards(2)", "--regime", "pfa"])):
        header = list(table[0])
        out = Path(extra[1]) if extra[:1] == ["--out"] else tmp_path
        (out / f"pdpfl_{name}.tsv").write_text(
            "\t".join(header) + "\n" + "".join("\t".join(row[k] for k in header) + "\n" for row in table))
        figures.main([name.split("_")[0], "--replot", "--out", str(tmp_path), *extra])  # a later --out wins
        assert (out / f"pdpfl_{name}.png").stat().st_size > 10_000


AUDIT = ROOT / "audit"


@pytest.mark.parametrize("name", ["one_run_mnist.yaml", "one_run_mnist_whitebox.yaml"])
def test_one_run_audit_configs_put_dpsgd_last(name, tmp_path, monkeypatch):
    """`--trainer.callbacks.init_args.X` overrides the LAST callback: DPSGD must be it (the configs' commands rely
    on it), beside exactly one OneRunAudit."""
    from lightning_dp.callbacks import DPSGD, OneRunAudit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(AUDIT / name), "--trainer.logger=false",
                                          "--trainer.callbacks.init_args.target_epsilon=1"])
    ours = [cb for cb in cli.trainer.callbacks if isinstance(cb, (DPSGD, OneRunAudit))]
    assert [type(cb).__name__ for cb in ours] == ["OneRunAudit", "DPSGD"]
    assert ours[1].target_epsilon == 1.0
    assert AUDIT.joinpath(name).read_text().startswith("#")


@pytest.mark.parametrize("name", ["mia_lm.yaml", "mia_lm_dpsgd.yaml"])
def test_mia_configs_instantiate(name):
    from lightning_dp.commands.audit_mia import _problems, build_parser

    parser = build_parser()
    cfg = parser.parse_args(["--config", str(AUDIT / name)])
    assert _problems(cfg) == []
    init = parser.instantiate_classes(cfg)
    assert init.model is not None and init.data is not None
    assert (init.callbacks is None) == (name == "mia_lm.yaml")
    assert AUDIT.joinpath(name).read_text().startswith("#")


def test_mia_report_pools_the_runs_of_several_stores(tmp_path, store_template, capsys, monkeypatch):
    """examples/audit/mia_report.py with two --tracking-uri: the finished audit runs of both stores in one table (a
    run without its target's tag, or unfinished, left out; a run on a pool of another size in a row of its own);
    mean and sample std over the pooled runs; --sigma-png draws one curve per run with a sigma search."""
    import importlib.util

    from mlflow import MlflowClient

    from tests.helpers import seed_store

    spec = importlib.util.spec_from_file_location("mia_report", AUDIT / "mia_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    uris = []
    for i, runs in enumerate([[(0.70, "500")], [(0.80, "500"), (0.90, "500"), (0.60, "1500")]]):
        seed_store(store_template, tmp_path / f"s{i}" / "mlflow.db")
        uris.append(f"sqlite:///{tmp_path / f's{i}' / 'mlflow.db'}")
        client = MlflowClient(uris[-1])
        experiment = client.create_experiment("mia-lm", artifact_location=str(tmp_path / f"a{i}"))
        for seed, (auc, pool) in enumerate(runs):
            target = client.create_run(experiment).info.run_id
            run = client.create_run(experiment, tags={"audit/target_run_id": target}).info.run_id
            client.log_param(run, "audit/pool_size", pool)
            client.log_param(run, "audit/seed", seed)
            client.log_param(run, "versions/lightning-dp-commit", f"c{i}")
            client.log_metric(run, "audit/auc/noisy", auc)
            client.log_metric(run, "audit/noisy/sigma", 0.1)
            client.log_text(run, "sigma\tauc\n0.01\t0.6\n0.1\t0.8\n1\t0.7\n", "audit/auc_vs_sigma.tsv")
            client.set_terminated(run)
        untagged = client.create_run(experiment).info.run_id  # finished, but no target: left out
        client.log_metric(untagged, "audit/auc/noisy", 0.1)
        client.set_terminated(untagged)
        unfinished = client.create_run(experiment, tags={"audit/target_run_id": target}).info.run_id
        client.log_metric(unfinished, "audit/auc/noisy", 0.2)  # running: left out
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    png = tmp_path / "sigma.png"
    report.main(["--experiment", "mia-lm", "--tracking-uri", uris[0], "--tracking-uri", uris[1], "--sigma-png",
                 str(png)])
    out = capsys.readouterr().out
    assert "| non-private, pool 500 | noisy | 3 | 0.800 ± 0.100 |" in out
    assert "| non-private, pool 1500 | noisy | 1 | 0.600 |" in out
    assert out.index("pool 500 | noisy") < out.index("pool 1500 | noisy")  # pools in numeric order
    assert "4 curves of the sigma search" in out and png.stat().st_size > 0
    assert "Note: non-private, pool 500: pools runs of different code (lightning-dp-commit c0 / c1)." in out
    assert "pool 1500: pools" not in out
    report.main(["--experiment", "mia-lm", "--tracking-uri", uris[1]])
    assert "| non-private, pool 500 | noisy | 2 | 0.850 ± 0.071 |" in capsys.readouterr().out


def test_fl_synthetic_report_matches_hypotheses_to_thetas_and_summarizes(tmp_path, store_template, capsys,
                                                                        monkeypatch):
    """examples/fl_synthetic_report.py: hypotheses matched one to one to the true thetas (order free; two on one
    theta leave the other far), the rounds, the largest client leakage and the best validation loss per run, and
    the summary per stopping rule (from config.yaml); runs without data/thetas left out, a run without its
    checkpoint named and left out; a rule whose runs were made by two commits noted."""
    import importlib.util

    import numpy as np
    import torch
    from mlflow import MlflowClient

    from tests.helpers import seed_store

    spec = importlib.util.spec_from_file_location("fl_synthetic_report", ROOT / "fl_synthetic_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    thetas = np.array([[5.0, 6.0], [4.0, -4.5]])
    assert report.matched_distances(np.array([[4.0, -4.0], [5.0, 6.0]]), thetas) == pytest.approx([0.0, 0.5])
    assert report.matched_distances(np.array([[5.0, 6.0], [5.0, 6.0]]), thetas).max() == pytest.approx(
        float(np.hypot(1.0, 10.5)))
    with pytest.raises(ValueError, match="cannot match"):
        report.matched_distances(np.zeros((1, 2)), thetas)

    seed_store(store_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("fl-synthetic", artifact_location=str(tmp_path / "art"))
    early_stopping = "  callbacks:\n  - class_path: lightning.pytorch.callbacks.EarlyStopping\n    init_args: {patience: 6}\n"
    runs = [([[5.0, 6.0], [4.0, -4.0]], 62, 4.8, [3.0, 0.6, 0.7], 1, "c0"),
            ([[0.0, 0.0], [5.0, 6.0]], 23, 1.6, [6.2, 6.5], 1, "c1"),
            ([[5.0, 6.0], [4.0, -4.5]], 199, 8.0, [0.6], 10, "c0"),
            (None, 50, 3.0, [1.0], 10, "c0")]  # no checkpoint: left out, named
    for seed, (hyps, epoch, leak, losses, every, commit) in enumerate(runs):
        run = client.create_run(experiment, run_name="fl-synthetic-nu5").info.run_id
        for key, value in {"data/thetas": "[[5.0, 6.0], [4.0, -4.5]]", "num_hypotheses": "2", "seed": seed,
                           "versions/lightning-dp-commit": commit}.items():
            client.log_param(run, key, value)
        client.log_text(run, f"trainer:\n  check_val_every_n_epoch: {every}\n{early_stopping}", "config.yaml")
        client.log_metric(run, "epoch", epoch)
        client.log_metric(run, "privacy/client_epsilon_max", leak)
        for step, loss in enumerate(losses):
            client.log_metric(run, "val/loss", loss, step=step)
        folder = tmp_path / f"ckpt{seed}"
        folder.mkdir()
        if hyps is None:
            client.set_terminated(run)
            continue
        if seed == 0:  # the best check's hypotheses are read when RestoreBestWeights logged them, not the last round's
            torch.save({"state_dict": {"hypotheses": torch.tensor(hyps)}}, folder / "best.ckpt")
            client.log_artifact(run, str(folder / "best.ckpt"), "model")
            hyps = [[0.0, 0.0], [0.0, 0.0]]
        torch.save({"state_dict": {"hypotheses": torch.tensor(hyps)}}, folder / "final.ckpt")
        client.log_artifact(run, str(folder / "final.ckpt"), "model")
        client.set_terminated(run)
    other = client.create_run(experiment).info.run_id  # no data/thetas: left out
    client.log_metric(other, "privacy/client_epsilon_max", 9.0)
    client.set_terminated(other)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    report.main(["--tracking-uri", uri])
    out = capsys.readouterr().out
    paper, example = "validate every 1 rounds, patience 6", "validate every 10 rounds, patience 6"
    assert f"| {paper} | " in out and "| 1 | 24 | 1.6 | 6.2 | last round | 0.00, 6.02 |" in out  # [0, 0] is far
    assert "| 0 | 63 | 4.8 | 0.6 | best check | 0.00, 0.50 |" in out
    assert f"{paper}: 2 runs: max client leakage 3.2 ± 2.3 (range 1.6-4.8); rounds 43.5 ± 28 (range 24-63)" in out
    assert f"{paper}: 2 runs:" in out and "every theta* within 1 in 1 of 2" in out
    assert f"{example}: 1 runs: max client leakage 8 (range 8-8); rounds 200 (range 200-200)" in out
    assert "left out: " in out and "MlflowException" in out
    assert f"Note: {paper}: pools runs of different code (lightning-dp-commit c0 / c1)." in out
    assert f"Note: {example}" not in out


LM = ROOT / "lm"


def test_the_lm_fine_tuning_pipeline_runs_from_its_configs(tmp_path, monkeypatch):
    """examples/lm: stage 1 (public pretraining) writes the checkpoint stage 2 starts from; LoRA fine-tuning trains
    only the adapters of exactly those weights, and full fine-tuning loads them too (fixture files, 1 step each)."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import torch

    from lightning_dp.models import LoRA
    from tests.datamodules.test_wikitext import write_fixture

    write_fixture(tmp_path / "data", splits=("valid", "test"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    small = ["--data.init_args.data_dir=data", "--data.init_args.block_size=16", "--data.init_args.vocab_size=40",
             "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"]
    net = "--model.init_args.network.init_args"
    LightningDPCLI(args=["fit", "--config", str(LM / "gpt2_public_pretrain.yaml"), *small, "--trainer.max_epochs=1",
                         f"{net}.vocab_size=40", "--data.init_args.batch_size=8"])
    base = tmp_path / "checkpoints" / "gpt2-wikitext2-public" / "base.ckpt"
    assert base.is_file()
    weights = torch.load(base, weights_only=True)["state_dict"]
    for name in ("dp_lora_wikitext2.yaml", "dp_full_wikitext2.yaml"):
        inner = f"{net}.network.init_args" if "lora" in name else net
        cli = LightningDPCLI(args=["fit", "--config", str(LM / name), *small, f"{inner}.vocab_size=40",
                                   "--trainer.max_epochs=null", "--trainer.max_steps=1",
                                   "--data.init_args.batch_size=4", "--trainer.callbacks.init_args.epochs=null",
                                   "--trainer.callbacks.init_args.max_steps=1"])
        assert cli.trainer.global_step == 1
        network = cli.model.network
        if "lora" in name:
            assert isinstance(network, LoRA)
            base_state = {k.replace(".base_layer", ""): v for k, v in network.network.state_dict().items()
                          if "lora_" not in k}
        else:
            base_state = network.state_dict()
        changed = [k for k, v in base_state.items() if not torch.equal(v, weights[f"network.{k}"])]
        assert (changed == []) == ("lora" in name)  # LoRA: the base weights are the checkpoint's, untouched


_PLAIN_INSTALL = '''
import importlib.abc, json, sys

BLOCKED = ("datasets", "flwr_datasets", "flwr", "transformers", "peft", "opacus")


class NotInstalled(importlib.abc.MetaPathFinder):  # the plain install: no extra is there
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
# libraries that test for an optional package (torchmetrics, Lightning) ask its metadata or find_spec first
import importlib.metadata as metadata, importlib.util as util

_distribution, _find_spec = metadata.distribution, util.find_spec


def distribution(name):
    if name.replace("-", "_").lower() in BLOCKED:
        raise metadata.PackageNotFoundError(name)
    return _distribution(name)


def find_spec(name, package=None):
    return None if name.split(".")[0] in BLOCKED else _find_spec(name, package)


metadata.distribution, util.find_spec = distribution, find_spec
from lightning_dp.commands.errors import is_refusal, root_message
from lightning_dp.commands.fit import LightningDPCLI

results = {}
for config in sys.argv[1:]:
    try:
        LightningDPCLI(run=False, args=["--config", config, "--trainer.logger=false"])
        results[config] = "ok"
    except SystemExit as exit_info:
        results[config] = f"exit {exit_info.code}"
    except Exception as err:
        results[config] = ("refused: " if is_refusal(err) else "BUG: ") + root_message(err)
print("RESULTS " + json.dumps(results))
'''


def test_every_example_instantiates_or_names_its_extra_on_the_plain_install(tmp_path):
    """Walk every example config as the plain install (no datasets, flwr, transformers, peft, opacus): each
    builds, or is refused in one line that says which extra to install; never a traceback."""
    import json
    import os
    import subprocess

    configs = [str(p) for p in EXAMPLES] + [str(p) for p in sorted((ROOT / "lm").glob("*.yaml"))]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    done = subprocess.run([sys.executable, "-c", _PLAIN_INSTALL, *configs], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULTS ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(line[0][len("RESULTS "):])
    needing = {}
    for config, outcome in results.items():
        if outcome == "ok":
            continue
        assert outcome.startswith("refused: ") and "\n" not in outcome, (config, outcome)
        assert "pip install 'lightning-dp[" in outcome, (config, outcome)
        needing[Path(config).name] = outcome
    assert "dpsgd_digits.yaml" not in needing and "fedavg_mnist.yaml" not in needing  # IID needs no extra
    assert "[fl]" in needing["fedavg_dp_mnist.yaml"] and "partition='pathological'" in needing["fedavg_dp_mnist.yaml"]
    assert "[lm]" in needing["dp_lora_wikitext2.yaml"]  # the language models name theirs


def test_oso_fig3_2_frontier_spends_the_same_everywhere_and_redraws(tmp_path):
    """examples/oso/figures.py fig3.2: every (nu_q, nu_g) on a curve composes to its nu (Prop. 1); the chosen
    point is the thesis' 7.124 nu / 1.01 nu; the committed table redraws without calibrating."""
    import csv
    import importlib.util
    import shutil

    from lightning_dp.privacy.adaptive import composed_noise_multiplier

    spec = importlib.util.spec_from_file_location("oso_figures", ROOT / "oso" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    for nu_q, nu_g in figures.frontier(0.845):
        assert composed_noise_multiplier(nu_g, nu_q) == pytest.approx(0.845, rel=1e-12)
    committed = ROOT.parent / "docs" / "figures" / "oso_fig3_2.tsv"
    shutil.copy(committed, tmp_path / "oso_fig3_2.tsv")
    figures.main(["fig3.2", "--out", str(tmp_path), "--replot"])
    assert (tmp_path / "oso_fig3_2.png").stat().st_size > 0
    shutil.copy(committed.with_name("oso_fig3_1.tsv"), tmp_path / "oso_fig3_1.tsv")  # Fig. 3.1 redraws too
    figures.main(["fig3.1", "--out", str(tmp_path), "--replot"])
    assert (tmp_path / "oso_fig3_1.png").stat().st_size > 0
    chosen = [r for r in csv.DictReader(committed.open(), delimiter="\t") if r["chosen"] == "1"]
    assert [float(r["epsilon"]) for r in chosen] == list(figures.EPSILONS)
    for r in chosen:
        assert float(r["nu_q"]) == pytest.approx(7.124 * float(r["nu"]))
        assert float(r["nu_g"]) == pytest.approx(1.01 * float(r["nu"]), rel=1e-3)


def test_oso_grid_figures_read_the_budgeted_grids_from_mlflow_and_redraw(tmp_path, monkeypatch):
    """examples/oso/figures.py fig3.10 / fig3.7: the chosen runs of every budgeted grid whose lr axis has k = 5 / 9
    values (a fake store), grouped by strategy and budget, with the chosen point's axes; grids without a budget, of
    another config, of another k or of another experiment are left out; the committed table redraws."""
    import csv
    import importlib.util
    import shutil

    from mlflow import MlflowClient

    spec = importlib.util.spec_from_file_location("oso_figures", ROOT / "oso" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)  # no global tracking state changed
    experiment = client.create_experiment("oso-mnist-t10k")
    client.create_run(client.create_experiment("another setting"), run_name="grid-x online")  # left out
    k5, k9 = "0.01,0.1,1,10,31.6", "0.003,0.01,0.03,0.1,0.3,1,3,10,31.6"
    for name, budget, accs, lrs in [("online", 5.0, [0.9, 0.92], k5), ("fixed_quantile", 7.0, [0.88], k5),
                                    ("other", 5.0, [0.5], k5), ("online", None, [0.1], k5),
                                    ("fixed_threshold", 5.0, [0.81, 0.83, 0.85], k9)]:
        parent = client.create_run(experiment, run_name=f"grid-{len(accs)}{name[:3]} {name}").info.run_id
        client.log_param(parent, "grid.lr", lrs)
        ids = []
        for acc in accs:
            child = client.create_run(experiment, tags={"mlflow.parentRunId": parent, "grid.lr": "0.1",
                                                        "grid.max_grad_norm": "3.16228"}).info.run_id
            client.log_metric(child, "test/acc", acc)
            ids.append(child)
        if budget is not None:
            client.log_metric(parent, "grid/budget_epsilon", budget)
        client.set_tag(parent, "grid.best_runs", ",".join(ids))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    figures.main(["fig3.10", "--out", str(tmp_path), "--tracking-uri", uri])
    rows = (tmp_path / "oso_fig3_10.tsv").read_text().splitlines()[1:]
    assert sorted((r.split("\t")[0], r.split("\t")[1], round(float(r.split("\t")[3]), 3)) for r in rows) == [
        ("fixed_quantile", "7", 88.0), ("online", "5", 90.0), ("online", "5", 92.0)]
    figures.main(["fig3.7", "--out", str(tmp_path), "--tracking-uri", uri])
    with (tmp_path / "oso_fig3_7.tsv").open() as handle:
        nine = list(csv.DictReader(handle, delimiter="\t"))
    assert sorted(round(float(r["test_acc"]), 3) for r in nine) == [81.0, 83.0, 85.0]
    assert {(r["strategy"], r["epsilon"], r["lr"], r["max_grad_norm"], r["target_quantile"]) for r in nine} == {
        ("fixed_threshold", "5", "0.1", "3.16228", "")}
    assert (tmp_path / "oso_fig3_7.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no budgeted OSO grid with k = 7"):  # and no table is written
        figures.main(["fig3.4", "--out", str(tmp_path), "--tracking-uri", uri])
    assert not (tmp_path / "oso_fig3_4.tsv").exists()
    empty = MlflowClient(f"sqlite:///{tmp_path / 'empty.db'}")
    empty.create_experiment("oso-mnist-t10k")
    with pytest.raises(SystemExit, match="no budgeted OSO grid"):  # and the table written before is kept
        figures.main(["fig3.10", "--out", str(tmp_path), "--tracking-uri", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert (tmp_path / "oso_fig3_10.tsv").read_text().splitlines()[1:] == rows
    for name in ("fig3.10", "fig3.7", "fig3.4"):  # the committed tables redraw
        stem = "oso_" + name.replace(".", "_")
        shutil.copy(ROOT.parent / "docs" / "figures" / f"{stem}.tsv", tmp_path / f"{stem}.tsv")
        figures.main([name, "--out", str(tmp_path), "--replot"])
        assert (tmp_path / f"{stem}.png").stat().st_size > 0


def test_fairness_fig2_6_is_the_configs_data_and_redraws(tmp_path):
    """examples/fairness/figures.py fig2.6: the committed table is the training data of
    examples/fairness/synthetic.yaml (800 / 200 clients of 10 samples); it redraws from the table."""
    import csv
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("fairness_figures", ROOT / "fairness" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    rows = figures.measure_fig2_6()
    committed = ROOT.parent / "docs" / "figures" / "fairness_fig2_6.tsv"
    with committed.open() as handle:
        assert [list(map(str, r)) for r in rows] == list(csv.reader(handle, delimiter="\t"))
    groups = [r[0] for r in rows[1:]]
    assert groups.count(1) == 8000 and groups.count(2) == 2000
    shutil.copy(committed, tmp_path / committed.name)
    figures.main(["fig2.6", "--out", str(tmp_path), "--replot"])
    assert (tmp_path / "fairness_fig2_6.png").stat().st_size > 0


def test_femnist_convergence_overlay_sets_the_thesis_stopping_rule(tmp_path, monkeypatch):
    """examples/femnist/convergence.yaml after fl_femnist.yaml: at most 500 rounds, validation every 5, patience 5
    checks, 10% of the writers held out (the thesis' Table 2.4 setting), the base config's model and round kept."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_dp.callbacks import RestoreBestWeights

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(ROOT / "fl_femnist.yaml"), "--config",
                                          str(ROOT / "femnist" / "convergence.yaml"), "--trainer.logger=false"])
    assert (cli.trainer.max_epochs, cli.trainer.check_val_every_n_epoch) == (500, 5)
    stops = [cb for cb in cli.trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert [(s.patience, s.monitor) for s in stops] == [(5, "val/loss")]
    assert len([cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]) == 1
    assert len([cb for cb in cli.trainer.callbacks if isinstance(cb, RestoreBestWeights)]) == 1
    assert cli.datamodule.hparams.val_fraction == 0.1
    assert (cli.model.hparams.num_hypotheses, cli.model.hparams.clients_per_round) == (2, 10)


def test_femnist_warm_start_overlay_sets_the_public_warm_up(tmp_path, monkeypatch):
    """examples/femnist/warm_start.yaml after fl_femnist.yaml (and convergence.yaml): 20 warm-up rounds, the rest of
    the round and the stopping rule kept."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    cli = LightningDPCLI(run=False, args=["--config", str(ROOT / "fl_femnist.yaml"), "--config",
                                          str(ROOT / "femnist" / "convergence.yaml"), "--config",
                                          str(ROOT / "femnist" / "warm_start.yaml"), "--trainer.logger=false"])
    assert cli.model.warm_start_rounds == 20 and cli.model.hparams.warm_start_rounds == 20
    assert (cli.model.hparams.num_hypotheses, cli.trainer.max_epochs) == (2, 500)


def test_femnist_stated_model_overlay_builds_the_papers_parameter_count(tmp_path, monkeypatch):
    """examples/femnist/stated_model.yaml after fl_femnist.yaml and convergence.yaml: the papers' stated 1,206,590
    parameters (3x3 kernels), the round and the stopping rule kept; the base config alone keeps Table 3's 2x2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    configs = [str(ROOT / "fl_femnist.yaml"), str(ROOT / "femnist" / "convergence.yaml")]
    counts = []
    for extra in ([], [str(ROOT / "femnist" / "stated_model.yaml")]):
        args = [a for config in configs + extra for a in ("--config", config)] + ["--trainer.logger=false"]
        cli = LightningDPCLI(run=False, args=args)
        counts.append(sum(p.numel() for p in cli.model.parameters()))
        assert (cli.model.hparams.num_hypotheses, cli.model.hparams.clients_per_round) == (2, 10)
        assert cli.trainer.max_epochs == 500
    assert counts == [1_400_990, 1_206_590]


def _load_example(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_femnist_split_counts_unanimous_checks_and_one_cluster_rounds(tmp_path):
    """examples/femnist/split.py logs: a check is unanimous when one val/chose_j is 1; a round has one cluster when
    one cluster size is non-zero (either name space); rows without them are neither."""
    split = _load_example("femnist_split", ROOT / "femnist" / "split.py")
    log = tmp_path / "metrics.csv"
    # rounds 0-2, a row without either, then the finished run's final validation and test (epoch 3): not checks
    log.write_text("epoch,nonprivate/cluster_size_0,nonprivate/cluster_size_1,val/chose_0,val/chose_1,step,test/acc\n"
                   "0,10.0,0.0,,,0,\n0,,,1.0,0.0,0,\n1,4.0,6.0,,,1,\n1,,,0.3,0.7,1,\n2,0.0,10.0,,,2,\n2,,,0.0,1.0,2,\n"
                   "2,,,,,2,\n3,,,1.0,0.0,3,\n3,,,,,3,0.5\n")
    assert split.log_split(str(log)) == {"log": str(log), "checks": 3, "unanimous_checks": 2, "rounds": 3,
                                         "one_cluster_rounds": 2}
    assert split.log_split(str(log), from_round=1) == {"log": str(log), "checks": 2, "unanimous_checks": 1,
                                                       "rounds": 2, "one_cluster_rounds": 1}  # after a warm-up
    round_names = tmp_path / "round.csv"
    round_names.write_text("epoch,round/cluster_size_0,round/cluster_size_1\n0,3.0,7.0\n1,0.0,10.0\n")
    assert split.log_split(str(round_names))["one_cluster_rounds"] == 1
    assert split.main(["logs", str(log), str(round_names)]) == 0


def test_femnist_split_of_a_checkpoint_matches_a_loop_over_the_writers(tmp_path, monkeypatch):
    """examples/femnist/split.py checkpoint: each test writer's choice (lowest cross-entropy over the checkpoint's
    hypotheses) by rotation, and each group's accuracy with each hypothesis, against nn.Module forwards of the
    hypotheses loaded with vector_to_parameters."""
    import torch
    import torch.nn.functional as F

    from lightning_dp.datamodules.femnist import FEMNISTDataModule
    from lightning_dp.models import FEMNISTConvNet
    from tests.datamodules.test_federated_femnist import write_leaf

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    split = _load_example("femnist_split", ROOT / "femnist" / "split.py")
    sizes = {f"f{i:04d}_{i:02d}": 4 + i % 3 for i in range(12)}
    write_leaf(tmp_path / "leaf", train_sizes=sizes, test_sizes={w: 2 + i % 2 for i, w in enumerate(sizes)})
    nets = []
    for j in range(2):
        torch.manual_seed(j)
        nets.append(FEMNISTConvNet())
    hypotheses = torch.stack([torch.nn.utils.parameters_to_vector(net.parameters()).detach() for net in nets])
    torch.save({"state_dict": {"hypotheses": hypotheses}}, tmp_path / "run.ckpt")
    # a fit's saved config (its own keys ckpt_path and weights_only beside the model's), a data seed other than 0
    import yaml

    saved = yaml.safe_load((ROOT / "fl_femnist.yaml").read_text())
    saved["data"]["init_args"].update(data_dir=str(tmp_path / "leaf"), val_fraction=0.25, seed=3)
    saved.update(ckpt_path=None, weights_only=None)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    out = split.checkpoint_split(str(tmp_path / "config.yaml"), str(tmp_path / "run.ckpt"), [])

    dm = FEMNISTDataModule(data_dir=str(tmp_path / "leaf"), val_fraction=0.25, seed=3)
    dm.setup("test")
    chose = {"upright": [0, 0], "rotated": [0, 0]}
    correct = {"upright": [0, 0], "rotated": [0, 0]}
    examples = {"upright": 0, "rotated": 0}
    with torch.no_grad():
        for client in dm.clients("test"):
            group = "rotated" if dm.rotated[client.client_id] else "upright"
            logits = [net(client.x) for net in nets]
            chose[group][int(torch.tensor([F.cross_entropy(z, client.y) for z in logits]).argmin())] += 1
            examples[group] += len(client.y)
            for j, z in enumerate(logits):
                correct[group][j] += int((z.argmax(1) == client.y).sum())
    assert sum(map(sum, chose.values())) == 12 and examples["upright"] and examples["rotated"]
    assert out["chose"] == chose
    for group in chose:
        assert out["accuracy"][group] == pytest.approx([c / examples[group] for c in correct[group]], abs=1e-12)


def test_femnist_clustering_compares_the_server_start_with_library_starts(tmp_path, monkeypatch):
    """examples/femnist/clustering.py: simulated rounds from a checkpoint, every noise multiplier and clustering
    reported; the releases' noise is nu times the update (the sanitizer's calibration); without noise the round's
    clustering (from the hypotheses, cluster j = hypothesis j) finds every writer's choice (two initializations far
    apart, small local updates); the geometry is the hypotheses' distance and the updates' norms; without a
    checkpoint the config's initial hypotheses are used (and the warm-up's assignment with ``assigned``); a config
    that is not the d-privacy round with k >= 2 is refused, and so is one without the model's seed and no
    checkpoint."""
    import torch
    import yaml

    from lightning_dp.models import FEMNISTConvNet
    from tests.datamodules.test_federated_femnist import write_leaf

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    clustering = _load_example("femnist_clustering", ROOT / "femnist" / "clustering.py")
    sizes = {f"f{i:04d}_{i:02d}": 4 + i % 3 for i in range(12)}
    write_leaf(tmp_path / "leaf", train_sizes=sizes, test_sizes={w: 2 for w in sizes})
    nets = []
    for j in range(2):
        torch.manual_seed(j)
        nets.append(FEMNISTConvNet())
    hypotheses = torch.stack([torch.nn.utils.parameters_to_vector(net.parameters()).detach() for net in nets])
    torch.save({"state_dict": {"hypotheses": hypotheses}, "epoch": 4}, tmp_path / "run.ckpt")
    saved = yaml.safe_load((ROOT / "fl_femnist.yaml").read_text())
    saved["data"]["init_args"].update(data_dir=str(tmp_path / "leaf"), val_fraction=0.25)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    out = clustering.clustering_rounds(str(tmp_path / "config.yaml"), str(tmp_path / "run.ckpt"), [], rounds=2,
                                       noise=[0.0, 10.0], seed=0, clients=4)
    rows = {(r["noise_multiplier"], r["clustering"]): r for r in out["results"]}
    assert set(rows) == {(nu, m) for nu in (0.0, 10.0) for m in clustering.METHODS}
    assert all(r["rounds"] == 2 and 0.5 <= r["agreement_mean"] <= 1 and 0 <= r["mixed_rounds"] <= 2
               for r in rows.values())
    assert rows[(0.0, "hypotheses")]["agreement_mean"] == 1.0 and rows[(0.0, "hypotheses")]["mixed_rounds"] == 0
    assert rows[(0.0, "random")]["noise_over_update_median"] == 0.0
    # the noise norm is Gamma(n, nu r / n): relative spread 1 / sqrt(n) (n = 1.4 M), so 1e-2 is > 10 std
    assert rows[(10.0, "random")]["noise_over_update_median"] == pytest.approx(10.0, rel=1e-2)
    geometry = out["geometry"]
    assert geometry["hypothesis_distance"] == pytest.approx(float(torch.dist(hypotheses[0].double(),
                                                                             hypotheses[1].double())))
    assert geometry["clients_per_round"] == 4 and geometry["parameters"] == hypotheses.shape[1]
    assert 0 < geometry["update_norm_min"] <= geometry["update_norm_median"] <= geometry["update_norm_max"]
    assert geometry["update_norm_max"] < geometry["hypothesis_distance"] / 10
    # without a checkpoint: the config's initial hypotheses (its model's seed), as the run's first round has them
    from lightning_dp.commands.fit import LightningDPCLI

    initial = LightningDPCLI(run=False, args=["--config", str(tmp_path / "config.yaml"), "--trainer.logger=false"])
    start = initial.model.hypotheses.detach().double()
    out = clustering.clustering_rounds(str(tmp_path / "config.yaml"), None, [], rounds=1, noise=[0.0], seed=0,
                                       clients=2, assigned=True)
    assert out["geometry"]["hypothesis_distance"] == pytest.approx(float(torch.dist(start[0], start[1])))
    assert out["geometry"]["first_round"] == 0 and out["geometry"]["starts"] == "assigned"
    assert {r["clustering"]: r["agreement_mean"] for r in out["results"]}["hypotheses"] == 1.0
    unseeded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    unseeded["model"]["init_args"]["seed"] = None
    (tmp_path / "unseeded.yaml").write_text(yaml.safe_dump(unseeded))
    with pytest.raises(SystemExit, match="model's seed"):
        clustering.clustering_rounds(str(tmp_path / "unseeded.yaml"), None, [], rounds=1, noise=[0.0], seed=0)
    out = clustering.clustering_rounds(str(tmp_path / "unseeded.yaml"), None, ["--model.init_args.seed=0"], rounds=1,
                                       noise=[0.0], seed=0, clients=2, assigned=True)  # the seed given after --
    assert out["geometry"]["hypothesis_distance"] == pytest.approx(float(torch.dist(start[0], start[1])))
    saved["model"]["init_args"]["num_hypotheses"] = 1
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(SystemExit, match="k >= 2"):
        clustering.clustering_rounds(str(tmp_path / "one.yaml"), None, [], rounds=1, noise=[0.0], seed=0, clients=4)


def test_femnist_table2_4_collects_summarizes_and_draws(tmp_path):
    """examples/femnist/table2_4.py: finished runs from their JSON lines; the best check's validation accuracy from
    the run's own CSV log (the check with the lowest val/loss; the final validation and test rows are not checks),
    found by the line's log_dir, else by its number of rounds when the point has a cut attempt's log too;
    unfinished runs kept but out of the means; sample std; a nu the thesis lacks still shows ours."""
    import importlib.util
    import json
    import statistics

    spec = importlib.util.spec_from_file_location("femnist_table", ROOT / "femnist" / "table2_4.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def log(folder, name, text):
        path = tmp_path / folder / name / "version_0"
        path.mkdir(parents=True)
        (path / "metrics.csv").write_text("epoch,train,val/loss,val/acc,test/acc\n" + text)
        return path

    # a finished run of 15 rounds: its best check at round 10, then the restored model's validation and the test
    done = log("csv", "seed_everything=0,noise_multiplier=0",
               "0,1,,,\n4,,2.0,0.5,\n9,,1.5,0.62,\n14,,1.7,0.64,\n14,1,,,\n15,,1.5,0.62,\n15,,,,0.7\n")
    log("cut", "seed_everything=0,noise_multiplier=0", "0,1,,,\n4,,1.0,0.9,\n")  # an earlier attempt, cut
    log("csv", "seed_everything=2,noise_multiplier=10", "0,1,,,\n4,,2.0,0.5,\n9,,1.8,0.55,\n")  # unfinished
    log("cut", "seed_everything=1,noise_multiplier=0", "0,1,,,\n4,,1.0,0.9,\n")  # cut; its rerun has 15 rounds
    log("csv", "seed_everything=1,noise_multiplier=0", "0,1,,,\n4,,2.0,0.5,\n9,,1.6,0.66,\n14,1,,,\n15,,,,0.7\n")
    # seed 1's line names its log relative to the runner's folder (the lines' folder here, not the test's cwd)
    runs = [(0, 0, 0.70, str(done)), (0, 1, 0.74, "csv/seed_everything=1,noise_multiplier=0/version_0"),
            (0, 2, 0.75, None), (10, 0, 0.60, None), (7, 0, 0.5, None)]
    with open(tmp_path / "ce.jsonl", "w") as f:
        for nu, seed, acc, log_dir in runs:
            f.write(json.dumps({"values": {"model.init_args.noise_multiplier": nu, "seed_everything": seed},
                                "epochs": 15, "metrics": {"test/acc": acc}, "log_dir": log_dir,
                                "privacy": {} if nu == 0 else {"client_epsilon_median": 7.0}}) + "\n")
        f.write(json.dumps({"values": {"model.init_args.noise_multiplier": 10, "seed_everything": 1},
                            "error": "RuntimeError: x"}) + "\n")
    out = tmp_path / "t.tsv"
    assert table.main(["collect", "--loss", "cross_entropy", "--jsonl", str(tmp_path / "ce.jsonl"),
                       "--logs", str(tmp_path / "cut"), "--logs", str(tmp_path / "csv"), "--out", str(out)]) == 0
    rows = {(r["nu"], r["seed"]): r for r in table.read(str(out))}
    assert [(k, r["finished"]) for k, r in rows.items()] == [
        (("0", "0"), "1"), (("0", "1"), "1"), (("0", "2"), "1"), (("7", "0"), "1"), (("10", "0"), "1"),
        (("10", "2"), "0")]
    assert (rows[("0", "0")]["best_round"], float(rows[("0", "0")]["val_acc_best"])) == ("10", 0.62)
    assert (rows[("0", "1")]["best_round"], float(rows[("0", "1")]["val_acc_best"])) == ("10", 0.66)
    assert (rows[("10", "2")]["rounds"], rows[("10", "2")]["test_acc"]) == ("10", "")
    # the personalization counts come from the same (chosen) log: these logs have no choices or clusters
    assert (rows[("0", "0")]["checks"], rows[("0", "0")]["logged_rounds"]) == ("0", "0")
    counted = [{"loss": "rmse", "checks": "4", "unanimous_checks": "3", "logged_rounds": "20",
                "one_cluster_rounds": "18"}, {"loss": "rmse", "checks": "2", "unanimous_checks": "2",
                                              "logged_rounds": "10", "one_cluster_rounds": "1"}, {"loss": "rmse"}]
    assert table.personalization(counted, "rmse") == (
        "rmse (2 logs): every validation writer chose one hypothesis at 5 of 6 checks; the k-means put a round's "
        "releases in one cluster in 19 of 30 rounds")
    assert table.personalization(counted, "cross_entropy") is None
    stats = table.summary(list(rows.values()))
    mean, std, n = stats[("cross_entropy", 0.0)]["test_acc"]
    assert (n, mean, std) == (3, statistics.mean([0.70, 0.74, 0.75]), statistics.stdev([0.70, 0.74, 0.75]))
    assert stats[("cross_entropy", 10.0)]["test_acc"][2] == 1  # the unfinished run is not averaged
    text = table.markdown(list(rows.values()))
    assert "| cross_entropy | 10 | 0.692 ± 0.002 | 0.600 (n = 1) | - |" in text
    assert "| cross_entropy | 7 | - | 0.500 (n = 1) | - |" in text  # not in the thesis' table
    assert table.pooled(list(rows.values()), "cross_entropy", "test_acc") is None  # one finished run at nu >= 10
    from scipy import stats as scipy_stats

    low, high = [0.70, 0.74, 0.75, 0.71], [0.60, 0.66, 0.64]
    pool = [{"loss": "rmse", "nu": nu, "finished": "1", "test_acc": str(x)}
            for nu, xs in ((0, low[:2]), (3, low[2:]), (10, high[:2]), (15, high[2:])) for x in xs]
    pool.append({"loss": "rmse", "nu": "0.1", "finished": "1", "test_acc": "0.1"})  # left out below
    pool.append({"loss": "rmse", "nu": "5", "finished": "1", "test_acc": "0.9"})  # in neither side
    p = scipy_stats.ttest_ind(low, high, equal_var=False).pvalue
    assert table.pooled(pool, "rmse", "test_acc", exclude=(0.1,)) == (
        f"rmse test_acc (without nu = 0.1): nu <= 3 {statistics.mean(low):.3f} ± {statistics.stdev(low):.3f} (n = 4), "
        f"nu >= 10 {statistics.mean(high):.3f} ± {statistics.stdev(high):.3f} (n = 3): "
        f"{statistics.mean(low) - statistics.mean(high):.3f} lower, Welch p = {p:.3f}")
    apart = [{"loss": "rmse", "nu": nu, "finished": "1", "test_acc": str(x)}
             for nu, x in ((0, 0.75), (0, 0.751), (3, 0.752), (10, 0.70), (10, 0.701), (15, 0.699))]
    p = scipy_stats.ttest_ind([0.75, 0.751, 0.752], [0.70, 0.701, 0.699], equal_var=False).pvalue
    assert p < 0.001 and table.pooled(apart, "rmse", "test_acc").endswith(f"Welch p = {p:.1e}")  # not 0.000
    table.main(["figure", str(out), str(tmp_path / "t.png")])
    assert (tmp_path / "t.png").stat().st_size > 10_000
    # a point redone elsewhere: --update replaces its row and keeps the loss's other rows (their logs are not here);
    # without it, the loss's rows are the collected ones only
    with open(tmp_path / "redo.jsonl", "w") as f:
        f.write(json.dumps({"values": {"model.init_args.noise_multiplier": 10, "seed_everything": 2}, "epochs": 20,
                            "metrics": {"test/acc": 0.66}, "privacy": {"client_epsilon_median": 7.0}}) + "\n")
    redo = ["collect", "--loss", "cross_entropy", "--jsonl", str(tmp_path / "redo.jsonl"), "--out", str(out)]
    assert table.main(redo + ["--update"]) == 0
    redone = {(r["nu"], r["seed"]): r for r in table.read(str(out))}
    assert list(redone) == list(rows)  # the same points, in the same order
    assert (redone[("10", "2")]["finished"], redone[("10", "2")]["test_acc"]) == ("1", "0.66")
    assert all(redone[k] == rows[k] for k in rows if k != ("10", "2"))
    # a point cut here (a log, no line) does not replace its finished row
    log("again", "seed_everything=1,noise_multiplier=0", "0,1,,,\n4,,2.0,0.5,\n")
    assert table.main(["collect", "--loss", "cross_entropy", "--logs", str(tmp_path / "again"), "--update",
                       "--out", str(out)]) == 0
    assert table.read(str(out)) == list(redone.values())
    assert table.main(redo) == 0
    assert [(r["nu"], r["seed"]) for r in table.read(str(out))] == [("10", "2")]


def test_femnist_table2_4_dimension(tmp_path, capsys):
    """table2_4.py dimension (hypothesis 3): each thesis nu >= 1 beside the nu of ours with the same noise per
    direction under each reading of the paper's model (a count: nu x sqrt(ours / theirs); the larger count drawn
    with the epsilon of the smaller: times their ratio too), with our CNN's true parameter count; the accuracy
    change from nu = 0 of ours at the finished nu within 10 % of it, "not run" elsewhere (a nu with unfinished
    runs only is not run), "-" for a metric the runs lack, no change without nu = 0; a run in two TSVs counts once;
    the figure."""
    import importlib.util
    import math

    from lightning_dp.models import FEMNISTConvNet

    spec = importlib.util.spec_from_file_location("femnist_table", ROOT / "femnist" / "table2_4.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.OUR_PARAMETERS == sum(p.numel() for p in FEMNISTConvNet().parameters())
    assert table.direction_scale(206_590) == math.sqrt(1_400_990 / 206_590)
    # noise drawn in 1,206,590 dimensions at the epsilon of 206,590: 5.84 times the norm, over sqrt(1,206,590)
    assert table.direction_scale(1_206_590, 206_590) == pytest.approx(
        1_206_590 / 206_590 * math.sqrt(1_400_990 / 1_206_590))
    with pytest.raises(ValueError, match="positive"):
        table.direction_scale(1_206_590, 0)

    def row(nu, seed, test, val, finished="1", loss="cross_entropy"):
        return {"loss": loss, "nu": str(nu), "seed": str(seed), "finished": finished, "test_acc": str(test),
                "val_acc_best": str(val)}

    rows = [row(0, 0, 0.75, 0.70), row(0, 1, 0.77, 0.72), row(26, 0, 0.60, 0.55), row(26, 1, 0.62, 0.57),
            row(15, 0, 0.70, 0.66), row(63, 0, "", "", finished="0")]  # nu = 63: an unfinished run only
    text = table.dimension(rows).splitlines()
    assert "| 10 | 0.692, -0.140 | 206,590 parameters | 26.0 (run at 26) | 0.560 ± 0.014 (n = 2), -0.150 | " \
           "0.610 ± 0.014 (n = 2), -0.150 |" in text
    assert "| 15 | 0.561, -0.271 | 1,206,590 parameters | 16.2 (run at 15) | 0.660 (n = 1), -0.050 | " \
           "0.700 (n = 1), -0.060 |" in text
    assert "| 15 | 0.561, -0.271 | 206,590 parameters | 39.1 | not run | not run |" in text
    assert "| 10 | 0.692, -0.140 | 1,206,590 drawn, epsilon from 206,590 | 62.9 | not run | not run |" in text
    assert not any(line.startswith("| 0.1 |") for line in text)  # nu < 1: the flat range under every reading
    # no nu = 0 of ours: no change; a metric the runs lack: "-"
    lacking = [dict(row(26, 0, 0.60, 0.55), val_acc_best="")]
    assert "| 10 | 0.692, -0.140 | 206,590 parameters | 26.0 (run at 26) | - | 0.600 (n = 1) |" in \
        table.dimension(lacking).splitlines()
    tsv, again = tmp_path / "d.tsv", tmp_path / "again.tsv"
    tsv.write_text("\t".join(rows[0]) + "\n" + "".join("\t".join(r.values()) + "\n" for r in rows))
    again.write_text("\t".join(rows[0]) + "\n" + "\t".join(rows[2].values()) + "\n")  # seed 0 at 26 again
    assert table.main(["dimension", str(tsv), str(again)]) == 0
    assert "| 10 | 0.692, -0.140 | 206,590 parameters | 26.0 (run at 26) | 0.560 ± 0.014 (n = 2), -0.150 |" in \
        capsys.readouterr().out
    rmse = [row(0, 0, 0.76, 0.73, loss="rmse"), row(26, 0, 0.70, 0.68, loss="rmse")]
    assert "| 10 | 0.687, -0.114 | 206,590 parameters | 26.0 (run at 26) | 0.680 (n = 1), -0.050 | " \
           "0.700 (n = 1), -0.060 |" in table.dimension(rmse, "rmse").splitlines()
    assert table.main(["dimension", str(tsv), "--png", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 10_000


@pytest.mark.parametrize("script, tsv, page", [
    ("fedavg_cosine_table.py", "fedavg_cosine_fig5_4.tsv", "results_dp_fedavg.md"),
    ("fairness/fig2_7_table.py", "fairness_fig2_7.tsv", "results_fairness.md"),
    ("fl_synthetic_table.py", "fl_synthetic_fig2_1.tsv", "results_fl_synthetic.md")])
def test_committed_per_seed_tables_give_their_pages_numbers(script, tsv, page, capsys):
    """The per-seed TSVs of issue 54 (thesis Figs. 5.4, 2.7 and 2.1 without noise): the mean ± std table their script
    prints from the TSV alone is the one on the results page, row for row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    docs = ROOT.parent / "docs"
    report.main(["--from-tsv", str(docs / "figures" / tsv)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and " ± " in line]
    text = (docs / page).read_text()
    assert rows and [row for row in rows if row not in text] == []


def test_fl_synthetic_table_places_one_hypothesis_on_the_segment_between_the_thetas():
    """examples/fl_synthetic_table.py (thesis Fig. 2.1 without noise): FedAvg's one hypothesis is located along the
    segment theta1* -> theta2* (0 at theta1*, 1 at theta2*), off its line, and against the nearer theta*."""
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("fl_synthetic_table", ROOT / "fl_synthetic_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    thetas = np.array([[5.0, 6.0], [4.0, -4.5]])
    assert table.segment_geometry(thetas[0], thetas) == pytest.approx((0.0, 0.0, 0.0))
    middle = thetas.mean(0)
    assert table.segment_geometry(middle, thetas) == pytest.approx((0.5, 0.0, np.hypot(0.5, 5.25)))
    normal = np.array([10.5, -1.0]) / np.hypot(10.5, 1.0)  # perpendicular to theta2* - theta1* = (-1, -10.5)
    position, offset, _ = table.segment_geometry(middle + 0.3 * normal, thetas)
    assert (position, offset) == pytest.approx((0.5, 0.3))
    assert table._sig(130.2, 2) == "130" and table._sig(0.0503, 2) == "0.050" and table._sig(5.234, 3) == "5.23"
