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

__all__ = ["Contribution", "Dense", "Factored", "Groups", "OneHotFactored", "choose_layer_strategy", "term_floor",
           "term_norms", "floor_of", "DEFAULT_INSTANTIATE_LIMIT", "DEFAULT_KEEP_LIMIT"]

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

    def term_sizes(self) -> tuple[Tensor, Tensor]:
        """``(sizes, counts)`` float64 ``(B,)``: the sum of the magnitudes of the terms ``G_b`` is summed from, and
        how many are nonzero (:func:`position_terms`); after :meth:`sq_norms`. A tied parameter's uses add theirs,
        and the parameter's norm, cross terms included, is floored by them (the engine's ``_norms_of``). Here: the
        gradient as one term, ``(||G_b||, 1)``, for a form without positions."""
        return _one_term(self.sq_norms())

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


def _one_term(sq: Tensor) -> tuple[Tensor, Tensor]:
    """:meth:`Contribution.term_sizes` of gradients of squared norms ``sq`` that are one term each."""
    sq = sq.double()
    return sq.clamp_min(0).sqrt(), (sq > 0).to(torch.float64)


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


def term_norms(t: Tensor) -> Tensor:
    """``||t[b, i]||`` over the last dimension, ``(B, T)``, computed in ``t``'s dtype (a float64 pass cost the
    Transformer's step 4 ms) and returned in float64: an entry beyond 1.8e19 in float32 overflows it to inf, and the
    example's norm with it (:func:`floored`): the engine then drops the example (a zero contribution, counted as
    clipped), as it drops any example whose norm is not finite."""
    return torch.linalg.vector_norm(t, dim=-1).double()


#: A per-sample gradient summed from positions' terms whose magnitudes add up to more than this many times its norm,
#: or more than twice the square root of its number of positions times it, if that is larger, is summed from its own
#: instantiated gradient, not from the factors (:meth:`Factored.sq_norms`), and clipped as if its norm were that sum
#: over the ratio (:func:`term_floor`). Random positions give about the square root of their number: such examples
#: keep the factors' path and their norms.
CANCELLATION_RATIO = 8.0


def cancelling(sq: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``(B,)`` bool: the examples of ``G_b = sum_t left[b, t] (x) right[b, t]`` whose terms cancel, ``sum_t
    ||left_bt|| ||right_bt||`` above ``max(CANCELLATION_RATIO, 2 sqrt(T_b))`` times ``sqrt(sq[b])`` (``T_b`` the
    example's nonzero terms). Each example's own numbers only: what other examples a batch holds, and how far it is
    padded, changes nothing.

    Where the terms cancel (two positions of one huge input with opposite output gradients: ``G_b`` small, its terms
    huge), floating point follows the terms, not ``G_b``: the Gram form rounded such a norm to 0 for a gradient of
    2e4 C, and a product over the batch's positions carried that gradient unclipped (a review;
    docs/per_sample_gradients.md, "Floating point"). Below the ratio, an example's terms are at most that many
    times its clipped gradient, and floating point moves its share of a sum by at most that many times the rounding
    of any sum of clipped gradients."""
    floor = term_floor(term_norms(left) * term_norms(right))
    return floor > sq.double().clamp_min(0).sqrt()


def term_floor(terms: Tensor) -> Tensor:
    """``sum_t terms[b, t] / max(CANCELLATION_RATIO, 2 sqrt(T_b))`` (float64 ``(B,)``; ``terms`` the magnitudes of
    an example's terms, ``T_b`` the nonzero ones): the least norm an example's gradient is clipped as (:func:`floored`).

    An example's float32 gradient moves with the batch through rounding (a mean loss divides every output gradient
    by the batch size), by a fraction of its terms' magnitude; clipped as if its norm were at least this, its clipped
    share moves by at most about ``max(8, 2 sqrt(T_b))`` times that fraction of C, however much its terms cancel
    (a review: 1,023 identical examples whose terms cancel 1e6 times moved neighbouring sums 27 C apart without it;
    docs/per_sample_gradients.md, "Floating point")."""
    return floor_of(*position_terms(terms))


def floor_of(sizes: Tensor, counts: Tensor) -> Tensor:
    """:func:`term_floor` from each example's sum of term magnitudes and its count of nonzero terms (which add up
    over the records of a user: :meth:`Dense.grouped`)."""
    return sizes / torch.clamp(2 * counts.sqrt(), min=CANCELLATION_RATIO)


def position_terms(norms: Tensor) -> tuple[Tensor, Tensor]:
    """``(sizes, counts)`` for :class:`Dense`'s ``terms`` from the magnitudes of each example's positions' terms
    ``(B, T)`` (:func:`term_norms`): their sum and the count of nonzero ones, float64 ``(B,)``."""
    return norms.sum(1, dtype=torch.float64), torch.count_nonzero(norms, dim=1).to(torch.float64)


def add_terms(a: tuple[Tensor, Tensor] | None, b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The ``terms`` of a gradient summed from two sets of terms (two calls of a layer, two uses of a bias)."""
    return b if a is None else (a[0] + b[0], a[1] + b[1])


def floored(sq: Tensor, floor: Tensor) -> Tensor:
    """``max(sq, floor^2)`` in float64: squared norms no smaller than :func:`term_floor`'s."""
    return torch.maximum(sq.double(), floor.square())


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
                 sq_norms: Callable[[], Tensor] | None = None, terms: tuple[Tensor, Tensor] | None = None) -> None:
        self.shape = torch.Size(grads.shape[1:] if shape is None else shape)
        self.to_param = to_param
        if to_param is None and grads.shape[1:] != self.shape:
            grads = grads.reshape(grads.shape[0], *self.shape)
        self.grads = grads
        # ||G_b||^2 computed by another contribution from the same tensor (a linear layer's bias gradient is its
        # output gradient, whose squared norms the weight's norm needs too); forgotten when the rows change
        self._sq_norms = sq_norms
        #: for a gradient summed over positions (a linear layer's bias on a sequence): each example's sum of its
        #: terms' magnitudes and count of nonzero terms (float64), whose floor_of() its norm is at least; or None
        self.terms = terms

    def sq_norms(self) -> Tensor:
        if self._sq_norms is not None:
            return self._sq_norms()
        sq = _row_sq(self.grads)
        return sq if self.terms is None else floored(sq, floor_of(*self.terms))

    def term_sizes(self) -> tuple[Tensor, Tensor]:
        return super().term_sizes() if self.terms is None else self.terms

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
        if self.terms is not None:
            self.terms = (_zero_rows(self.terms[0], examples), _zero_rows(self.terms[1], examples))

    def grouped(self, groups: Groups) -> Contribution:
        summed = self.grads.new_zeros((groups.count, *self.grads.shape[1:]))
        summed.index_add_(0, groups.group, groups.scaled(self.grads))
        # a group's terms are its examples' (weighted): their sums and counts add up; an example's gradient without
        # terms of its own is one (a flat linear layer's bias, the torch.func fallback's): a user's records whose
        # gradients cancel moved neighbouring sums 8.3 C apart without it (a review, 255 users of two records)
        sizes, counts = self.term_sizes()
        terms = (sizes.new_zeros(groups.count).index_add_(0, groups.group, groups.scaled(sizes).abs()),
                 counts.new_zeros(groups.count).index_add_(0, groups.group, counts))
        return Dense(summed, self.shape, self.to_param, terms=terms)


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
                 instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT,
                 factor_norms: tuple[Tensor | None, Tensor | None] = (None, None)) -> None:
        # ``(B, p)`` and ``(B, d)`` (one position per example: a linear layer on a batch of vectors) are kept as they
        # are: the norm is then ||left_b||^2 ||right_b||^2 and the weighted sum one matrix product, with no reshape
        # (a small model's step is a few dozen such operations, each of which costs its dispatch)
        self._flat = left.dim() == 2
        self._left, self._right = left, right
        self.shape = torch.Size(shape)
        self.instantiate_limit = instantiate_limit
        self._dense: Tensor | None = None
        self._row_sq: list[Tensor | None] = [None, None]  # ||left_b||^2, ||right_b||^2 (flat only), once per step
        #: the examples whose terms cancel (cancelling()) and their instantiated gradients: the weighted sum adds
        #: those, not their factors
        self._exact: tuple[Tensor, Tensor] | None = None
        #: :func:`term_norms` of the factors where the rule has them already (a linear layer's bias needs its output
        #: gradient's), else computed when asked for
        self._factor_norms = factor_norms
        #: the norms' :func:`term_floor` and the instantiated gradients' squared norms (sq_norms), for release()
        self._floor: Tensor | None = None
        self._dense_sq: Tensor | None = None
        #: the terms' (sizes, counts) behind the floor (term_sizes), for a tied parameter's
        self._sizes: tuple[Tensor, Tensor] | None = None

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
        if self._strategy() == "ghost" and not torch.compiler.is_compiling():
            # in float64 (the Gram form's terms can be far larger than the norm), then the examples whose terms
            # cancel summed from their own gradient (cancelling()), instantiated in float64
            left, right = self._left.double(), self._right.double()
            gram_l, gram_r = torch.bmm(left, left.transpose(1, 2)), torch.bmm(right, right.transpose(1, 2))
            sq = (gram_l * gram_r).sum((1, 2))
            # the terms' magnitudes from the Gram matrices' diagonals: ||l_t||^2 ||r_t||^2
            self._sizes = position_terms((gram_l.diagonal(dim1=1, dim2=2) * gram_r.diagonal(dim1=1, dim2=2)).sqrt())
            floor = self._floor = floor_of(*self._sizes)
            rows = (floor > sq.clamp_min(0).sqrt()).nonzero().flatten()  # cancelling()
            if rows.numel():
                grads = torch.bmm(left[rows].transpose(1, 2), right[rows])
                self._exact = (rows, grads)
                sq = sq.index_put((rows,), _row_sq(grads))
            return floored(sq, floor)
        # instantiated: the norms are those of the gradients the weighted sum sums (also in a compiled pass, whose
        # shapes cannot follow which examples cancel); within instantiate_limit, else refused there
        if torch.compiler.is_compiling() and self._strategy() == "ghost" and b * p * d * self._left.element_size() \
                > self.instantiate_limit:
            raise RuntimeError(
                f"a compiled private pass instantiates per-sample gradients of every layer on positions; this one's "
                f"({b} x {p} x {d}) exceed instantiate_limit={self.instantiate_limit} bytes: raise "
                "instantiate_limit or run the pass eagerly (compile_step=False)")
        grads = self._dense = torch.bmm(self._left.transpose(1, 2), self._right)  # (B, p, d), for the weighted sum
        given_left, given_right = self._factor_norms
        left_norms = term_norms(self._left) if given_left is None else given_left
        right_norms = term_norms(self._right) if given_right is None else given_right
        self._sizes = position_terms(left_norms * right_norms)
        self._floor, self._dense_sq = floor_of(*self._sizes), _row_sq(grads)
        return floored(self._dense_sq, self._floor)

    def term_sizes(self) -> tuple[Tensor, Tensor]:
        if self._sizes is None:  # not yet asked (sq_norms computes them), or one position per example
            sq = self.sq_norms()
            if self._sizes is None:
                return _one_term(sq)
        return self._sizes

    def releasable_bytes(self) -> int:
        if self._dense is None or torch.compiler.is_compiling():
            return 0
        b, t, p, d = self._b_t_p_d
        return 0 if p * d <= t * (p + d) else self._dense.numel() * self._dense.element_size()

    def release(self) -> None:
        # the examples whose terms cancel keep their instantiated gradient: the weighted sum adds it as it is, the
        # gradient its norm was taken of (cancelling())
        dense = self._dense
        if dense is not None:
            assert self._floor is not None and self._dense_sq is not None  # sq_norms() instantiated it
            rows = (self._floor > self._dense_sq.double().clamp_min(0).sqrt()).nonzero().flatten()  # cancelling()
            self._exact = (rows, dense[rows]) if rows.numel() else None
        self._dense = None

    def dense(self) -> Tensor:
        if self._flat:
            grads = self._left.unsqueeze(2) * self._right.unsqueeze(1)
        else:
            grads = self._dense if self._dense is not None else torch.bmm(self._left.transpose(1, 2), self._right)
            if self._dense is None and self._exact is not None:
                rows, exact = self._exact
                grads = grads.index_copy(0, rows, exact.to(grads.dtype))
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
        exact = self._exact
        if exact is not None:  # those examples from their instantiated gradients, not from the factors
            rows, grads = exact
            f = f.index_fill(0, rows, 0)
        out = ((left * f[:, None, None]).reshape(-1, p).T @ right.reshape(-1, d))
        if exact is not None:
            out = out + torch.mv(grads.flatten(1).t(), _as(factors, grads.dtype)[rows]).view(p, d).to(out.dtype)
        return out.view(self.shape)

    def dot(self, other: Contribution) -> Tensor:
        if isinstance(other, OneHotFactored):
            return other.dot(self)
        if isinstance(other, Factored):
            left, right = self.left.double(), self.right.double()
            o_left, o_right = other.left.double(), other.right.double()
            return (torch.bmm(left, o_left.transpose(1, 2)) * torch.bmm(right, o_right.transpose(1, 2))).sum((1, 2))
        # Dense: <sum_t l_t r_t^T, D> = sum_t l_t^T D r_t
        d = other.dense().reshape(self.left.shape[0], self.left.shape[-1], self.right.shape[-1])
        return torch.einsum("btp,bpd,btd->b", self.left, d, self.right)

    def drop(self, examples: Tensor) -> None:
        self._left, self._right = _zero_rows(self._left, examples), _zero_rows(self._right, examples)
        self._row_sq = [None, None]
        self._sizes = None  # sq_norms() computes them again
        self._factor_norms = tuple(None if n is None else _zero_rows(n, examples)  # type: ignore[assignment]
                                   for n in self._factor_norms)
        if self._exact is not None:
            rows, grads = self._exact
            self._exact = (rows, _zero_rows(grads, examples[rows]))
        if self._dense is not None:
            self._dense = _zero_rows(self._dense, examples)

    def grouped(self, groups: Groups) -> Contribution:
        # a group's gradient is the sum over its examples' positions: their factors side by side (zeros pad)
        return Factored(groups.place(groups.scaled(self.left)), groups.place(self.right), self.shape,
                        instantiate_limit=self.instantiate_limit)


class OneHotFactored(Contribution):
    """An embedding's ``G_b = sum_t e_{index[b, t]} (x) right[b, t]``: rows of a ``(V, d)`` table.

    Positions whose ``right`` is zero (padding) contribute nothing. Each example's rows are summed per token first
    (at the token's first position in the example: a ``(B, T, d)`` tensor, never ``(B, V, d)``), and its norm is
    theirs: the clipped sum adds the same rows, so the norm is that of what is summed even where one token's
    positions have opposite gradients (a review found the token-equality Gram form rounding such a norm to 0 in
    float32, and the sum carrying the gradient unclipped).
    """

    def __init__(self, index: Tensor, right: Tensor, shape: Sequence[int]) -> None:
        if index.dim() == 1:
            index, right = index.unsqueeze(1), right.unsqueeze(1)
        self.index, self.right = index, right
        self.shape = torch.Size(shape)
        self._rows: Tensor | None = None  # (B, T, d): each example's rows per token, at the token's first position
        self._sizes: tuple[Tensor, Tensor] | None = None  # term_sizes(), for sq_norms and a tied parameter's floor

    def _per_token(self) -> Tensor:
        rows = self._rows
        if rows is None:
            b, t, d = self.right.shape
            if t <= 1:  # one position (or none: an empty sequence)
                rows = self.right
            else:
                same = self.index.unsqueeze(2) == self.index.unsqueeze(1)  # (B, T, T)
                first = same.to(torch.uint8).argmax(dim=2)  # the first position of each position's token
                rows = torch.zeros_like(self.right).scatter_add_(1, first.unsqueeze(-1).expand(b, t, d), self.right)
            self._rows = rows
        return rows

    def sq_norms(self) -> Tensor:
        return floored(_row_sq(self._per_token()), floor_of(*self.term_sizes()))

    def term_sizes(self) -> tuple[Tensor, Tensor]:
        if self._sizes is None:
            self._sizes = position_terms(term_norms(self.right))
        return self._sizes

    def weighted_sum(self, factors: Tensor) -> Tensor:
        rows = self._per_token()  # a token's later positions hold zeros
        weighted = (rows * factors.to(rows.dtype)[:, None, None]).reshape(-1, rows.shape[-1])
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
        self._sizes = None
        if self._rows is not None:
            self._rows = _zero_rows(self._rows, examples)

    def grouped(self, groups: Groups) -> Contribution:
        # padded positions point at row 0 with a zero right factor: they contribute nothing
        return OneHotFactored(groups.place(self.index), groups.place(groups.scaled(self.right)), self.shape)
