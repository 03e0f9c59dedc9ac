"""``target_epsilon``'s enforcement for DPSGD: how many more accounted events fit in the budget, for the event each
step is accounted as now, and how many have been taken since.

The accountant answers "how many more" (:meth:`~lightning_dp.privacy.accounting.Accountant.max_steps`: the spend of
the history plus that many events stays within ``(target_epsilon, delta)``); this holds the answer and the count, so
that the callback stops training before a step that would exceed the budget, and recomputes the answer when the
event changes (a reloaded loader changes ``q``). No Lightning here: the callback decides when to stop and says why.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Budget"]


class Budget:
    """The events the budget allows from the last :meth:`update`, and those taken since."""

    def __init__(self) -> None:
        self.allowed: int | None = None  #: events that fit from the last update (None: no budget)
        self.taken = 0  #: events taken since the last update
        self.event: tuple[float, float] | None = None  #: the (multiplier, rate) ``allowed`` was computed for
        self.plan_done = False  #: ``allowed`` is the planned length, not the budget's limit
        self.stopped_at: int | None = None  #: the step after which the budget or the plan stopped training

    def start(self) -> None:
        """A new fit: the next :meth:`update` computes afresh."""
        self.event, self.stopped_at = None, None

    def update(self, event: tuple[float, float], *, accountant: Any, target_epsilon: float, target_delta: float,
               planned: int | None) -> bool:
        """Recompute ``allowed`` for ``event = (noise multiplier, sample rate)`` unless it is the event of the last
        update; returns whether it was recomputed. ``planned``: the planned events (the search's upper limit)."""
        if event == self.event:
            return False
        sigma_e, q_e = event
        limit = planned if planned is not None else 10**7
        self.allowed = accountant.max_steps(target_epsilon, target_delta, noise_multiplier=sigma_e, sample_rate=q_e,
                                            limit=limit)
        self.plan_done = planned is not None and self.allowed == planned  # the plan ends first, not the budget
        self.taken = 0
        self.event = event
        return True

    def take(self) -> None:
        """One accounted event was released."""
        self.taken += 1

    @property
    def spent(self) -> bool:
        """No further event fits (False without a budget)."""
        return self.allowed is not None and self.taken >= self.allowed
