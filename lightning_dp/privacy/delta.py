"""Whether a delta is small enough for the number of units it protects: the ``delta < 1/N`` rule.

An ``(epsilon, delta)`` guarantee allows a probability ``delta`` of anything. The mechanism
that picks one of the ``N`` protected units (examples, clients, records of a client) at
random and publishes it whole satisfies ``(0, 1/N)``-DP: at ``delta >= 1/N`` it meets ANY
epsilon, 0 included, while exposing someone completely with certainty (Dwork & Roth, "The
Algorithmic Foundations of Differential Privacy", 2014, section 2.3: "values of delta on the
order of 1/||x||_1 are very dangerous"). A reported epsilon at such a delta therefore says
nothing (issue 24: ``CentralGaussian`` with 10 clients and delta 0.3 reported epsilon 0.0).
The usual choice is ``delta << 1/N``.

Every accountant of the project asks :func:`check_delta_for_size` once it knows ``N``, so that
the rule and its wording live in one place:

- :class:`~lightning_dp.callbacks.DPSGD`: N training examples;
- :class:`~lightning_dp.federated.parts.CentralGaussian`: N training clients (client-level DP);
- :class:`~lightning_dp.federated.parts.LocalDPSGD`: the ``n_c`` records of each client (its
  :class:`~lightning_dp.privacy.ledger.RecordLedger` states one epsilon per client at one delta),
  reported once for all clients (the exposed ones are the LARGEST: ``delta >= 1/n_c`` when ``n_c >= 1/delta``);
- ``lightning-dp epsilon`` (:mod:`lightning_dp.commands.epsilon`) prints the message the training would give.

Local DP ledgers need no check: a local release protects the client's whole data, one unit
(``N = 1``), and their delta is already required to be below 1
(:class:`~lightning_dp.privacy.ledger.GaussianLedger`); d-privacy ledgers
(:class:`~lightning_dp.privacy.ledger.PrivacyLedger`) are pure epsilon.

Warning, not refusal: epsilon at a large delta is still a true statement, and small
experiments (a federation of 10 clients) may knowingly use one; so the components warn with
:class:`LargeDeltaWarning` (the shells emit it through Lightning's ``rank_zero_warn``), as
:class:`~lightning_dp.callbacks.DPSGD` always did. ``warnings.simplefilter("error",
LargeDeltaWarning)`` turns it into a refusal.

Example:
    >>> print(check_delta_for_size(1e-5, 60_000))
    None
    >>> print(check_delta_for_size(0.3, 10, unit="clients", who="CentralGaussian"))  # doctest: +NORMALIZE_WHITESPACE
    CentralGaussian: target_delta=0.3 is not below 1/N = 0.1 (N = 10 training clients): a mechanism that
    publishes one random client's data whole satisfies such a delta with any epsilon, even 0, so the
    reported epsilon does not mean privacy. Use delta << 1/N, e.g. 1e-02.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["LargeDeltaWarning", "check_delta_for_size"]

#: unit -> (what N counts, what the breaching mechanism publishes)
_UNITS = {
    "examples": ("training examples", "one random example"),
    "clients": ("training clients", "one random client's data"),
    "records": ("records of a client", "one random record of the client"),
}


class LargeDeltaWarning(UserWarning):
    """A delta that is not below ``1/N`` for the ``N`` units its guarantee protects (module docstring)."""


def _suggested(size: int) -> str:
    """A delta an order of magnitude below ``1/size``, as a power of ten."""
    return f"{10 ** math.floor(math.log10(1 / size) - 1):.0e}"


def check_delta_for_size(delta: float, size: int | Sequence[int], *, unit: str = "examples", who: str = "DPSGD",
                         name: str = "target_delta") -> LargeDeltaWarning | None:
    """The warning a component gives when ``delta >= 1/N`` (module docstring), or None when delta is below it.

    Args:
        delta: the delta the component states its epsilon at.
        size: N, the number of protected units; or one N per client (``unit="records"``: the records
            ``n_c`` of every client, each client's epsilon being stated at the same delta), for which ONE
            warning names how many clients are concerned and the range of their ``n_c``: since ``delta >= 1/n``
            exactly when ``n >= 1/delta``, the LARGEST clients are the exposed ones, and the advice is a delta
            below ``1/max n_c``. Sizes below 1 (an empty client, an unknown N given as 0) are skipped.
        unit: ``"examples"``, ``"clients"`` or ``"records"``.
        who: the component, which starts the message.
        name: the component's name for delta (``"target_delta"``, ``"delta"``).

    Returns:
        A :class:`LargeDeltaWarning` to emit (``warnings.warn(w)`` or Lightning's ``rank_zero_warn(w)``), whose
        text is the message; None when delta is below ``1/N`` for every size.

    Raises:
        ValueError: for an unknown ``unit``.

    Example:
        >>> w = check_delta_for_size(1e-3, [5000, 40, 1200, 12], unit="records", who="LocalDPSGD", name="delta")
        >>> str(w).split(" (")[0]
        'LocalDPSGD: delta=0.001 is not below 1/N for 2 of 4 clients, those with N >= 1200'
    """
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r} is not allowed; choose one of {', '.join(_UNITS)}")
    counted, published = _UNITS[unit]
    delta = float(delta)
    advice = ("satisfies such a delta with any epsilon, even 0, so the reported epsilon does not mean privacy. Use "
              "delta << 1/N")
    if isinstance(size, Sequence):
        sizes = [int(n) for n in size if int(n) >= 1]
        exposed = [n for n in sizes if delta >= 1 / n]
        if not exposed:
            return None
        # delta >= 1/n exactly when n >= 1/delta: the LARGEST clients are the exposed ones
        smallest, largest = min(exposed), max(exposed)
        return LargeDeltaWarning(
            f"{who}: {name}={delta:g} is not below 1/N for {len(exposed)} of {len(sizes)} clients, those with N >= "
            f"{smallest} (N = {counted}; the largest has N = {largest}, 1/N = {1 / largest:.3g}): for each of them a "
            f"mechanism that publishes {published} whole {advice} of the largest client, e.g. {_suggested(largest)}.")
    n = int(size)
    if n < 1 or delta < 1 / n:
        return None
    return LargeDeltaWarning(f"{who}: {name}={delta:g} is not below 1/N = {1 / n:.3g} (N = {n} {counted}): a "
                             f"mechanism that publishes {published} whole {advice}, e.g. {_suggested(n)}.")
