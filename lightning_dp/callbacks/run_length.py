"""DPSGD's planned length against the Trainer's limits (``calibrate_for``): the events a calibrated noise multiplier
is for, the refusal of a Trainer that would run longer than the plan, and what the user is told when they disagree.

The counting is :mod:`lightning_dp.privacy.planning`'s (pure functions); this module holds the decision and its
wording, over plain values (no Trainer), so that each case is testable on its own.

Example:
    >>> from lightning_dp.privacy.planning import DataFacts
    >>> data = DataFacts.of(dataset_size=1000, batch_size=100, world_size=1, parts=1, poisson_sampling=True)
    >>> Lengths(epochs=2, max_steps=None, calibrate_for="trainer", poisson_sampling=True,
    ...         trainer_max_epochs=3, trainer_max_steps=-1).planned_events(data)
    30
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dp.privacy import planning
from lightning_dp.privacy.planning import DataFacts

__all__ = ["LIGHTNING_DEFAULT_MAX_EPOCHS", "Lengths"]

#: Lightning's ``max_epochs`` when neither limit is given (it warns): a safeguard, not a plan.
LIGHTNING_DEFAULT_MAX_EPOCHS = 1000


@dataclass(frozen=True)
class Lengths:
    """A run's two lengths: DPSGD's own plan (``epochs`` or ``max_steps``) and the Trainer's limits."""

    epochs: int | None  #: DPSGD's planned epochs
    max_steps: int | None  #: DPSGD's planned steps
    calibrate_for: str  #: one of :data:`lightning_dp.privacy.planning.CALIBRATE_FOR`
    poisson_sampling: bool
    trainer_max_epochs: int | None
    trainer_max_steps: int | None  #: Lightning's -1 (or None): no limit

    @classmethod
    def of(cls, dp: Any, trainer: Any) -> Lengths:
        """The lengths of a :class:`~lightning_dp.callbacks.DPSGD` ``dp`` fitted by ``trainer``."""
        return cls(dp.epochs, dp.max_steps, dp.calibrate_for, dp.poisson_sampling, trainer.max_epochs,
                   trainer.max_steps)

    def own_events(self, data: DataFacts) -> int | None:
        return planning.own_planned_events(data, self.poisson_sampling, epochs=self.epochs, max_steps=self.max_steps)

    def trainer_steps(self, data: DataFacts) -> int | None:
        return planning.trainer_steps(data, max_epochs=self.trainer_max_epochs, max_steps=self.trainer_max_steps)

    def trainer_events(self, data: DataFacts) -> int | None:
        return planning.trainer_events(data, self.poisson_sampling, max_epochs=self.trainer_max_epochs,
                                       max_steps=self.trainer_max_steps)

    def planned_events(self, data: DataFacts) -> int | None:
        """Events of the planned run, by ``calibrate_for`` (:func:`lightning_dp.privacy.planning.planned_events`)."""
        return planning.planned_events(self.own_events(data), self.trainer_events(data), self.calibrate_for)

    @property
    def implicit_limit(self) -> bool:
        """Whether the Trainer's only limit is Lightning's default ``max_epochs``."""
        return self.trainer_max_epochs == LIGHTNING_DEFAULT_MAX_EPOCHS and (self.trainer_max_steps or -1) < 0

    def check_epochs(self, *, target_epsilon: float | None, who: str) -> None:
        """Refuse, before any data is read, a Trainer's ``max_epochs`` above DPSGD's ``epochs`` under ``"auto"``
        (lengths in steps need the steps per epoch: :meth:`resolve` checks them when training starts).

        Raises:
            MisconfigurationException: both lengths and the ways out.
        """
        if (self.calibrate_for != "auto" or self.max_steps is not None or self.epochs is None
                or (self.trainer_max_steps or -1) > 0 or self.trainer_max_epochs is None or self.implicit_limit):
            return
        if self.trainer_max_epochs > self.epochs:
            raise MisconfigurationException(self.conflict(
                f"{self.epochs} epochs (epochs={self.epochs})", f"{self.trainer_max_epochs} epochs (Trainer max_epochs="
                f"{self.trainer_max_epochs})", "epochs", self.trainer_max_epochs, target_epsilon=target_epsilon,
                who=who))

    def conflict(self, mine: str, theirs: str, key: str, agree: Any, *, target_epsilon: float | None,
                 who: str) -> str:
        """The refusal of a Trainer longer than DPSGD's plan: both lengths and the three ways out."""
        trainer_key = "max_steps" if key == "max_steps" else "max_epochs"
        return (f"{who} plans {mine} but the Trainer runs up to {theirs}: the noise would be "
                f"calibrated for the plan and target_epsilon={target_epsilon} would stop training there. Make them "
                f"agree (Trainer({trainer_key}={getattr(self, key)}) or {who}({key}={_py(agree)}); in lightning-dp "
                f"--trainer.{trainer_key}={getattr(self, key)} or, for the last callback, "
                f"--trainer.callbacks.init_args.{key}={agree}), or pass "
                "calibrate_for='trainer' (noise for the Trainer's length) or 'callback' (stop at the plan).")

    def resolve(self, data: DataFacts, *, target_epsilon: float | None, who: str) -> int | None:
        """The events a noise multiplier calibrated now is for; tells the user when the two lengths disagree.

        Raises:
            MisconfigurationException: ``calibrate_for="auto"`` and the Trainer would run longer than DPSGD's plan.
        """
        own, limit = self.own_events(data), self.trainer_events(data)
        planned = self.planned_events(data)
        if own is None or limit is None or own == limit:
            return planned
        mine, theirs = self._describe_own(data), self._describe_trainer(data)
        key = "max_steps" if self.max_steps is not None else "epochs"
        agree = self._agreeing_value(data, key)
        value = "null" if agree is None else agree  # null: no plan of its own, the Trainer's length
        set_own = (f"DPSGD's {key}={value}: DPSGD({key}={_py(agree)}) (in lightning-dp, for the last callback, "
                   f"--trainer.callbacks.init_args.{key}={value})")
        if self.calibrate_for == "auto" and limit > own and self.implicit_limit:
            rank_zero_info(f"DPSGD: calibrating the noise for DPSGD's plan of {mine}; the Trainer's limit is "
                           f"Lightning's default max_epochs={self.trainer_max_epochs}, so the plan ends the run.")
            return planned
        if self.calibrate_for == "auto" and limit > own:
            raise MisconfigurationException(self.conflict(mine, theirs, key, value, target_epsilon=target_epsilon,
                                                          who=who))
        if planned == limit:
            rank_zero_info(
                f"DPSGD: the Trainer stops after {theirs}, DPSGD planned {mine}: calibrating the noise for the "
                f"Trainer's length, so that this run spends up to target_epsilon={target_epsilon} "
                f"(calibrate_for={self.calibrate_for!r}). To calibrate for DPSGD's plan instead (one run trained over "
                f"several fits resumed from checkpoints), pass calibrate_for='callback'; to make the two agree, set "
                f"{set_own}.")
        else:
            rank_zero_info(
                f"DPSGD: calibrating the noise for DPSGD's plan of {mine} (calibrate_for='callback'); the Trainer "
                f"runs up to {theirs}, so this fit "
                + ("spends less than target_epsilon." if limit < own else "is stopped by the budget at DPSGD's plan."))
        return planned

    def _agreeing_value(self, data: DataFacts, key: str) -> int | None:
        """The value of DPSGD's ``epochs``/``max_steps`` that would match the Trainer's limit (None: none)."""
        steps = self.trainer_steps(data)
        if key == "max_steps":
            return steps
        max_epochs = self.trainer_max_epochs
        if max_epochs is not None and max_epochs > 0 and steps == max_epochs * data.steps_per_epoch:
            return max_epochs
        return None

    def _describe_own(self, data: DataFacts) -> str:
        if self.max_steps is not None:
            return f"{self.max_steps} steps (max_steps={self.max_steps})"
        steps = self.epochs * data.steps_per_epoch if self.epochs is not None else None
        return f"{self.epochs} epochs (epochs={self.epochs}, {steps} steps)"

    def _describe_trainer(self, data: DataFacts) -> str:
        steps = self.trainer_steps(data)
        max_steps = self.trainer_max_steps
        if max_steps is not None and max_steps > 0 and steps == max_steps:
            return f"{steps} steps (Trainer max_steps={max_steps})"
        return f"{self.trainer_max_epochs} epochs (Trainer max_epochs={self.trainer_max_epochs}, {steps} steps)"


def _py(value: Any) -> str:
    """A value as Python spells it (a config's null is None)."""
    return "None" if value is None or value == "null" else str(value)
