"""Membership-inference experiment pieces: the member split, attack metrics against closed forms, epsilon along the
ROC, and ``lightning-dp audit mia`` end to end on WikiText-2 fixture files (every attack's metrics, figures and
the linked target run in MLflow; bad settings refused before any run opens)."""

from __future__ import annotations

import math
import random

import mlflow
import numpy as np
import pytest
from scipy.stats import norm

from lightning_dp import cli
from lightning_dp.audit.mia import FPRS, attack_result, epsilon_vs_fpr, split_members, table


def test_the_split_is_a_seeded_partition_with_the_asked_fractions():
    s = split_members(1000, member_fraction=0.6, calibration_fraction=0.2, seed=3)
    parts = [s.calibration_members, s.calibration_nonmembers, s.members, s.nonmembers]
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(1000))
    assert len(s.training) == 600 and len(s.calibration_members) == 120 and len(s.calibration_nonmembers) == 80
    assert (s.evaluation[: len(s.members)] == s.members).all()
    again = split_members(1000, member_fraction=0.6, calibration_fraction=0.2, seed=3)
    assert all((a == b).all() for a, b in zip(parts, [again.calibration_members, again.calibration_nonmembers,
                                                       again.members, again.nonmembers]))
    with pytest.raises(ValueError, match="member_fraction"):
        split_members(100, member_fraction=1.0)
    with pytest.raises(ValueError, match="at least 10"):
        split_members(5)


def test_attack_metrics_match_the_gaussian_closed_forms():
    rng = np.random.default_rng(0)
    mu, n = 1.0, 50_000
    result = attack_result("x", rng.normal(mu, 1, n), rng.normal(0, 1, n), forward_passes=2 * n, seconds=1.0)
    assert result.curve.auc == pytest.approx(norm.cdf(mu / math.sqrt(2)), abs=6e-3)
    for f in FPRS[1:]:  # TPR at FPR f of two unit Gaussians: 1 - Phi(Phi^-1(1 - f) - mu)
        assert result.tpr[f] == pytest.approx(1 - norm.cdf(norm.ppf(1 - f) - mu), abs=0.01)
    metrics = result.metrics()
    assert {"audit/auc/x", "audit/epsilon/x", "audit/tpr_at_fpr_0.001/x", "audit/cost/forward_passes/x"} <= set(metrics)
    fpr, point, lower = epsilon_vs_fpr(result)
    keep = (result.curve.fpr > 0) & (result.curve.tpr < 1)
    tpr = result.curve.tpr[keep]
    i = np.searchsorted(fpr, 0.1)
    assert point[i] == pytest.approx(max(math.log(tpr[i] / fpr[i]), math.log((1 - fpr[i]) / (1 - tpr[i]))), rel=1e-9)
    assert (lower <= point + 1e-9).all()
    assert f"| x | {result.curve.auc:.4f} |" in table([result])


WORDS = [f"w{i}" for i in range(40)]


def _write_wikitext(folder):
    rng = random.Random(0)
    for split in ("valid", "test"):
        lines = [" " + " ".join(rng.choice(WORDS) for _ in range(30)) + " " for _ in range(60)]
        (folder / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _args(folder, *extra):
    return ["audit", "mia",
            "--model=lightning_dp.models.CausalLanguageModel",
            "--model.init_args.network=lightning_dp.models.GPT2",
            "--model.init_args.network.init_args.vocab_size=45",
            "--model.init_args.network.init_args.max_positions=16",
            "--model.init_args.network.init_args.embed_dim=16",
            "--model.init_args.network.init_args.num_layers=1",
            "--model.init_args.network.init_args.num_heads=2",
            "--data=lightning_dp.datamodules.WikiText2DataModule",
            f"--data.init_args.data_dir={folder}", "--data.init_args.block_size=16",
            "--data.init_args.vocab_size=45", "--data.init_args.train_file=valid", "--data.init_args.val_file=null",
            "--trainer={max_epochs: 2}", "--batch_size=16", "--num_shadows=2", "--num_neighbours=2",
            "--sigma_grid=3", "--sigma_iterations=1", "--experiment_name=mia-test", "--run_name=tiny", *extra]


def test_the_command_logs_every_attack_beside_a_linked_target_run(tmp_path, monkeypatch):
    _write_wikitext(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    # the target and shadows train with DP-SGD: its seed, a secret, must not reach the logged config
    dpsgd = "--callbacks=[{class_path: lightning_dp.callbacks.DPSGD, init_args: {noise_multiplier: 0.5, seed: 123}}]"
    assert cli.main(_args(tmp_path, dpsgd)) in (0, None)
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("mia-test")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    audit, target = runs["tiny"], runs["tiny-target"]
    metrics = audit.data.metrics
    for attack in ("loss", "shadow", "noisy"):
        assert 0 <= metrics[f"audit/auc/{attack}"] <= 1
        assert f"audit/tpr_at_fpr_0.01/{attack}" in metrics and f"audit/cost/forward_passes/{attack}" in metrics
    assert metrics["audit/noisy/sigma"] > 0 and "audit/cost/ratio_forward_passes" in metrics
    assert metrics["audit/cost/training_forward_passes/shadow"] > 0  # 2 shadows x 2 epochs x their halves
    assert audit.data.tags["audit/target_run_id"] == target.info.run_id
    assert target.data.tags["audit/audit_run_id"] == audit.info.run_id
    history = client.get_metric_history(audit.info.run_id, "audit/noisy/auc_vs_sigma")
    assert len(history) == 4  # 3 grid sigmas + 1 golden-section step
    config = client.download_artifacts(audit.info.run_id, "config.yaml", str(tmp_path))
    text = open(config).read()
    assert "seed: 123" not in text and "redacted" in text
    assert "privacy/epsilon" in target.data.metrics
    files = {f.path for f in client.list_artifacts(audit.info.run_id, "audit")}
    assert {"audit/roc.png", "audit/roc_loglog.png", "audit/auc_vs_sigma.png", "audit/epsilon_vs_fpr.png",
            "audit/mia.md", "audit/scores.tsv"} <= files


def test_bad_settings_are_refused_before_a_run_opens(tmp_path, monkeypatch, capsys):
    _write_wikitext(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(SystemExit):
        cli.main(_args(tmp_path, "--attacks=[shadow, magic]", "--num_shadows=3"))
    err = capsys.readouterr().err
    assert "--attacks" in err and "magic" in err and "--num_shadows=3" in err
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("mia-test") is None


def test_an_attack_is_one_registered_class_and_runs_beside_the_others(tmp_path, monkeypatch):
    """A membership attack is a registered part producing scores: the command logs it as it logs the built-in ones."""
    from lightning_dp.audit.attacks import AttackScores, MembershipAttack, register_attack, resolve_attacks

    @register_attack("confidence_test")
    class Confidence(MembershipAttack):
        def run(self, setting):
            n = setting.split.members.size
            scores = -setting.target_losses
            return AttackScores(scores[:n], scores[n:], forward_passes=0, seconds=0.0, note="confidence attack")

    assert [a.name for a in resolve_attacks(["confidence_test", "loss"])] == ["loss", "confidence_test"]
    with pytest.raises(ValueError, match="Did you mean 'shadow'"):
        resolve_attacks(["shadw"])
    _write_wikitext(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    assert cli.main(_args(tmp_path, "--attacks=[loss, confidence_test]")) in (0, None)
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("mia-test")
    audit = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}["tiny"]
    metrics = audit.data.metrics
    assert metrics["audit/auc/confidence_test"] == metrics["audit/auc/loss"]  # the same scores, logged alike
    assert "audit/auc/shadow" not in metrics
