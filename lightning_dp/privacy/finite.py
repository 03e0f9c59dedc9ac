"""What a private computation does with a non-finite input: one policy for every unit of privacy.

An example whose gradient is not finite (DP-SGD, local DP-SGD), a client whose update is not finite (the
federated round, every engine and sanitizer), a node whose reply is not finite (a Flower deployment): its
contribution becomes zero, the release still happens and is accounted as planned, and how many were dropped
is an exact statistic of the data (``nonprivate/``). Letting one through would make the release non-finite
(unbounded sensitivity: a NaN model tells D' from D with certainty); stopping the run would reveal the same
fact through the stop. DESIGN.md, "One protocol per run".
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["drop_non_finite", "non_finite"]


def non_finite(values: Tensor, dim: int = -1) -> Tensor:
    """The units with an inf or NaN entry: ``values`` reduced over ``dim``.

    Args:
        values: per-unit vectors, the unit's entries along ``dim``; a 1-D tensor (per-example norms) holds one
            entry per unit, and ``dim`` is then ignored.

    Example:
        >>> non_finite(torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [float("inf"), 1.0]]))
        tensor([False,  True,  True])
    """
    if values.ndim <= 1:
        return ~torch.isfinite(values)
    # a unit whose sum is finite has only finite entries (inf + -inf is NaN, NaN stays NaN): one read of the values
    # and no mask of them; only the units whose sum is not finite (a non-finite entry, or a sum of finite ones that
    # overflows) are read entry by entry. isfinite then all() took 6 ms of a block of 534 x 7,850 (issue 53)
    bad = ~values.sum(dim=dim).isfinite()
    if bool(bad.any()):
        bad[bad.clone()] = ~torch.isfinite(values.movedim(dim, -1)[bad]).all(dim=-1)
    return bad


def drop_non_finite(rows: Tensor, origin: Tensor | float = 0.0) -> tuple[Tensor, Tensor]:
    """``rows`` with every row whose contribution ``rows - origin`` has an inf or NaN entry replaced by ``origin`` (its
    zero contribution), and the mask of the replaced rows.

    Args:
        rows: (m, ..., P) per-unit vectors along the last dimension: clients' trained models (``origin``: the
            models they started from, (m, P) or broadcastable, so that the update is zero) or per-example
            gradients (``origin`` 0).
        origin: what a dropped row becomes.

    Returns:
        ``(kept, dropped)``: a new tensor (or ``rows`` itself when every row is finite) and the (m, ...) bool mask.

    Example:
        >>> kept, dropped = drop_non_finite(torch.tensor([[1.0, 2.0], [float("nan"), 0.0]]), torch.zeros(2))
        >>> kept, dropped
        (tensor([[1., 2.],
                [0., 0.]]), tensor([False,  True]))
    """
    zero = not isinstance(origin, Tensor) and origin == 0
    origin = torch.as_tensor(origin, dtype=rows.dtype, device=rows.device)
    # the unit's contribution is rows - origin (a client's update): a finite model can still be an infinite step
    # from its start (float16 or float32 near its largest value), whose clipping would give 0 * inf = NaN
    # (origin 0 given as a number: the rows themselves; x - 0 is x for every x, so a zero tensor gives the same units.
    # origin.any() of a start expanded to (m, P) read all m x P entries)
    contribution = rows if zero else rows - origin
    dropped = non_finite(contribution, dim=-1) if rows.ndim > 1 else non_finite(contribution)
    if not bool(dropped.any()):
        return rows, dropped
    mask = dropped.unsqueeze(-1) if rows.ndim > 1 else dropped
    return torch.where(mask, origin, rows), dropped
