"""LiRA: the logit confidence against its definition, the inclusion masks' halves, the online and offline scores
against a per-example scipy loop, the closed-form AUC of a synthetic Gaussian case, and shadow models trained with
Lightning (shape, overfitting, reproducibility, the caller's RNG untouched)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm
from torch.utils.data import TensorDataset

from lightning_dp.audit.lira import (
    inclusion_masks,
    lira_from_losses,
    lira_scores,
    logit_confidence,
    train_shadow_models,
)
from lightning_dp.audit.statistics import roc

pytestmark = pytest.mark.usefixtures("one_thread")


def test_logit_confidence_is_the_logit_of_the_true_label_probability_and_stays_finite():
    losses = np.array([0.01, 0.1, 0.5, math.log(2), 1.0, 3.0, 10.0])
    p = np.exp(-losses)
    np.testing.assert_allclose(logit_confidence(losses), np.log(p / (1 - p)), rtol=1e-9)
    assert logit_confidence(math.log(2)) == pytest.approx(0.0, abs=1e-12)  # p = 1/2
    extreme = logit_confidence([0.0, 1e-300, 1e-12, 800.0, 1e5])
    assert np.isfinite(extreme).all()
    assert extreme[2] == pytest.approx(-math.log(1e-12), rel=1e-9)  # phi ~ -log l for tiny losses
    assert extreme[3] == pytest.approx(-800.0) and extreme[4] == pytest.approx(-1e5)  # phi ~ -l for huge ones
    assert (np.diff(extreme) < 0).all()  # decreasing in the loss, 0 included
    for bad in ([-0.1], [np.nan], [np.inf]):
        with pytest.raises(ValueError, match="losses must be finite"):
            logit_confidence(bad)


def test_inclusion_masks_put_every_example_in_exactly_half_of_the_shadows():
    masks = inclusion_masks(100, 8, seed=3)
    assert masks.shape == (8, 100) and masks.dtype == np.bool_
    assert (masks.sum(0) == 4).all()
    assert 30 <= masks.sum(1).min() and masks.sum(1).max() <= 70  # each shadow trains on about half the data
    np.testing.assert_array_equal(masks, inclusion_masks(100, 8, seed=3))
    assert not np.array_equal(masks, inclusion_masks(100, 8, seed=4))
    for (num_examples, num_shadows, seed), match in (((0, 4, 0), "num_examples"), ((10, 3, 0), "even"),
                                                     ((10, 0, 0), "num_shadows"), ((10, 2.0, 0), "num_shadows"),
                                                     ((10, 4, -1), "seed")):
        with pytest.raises(ValueError, match=match):
            inclusion_masks(num_examples, num_shadows, seed=seed)


def _synthetic(num_examples, num_shadows, seed):
    """Statistics with an example offset c_n ~ N(0, 3^2): IN ~ N(c_n + 1, 1), OUT ~ N(c_n, 1); half the targets IN."""
    rng = np.random.default_rng(seed)
    masks = inclusion_masks(num_examples, num_shadows, seed=seed)
    offset = rng.normal(0.0, 3.0, num_examples)
    shadow = offset + masks + rng.normal(0.0, 1.0, masks.shape)
    member = rng.random(num_examples) < 0.5
    target = offset + member + rng.normal(0.0, 1.0, num_examples)
    return target, shadow, masks, member


def _naive(target, shadow, masks, *, online, fixed_variance):
    """A per-example loop with scipy's normal distribution."""
    n = shadow.shape[1]
    if fixed_variance:
        pooled = {}
        for side in (True, False):
            squares = dof = 0.0
            for j in range(n):
                values = shadow[masks[:, j] == side, j]
                squares += ((values - values.mean()) ** 2).sum()
                dof += values.size - 1
            pooled[side] = math.sqrt(squares / dof)
    scores = []
    for j in range(n):
        inside, outside = shadow[masks[:, j], j], shadow[~masks[:, j], j]
        s_in = pooled[True] if fixed_variance else inside.std()
        s_out = pooled[False] if fixed_variance else outside.std()
        if online:
            scores.append(norm.logpdf(target[j], inside.mean(), s_in) - norm.logpdf(target[j], outside.mean(), s_out))
        else:
            scores.append(-norm.logsf(target[j], outside.mean(), s_out))  # minus log p-value of "above OUT"
    return np.array(scores)


@pytest.mark.parametrize("fixed_variance", [False, True])
@pytest.mark.parametrize("online", [True, False])
def test_lira_scores_equal_a_per_example_scipy_loop(online, fixed_variance):
    target, shadow, masks, _ = _synthetic(50, 8, seed=0)
    got = lira_scores(target, shadow, masks, online=online, fixed_variance=fixed_variance)
    np.testing.assert_allclose(got, _naive(target, shadow, masks, online=online, fixed_variance=fixed_variance),
                               rtol=1e-9, atol=1e-9)


def test_the_offline_score_is_increasing_in_the_statistic_and_resolves_strong_members():
    masks = inclusion_masks(1, 4, seed=0)
    shadow = np.array([[0.0], [1.0], [-1.0], [0.5]])
    phis = np.array([-5.0, 0.0, 5.0, 40.0, 45.0])
    scores = [lira_scores([phi], shadow, masks, online=False)[0] for phi in phis]
    assert (np.diff(scores) > 0).all()  # 40 and 45 sigma above the OUT mean stay distinct (log Phi would round to 0)


def test_the_online_auc_reaches_the_closed_form_despite_per_example_offsets():
    """IN ~ N(c_n + 1, 1) and OUT ~ N(c_n, 1) with offsets c_n ~ N(0, 9): the likelihood ratio is phi - c_n - 1/2, whose
    AUC is P(N(1, 2) > 0) = Phi(1/sqrt 2) = 0.7602; the raw statistic only reaches Phi(1/sqrt 20) = 0.587. With 10^4
    targets the AUC's standard error is about 0.005 (the oracle score phi - c_n gives 0.7557 on this sample) and
    estimating the Gaussians from 32 + 32 shadows costs about 0.01 more (measured: 0.747 with per-example stds, 0.751
    fixed): tolerance 0.02 (a fixed seed, so no false failures; over seeds a failure needs a 2-3 standard-error
    draw, roughly 1 in 100)."""
    target, shadow, masks, member = _synthetic(10_000, 64, seed=1)
    best = norm.cdf(1 / math.sqrt(2))
    for fixed_variance in (False, True):
        scores = lira_scores(target, shadow, masks, fixed_variance=fixed_variance)
        assert roc(scores[member], scores[~member]).auc == pytest.approx(best, abs=0.02)
    offline = lira_scores(target, shadow, masks, online=False, fixed_variance=True)
    assert roc(offline[member], offline[~member]).auc == pytest.approx(best, abs=0.02)  # equal variances: same test
    assert roc(target[member], target[~member]).auc == pytest.approx(norm.cdf(1 / math.sqrt(20)), abs=0.02)


def test_missing_sides_fail_clearly_online_and_offline_needs_only_out_shadows():
    target, shadow, masks, _ = _synthetic(6, 4, seed=2)
    masks = masks.copy()
    masks[:, 2] = False  # example 2 was never IN
    with pytest.raises(ValueError, match=r"1 example\(s\) \(indices \[2\]\) have no IN shadow"):
        lira_scores(target, shadow, masks)
    assert np.isfinite(lira_scores(target, shadow, masks, online=False)).all()
    masks[:, 3] = True  # example 3 was never OUT
    with pytest.raises(ValueError, match=r"indices \[3\]\) have no OUT shadow"):
        lira_scores(target, shadow, masks, online=False)
    with pytest.raises(ValueError, match="shape"):
        lira_scores(target, shadow[:, :5], masks)
    with pytest.raises(ValueError, match="min_std"):
        lira_scores(target, shadow, masks, online=False, min_std=0.0)


def test_identical_shadow_statistics_give_finite_scores():
    masks = inclusion_masks(3, 2, seed=0)  # one IN and one OUT shadow per example: every std is 0
    shadow = np.where(masks, 2.0, -2.0)
    scores = lira_scores([2.0, -2.0, 0.5], shadow, masks)
    assert np.isfinite(scores).all() and scores[0] > scores[2] > scores[1]
    assert np.isfinite(lira_scores([2.0, -2.0, 0.5], shadow, masks, fixed_variance=True)).all()


def test_lira_from_losses_maps_losses_to_the_statistics():
    rng = np.random.default_rng(5)
    masks = inclusion_masks(20, 6, seed=5)
    shadow_losses = rng.exponential(1.0, masks.shape) * np.where(masks, 0.2, 1.0)
    target_losses = rng.exponential(1.0, 20)
    np.testing.assert_allclose(lira_from_losses(target_losses, shadow_losses, masks),
                               lira_scores(logit_confidence(target_losses), logit_confidence(shadow_losses), masks))
    np.testing.assert_allclose(lira_from_losses(target_losses, shadow_losses, masks, statistic="loss", online=False),
                               lira_scores(-target_losses, -shadow_losses, masks, online=False))
    with pytest.raises(ValueError, match="statistic='perplexity'"):
        lira_from_losses(target_losses, shadow_losses, masks, statistic="perplexity")


def test_shadow_models_overfit_their_halves_reproducibly_and_leave_the_global_rng_alone(tmp_path, monkeypatch):
    """4 shadows (an MLP on 64 random points with random labels, 60 epochs of Adam) memorize their halves: the mean
    loss IN is far below OUT. Shadow 0 trained alone (Trainer arguments from a callable) equals shadow 0 of the four
    (it depends on (seed, 0) only), and the caller's torch RNG state is the same afterwards. Nothing is written
    outside tmp_path."""
    from lightning_dp.models import MLP, ImageClassifier

    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(2, (64,), generator=g))
    masks = inclusion_masks(64, 4, seed=0)

    def make_model():
        return ImageClassifier(MLP(8, hidden=(64,), num_classes=2), num_classes=2, lr=0.02, optimizer="adam",
                               log_nonprivate_metrics=False)

    kwargs = {"trainer_kwargs": {"max_epochs": 60, "default_root_dir": str(tmp_path)}, "batch_size": 16, "seed": 7}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    result = train_shadow_models(make_model, data, masks, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    assert result.losses.shape == (4, 64) and result.forward_passes == 4 * 64 and result.seconds > 0
    assert result.losses[masks].mean() < 0.1 and result.losses[~masks].mean() > 1.0
    for k in range(4):  # every shadow separately
        assert result.losses[k][masks[k]].mean() < result.losses[k][~masks[k]].mean()
    alone = train_shadow_models(make_model, data, masks[:1], batch_size=16, seed=7,  # per-shadow Trainer arguments
                                trainer_kwargs=lambda k: {"max_epochs": 60, "default_root_dir": str(tmp_path / str(k))})
    np.testing.assert_allclose(alone.losses[0], result.losses[0], rtol=1e-6)
    with pytest.raises(ValueError, match="masks must be a boolean array"):
        train_shadow_models(make_model, data, masks[:, :10], **kwargs)
    empty = masks.copy()
    empty[1] = False
    with pytest.raises(ValueError, match=r"shadow\(s\) \[1\] would train on no example"):
        train_shadow_models(make_model, data, empty, **kwargs)
