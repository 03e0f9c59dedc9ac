"""What DPSGD writes to the run's record, as pure functions of public configuration and released values: the fixed
privacy parameters (MLflow params), the end-of-training summary, and the spend and clipping-threshold figures; and
:class:`Record`, which logs the spend at Lightning's cadence and writes the final one.

Nothing here touches data: every value is public configuration (sigma, C, q, delta, the sizes), the accountant's
epsilon, or post-processing of released values (an adaptive C). Which of them reach the record is the gate's
decision (:mod:`lightning_dp.gate`); :class:`~lightning_dp.callbacks.DPSGD` logs what these return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_dp.privacy.planning import BatchShape, DataFacts

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lightning_dp.callbacks.clipping import ClipStrategy
    from lightning_dp.protocol import RunProtocol

__all__ = ["Record", "adjacency_label", "figures", "hyperparams", "summary_rows"]


def adjacency_label(adjacency: str) -> str:
    """``add/remove`` or ``replacement``: how the record names the neighbouring datasets."""
    return "add/remove" if adjacency == "add_remove" else "replacement"


def hyperparams(*, sigma: float | None, clipping: ClipStrategy, target_epsilon: float | None, target_delta: float,
                accountant: str, poisson_sampling: bool, adjacency: str, data: DataFacts, planned: int | None,
                max_physical_batch_size: int | None, strategy_params: dict[str, Any], privacy_unit: str = "example",
                max_examples_per_user: int | None = None, user_accounting: str = "mixture",
                sampling: str = "example", shape: BatchShape | None = None) -> dict[str, Any]:
    """The run's fixed privacy parameters, logged once per fit: with dp-accounting, anyone recomputes
    ``privacy/epsilon`` from them and the steps (per user: docs/privacy.md, "The privacy unit").

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
        "privacy/privacy_unit": privacy_unit, "privacy/sampling": sampling,
        **strategy_params,
    }
    if privacy_unit == "user":
        params.update({"privacy/max_examples_per_user": max_examples_per_user,
                       "privacy/user_accounting": user_accounting})
    if shape is not None:  # the truncated event's arguments: TruncatedSubsampledGaussianDpEvent(size, q, bound, sigma)
        params.update({"privacy/max_batch_size": shape.max_batch_size,
                       "privacy/truncated_batch_size": shape.max_batch_size,
                       "privacy/truncated_dataset_size": shape.accounted_size,
                       "privacy/batch_overflow_probability": shape.overflow_probability})
    if clipping.adaptive:
        del params["privacy/max_grad_norm"]
    return params


def summary_rows(*, epsilon: float, target_epsilon: float | None, target_delta: float, accountant: str,
                 adjacency: str, poisson_sampling: bool, data: DataFacts, rate_varies: bool, sigma: float | None,
                 sigma_source: str, clipping: ClipStrategy, max_physical_batch_size: int | None,
                 budget_stop: int | None, plan_done: bool, max_examples_per_user: int | None = None,
                 user_accounting: str = "mixture", shape: BatchShape | None = None) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the end-of-training summary (:mod:`lightning_dp.callbacks.summary`)."""
    if target_epsilon is None:
        spend = f"{epsilon:.4g} at delta {target_delta:g} (no target_epsilon)"
    else:
        spend = f"{epsilon:.4g} of target_epsilon {target_epsilon:g} at delta {target_delta:g}"
    if poisson_sampling and user_accounting == "users" and max_examples_per_user is not None:  # ULS: users drawn
        batches = ("sample rate q", f"{data.sample_rate:.4g} of users (expected {data.expected_batch_size:g} users "
                                    f"of {data.dataset_size} per step{'; changed during the run' if rate_varies else ''})")
    elif poisson_sampling:
        batches = ("sample rate q", f"{data.sample_rate:.4g} (expected batch {data.expected_batch_size:g} "
                                    f"of N = {data.dataset_size}{'; changed during the run' if rate_varies else ''})")
    else:
        batches = ("batches", f"shuffled, {data.expected_batch_size:g} of N = {data.dataset_size} (one "
                              "Gaussian mechanism per epoch)")
    rows = [("epsilon", f"{spend} ({accountant}, {adjacency_label(adjacency)} adjacency)"),
            *([("privacy unit", f"user: at most {max_examples_per_user} records each, " + {
                "mixture": "example-level sampling, mixture-of-Gaussians accounting (ELS)",
                "group": "example-level sampling, group privacy of the example-level spend",
                "users": "users sampled and clipped as units (ULS)"}[user_accounting])]
              if max_examples_per_user is not None else []),
            ("noise multiplier", f"{sigma:.4g} ({sigma_source})"),
            ("clipping norm C", clipping.describe()), batches]
    if data.parts > 1 or max_physical_batch_size is not None:
        bound = f", at most {max_physical_batch_size} examples per pass" if max_physical_batch_size is not None else ""
        rows.append(("virtual batches", f"{data.parts} micro-batch(es) per step{bound}; noise added once per step"))
    if shape is not None:
        rows.append(("batches of one shape", f"at most {shape.max_batch_size} examples per step, padded ("
                     f"{shape.per_rank} rows per process, overflow probability {shape.overflow_probability:.2g} per "
                     f"step; truncated event over {shape.accounted_size} records)"))
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


class Record:
    """The spend DPSGD logs: its curve (the figure, and checkpoints) and the last step Lightning writes."""

    def __init__(self) -> None:
        self.curve: list[tuple[int, float]] = []
        self.logged_step = -1
        self.logged_interim = False  # the last write's epsilon was the accountant's cheaper bound: end() writes again

    def metrics(self, step: int, epsilon: float, sample_rate: float | None, nonprivate: dict[str, float],
                clipping: ClipStrategy) -> dict[str, float]:
        """The metrics of ``step`` (the curve notes its spend): epsilon, a sample rate that varies, the
        ``nonprivate/`` statistics, and what the clipping strategy moves (C, OSO's learning rate: post-processing)."""
        if self.curve and self.curve[-1][0] == step:
            self.curve[-1] = (step, epsilon)  # the final spend after an interim write of the same step
        else:
            self.curve.append((step, epsilon))
        # what is fixed for the run (delta, sigma, C, q) is a param (hyperparams); only what moves is a metric
        metrics = {"privacy/epsilon": epsilon, "privacy/steps": float(step)}
        if sample_rate is not None:  # a reloaded loader changed q since the param was logged: chart it from then on
            metrics["privacy/sample_rate"] = sample_rate
        metrics.update(nonprivate)
        metrics.update(clipping.metrics())
        return metrics

    def log(self, trainer: Any, pl_module: Any, batch_idx: int,
            metrics: Callable[[int, bool], dict[str, float]]) -> None:
        """After a released step: log its metrics where Lightning writes them (its cadence, or a stop) and at every
        epoch end (the progress bar's epsilon); nothing is written with ``log_every_n_steps=0``.

        ``metrics(step, interim)``: the writes before the run's last (an epoch's end, the progress bar's value,
        included) take the accountant's cheaper bound (:meth:`~lightning_dp.privacy.accounting.Accountant.
        interim_epsilon`, an upper bound too: a PLD at 1e-3 instead of 1e-4, 13-16 ms instead of 80-130 ms per
        write); the last write, and :meth:`end`'s, the accountant's own.
        """
        every = trainer.log_every_n_steps
        epoch_end = batch_idx + 1 >= trainer.num_training_batches
        written = bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)
        if not (written or epoch_end):
            return
        step = trainer.global_step
        last = bool(trainer.should_stop) or (0 < trainer.max_steps <= step) or (
            epoch_end and trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1)
        interim = not last
        for name, value in metrics(step, interim).items():
            # float64 tensors: Lightning would store a Python float as float32 and round the spend
            pl_module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True, on_epoch=False,
                          prog_bar=name == "privacy/epsilon")
        if written:  # else it only reaches the progress bar and end() still writes the final value
            self.logged_step, self.logged_interim = step, interim

    def end(self, trainer: Any, protocol: RunProtocol, metrics: Callable[[int, bool], dict[str, float]], *,
            figures: Callable[[], list[tuple[Figure, str]]]) -> None:
        """When training ends: the final spend (Lightning writes step metrics only every ``log_every_n_steps``, and
        a write that did not know it was the last took the cheaper bound) and, on global rank zero, the figures."""
        step = trainer.global_step
        if step > 0 and (self.logged_step != step or self.logged_interim):
            protocol.write_final(trainer, metrics(step, False), step)
            self.logged_step = step
        if trainer.is_global_zero:
            from lightning_dp import tracking

            for fig, name in figures():
                tracking.log_figure(trainer, fig, name)
