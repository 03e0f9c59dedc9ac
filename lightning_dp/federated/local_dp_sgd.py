"""Record-level DP-SGD inside clients (local DP-SGD), vectorized over the round's clients.

Per client and step: a Poisson (or shuffled) batch, per-example clipping at ``C``
(:func:`~lightning_dp.privacy.clipping.clip_factors`), ``N(0, (sigma_c C)^2 I)`` noise over the expected batch size
(:func:`~lightning_dp.privacy.noise.noisy_mean`), a plain SGD step. Each client draws from its own secret generator,
batch then noise, so the ``"vmap"`` and ``"loop"`` engines draw the same numbers. Why hand-written and what it
guarantees: docs/federated.md, "Record-level DP-SGD inside the clients".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from lightning_dp.federated.local import FlatParams, check_loss, example_loss
from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.finite import drop_non_finite, non_finite
from lightning_dp.privacy.noise import noisy_mean, require_secret

__all__ = ["ClientPlan", "local_dp_sgd", "steps_per_participation"]


class ClientPlan(NamedTuple):
    """One client's DP-SGD settings for one participation.

    ``sample_rate`` is the Poisson rate ``q_c``; in shuffled mode it is not used (batches are
    consecutive slices of a permutation).
    """

    steps: int
    sample_rate: float
    noise_multiplier: float


def steps_per_participation(num_examples: int, batch_size: int, epochs: int) -> int:
    """``epochs * max(1, floor(n / B))``: the local steps of a client of ``n`` records (tau of PFA)."""
    return epochs * max(1, num_examples // batch_size)


def _draw_batch(n: int, plan: ClientPlan, batch_size: int, step: int, order: Tensor | None,
                generator: torch.Generator, device: torch.device) -> Tensor:
    """Positions of the client's records in this step's batch (drawn from its secret generator)."""
    if order is None:  # Poisson: every record independently with probability q
        return (torch.rand(n, generator=generator, device=device) < plan.sample_rate).nonzero().flatten()
    per_epoch = max(1, n // batch_size)
    first = (step % per_epoch) * batch_size
    return order[first:first + batch_size]


def local_dp_sgd(template: nn.Module, spec: FlatParams, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *,
                 plans: Sequence[ClientPlan], generators: Sequence[torch.Generator], batch_size: int,
                 max_grad_norm: float, lr: float, loss: str, sampling: Literal["poisson", "shuffle"] = "poisson",
                 engine: Literal["vmap", "loop"] = "vmap") -> Tensor:
    """DP-SGD of every client from its start (see the module docstring).

    Args:
        template: the model (its forward only).
        spec: the flat-parameter layout of ``template``.
        start: (C, P) starting parameters.
        x, y, mask: padded client data (C, Nmax, ...), records first (``mask[c, :n_c]`` true).
        plans: one :class:`ClientPlan` per client.
        generators: one :class:`~lightning_dp.privacy.noise.SecretGenerator` per client (batches and noise);
            a plain ``torch.Generator`` is refused.
        batch_size: B, the expected batch size the noisy sum is divided by (and the shuffled batch).
        max_grad_norm: C.
        lr: the SGD learning rate.
        loss: one of :data:`~lightning_dp.federated.local.LOSSES`; the per-example loss is the loss of a
            batch of that one example (for ``rmse``, the example's absolute error).
        sampling: ``"poisson"`` or ``"shuffle"`` (a fresh secret permutation per epoch, ``floor(n_c / B)``
            batches of B; the remainder is left out of that epoch).
        engine: ``"vmap"`` (all clients at once; memory C x B x P) or ``"loop"`` (one client at a time).

    Returns:
        (C, P) the clients' parameters after their steps.
    """
    check_loss(loss)
    c = start.shape[0]
    if not (len(plans) == len(generators) == c == mask.shape[0]):
        raise ValueError(f"got {len(plans)} plans and {len(generators)} generators for {c} clients; pass one each")
    if sampling not in ("poisson", "shuffle"):
        raise ValueError(f"sampling={sampling!r} is not allowed; choose 'poisson' or 'shuffle'")
    for g in generators:  # the record-level accountant amplifies by these batches (and the noise hides the rest)
        require_secret(g, f"local DP-SGD's {sampling} batches")
    counts = mask.sum(1).tolist()
    # randomness="different": dropout draws each example's own mask, as in a batched forward
    per_example = vmap(grad(example_loss(template, spec, loss)), in_dims=(None, 0, 0), randomness="different")
    theta = start.clone()
    device = mask.device
    total = max((p.steps for p in plans), default=0)
    orders: list[Tensor | None] = [None] * c

    def order_for(ci: int, step: int) -> Tensor | None:
        if sampling == "poisson":
            return None
        if step % max(1, counts[ci] // batch_size) == 0:  # a new epoch: a new secret permutation
            orders[ci] = torch.randperm(counts[ci], generator=generators[ci], device=device)
        return orders[ci]

    def noisy(ci: int, clipped_sum: Tensor) -> Tensor:
        return noisy_mean([clipped_sum], noise_multiplier=plans[ci].noise_multiplier, max_grad_norm=max_grad_norm,
                          expected_batch_size=batch_size, generator=generators[ci])[0]

    def clipped_sum(g: Tensor, valid: Tensor) -> Tensor:
        """Sum over the last-but-one axis of per-example gradients clipped to C (invalid rows weigh 0; an example
        whose gradient is not finite contributes 0, as in DP-SGD: :mod:`lightning_dp.privacy.finite`)."""
        norms = g.double().norm(dim=-1)  # float64: a rounded-down norm would let a gradient exceed C
        # a gradient with an inf or NaN entry has a non-finite norm (float64 cannot overflow on float32 entries): the
        # norms the clipping needs anyway find it, as DP-SGD's engine does, without another pass over the gradients
        bad = non_finite(norms.unsqueeze(-1))  # one unit per example, whatever the leading dims
        if bool(bad.any()):
            g, _ = drop_non_finite(g)
            norms = norms.masked_fill(bad, 0.0)
        factors = clip_factors(norms, max_grad_norm).to(g.dtype) * valid.to(g.dtype)
        return (factors.unsqueeze(-1) * g).sum(-2)

    if engine == "loop":
        for ci in range(c):
            for step in range(plans[ci].steps):
                idx = _draw_batch(counts[ci], plans[ci], batch_size, step, order_for(ci, step), generators[ci], device)
                if idx.numel():
                    g = per_example(theta[ci], x[ci, idx], y[ci, idx])
                    summed = clipped_sum(g, torch.ones(idx.numel(), dtype=torch.bool, device=device))
                else:
                    summed = torch.zeros_like(theta[ci])
                theta[ci] = theta[ci] - lr * noisy(ci, summed)
        return theta
    if engine != "vmap":
        raise ValueError(f"engine={engine!r} is not allowed; choose 'vmap' or 'loop'")
    over_clients = vmap(per_example, in_dims=(0, 0, 0), randomness="different")
    for step in range(total):
        active = [ci for ci in range(c) if step < plans[ci].steps]
        batches = [_draw_batch(counts[ci], plans[ci], batch_size, step, order_for(ci, step), generators[ci], device)
                   for ci in active]
        width = max(b.numel() for b in batches)
        rows = torch.tensor(active, device=device)
        if width:
            idx = torch.zeros((len(active), width), dtype=torch.long, device=device)
            valid = torch.zeros((len(active), width), dtype=torch.bool, device=device)
            for j, b in enumerate(batches):
                idx[j, : b.numel()], valid[j, : b.numel()] = b, True
            g = over_clients(theta[rows], x[rows[:, None], idx], y[rows[:, None], idx])  # (A, width, P)
            sums = clipped_sum(g, valid)
        else:
            sums = theta.new_zeros((len(active), theta.shape[1]))
        theta[rows] = theta[rows] - lr * torch.stack([noisy(ci, sums[j]) for j, ci in enumerate(active)])
    return theta
