"""Whether a delta is small enough for the number of units it protects: the ``delta < 1/N`` rule.

At ``delta >= 1/N`` a mechanism that publishes one random unit whole meets any epsilon, so such an epsilon
says nothing. Every accountant of the project asks :func:`check_delta_for_size` once it knows ``N``; the
components warn with :class:`LargeDeltaWarning` (``warnings.simplefilter("error", LargeDeltaWarning)`` refuses).
Who checks which ``N``, and why a warning: docs/privacy.md, "Delta and the number of protected units".
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
    "users": ("users of the training data", "every record of one random user"),
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
