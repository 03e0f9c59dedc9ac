"""OneRunAudit inside DPSGD runs: the canary slots keep N and q independent of the coins, excluded canaries never
train, the bound stays below the accounted epsilon of a correct run and far above it when the noise is removed
(white-box and black-box), metrics sit beside privacy/epsilon with each bound's ceiling (and say when the claim is
out of the audit's reach), state survives a checkpoint, bad set-ups refuse."""

from __future__ import annotations

import csv
import math

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.audit.canaries import ABSENT, CanaryDataset, DropAbsent, draw_inclusions, make_input_canaries
from lightning_dp.callbacks import DPSGD, OneRunAudit
from lightning_dp.callbacks.faults import NoiselessDPSGD
from lightning_dp.models import ImageClassifier

N = 512


def _sparse_data():
    """Only 5 of 200 input features vary: most weights get no gradient, so a Dirac canary there is clean."""
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(N, 200)
    x[:, :5] = torch.randn(N, 5, generator=g)
    return x, (x[:, 0] > 0).long()


def _dense_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 20, generator=g)
    return x, (x[:, 0] > 0).long()


def _fit(kind, *, broken=False, sigma=1.0, epochs=4, lr=0.5, logger=False, num_canaries=None, seed=2,
         methods=("steinke",), root=None):
    torch.manual_seed(0)
    if kind == "gradient":
        (x, y), net = _sparse_data(), torch.nn.Linear(200, 2)
    else:
        (x, y), net = _dense_data(), torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                                         torch.nn.Linear(64, 2))
    model = ImageClassifier(net, num_classes=2, lr=lr, optimizer="sgd")
    dp = (NoiselessDPSGD if broken else DPSGD)(noise_multiplier=sigma, max_grad_norm=1.0, seed=1)
    audit = OneRunAudit(num_canaries=num_canaries or (256 if kind == "gradient" else 200), canary=kind, seed=seed,
                        methods=methods)
    trainer = L.Trainer(max_epochs=epochs, callbacks=[dp, audit], logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64))
    return dp, audit, model


def test_canary_slots_and_dropped_absent_canaries():
    base = TensorDataset(torch.arange(6.0).view(6, 1), torch.zeros(6, dtype=torch.long))
    canaries = [(torch.tensor([100.0 + i]), torch.tensor(1)) for i in range(4)]
    data = CanaryDataset(base, canaries, [True, False, True, False])
    assert len(data) == 10 and data[7] is ABSENT and data[6][0].item() == 100.0 and data[-2][0].item() == 102.0
    collate = DropAbsent(torch.utils.data.default_collate, data)
    x, y = collate([data[0], data[7], data[8]])
    assert x.view(-1).tolist() == [0.0, 102.0]
    x, y = collate([data[7], data[9]])  # only empty slots: an empty batch with the real structure
    assert x.shape == (0, 1) and y.shape == (0,)


def test_inclusions_are_fair_coins_and_input_canaries_are_wrongly_labelled():
    bits = draw_inclusions(4000, seed=5)
    assert abs(bits.mean() - 0.5) < 4 * 0.5 / np.sqrt(4000)  # four standard errors
    assert (draw_inclusions(4000, seed=5) == bits).all() and not (draw_inclusions(4000, seed=6) == bits).all()
    x, y = _dense_data()
    base = TensorDataset(x, y)
    canaries = make_input_canaries(base, 50, kind="mislabeled", num_classes=2, seed=1)
    rows = {tuple(x[i].tolist()): int(y[i]) for i in range(N)}
    assert all(rows[tuple(cx.tolist())] != int(cy) for cx, cy in canaries)  # a training input with another label
    noise = make_input_canaries(base, 30, kind="random_inputs", num_classes=2, seed=1)
    assert noise[0][0].shape == x[0].shape and noise[0][1].dtype == y.dtype
    tokens = make_input_canaries([torch.zeros(8, dtype=torch.long)], 3, kind="random_inputs", num_classes=11, seed=1)
    assert tokens[0].shape == (8,) and tokens[0].dtype == torch.long and int(tokens[0].max()) < 11
    with pytest.raises(ValueError, match="num_classes"):
        make_input_canaries(base, 3, kind="mislabeled", num_classes=None, seed=1)


def test_the_sampling_rate_counts_every_slot_whatever_the_coins():
    rates = []
    for seed in (2, 3):
        dp, audit, _ = _fit("mislabeled", epochs=1, seed=seed)
        rates.append(dp.sample_rate)
        assert audit.result.included != 0
    assert rates[0] == rates[1] == 64 / (N + 200)


def test_excluded_canaries_never_reach_a_training_step():
    seen = []

    class Recorder(ImageClassifier):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0].detach().clone())
            return super().training_step(batch, batch_idx)

    (x, y) = _dense_data()
    model = Recorder(torch.nn.Linear(20, 2), num_classes=2, lr=0.1, optimizer="sgd")
    audit = OneRunAudit(num_canaries=100, canary="random_inputs", seed=4, methods=("steinke",))
    trainer = L.Trainer(max_epochs=3, callbacks=[DPSGD(noise_multiplier=1.0, seed=1), audit], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64))
    rows = {tuple(r.tolist()) for b in seen for r in b}
    inputs = [tuple(c[0].tolist()) for c in audit._canaries]
    included = audit._included
    assert not any(inputs[i] in rows for i in np.flatnonzero(~included))
    assert sum(inputs[i] in rows for i in np.flatnonzero(included)) > 0.8 * included.sum()


def test_white_box_bound_is_below_the_accounted_epsilon_of_a_correct_run_and_catches_a_noiseless_one():
    dp, audit, _ = _fit("gradient", sigma=1.0, methods=("steinke", "fdp_accounted"))
    assert 0 < dp.epsilon
    assert max(audit.result.epsilon.values()) <= dp.epsilon
    dp, audit, _ = _fit("gradient", broken=True, sigma=4.0, methods=("steinke", "fdp_accounted"))
    assert dp.epsilon < 1.0  # what the broken run claims
    assert audit.result.epsilon["steinke"] > 1.5 > 1.5 * dp.epsilon
    assert audit.result.epsilon["fdp_accounted"] > 3 * dp.epsilon
    for name, bound in audit.result.epsilon.items():  # even a broken run's bounds stay under the audit's ceiling
        assert bound <= audit.result.ceiling.epsilon[name]


def test_black_box_bound_catches_a_noiseless_run_and_respects_a_correct_one():
    dp, audit, _ = _fit("mislabeled", broken=True, sigma=20.0, epochs=60, lr=5.0)
    assert dp.epsilon < 0.5
    assert audit.result.epsilon["steinke"] > 2 * dp.epsilon
    dp, audit, _ = _fit("mislabeled", sigma=1.0, epochs=20, lr=5.0)
    assert audit.result.epsilon["steinke"] <= dp.epsilon


def _audit_row(logger) -> dict[str, float]:
    """The CSV row holding the audit's metrics."""
    with open(logger.experiment.metrics_file_path) as handle:
        rows = list(csv.DictReader(handle))
    (row,) = [r for r in rows if r.get("audit/epsilon_lower_bound")]
    return {k: float(v) for k, v in row.items() if v != ""}


def test_metrics_beside_privacy_epsilon_and_state_round_trip(tmp_path, capsys):
    logger = CSVLogger(tmp_path, name="audit")
    dp, audit, _ = _fit("gradient", epochs=2, logger=logger, root=tmp_path,
                        methods=("steinke", "fdp_gaussian", "fdp_accounted"))
    with open(logger.experiment.metrics_file_path) as handle:
        columns = set(next(csv.reader(handle)))
    for name in ("privacy/epsilon", "audit/epsilon_lower_bound", "audit/epsilon_lower_bound_fdp",
                 "audit/epsilon_lower_bound_gdp", "audit/epsilon_accounted", "audit/canary_auc", "audit/guesses",
                 "audit/epsilon_ceiling", "audit/epsilon_ceiling_fdp", "audit/epsilon_ceiling_gdp",
                 "audit/claim_above_ceiling"):
        assert name in columns
    # each ceiling beside its bound, above it, and the one of epsilon_ceiling for the run's m and mechanism
    row = _audit_row(logger)
    for suffix in ("", "_fdp", "_gdp"):
        assert row[f"audit/epsilon_lower_bound{suffix}"] <= row[f"audit/epsilon_ceiling{suffix}"]
    from lightning_dp.audit.one_run import epsilon_ceiling

    assert row["audit/epsilon_ceiling"] == pytest.approx(epsilon_ceiling(256, delta=dp.target_delta).epsilon["steinke"])
    # the claim (epsilon 4.0) is above Steinke et al.'s ceiling with 256 canaries (3.8), but the f-DP test against the
    # run's curve could still refute it: the audit as a whole has the power, and says which method has it
    ceiling = audit.result.ceiling
    assert ceiling.epsilon["steinke"] < dp.epsilon < ceiling.epsilon["fdp_accounted"]
    assert row["audit/claim_above_ceiling"] == 0.0
    out = capsys.readouterr().out
    assert f"steinke            {audit.result.epsilon['steinke']:.3f} (ceiling {ceiling.epsilon['steinke']:.3f} with " \
           "256 canaries; the claim is above it)" in out
    assert f"fdp_accounted      {audit.result.epsilon['fdp_accounted']:.3f} (ceiling " \
           f"{ceiling.epsilon['fdp_accounted']:.3f} with 256 canaries; the claim is below it)" in out
    assert "claim              not refuted (within reach of fdp_accounted: a perfect attack" in out
    state = audit.state_dict()
    other = OneRunAudit(num_canaries=256, canary="gradient")
    other.load_state_dict(state)
    assert other._seed == audit._seed and (other._included == audit._included).all()
    assert np.array_equal(other._gradient.scores, audit._gradient.scores)
    assert other.state_key == audit.state_key


def test_too_few_canaries_say_that_not_refuted_carries_no_information(tmp_path, capsys):
    """16 canaries: Steinke et al.'s bound can never exceed about 1 (every guess correct), below the run's claim."""
    logger = CSVLogger(tmp_path, name="audit")
    dp, audit, _ = _fit("gradient", epochs=1, logger=logger, root=tmp_path, num_canaries=16)
    ceiling = audit.result.ceiling.epsilon["steinke"]
    assert audit.result.epsilon["steinke"] <= ceiling < dp.epsilon
    row = _audit_row(logger)
    assert row["audit/claim_above_ceiling"] == 1.0 and row["audit/claim_refuted"] == 0.0
    assert row["audit/epsilon_ceiling"] == pytest.approx(ceiling)
    out = capsys.readouterr().out
    assert f"(ceiling {ceiling:.3f} with 16 canaries; the claim is above it)" in out
    assert "not refuted, which carries no information" in out


def test_a_budgeted_plan_counts_the_canary_slots():
    x, y = _dense_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    dp = DPSGD(noise_multiplier=1.0, epochs=2)
    trainer = L.Trainer(max_epochs=2, callbacks=[dp, OneRunAudit(num_canaries=200)], logger=False,
                        enable_checkpointing=False)
    plan = dp.plan(trainer, loader)
    assert plan.sample_rate == 64 / (N + 200) and plan.events == 2 * math.ceil((N + 200) / 64)
    white = L.Trainer(max_epochs=2, callbacks=[dp, OneRunAudit(num_canaries=200, canary="gradient")], logger=False,
                      enable_checkpointing=False)
    assert dp.plan(white, loader).sample_rate == 64 / N  # gradient canaries add no slot


def test_resumed_audit_equals_the_uninterrupted_one(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(epochs, ckpt=None, save=False):
        torch.manual_seed(0)
        (x, y), net = _sparse_data(), torch.nn.Linear(200, 2)
        model = ImageClassifier(net, num_classes=2, lr=0.5, optimizer="sgd")
        audit = OneRunAudit(num_canaries=64, canary="gradient", seed=2, methods=("steinke",))
        callbacks = [DPSGD(noise_multiplier=1.0, seed=1), audit]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, save_last=True))
        trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=save,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64), ckpt_path=ckpt)
        return audit

    whole = run(4)
    run(2, save=True)
    resumed = run(4, ckpt=str(tmp_path / "last.ckpt"))
    assert (resumed._included == whole._included).all()
    assert resumed._gradient.steps == whole._gradient.steps
    np.testing.assert_allclose(resumed._gradient.scores, whole._gradient.scores, rtol=1e-5, atol=1e-7)
    assert resumed.result.epsilon == whole.result.epsilon


def test_refusals():
    x, y = _dense_data()
    model = ImageClassifier(torch.nn.Linear(20, 2), num_classes=2)
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    kwargs = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    with pytest.raises(MisconfigurationException, match="exactly one"):
        L.Trainer(callbacks=[OneRunAudit(num_canaries=10)], **kwargs).fit(model, loader)
    with pytest.raises(MisconfigurationException, match="add_remove"):
        L.Trainer(callbacks=[DPSGD(noise_multiplier=1.0, poisson_sampling=False), OneRunAudit(num_canaries=10)],
                  **kwargs).fit(model, loader)
    with pytest.raises(MisconfigurationException, match="equals DPSGD's seed"):
        L.Trainer(callbacks=[DPSGD(noise_multiplier=1.0, seed=5), OneRunAudit(num_canaries=10, seed=5)],
                  **kwargs).fit(model, loader)
    with pytest.raises(MisconfigurationException, match="42 trainable parameters"):
        L.Trainer(callbacks=[DPSGD(noise_multiplier=1.0), OneRunAudit(num_canaries=100, canary="gradient")],
                  **kwargs).fit(model, loader)
    for bad, match in (({"num_canaries": 1}, "num_canaries"), ({"canary": "poison"}, "canary"),
                       ({"confidence": 1.0}, "confidence"), ({"methods": ("x",)}, "methods"),
                       ({"candidates": [(0, 0)]}, "candidates")):
        with pytest.raises(ValueError, match=match):
            OneRunAudit(**bad)


def test_the_audit_seed_is_a_secret():
    """The seed draws the inclusion bits and the canaries' sampling coins: kept under the secret key of the callback's
    state (resume only) and redacted from logged configs; a checkpoint from before keeps loading."""
    from lightning_dp.cli import redact_secrets
    from lightning_dp.privacy.seeds import SECRET_KEY, strip_secrets

    audit = OneRunAudit(num_canaries=8, seed=5)
    audit._seed = 5
    state = audit.state_dict()
    assert state[SECRET_KEY] == {"seed": 5} and "seed" not in strip_secrets(state)
    text = ("trainer:\n  callbacks:\n  - class_path: lightning_dp.callbacks.OneRunAudit\n    init_args:\n"
            "      num_canaries: 8\n      seed: 5\n")
    assert "seed: null" in redact_secrets(text) and "seed: 5" not in redact_secrets(text)
    old = OneRunAudit(num_canaries=8)
    old.load_state_dict({"seed": 7, "included": None, "gradient": None})
    assert old._seed == 7
    assert old.privacy_spend() == []  # its canaries are accounted by the audited DPSGD
