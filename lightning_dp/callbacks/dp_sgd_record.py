"""What DPSGD writes to the run's record, as pure functions of public configuration and released values: the fixed
privacy parameters (MLflow params), the end-of-training summary, and the spend and clipping-threshold figures.

Nothing here touches data: every value is public configuration (sigma, C, q, delta, the sizes), the accountant's
epsilon, or post-processing of released values (an adaptive C). Which of them reach the record is the gate's
decision (:mod:`lightning_dp.gate`); :class:`~lightning_dp.callbacks.DPSGD` logs what these return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dp.privacy.planning import DataFacts

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lightning_dp.callbacks.clipping import ClipStrategy

__all__ = ["adjacency_label", "figures", "hyperparams", "summary_rows"]


def adjacency_label(adjacency: str) -> str:
    """``add/remove`` or ``replacement``: how the record names the neighbouring datasets."""
    return "add/remove" if adjacency == "add_remove" else "replacement"


def hyperparams(*, sigma: float | None, clipping: ClipStrategy, target_epsilon: float | None, target_delta: float,
                accountant: str, poisson_sampling: bool, adjacency: str, data: DataFacts, planned: int | None,
                max_physical_batch_size: int | None, strategy_params: dict[str, Any]) -> dict[str, Any]:
    """The run's fixed privacy parameters, logged once per fit.

    What moves during the run is a metric instead: epsilon, an adaptive C (``privacy/max_grad_norm``; its initial C
    is the strategy's param ``privacy/initial_clip``), a sampling rate that a reloaded loader changes.
    """
    params = {
        "privacy/noise_multiplier": sigma, "privacy/max_grad_norm": clipping.clip,
        "privacy/target_epsilon": target_epsilon, "privacy/target_delta": target_delta,
        "privacy/accountant": accountant, "privacy/poisson_sampling": poisson_sampling,
        "privacy/sample_rate": data.sample_rate, "privacy/dataset_size": data.dataset_size,
        "privacy/expected_batch_size": data.expected_batch_size,
        "privacy/steps_per_epoch": data.steps_per_epoch, "privacy/planned_events": planned,
        "privacy/adjacency": adjacency_label(adjacency),
        "privacy/accumulate_grad_batches": data.parts,
        "privacy/max_physical_batch_size": max_physical_batch_size,
        **strategy_params,
    }
    if clipping.adaptive:
        del params["privacy/max_grad_norm"]
    return params


def summary_rows(*, epsilon: float, target_epsilon: float | None, target_delta: float, accountant: str,
                 adjacency: str, poisson_sampling: bool, data: DataFacts, rate_varies: bool, sigma: float | None,
                 sigma_source: str, clipping: ClipStrategy, max_physical_batch_size: int | None,
                 budget_stop: int | None, plan_done: bool) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the end-of-training summary (:mod:`lightning_dp.callbacks.summary`)."""
    if target_epsilon is None:
        spend = f"{epsilon:.4g} at delta {target_delta:g} (no target_epsilon)"
    else:
        spend = f"{epsilon:.4g} of target_epsilon {target_epsilon:g} at delta {target_delta:g}"
    if poisson_sampling:
        batches = ("sample rate q", f"{data.sample_rate:.4g} (expected batch {data.expected_batch_size:g} "
                                    f"of N = {data.dataset_size}{'; changed during the run' if rate_varies else ''})")
    else:
        batches = ("batches", f"shuffled, {data.expected_batch_size:g} of N = {data.dataset_size} (one "
                              "Gaussian mechanism per epoch)")
    rows = [("epsilon", f"{spend} ({accountant}, {adjacency_label(adjacency)} adjacency)"),
            ("noise multiplier", f"{sigma:.4g} ({sigma_source})"),
            ("clipping norm C", clipping.describe()), batches]
    if data.parts > 1 or max_physical_batch_size is not None:
        bound = f", at most {max_physical_batch_size} examples per pass" if max_physical_batch_size is not None else ""
        rows.append(("virtual batches", f"{data.parts} micro-batch(es) per step{bound}; noise added once per step"))
    if budget_stop is not None:
        rows.append(("stopped", f"after step {budget_stop}: " + (
            "DPSGD's planned length is done" if plan_done else
            "by the budget (the next step would exceed target_epsilon)")))
    return rows


def figures(curve: list[tuple[int, float]], *, target_delta: float, sigma: float | None,
            clipping: ClipStrategy) -> list[tuple[Figure, str]]:
    """``(figure, artifact path)`` of the spend curve (``privacy/epsilon.png``) and, for an adaptive strategy, of
    its released thresholds (``privacy/max_grad_norm.png``)."""
    from lightning_dp import tracking

    if not curve:
        return []
    steps, eps = zip(*curve)
    out = [(tracking.plot_series(steps, eps, xlabel="step", ylabel=f"epsilon (delta={target_delta:g})",
                                 title=f"privacy spend, sigma={sigma:.3g}, C={clipping.clip:g}"),
            "privacy/epsilon.png")]
    if clipping.adaptive and clipping.trace:
        steps, clips, _ = zip(*clipping.trace)
        fig = tracking.plot_series(steps, clips, xlabel="released step", ylabel="clipping threshold C",
                                   title=f"{clipping.title}: C_t (sigma={sigma:.3g})")
        fig.axes[0].set_yscale("log")
        out.append((fig, "privacy/max_grad_norm.png"))
    return out
