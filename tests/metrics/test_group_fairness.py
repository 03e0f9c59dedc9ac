"""Tests of GroupFairness and its functional part, against fairlearn.metrics (and sklearn's accuracy_score).

Every expected number comes from fairlearn on the same data: demographic_parity_difference,
equalized_odds_difference, equal_opportunity_difference and a MetricFrame of selection_rate,
true_positive_rate, false_positive_rate, accuracy_score and count per group. Data are generated from
fixed seeds; agreement is required to 1e-6 (absolute).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairlearn.metrics import (
    MetricFrame,
    count,
    demographic_parity_difference,
    equal_opportunity_difference,
    equalized_odds_difference,
    false_positive_rate,
    selection_rate,
    true_positive_rate,
)
from sklearn.metrics import accuracy_score
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.metrics import GroupFairness, binary_group_counts, group_fairness, group_fairness_from_counts

ATOL = 1e-6
RATES = ("selection_rate", "true_positive_rate", "false_positive_rate", "accuracy", "count")
FAIRLEARN_RATES = {
    "selection_rate": selection_rate,
    "true_positive_rate": true_positive_rate,
    "false_positive_rate": false_positive_rate,
    "accuracy": accuracy_score,
    "count": count,
}


def _keys(num_groups: int) -> list[str]:
    head = ["demographic_parity_difference", "equalized_odds_difference", "equal_opportunity_difference", "accuracy"]
    return head + [f"{rate}/group_{g}" for rate in RATES for g in range(num_groups)]


def _fairlearn(preds, target, groups, num_groups: int) -> dict[str, float]:
    """The expected result: fairlearn on hard predictions; NaN rates and count 0 for groups never seen."""
    y, p, g = (np.asarray(t, dtype=np.int64) for t in (target, preds, groups))
    expected = {
        "demographic_parity_difference": demographic_parity_difference(y, p, sensitive_features=g),
        "equalized_odds_difference": equalized_odds_difference(y, p, sensitive_features=g),
        "equal_opportunity_difference": equal_opportunity_difference(y, p, sensitive_features=g),
        "accuracy": accuracy_score(y, p),
    }
    by_group = MetricFrame(metrics=FAIRLEARN_RATES, y_true=y, y_pred=p, sensitive_features=g).by_group
    for rate in RATES:
        for group in range(num_groups):
            seen = group in by_group.index
            value = float(by_group.loc[group, rate]) if seen else (0.0 if rate == "count" else math.nan)
            expected[f"{rate}/group_{group}"] = value
    return expected


def _assert_matches(result: dict[str, torch.Tensor], expected: dict[str, float]) -> None:
    assert list(result) == list(expected)  # same names, same order
    for key, value in result.items():
        assert value.dtype == torch.float64 and value.shape == (), key
        if math.isnan(expected[key]):
            assert torch.isnan(value), (key, value)
        else:
            assert abs(value.item() - expected[key]) <= ATOL, (key, value.item(), expected[key])


def _assert_same(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert list(first) == list(second)
    for key in first:
        assert torch.equal(first[key], second[key]) or (first[key].isnan() and second[key].isnan()), key


def _random_data(num_groups: int, seed: int, n: int = 600):
    """Unequal group sizes (weights 1, 2, ..., G squared) and group-dependent base rates and errors."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, num_groups + 1, dtype=torch.float64) ** 2
    groups = torch.multinomial(weights, n, replacement=True, generator=gen)
    base_rate = torch.rand(num_groups, generator=gen, dtype=torch.float64) * 0.6 + 0.2
    target = (torch.rand(n, generator=gen, dtype=torch.float64) < base_rate[groups]).long()
    error = torch.rand(num_groups, generator=gen, dtype=torch.float64) * 0.4 + 0.05
    flip = torch.rand(n, generator=gen, dtype=torch.float64) < error[groups]
    preds = torch.where(flip, 1 - target, target)
    return preds, target, groups


# --------------------------------------------------------------------------- agreement with fairlearn


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("num_groups", [2, 3, 7])
def test_matches_fairlearn_on_random_data(num_groups: int, seed: int) -> None:
    preds, target, groups = _random_data(num_groups, seed)
    assert len(torch.unique(torch.bincount(groups, minlength=num_groups))) > 1  # unequal group sizes
    metric = GroupFairness(num_groups)
    metric.update(preds, target, groups)
    _assert_matches(metric.compute(), _fairlearn(preds, target, groups, num_groups))
    _assert_matches(group_fairness(preds, target, groups, num_groups), _fairlearn(preds, target, groups, num_groups))


@pytest.mark.parametrize("num_groups", [2, 7])
def test_batches_equal_one_update(num_groups: int) -> None:
    preds, target, groups = _random_data(num_groups, seed=11)
    whole = GroupFairness(num_groups)
    whole.update(preds, target, groups)
    batched = GroupFairness(num_groups)
    bounds = [0, 1, 1, 57, 200, 201, 450, len(preds)]  # uneven batches, one of size 1, one empty
    for start, stop in zip(bounds[:-1], bounds[1:]):
        batched.update(preds[start:stop], target[start:stop], groups[start:stop])
    for name in ("tp", "fp", "tn", "fn"):
        assert torch.equal(getattr(batched, name), getattr(whole, name))
    _assert_same(batched.compute(), whole.compute())
    _assert_matches(batched.compute(), _fairlearn(preds, target, groups, num_groups))


def test_forward_returns_the_batch_and_accumulates() -> None:
    preds, target, groups = _random_data(3, seed=5)
    metric = GroupFairness(3)
    batch_result = metric(preds[:300], target[:300], groups[:300])
    _assert_matches(batch_result, _fairlearn(preds[:300], target[:300], groups[:300], 3))
    metric(preds[300:], target[300:], groups[300:])
    _assert_matches(metric.compute(), _fairlearn(preds, target, groups, 3))


# --------------------------------------------------------------------------- probabilities and logits


@pytest.mark.parametrize("threshold", [0.5, 0.3, 0.8])
def test_probabilities_are_thresholded_with_greater_or_equal(threshold: float) -> None:
    _, target, groups = _random_data(3, seed=21)
    gen = torch.Generator().manual_seed(22)
    probs = torch.rand(len(target), generator=gen)
    probs[:10] = threshold  # ties count as positive predictions
    hard = (probs >= threshold).long()  # by hand
    metric = GroupFairness(3, threshold=threshold)
    metric.update(probs, target, groups)
    _assert_same(metric.compute(), group_fairness(hard, target, groups, 3))
    _assert_matches(metric.compute(), _fairlearn(hard, target, groups, 3))


@pytest.mark.parametrize("threshold", [0.5, 0.3])
def test_logits_go_through_a_sigmoid(threshold: float) -> None:
    _, target, groups = _random_data(3, seed=31)
    gen = torch.Generator().manual_seed(32)
    logits = 3 * torch.randn(len(target), generator=gen, dtype=torch.float64)
    logits[:5] = 0.0  # sigmoid(0) = 0.5 exactly
    hard = (1 / (1 + torch.exp(-logits)) >= threshold).long()  # by hand
    metric = GroupFairness(3, threshold=threshold)
    metric.update(logits.float(), target, groups)
    _assert_same(metric.compute(), group_fairness(hard, target, groups, 3))
    _assert_matches(metric.compute(), _fairlearn(hard, target, groups, 3))


def test_prediction_dtypes_agree() -> None:
    preds, target, groups = _random_data(2, seed=41)
    expected = group_fairness(preds, target, groups, 2)
    for variant in (preds.bool(), preds.int(), preds.to(torch.uint8), preds.float(), preds.double()):
        _assert_same(group_fairness(variant, target, groups, 2), expected)
    for labels in (target.bool(), target.float()):
        _assert_same(group_fairness(preds, labels, groups, 2), expected)
    _assert_same(group_fairness(preds, target, groups.int(), 2), expected)


def test_counts_of_one_batch() -> None:
    tp, fp, tn, fn = binary_group_counts(
        torch.tensor([1, 1, 0, 0, 1, 0]), torch.tensor([1, 0, 1, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 2, 2]), 3)
    assert [t.tolist() for t in (tp, fp, tn, fn)] == [[1, 0, 1], [1, 0, 0], [1, 0, 0], [1, 0, 1]]
    assert all(t.dtype == torch.int64 for t in (tp, fp, tn, fn))


# --------------------------------------------------------------------------- degenerate groups

# Group 0 is ordinary in every case (TP = FP = TN = FN = 1: TPR = FPR = 0.5); group 1 is degenerate.
DEGENERATE = {  # (preds, target, groups)
    "no_positive_labels": ([1, 0, 0, 1, 1, 0, 1], [1, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1]),
    "no_negative_labels": ([1, 0, 0, 1, 1, 0, 1], [1, 0, 1, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]),
    "all_predictions_one": ([1, 0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]),
    "all_negative_labels_all_predictions_zero": ([1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]),
    "one_example": ([1, 0, 0, 1, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 1]),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_degenerate_groups_match_fairlearn(case: str) -> None:
    preds, target, groups = (torch.tensor(t) for t in DEGENERATE[case])
    metric = GroupFairness(2)
    metric.update(preds, target, groups)
    _assert_matches(metric.compute(), _fairlearn(preds, target, groups, 2))


def test_no_positive_labels_gives_true_positive_rate_zero() -> None:
    # Group 1 has no positive label: fairlearn's TPR is 0/0 -> 0, and it enters the differences as 0.
    preds, target, groups = (torch.tensor(t) for t in DEGENERATE["no_positive_labels"])
    result = group_fairness(preds, target, groups, 2)
    assert result["true_positive_rate/group_1"].item() == 0.0
    assert result["true_positive_rate/group_0"].item() == 0.5
    assert result["equal_opportunity_difference"].item() == 0.5
    assert equal_opportunity_difference(target.numpy(), preds.numpy(), sensitive_features=groups.numpy()) == 0.5


def test_no_negative_labels_gives_false_positive_rate_zero() -> None:
    preds, target, groups = (torch.tensor(t) for t in DEGENERATE["no_negative_labels"])
    result = group_fairness(preds, target, groups, 2)
    assert result["false_positive_rate/group_1"].item() == 0.0
    assert result["false_positive_rate/group_0"].item() == 0.5
    assert result["equal_opportunity_difference"].item() == pytest.approx(2 / 3 - 0.5, abs=1e-12)
    assert result["equalized_odds_difference"].item() == 0.5  # max(1/6, |0.5 - 0|): the FPR 0 decides
    assert equalized_odds_difference(target.numpy(), preds.numpy(), sensitive_features=groups.numpy()) == 0.5


def test_groups_never_seen_are_left_out() -> None:
    preds, target, groups = _random_data(3, seed=51)
    groups = torch.tensor([0, 2, 3])[groups]  # ids 1 and 4 never occur
    metric = GroupFairness(5)
    metric.update(preds, target, groups)
    result = metric.compute()
    _assert_matches(result, _fairlearn(preds, target, groups, 5))
    for group in (1, 4):
        assert result[f"count/group_{group}"].item() == 0
        assert all(result[f"{rate}/group_{group}"].isnan() for rate in RATES if rate != "count")
    assert not any(result[key].isnan() for key in _keys(5)[:4])


@pytest.mark.parametrize(("num_groups", "group_id"), [(1, 0), (3, 1)])
def test_single_group_gives_zero_differences(num_groups: int, group_id: int) -> None:
    preds, target, _ = _random_data(2, seed=61)
    groups = torch.full_like(target, group_id)
    result = group_fairness(preds, target, groups, num_groups)
    _assert_matches(result, _fairlearn(preds, target, groups, num_groups))
    assert [result[key].item() for key in _keys(num_groups)[:3]] == [0.0, 0.0, 0.0]


def test_nothing_seen_gives_nan() -> None:
    metric = GroupFairness(2)
    with pytest.warns(UserWarning, match="before the ``update``"):
        result = metric.compute()
    assert list(result) == _keys(2)
    assert all(result[key].isnan() for key in result if not key.startswith("count/"))
    assert result["count/group_0"].item() == result["count/group_1"].item() == 0


# --------------------------------------------------------------------------- distributed safety


def test_states_are_summed_int64_counts() -> None:
    metric = GroupFairness(4)
    assert metric.full_state_update is False and metric.is_differentiable is False
    assert metric.higher_is_better is False
    for name in ("tp", "fp", "tn", "fn"):
        state = getattr(metric, name)
        assert state.dtype == torch.int64 and state.shape == (4,)
        assert metric._reductions[name] is not None  # dist_reduce_fx="sum"
        assert torch.equal(metric._reductions[name](torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])),
                           torch.tensor([6, 8, 10, 12]))


def test_merge_state_equals_one_instance() -> None:
    preds, target, groups = _random_data(3, seed=71)
    first, second, whole = GroupFairness(3), GroupFairness(3), GroupFairness(3)
    first.update(preds[:250], target[:250], groups[:250])
    second.update(preds[250:], target[250:], groups[250:])
    whole.update(preds, target, groups)
    summed = group_fairness_from_counts(*(getattr(first, s) + getattr(second, s) for s in ("tp", "fp", "tn", "fn")))
    first.merge_state(second)
    _assert_same(first.compute(), whole.compute())
    _assert_same(summed, whole.compute())
    _assert_matches(whole.compute(), _fairlearn(preds, target, groups, 3))


def _ddp_worker(rank: int, world_size: int, init_file: str, out_dir: str, shards) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metric = GroupFairness(4)
        preds, target, groups = shards[rank]
        half = len(preds) // 2
        metric.update(preds[:half], target[:half], groups[:half])
        metric.update(preds[half:], target[half:], groups[half:])
        local = metric.tp.clone()
        result = metric.compute()  # synced: sums the counts of both ranks
        assert torch.equal(metric.tp, local)  # the local state is restored after the sync
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_sync_matches_fairlearn_on_the_union(tmp_path) -> None:
    preds, target, groups = _random_data(3, seed=81)
    groups = torch.where(torch.arange(len(groups)) < 350, groups, torch.full_like(groups, 3))
    # Rank 0 gets 350 examples of groups 0-2, rank 1 gets 250 examples, group 3 only there.
    shards = [(preds[:350], target[:350], groups[:350]), (preds[350:], target[350:], groups[350:])]
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), shards), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    _assert_same(results[0], results[1])
    _assert_matches(results[0], _fairlearn(preds, target, groups, 4))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("num_groups", [0, -1, 2.5, True, "2"])
def test_bad_num_groups(num_groups) -> None:
    with pytest.raises(ValueError, match=re.escape(f"num_groups={num_groups!r} is not allowed") + ".*>= 1"):
        GroupFairness(num_groups)


@pytest.mark.parametrize("threshold", [0.0, 1.0, 1.5, -0.1, math.nan, "0.5"])
def test_bad_threshold(threshold) -> None:
    with pytest.raises(ValueError, match=re.escape(f"threshold={threshold!r} is not allowed") + ".*between 0 and 1"):
        GroupFairness(2, threshold=threshold)
    with pytest.raises(ValueError, match="threshold="):
        group_fairness(torch.tensor([1]), torch.tensor([1]), torch.tensor([0]), 2, threshold=threshold)


@pytest.mark.parametrize(
    ("preds", "target", "groups", "message"),
    [
        ([1, 0, 1], [1, 0], [0, 1], r"same shape \(N,\), got preds \(3,\), target \(2,\) and groups \(2,\)"),
        ([1, 0], [1, 0], [0, 1, 1], r"got preds \(2,\), target \(2,\) and groups \(3,\)"),
        ([[1], [0]], [1, 0], [0, 1], r"preds has shape \(2, 1\).*preds.squeeze\(-1\)"),
        ([1, 0], [1, 2], [0, 1], r"target has values \[1, 2\].*\{0, 1\}"),
        ([1, 0], [-1, 0], [0, 1], r"target has values \[-1, 0\]"),
        ([1, 0], [0.5, 1.0], [0, 1], r"target has values \[0.5, 1.0\]"),
        ([2, 0], [1, 0], [0, 1], r"preds is a torch.int64 tensor with values \[0, 2\].*\{0, 1\}"),
        ([math.nan, 0.2], [1, 0], [0, 1], "preds contains NaN"),
        ([1, 0], [1, 0], [0.0, 1.0], r"groups is a torch.float32 tensor.*groups.long\(\)"),
        ([1, 0, 1], [1, 0, 0], [0, 2, 5], r"groups contains the id\(s\) \[2, 5\], outside \[0, 2\).*num_groups=2"),
        ([1, 0], [1, 0], [-1, 1], r"groups contains the id\(s\) \[-1\], outside \[0, 2\)"),
    ],
)
def test_bad_inputs(preds, target, groups, message: str) -> None:
    metric = GroupFairness(2)
    with pytest.raises(ValueError, match=message):
        metric.update(torch.tensor(preds), torch.tensor(target), torch.tensor(groups))
    assert metric.tp.sum() == metric.fp.sum() == metric.tn.sum() == metric.fn.sum() == 0  # nothing was counted


def test_logging_from_a_lightning_module() -> None:
    # Lightning is imported here, not at the top: the processes of the gloo test import this module.
    from lightning.pytorch import LightningModule, Trainer

    class _TinyClassifier(LightningModule):
        """The usage of the module docstring: update in test_step, compute + log_dict + reset at epoch end."""

        def __init__(self, num_groups: int) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)
            self.fairness = GroupFairness(num_groups)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).squeeze(-1)  # logits

        def test_step(self, batch, batch_idx: int) -> None:
            x, y, groups = batch
            self.fairness.update(self(x), y, groups)

        def on_test_epoch_end(self) -> None:
            self.log_dict({f"test/fairness/{k}": v for k, v in self.fairness.compute().items()})
            self.fairness.reset()

    torch.manual_seed(0)  # the initial weights of the tiny model
    gen = torch.Generator().manual_seed(91)
    x = torch.randn(96, 2, generator=gen)
    target = (x[:, 0] + 0.5 * torch.randn(96, generator=gen) > 0).long()
    groups = (x[:, 1] > 0.3).long()  # ids 0 and 1; group 2 never occurs
    model = _TinyClassifier(num_groups=3)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.test(model, DataLoader(TensorDataset(x, target, groups), batch_size=32), verbose=False)
    with torch.no_grad():
        hard = (torch.sigmoid(model(x)) >= 0.5).long()
    logged = {k.removeprefix("test/fairness/"): v for k, v in trainer.callback_metrics.items()}
    _assert_matches({k: logged[k] for k in _keys(3)}, _fairlearn(hard, target, groups, 3))
    assert model.fairness.tp.sum() == 0  # reset after logging


def test_inputs_must_be_tensors() -> None:
    with pytest.raises(ValueError, match=r"target must be a torch.Tensor, got list; .*torch.as_tensor\(target\)"):
        GroupFairness(2).update(torch.tensor([1, 0]), [1, 0], torch.tensor([0, 1]))


def test_public_api() -> None:
    import lightning_dp.metrics as metrics

    assert set(metrics.__all__) == {"GroupFairness", "binary_group_counts", "group_fairness",
                                    "group_fairness_from_counts"}
    assert all(hasattr(metrics, name) for name in metrics.__all__)
