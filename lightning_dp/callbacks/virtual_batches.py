"""Virtual batches for DP-SGD: one logical Poisson batch, processed in micro-batches, released once.

``Trainer(accumulate_grad_batches=k)`` splits a logical batch into ``k`` micro-batches;
``DPSGD(max_physical_batch_size=M)`` cuts a batch into chunks of at most ``M`` inside the training step. Either
way the noise is added once per logical batch: one optimizer step, one accounted event at ``q``. This module holds
the factor Lightning will use, the refusals of schedules that would change it, and the chunk loop (the formulas are
in :mod:`lightning_dp.privacy`). How and why: docs/fine_tuning.md, "Virtual batches".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException

__all__ = ["LogicalStep", "accumulation_factor", "check_schedule", "closure_loss", "mismatch", "run_in_chunks",
           "with_loss"]


def _scheduler(callbacks: list[Callback]) -> GradientAccumulationScheduler | None:
    return next((cb for cb in callbacks if isinstance(cb, GradientAccumulationScheduler)), None)


@dataclass
class LogicalStep:
    """Where DPSGD stands in the current logical batch: its micro-batches, their clipped sums so far, and whether the
    step was released (the noise is added once, when the last backward of the logical batch is done)."""

    parts: int = 1  #: micro-batches per logical batch the training data was sampled for
    part: int = 0  #: micro-batches begun in the current logical batch
    #: their clipped sums so far (private: never saved nor shown in a repr)
    pending: Optional[list[list[Tensor]]] = field(default=None, repr=False)
    pending_stats: Optional[Tensor] = field(default=None, repr=False)  #: their clipping statistics so far
    in_chunks: bool = False  #: a backward runs inside the chunk loop of max_physical_batch_size (not the step's last)
    awaiting_step: bool = False  #: released; the optimizer step has not run yet
    released_in_batch: bool = False  #: the step was released in this batch
    batch_idx: int = -1  #: Lightning's index of the current batch
    backward_seen: bool = False  #: a backward pass ran for the current micro-batch
    adds_event: bool = False  #: this step starts an accounted event

    def restart(self) -> None:
        """A new fit starts at the beginning of a logical batch (the factor ``parts`` is kept)."""
        self.part, self.pending, self.pending_stats, self.awaiting_step = 0, None, None, False


def accumulation_factor(trainer: Trainer) -> int:
    """Micro-batches per optimizer step in the epoch that starts now (``trainer.current_epoch``).

    A ``GradientAccumulationScheduler`` sets ``trainer.accumulate_grad_batches`` only in its
    ``on_train_epoch_start``, after the training data of that epoch was loaded; its schedule is read
    here instead, so that the loader is sampled for the factor the epoch will run with.
    """
    scheduler = _scheduler(trainer.callbacks)  # type: ignore[attr-defined]  # set by Lightning, undeclared
    if scheduler is not None:
        return int(scheduler.get_accumulate_grad_batches(trainer.current_epoch))
    return int(trainer.accumulate_grad_batches)


def _schedule(scheduler: GradientAccumulationScheduler) -> dict[int, int]:
    return dict(sorted(getattr(scheduler, "scheduling", {}).items()))


def check_schedule(trainer: Trainer, *, for_plan: bool = False) -> None:
    """Refuses a ``GradientAccumulationScheduler`` whose factor changes at an epoch where the training data is
    not loaded again.

    The Poisson loader is sampled for one factor (the logical batch of ``k`` micro-batches has rate
    ``q = k x batch_size x world_size / N``); a factor that changes while the loader stays would run
    micro-batches of one logical batch across two optimizer steps. Where Lightning reloads the data at
    the change (``reload_dataloaders_every_n_epochs`` dividing the epoch), the loader is sampled anew for
    the new factor and every step is accounted at its own rate. ``for_plan``: a grid plans one rate per
    run, so any change is refused.

    Raises:
        MisconfigurationException: with the schedule, the epoch of the change and the fixes.
    """
    scheduler = _scheduler(trainer.callbacks)  # type: ignore[attr-defined]
    if scheduler is None:
        return
    schedule = _schedule(scheduler)
    factors = [scheduler.get_accumulate_grad_batches(0)]
    changes = []
    for epoch in schedule:
        factor = scheduler.get_accumulate_grad_batches(epoch)
        if epoch > 0 and factor != factors[-1]:
            changes.append((epoch, factors[-1], factor))
        factors.append(factor)
    # Lightning reloads every n epochs counted from the last reload (from epoch 0 unless a resume moved it): a
    # change at a multiple of n is expected to find a reload; should a resume shift the reloads, the check before
    # every micro-batch (PrivateStep.check_accumulation) refuses the mismatch before anything of it is released
    every = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)  # set by Lightning, undeclared
    for epoch, before, after in changes:
        if for_plan or not every or epoch % every:
            reason = ("lightning-dp grid plans one sampling rate per run" if for_plan else
                      "the training data is not loaded again at that epoch (reload_dataloaders_every_n_epochs="
                      f"{every}), so the Poisson batches of the loader, sampled for {before} micro-batches per step, "
                      f"would be split across optimizer steps")
            raise MisconfigurationException(
                f"GradientAccumulationScheduler(scheduling={schedule}) changes accumulate_grad_batches from {before} "
                f"to {after} at epoch {epoch} (zero-indexed), and {reason}. DPSGD samples each logical batch at "
                f"q = accumulate_grad_batches x batch_size x world_size / N and releases it once. Use a constant "
                "factor (Trainer(accumulate_grad_batches=k))"
                + ("." if for_plan else ", or reload the training data where it changes: "
                   "Trainer(reload_dataloaders_every_n_epochs=1) (each epoch is then accounted at its own rate)."))


def mismatch(factor: int, parts: int, where: str) -> MisconfigurationException:
    """The refusal of an accumulation factor that differs from the one the training data was sampled for."""
    return MisconfigurationException(
        f"accumulate_grad_batches={factor} ({where}), but the training data of this epoch was sampled as logical "
        f"batches of {parts} micro-batch(es) each. DPSGD releases one logical batch per optimizer step (its "
        "micro-batches are clipped, summed and noised once); with another factor Lightning would step in the middle "
        "of a logical batch or across two, and the release would no longer be the accounted one. Set the factor "
        "before training starts (Trainer(accumulate_grad_batches=k), or a GradientAccumulationScheduler, whose "
        "schedule DPSGD reads when the data is loaded) and change it only at epochs where the data is loaded again "
        "(Trainer(reload_dataloaders_every_n_epochs=...)).")


def closure_loss(output: Any) -> torch.Tensor | None:
    """The loss of a ``training_step`` output (a tensor, or a mapping with ``"loss"``), as Lightning reads it."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """``output`` with its loss replaced by ``loss``."""
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


def run_in_chunks(chunks: list[Any], sizes: list[int], *, step: Callable[[Any], Any],
                  start: Callable[[int], None], backward: Callable[[torch.Tensor], Any],
                  inner: Callable[[bool], None]) -> Any:
    """Runs ``step`` on every chunk; the backward of all but the last is ``backward(loss)``, here.

    ``start(size)`` prepares the recording of a chunk of ``size`` examples, ``inner(True/False)``
    brackets the backward passes run here (they are not the step's last). Returns the last chunk's
    output with its loss replaced by a tensor whose VALUE is the mean over all chunks (weighted by
    their sizes, as the unsplit batch mean) and whose GRADIENT is the last chunk's (its backward, the
    Trainer's own, follows).

    Raises:
        MisconfigurationException: if a chunk's ``training_step`` returns no loss.
    """
    total = sum(sizes)
    weighted: torch.Tensor | float = 0.0
    for i, (chunk, size) in enumerate(zip(chunks, sizes)):
        start(size)
        output = step(chunk)
        loss = closure_loss(output)
        if loss is None:
            raise MisconfigurationException(
                f"training_step returned no loss for micro-batch {i + 1} of {len(chunks)} (max_physical_batch_size): "
                "every micro-batch of a logical batch must be trained and released, an empty one included; "
                "skipping one would make the release depend on which examples it held.")
        if i < len(chunks) - 1:
            inner(True)
            try:
                backward(loss)
            finally:
                inner(False)
            weighted = weighted + loss.detach() * size
            continue
        mean = (weighted + loss.detach() * size) / max(total, 1)
        return with_loss(output, loss + (mean - loss.detach()))
    raise ValueError("run_in_chunks needs at least one chunk")
