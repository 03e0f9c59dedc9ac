"""Per-sample gradients of one parameter from one layer, in the form that is cheapest to use.

:class:`Factored` (``G_b = sum_t left[b, t] (x) right[b, t]``: ghost norms from Gram matrices),
:class:`OneHotFactored` (embeddings) and :class:`Dense`; a tied parameter gets one contribution per use, and
:meth:`Contribution.dot` gives the cross terms of its norm. The forms and an example: docs/per_sample_gradients.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["Contribution", "Dense", "Factored", "Groups", "OneHotFactored", "choose_layer_strategy",
           "DEFAULT_INSTANTIATE_LIMIT", "DEFAULT_KEEP_LIMIT"]

#: Instantiated per-sample gradients larger than this (bytes, per contribution) force the ghost norm.
DEFAULT_INSTANTIATE_LIMIT = 512 * 2**20

#: Instantiated per-sample gradients larger than their factors that one step keeps from the norms to the clipped sum
#: (bytes, all contributions together); beyond it they are released and the sum recomputed from the factors.
DEFAULT_KEEP_LIMIT = 64 * 2**20


def choose_layer_strategy(batch: int, positions: int, d_in: int, d_out: int, *, bytes_per_element: int = 4,
                          instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT) -> str:
    """Chooses between the ghost norm and instantiated per-sample gradients for one factored weight.

    Costs in multiply-adds for a weight of shape ``(d_out, d_in)`` seen at ``positions``
    positions per example (sequence length, or output pixels of a convolution):

    * ghost: Gram matrices ``B T^2 (d_in + d_out)`` plus the clipped sum ``B T d_in d_out``;
    * instantiate: ``B T d_in d_out`` for the per-sample gradients plus ``3 B d_in d_out``
      for their norms and weighted sum, and ``B d_in d_out`` elements of memory.

    Returns:
        ``"ghost"`` or ``"instantiate"``.
    """
    ghost = batch * positions * positions * (d_in + d_out) + batch * positions * d_in * d_out
    inst = batch * positions * d_in * d_out + 3 * batch * d_in * d_out
    if batch * d_in * d_out * bytes_per_element > instantiate_limit:
        return "ghost"
    return "ghost" if ghost < inst else "instantiate"


class Contribution:
    """The per-sample gradients ``G_b`` (b = 1..B) of one parameter from one layer.

    Attributes:
        shape: the parameter's shape.
    """

    shape: torch.Size

    def sq_norms(self) -> Tensor:
        """``||G_b||^2``, shape ``(B,)``."""
        raise NotImplementedError

    def weighted_sum(self, factors: Tensor) -> Tensor:
        """``sum_b factors[b] G_b``, in the parameter's shape."""
        raise NotImplementedError

    def dense(self) -> Tensor:
        """``G`` as a ``(B, *shape)`` tensor (may be large)."""
        raise NotImplementedError

    def dot(self, other: Contribution) -> Tensor:
        """``<G_b, G'_b>`` per example, shape ``(B,)`` (the cross term of tied parameters)."""
        mine, theirs = self.dense(), other.dense()  # (B, *shape); a scalar parameter's is (B,)
        return (mine.reshape(mine.shape[0], -1) * theirs.reshape(theirs.shape[0], -1)).sum(1)

    def drop(self, examples: Tensor) -> None:
        """Sets ``G_b = 0`` for every ``b`` where the boolean ``examples`` is True (examples whose gradient
        overflowed in half precision: a zero contribution is within any clipping bound)."""
        raise NotImplementedError

    def margin(self) -> Tensor | None:
        """Per example (float64), a bound on how much larger the norm of this contribution's share of
        :meth:`weighted_sum` (its row for a factor of 1) can be than ``sqrt(sq_norms())`` through floating point,
        where the per-sample gradient is summed from terms that can cancel (positions of a sequence: a Gram matrix's
        sums, a product over every example's positions): :func:`cancellation_margin`. None where the norm is that
        of the per-sample gradient as it is summed (instantiated, or one term per example). Asked for after
        :meth:`release`, which changes it."""
        return None

    def releasable_bytes(self) -> int:
        """Bytes this contribution keeps after :meth:`sq_norms` that it can do without (per-sample gradients
        instantiated for the norms, larger than the factors it holds anyway): 0 for most forms."""
        return 0

    def release(self) -> None:
        """Frees what :meth:`releasable_bytes` counts; :meth:`weighted_sum` then recomputes from the factors."""

    def grouped(self, groups: Groups) -> Contribution:
        """The contribution of the groups, ``H_g = sum_{b in g} w_b G_b``, in this contribution's form (a user's
        examples side by side: the factors' positions of its examples concatenated, :class:`Groups`)."""
        raise NotImplementedError


class Groups:
    """Examples ``b = 0..B-1`` in ``count`` groups (a batch's users): ``group[b]``, the example's ``slot`` among its
    group's (0..slots-1), and the weights ``w_b`` of :meth:`Contribution.grouped`.

    Example:
        >>> g = Groups.of_sizes([2, 1], torch.tensor([0.5, 0.5, 1.0]))
        >>> g.group.tolist(), g.slot.tolist(), g.count, g.slots
        ([0, 0, 1], [0, 1, 0], 2, 2)
    """

    def __init__(self, group: Tensor, slot: Tensor, count: int, slots: int, weights: Tensor) -> None:
        self.group, self.slot, self.count, self.slots, self.weights = group, slot, count, slots, weights

    @classmethod
    def of_sizes(cls, sizes: Sequence[int], weights: Tensor) -> Groups:
        """Groups of consecutive examples, ``sizes[g]`` in group ``g``."""
        device = weights.device
        counts = torch.tensor(list(sizes), dtype=torch.long, device=device)
        total = int(sum(sizes))  # known on the host: repeat_interleave need not compute (or sync for) it
        group = torch.repeat_interleave(torch.arange(len(sizes), device=device), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(total, device=device) - starts[group]  # position within its group
        return cls(group, slot, len(sizes), max(sizes, default=1), weights)

    def place(self, rows: Tensor) -> Tensor:
        """``rows`` ``(B, T, ...)`` placed at ``(group, slot)`` of a zero ``(count, slots * T, ...)`` tensor."""
        b, t = rows.shape[:2]
        out = rows.new_zeros((self.count * self.slots, t, *rows.shape[2:]))
        out.index_copy_(0, self.group * self.slots + self.slot, rows)
        return out.reshape(self.count, self.slots * t, *rows.shape[2:])

    def scaled(self, rows: Tensor) -> Tensor:
        """``rows`` (examples first) times the weights."""
        return rows * self.weights.to(rows.dtype).view(-1, *([1] * (rows.dim() - 1)))


def _row_sq(t: Tensor) -> Tensor:
    """``||t_b||^2`` over everything but dimension 0, in two operations: squares and a sum for a small tensor (its
    rows' widths are factors of a norm), one pass of ``vector_norm`` for a large one (per-sample gradients: no
    temporary as large as they are)."""
    if t.numel() <= 2**16:
        return t.square().sum(1) if t.dim() == 2 else t.square().reshape(t.shape[0], -1).sum(1)
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1).square()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (no dispatched operation when it is already)."""
    return t if t.dtype == dtype else t.to(dtype)


def _zero_rows(t: Tensor, examples: Tensor) -> Tensor:
    """``t`` with its rows (dimension 0) at ``examples`` set to 0, out of place (``t`` may be a shared view)."""
    return t.masked_fill(examples.view(-1, *([1] * (t.dim() - 1))), 0)


def _gamma(n: int, dtype: torch.dtype) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative bound on the rounding of a sum of ``n`` terms in ``dtype``
    (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1), whatever the order of the summation."""
    u = torch.finfo(dtype).eps / 2
    nu = n * u
    return nu / (1 - nu) if nu < 0.5 else math.inf


def _term_norms(t: Tensor) -> Tensor:
    """``||t[b, i]||`` over the last dimension, float64 ``(B, T)``."""
    return torch.linalg.vector_norm(t, dim=-1, dtype=torch.float64)


#: A per-sample gradient summed from terms whose magnitudes add up to more than this many times its norm gets the
#: margin of :func:`cancellation_margin` (below, floating point moves its share of a sum by at most this many times
#: the rounding of a sum of already clipped gradients, which no margin covers anywhere: not amplified). Random
#: positions give about ``sqrt(T)`` times: the tests' sequences stay below it.
CANCELLATION_RATIO = 8.0


def cancellation_margin(sq: Tensor, sizes: Tensor, gram: float, summed: float) -> Tensor:
    """``sqrt(sq + gram sizes^2) - sqrt(sq) + summed sizes`` where ``sizes > CANCELLATION_RATIO * sqrt(sq)``, else 0
    (float64).

    A per-example gradient ``G_b = sum_t l_bt (x) r_bt`` assembled from terms whose magnitudes add up to
    ``sizes[b]`` (``sum_t ||l_bt|| ||r_bt||``) has a norm of at most ``sqrt(sq[b] + gram sizes[b]^2)``, ``sq`` the
    square its Gram matrices give (their rounding is at most ``gram sizes[b]^2``), and its share of a sum over the
    batch's terms is within ``summed sizes[b]`` of ``G_b`` (``summed``: the relative bound of that sum's
    rounding). Added to the norm, it makes the clipping bound hold for what floating point sums, not only for
    ``G_b``: where the terms cancel (two positions with one huge input and opposite gradients: ``G_b`` small,
    ``sizes[b]`` huge) the norm rounded to 0 for a gradient of 2e4 C and the sum carried that gradient unclipped (a
    review; docs/per_sample_gradients.md, "Floating point")."""
    square = sq.double().clamp_min(0)
    norms = square.sqrt()
    bound = (square + gram * sizes.square()).sqrt() - norms + summed * sizes
    return torch.where(sizes > CANCELLATION_RATIO * norms, bound, torch.zeros_like(sizes))


class Dense(Contribution):
    """Per-sample gradients held as one ``(B, ...)`` tensor.

    Args:
        grads: ``(B, *shape)``, or ``(B, *layout)`` with ``to_param``.
        shape: the parameter's shape (default: ``grads.shape[1:]``).
        to_param: maps the stored layout of one example (or of a batch, with a leading
            dimension) to the parameter's shape, when the rule computes the gradients in
            another layout (a grouped convolution's ``(groups, d, p)``): norms and the
            weighted sum are taken in the stored layout and only the sum is transformed.
    """

    def __init__(self, grads: Tensor, shape: Sequence[int] | None = None,
                 to_param: Callable[[Tensor], Tensor] | None = None, *,
                 sq_norms: Callable[[], Tensor] | None = None) -> None:
        self.shape = torch.Size(grads.shape[1:] if shape is None else shape)
        self.to_param = to_param
        if to_param is None and grads.shape[1:] != self.shape:
            grads = grads.reshape(grads.shape[0], *self.shape)
        self.grads = grads
        # ||G_b||^2 computed by another contribution from the same tensor (a linear layer's bias gradient is its
        # output gradient, whose squared norms the weight's norm needs too); forgotten when the rows change
        self._sq_norms = sq_norms

    def sq_norms(self) -> Tensor:
        if self._sq_norms is not None:
            return self._sq_norms()
        return _row_sq(self.grads)

    def weighted_sum(self, factors: Tensor) -> Tensor:
        grads = self.grads
        f = _as(factors, grads.dtype)
        if grads.dim() == 2:  # one matrix-vector product, no reshapes
            summed = torch.mv(grads.t(), f)
        else:
            summed = torch.mv(grads.reshape(grads.shape[0], -1).t(), f).view(grads.shape[1:])
        if self.to_param is not None:
            summed = self.to_param(summed)
        return summed if summed.shape == self.shape else summed.reshape(self.shape)

    def dense(self) -> Tensor:
        return self.grads if self.to_param is None else self.to_param(self.grads).reshape(-1, *self.shape)

    def dot(self, other: Contribution) -> Tensor:
        if isinstance(other, Factored):
            return other.dot(self)
        return super().dot(other)

    def drop(self, examples: Tensor) -> None:
        self.grads = _zero_rows(self.grads, examples)
        self._sq_norms = None

    def grouped(self, groups: Groups) -> Contribution:
        summed = self.grads.new_zeros((groups.count, *self.grads.shape[1:]))
        summed.index_add_(0, groups.group, groups.scaled(self.grads))
        return Dense(summed, self.shape, self.to_param)


class Factored(Contribution):
    """``G_b = sum_t left[b, t] (x) right[b, t]`` reshaped to ``shape``; left ``(B, T, p)``, right ``(B, T, d)``.

    The norms use Gram matrices ("ghost") or instantiated gradients, whichever
    :func:`choose_layer_strategy` says is cheaper. Instantiated gradients are kept for
    :meth:`weighted_sum` of the same step (one matrix-vector product instead of a matrix product
    of the factors, the cost of a batch weight gradient). Those larger than the factors the
    contribution holds anyway are :meth:`releasable_bytes`: the engine keeps them within its
    ``keep_limit`` for the whole step and releases the rest, so that its memory stays within
    twice its records plus that limit (docs/benchmarks.md).
    """

    def __init__(self, left: Tensor, right: Tensor, shape: Sequence[int], *,
                 instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT) -> None:
        # ``(B, p)`` and ``(B, d)`` (one position per example: a linear layer on a batch of vectors) are kept as they
        # are: the norm is then ||left_b||^2 ||right_b||^2 and the weighted sum one matrix product, with no reshape
        # (a small model's step is a few dozen such operations, each of which costs its dispatch)
        self._flat = left.dim() == 2
        self._left, self._right = left, right
        self.shape = torch.Size(shape)
        self.instantiate_limit = instantiate_limit
        self._dense: Tensor | None = None
        self._row_sq: list[Tensor | None] = [None, None]  # ||left_b||^2, ||right_b||^2 (flat only), once per step
        self._sq: Tensor | None = None  # the squared norms sq_norms() gave (for margin())

    @property
    def left(self) -> Tensor:
        """``(B, T, p)``."""
        return self._left.unsqueeze(1) if self._flat else self._left

    @property
    def right(self) -> Tensor:
        """``(B, T, d)``."""
        return self._right.unsqueeze(1) if self._flat else self._right

    def left_sq_norms(self) -> Tensor:
        """``||left_b||^2`` of a contribution with one position per example (a bias shares it: :class:`Dense`)."""
        return self._factor_sq(0)

    def right_sq_norms(self) -> Tensor:
        """``||right_b||^2`` of a contribution with one position per example."""
        return self._factor_sq(1)

    def _factor_sq(self, i: int) -> Tensor:
        if not self._flat:
            raise ValueError("the squared norms of one factor are defined for one position per example (2-D factors)")
        sq = self._row_sq[i]
        if sq is None:
            sq = self._row_sq[i] = _row_sq(self._left if i == 0 else self._right)
        return sq

    @property
    def _b_t_p_d(self) -> tuple[int, int, int, int]:
        if self._flat:
            b, p = self._left.shape
            return b, 1, p, self._right.shape[-1]
        b, t, p = self._left.shape
        return b, t, p, self._right.shape[-1]

    def _strategy(self) -> str:
        b, t, p, d = self._b_t_p_d
        return choose_layer_strategy(b, t, d, p, bytes_per_element=self._left.element_size(),
                                     instantiate_limit=self.instantiate_limit)

    def sq_norms(self) -> Tensor:
        if self._flat:
            return self.left_sq_norms() * self.right_sq_norms()
        b, t, p, d = self._b_t_p_d
        if t == 1:
            return _row_sq(self._left) * _row_sq(self._right)
        if self._strategy() == "ghost":
            # in float64: the Gram form sums terms that can be far larger than the norm (cancelling positions), and
            # its rounding is bounded in margin()
            left, right = self._left.double(), self._right.double()
            sq = (torch.bmm(left, left.transpose(1, 2)) * torch.bmm(right, right.transpose(1, 2))).sum((1, 2))
        else:
            grads = self._dense = torch.bmm(self._left.transpose(1, 2), self._right)  # (B, p, d), for the sum
            sq = _row_sq(grads)
        self._sq = sq
        return sq

    def margin(self) -> Tensor | None:
        if self._flat:
            return None
        b, t, p, d = self._b_t_p_d
        if t == 1:
            return None  # one term per example: its norm is the product of the factors' norms
        if self._dense is not None:
            return None  # the norm is the instantiated gradient's, which the weighted sum sums
        if self._sq is None:
            return None  # no norm asked for yet
        sizes = (_term_norms(self._left) * _term_norms(self._right)).sum(1)
        dtype = self._left.dtype
        if self._strategy() == "ghost":  # the norm from float64 Gram matrices, the sum a product over all positions
            gram = _gamma(p + 1, torch.float64) + _gamma(d + 1, torch.float64) + _gamma(t * t + 1, torch.float64)
            return cancellation_margin(self._sq, sizes, gram, _gamma(b * t, dtype))
        # released: the norm was the instantiated gradient's (a sum over t positions in the factors' dtype), the
        # weighted sum a product over all positions
        return cancellation_margin(self._sq, sizes, 0.0, _gamma(t, dtype) + _gamma(b * t, dtype))

    def releasable_bytes(self) -> int:
        if self._dense is None:
            return 0
        b, t, p, d = self._b_t_p_d
        return 0 if p * d <= t * (p + d) else self._dense.numel() * self._dense.element_size()

    def release(self) -> None:
        self._dense = None

    def dense(self) -> Tensor:
        if self._flat:
            grads = self._left.unsqueeze(2) * self._right.unsqueeze(1)
        else:
            grads = self._dense if self._dense is not None else torch.bmm(self._left.transpose(1, 2), self._right)
        return grads.view(grads.shape[0], *self.shape)

    def weighted_sum(self, factors: Tensor) -> Tensor:
        left, right = self._left, self._right
        f = _as(factors, left.dtype)
        if self._flat:
            # sum_b f_b left_b (x) right_b = (left^T diag(f)) right: the factors scale the narrower side
            if left.shape[1] <= right.shape[1]:
                out = torch.mm(left.t() * f, right)
            else:
                out = torch.mm(left.t(), right * f.unsqueeze(1))
            return out if out.shape == self.shape else out.view(self.shape)
        if self._dense is not None:
            return torch.mv(self._dense.flatten(1).t(), f).view(self.shape)
        b, t, p, d = self._b_t_p_d
        return ((left * f[:, None, None]).reshape(-1, p).T @ right.reshape(-1, d)).view(self.shape)

    def dot(self, other: Contribution) -> Tensor:
        if isinstance(other, OneHotFactored):
            return other.dot(self)
        if isinstance(other, Factored):
            left, right, o_left, o_right = self.left.double(), self.right.double(), other.left.double(), other.right.double()
            return (torch.bmm(left, o_left.transpose(1, 2)) * torch.bmm(right, o_right.transpose(1, 2))).sum((1, 2))
        # Dense: <sum_t l_t r_t^T, D> = sum_t l_t^T D r_t
        d = other.dense().reshape(self.left.shape[0], self.left.shape[-1], self.right.shape[-1])
        return torch.einsum("btp,bpd,btd->b", self.left, d, self.right)

    def drop(self, examples: Tensor) -> None:
        self._left, self._right = _zero_rows(self._left, examples), _zero_rows(self._right, examples)
        self._row_sq = [None, None]
        if self._sq is not None:
            self._sq = _zero_rows(self._sq, examples)
        if self._dense is not None:
            self._dense = _zero_rows(self._dense, examples)

    def grouped(self, groups: Groups) -> Contribution:
        # a group's gradient is the sum over its examples' positions: their factors side by side (zeros pad)
        return Factored(groups.place(groups.scaled(self.left)), groups.place(self.right), self.shape,
                        instantiate_limit=self.instantiate_limit)


class OneHotFactored(Contribution):
    """An embedding's ``G_b = sum_t e_{index[b, t]} (x) right[b, t]``: rows of a ``(V, d)`` table.

    Positions whose ``right`` is zero (padding) contribute nothing. Norms use the
    token-equality Gram matrix, never a ``(B, V, d)`` tensor.
    """

    def __init__(self, index: Tensor, right: Tensor, shape: Sequence[int]) -> None:
        if index.dim() == 1:
            index, right = index.unsqueeze(1), right.unsqueeze(1)
        self.index, self.right = index, right
        self.shape = torch.Size(shape)
        self._sq: Tensor | None = None  # the squared norms sq_norms() gave (for margin())

    def sq_norms(self) -> Tensor:
        # in float64: positions of one token whose gradients cancel make the Gram form's terms far larger than the
        # norm (margin() bounds the rounding)
        right = self.right.double()
        same = (self.index.unsqueeze(2) == self.index.unsqueeze(1)).to(right.dtype)  # (B, T, T)
        self._sq = (same * torch.bmm(right, right.transpose(1, 2))).sum((1, 2))
        return self._sq

    def margin(self) -> Tensor | None:
        b, t, d = self.right.shape
        if t == 1:
            return None
        gram = _gamma(d + 1, torch.float64) + _gamma(t * t + 1, torch.float64)
        # the weighted sum adds every position's row into the table: at most b * t rows into one
        if self._sq is None:
            return None  # no norm asked for yet
        return cancellation_margin(self._sq, _term_norms(self.right).sum(1), gram, _gamma(b * t, self.right.dtype))

    def weighted_sum(self, factors: Tensor) -> Tensor:
        weighted = (self.right * factors.to(self.right.dtype)[:, None, None]).reshape(-1, self.right.shape[-1])
        out = torch.zeros(self.shape[0], math.prod(self.shape[1:]), dtype=self.right.dtype, device=self.right.device)
        return out.index_add_(0, self.index.reshape(-1), weighted).view(self.shape)

    def dense(self) -> Tensor:
        b, t, d = self.right.shape
        out = torch.zeros(b, self.shape[0], d, dtype=self.right.dtype, device=self.right.device)
        out.scatter_add_(1, self.index.unsqueeze(-1).expand(b, t, d), self.right)
        return out.view(b, *self.shape)

    def dot(self, other: Contribution) -> Tensor:
        # in float64, as the squared norms (a tied parameter's cross term can cancel them)
        if isinstance(other, OneHotFactored):
            same = (self.index.unsqueeze(2) == other.index.unsqueeze(1)).to(torch.float64)
            return (same * torch.bmm(self.right.double(), other.right.double().transpose(1, 2))).sum((1, 2))
        if isinstance(other, Factored) and other.left.shape[-1] == self.shape[0]:
            # <e_i (x) r_t, l_s (x) r'_s> = l_s[i] (r_t . r'_s): gather the rows of `left` at our indices
            b, t = self.index.shape
            picked = other.left.gather(2, self.index.unsqueeze(1).expand(b, other.left.shape[1], t))  # (B, S, T)
            return (picked.transpose(1, 2).double()
                    * torch.bmm(self.right.double(), other.right.double().transpose(1, 2))).sum((1, 2))
        return super().dot(other)

    def drop(self, examples: Tensor) -> None:
        self.right = _zero_rows(self.right, examples)
        if self._sq is not None:
            self._sq = _zero_rows(self._sq, examples)

    def grouped(self, groups: Groups) -> Contribution:
        # padded positions point at row 0 with a zero right factor: they contribute nothing
        return OneHotFactored(groups.place(self.index), groups.place(groups.scaled(self.right)), self.shape)
