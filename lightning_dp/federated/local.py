"""Client-side computations of a round, vectorized over clients (Algorithm 1, client part).

Each sampled client picks the hypothesis with the lowest loss on its data and runs E epochs of mini-batch SGD
from it; all clients of a round train at once with ``torch.func`` (``vmap`` over clients of ``grad``), their data
padded to the largest client and every batch masked. Models are flat parameter vectors (:class:`FlatParams`).
Why hand-written: docs/federated.md, "How a round trains its clients".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from lightning_dp import checks

__all__ = ["FlatParams", "LOSSES", "assigned_hypotheses", "check_loss", "choose_hypotheses", "client_losses",
           "client_outputs_and_losses", "example_loss", "forward_and_loss", "row_norms", "local_sgd",
           "local_sgd_loop", "masked_loss", "predictions"]

#: Loss names accepted by the round; all are means over a client's (masked) batch.
LOSSES = ("rmse", "cross_entropy", "binary_cross_entropy")


@dataclass(frozen=True)
class FlatParams:
    """How a module's trainable parameters map onto one flat vector (in ``named_parameters`` order)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, module: nn.Module) -> FlatParams:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(module).__name__} has no trainable parameters; nothing to train federatedly")
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @property
    def sizes(self) -> list[int]:
        """Number of parameters of each tensor (the per-layer sizes n_l of the sanitizer)."""
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def flatten(self, module: nn.Module, *, out: Tensor | None = None) -> Tensor:
        """The module's parameters as one vector, in :attr:`names` order (into ``out`` if given)."""
        params = dict(module.named_parameters())
        return torch.cat([params[n].detach().reshape(-1) for n in self.names], out=out)

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """``{name: tensor}`` views of a flat vector (works under vmap)."""
        return {n: t.reshape(s) for n, t, s in zip(self.names, torch.split(flat, self.sizes, dim=-1), self.shapes)}


def check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not supported; choose one of {LOSSES} ('rmse' for regression or "
                         "class scores, 'cross_entropy' for logits of C classes, 'binary_cross_entropy' for one "
                         "logit per example)")


def masked_loss(output: Tensor, target: Tensor, mask: Tensor, loss: str) -> Tensor:
    """Mean loss over the masked-in examples of one client's batch (0 when the batch is empty).

    - ``rmse`` with ``output`` of shape (B, 1) or (B,) (regression, the seed's loss):
      ``sqrt(mean_i (output_i - y_i)^2)``;
    - ``rmse`` with logits ``output`` of shape (B, C), C > 1, and class indices ``y``
      (a classifier trained with the RMSE loss, the seeds' Table 2):
      ``sqrt(mean_i ||softmax(output_i) - onehot(y_i)||^2)``, the root of the Brier score
      (the seeds do not state how they apply RMSE to 62 classes; probabilities against
      one-hot targets is the reading that keeps the loss bounded and the prediction
      ``argmax``);
    - ``cross_entropy``: mean cross-entropy of logits (B, C);
    - ``binary_cross_entropy``: mean binary cross-entropy of one logit per example,
      ``output`` of shape (B,) or (B, 1), targets in {0, 1}.
    """
    m = mask.to(output.dtype)
    count = m.sum()
    denom = torch.clamp(count, min=1.0)
    if loss == "rmse":
        if output.dim() == target.dim() + 1 and output.shape[-1] > 1:
            probs = torch.softmax(output, dim=-1)
            # a comparison, not F.one_hot, which reads the largest label (data-dependent, refused under vmap)
            onehot = (target.long().unsqueeze(-1) == torch.arange(output.shape[-1], device=output.device)).to(
                probs.dtype)
            err = (probs - onehot).square().sum(-1)
        else:
            err = (output.reshape(target.shape) - target).square()
        mse = (err * m).sum() / denom
        # sqrt has an infinite derivative at 0: an exactly fitted batch gets gradient 0
        return torch.where(mse > 0, torch.sqrt(torch.clamp(mse, min=torch.finfo(mse.dtype).tiny)), mse)
    if loss == "binary_cross_entropy":
        per = torch.nn.functional.binary_cross_entropy_with_logits(
            output.reshape(target.shape), target.to(output.dtype), reduction="none")
        return (per * m).sum() / denom
    per = torch.nn.functional.cross_entropy(output, target.long(), reduction="none")
    return (per * m).sum() / denom


def predictions(output: Tensor, loss: str) -> Tensor:
    """Predicted labels of a classifier's ``output`` (B, ...) under the loss it was trained with.

    ``binary_cross_entropy``: ``1`` where the logit is ``>= 0`` (probability ``>= 0.5``);
    ``cross_entropy`` and ``rmse`` on class scores (B, C): ``argmax``. Regression outputs
    have no predicted label: ``rmse`` on (B,) or (B, 1) raises ``ValueError``.
    """
    if loss == "binary_cross_entropy":
        return (output.reshape(output.shape[0], -1)[:, 0] >= 0).long()
    if output.dim() >= 2 and output.shape[-1] > 1:
        return output.argmax(dim=-1)
    raise ValueError(f"loss={loss!r} with outputs of shape {tuple(output.shape)} is a regression: it has no "
                     "predicted labels; accuracy and fairness need a classifier (binary_cross_entropy, or "
                     "cross_entropy/rmse on class scores)")


def client_outputs_and_losses(template: nn.Module, spec: FlatParams, hypotheses: Tensor, x: Tensor, y: Tensor,
                              mask: Tensor, loss: str, engine: str = "vmap") -> tuple[Tensor, Tensor]:
    """Output and loss of every hypothesis on every client's whole (padded) data set.

    One forward pass per (hypothesis, client) serves both the choice of a hypothesis
    (the losses) and its predictions (the outputs, e.g. for accuracy and fairness).

    Args:
        hypotheses: (k, P) flat parameter vectors.
        x: padded client inputs (C, Nmax, ...).
        y: padded client targets (C, Nmax, ...).
        mask: (C, Nmax), ``mask[c, i]`` marks client c's real examples.

    Returns:
        ``outputs`` of shape (C, k, Nmax, ...) (padding positions hold the output on the
        padding value) and ``losses`` of shape (C, k) (:func:`masked_loss`).

    ``engine="loop"`` runs one (client, hypothesis) pair at a time: the same values to rounding,
    faster on CPU for convolutional models, where ``vmap`` over clients turns every convolution
    into a grouped one (see ``AUTO_VMAP_MAX_PARAMETERS``).
    """
    check_loss(loss)
    if engine == "loop":
        pairs = [[forward_and_loss(template, spec, theta, x[c], y[c], mask[c], loss) for theta in hypotheses]
                 for c in range(x.shape[0])]
        outputs = torch.stack([torch.stack([o for o, _ in row]) for row in pairs])
        return outputs, torch.stack([torch.stack([v for _, v in row]) for row in pairs])

    def one(theta: Tensor, xc: Tensor, yc: Tensor, mc: Tensor) -> tuple[Tensor, Tensor]:
        return forward_and_loss(template, spec, theta, xc, yc, mc, loss)

    # randomness="different": a model's dropout draws its own masks per client and hypothesis, as the loop does
    # (vmap's default refuses random operations)
    over_clients = vmap(one, in_dims=(None, 0, 0, 0), randomness="different")
    return vmap(over_clients, in_dims=(0, None, None, None), out_dims=1, randomness="different")(
        hypotheses, x, y, mask)


def forward_and_loss(template: nn.Module, spec: FlatParams, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor,
                 loss: str) -> tuple[Tensor, Tensor]:
    """Output of the model with flat parameters ``theta`` on ``x``, and its :func:`masked_loss`."""
    output = functional_call(template, spec.unflatten(theta), (x,))
    return output, masked_loss(output, y, mask, loss)


def row_norms(rows: Tensor) -> Tensor:
    """The float64 L2 norm of every row of ``rows`` (m, P); above 2^22 entries one row at a time, so that a large
    model's updates are never copied whole into float64 (a rounded-down norm could let an update exceed a clip)."""
    if rows.numel() <= 2**22 or not len(rows):
        return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64)  # the float64 norm, 40 % faster than
    return torch.stack([torch.linalg.vector_norm(row, dtype=torch.float64) for row in rows])  # .double().norm()


def row_blocks(rows: Tensor, entries: int = 2**22) -> list[slice]:
    """Consecutive blocks of rows of ``rows`` (m, P) of at most ``entries`` entries each (at least one row): one
    block when the whole fits, so that small rounds compute exactly as one operation would."""
    per = max(1, entries // max(1, rows.shape[1] if rows.ndim > 1 else 1))
    return [slice(i, i + per) for i in range(0, len(rows), per)] or [slice(0, 0)]


def delta_norms(rows: Tensor, origin: Tensor) -> Tensor:
    """:func:`row_norms` of ``rows - origin``, a block of rows at a time (:func:`row_blocks`): a round of 1,000 CNN
    clients (1.7 M parameters) never holds a second (U, P) copy for its updates."""
    if not len(rows):
        return rows.new_zeros(0, dtype=torch.float64)
    return torch.cat([row_norms(rows[b] - origin) for b in row_blocks(rows)])


def clipped_delta_sum(rows: Tensor, origin: Tensor, factors: Tensor) -> Tensor:
    """``sum_i factors[i] * (rows[i] - origin)`` (P,), a block of rows at a time (:func:`row_blocks`)."""
    total = torch.zeros_like(origin)
    for b in row_blocks(rows):
        total += factors[b].to(rows.dtype) @ (rows[b] - origin)
    return total


def delta_norms_and_sum(rows: Tensor, origin: Tensor, factors_of: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """``(norms, total)``: :func:`delta_norms` of ``rows`` around ``origin`` and ``sum_i f_i (rows[i] - origin)`` with
    ``f = factors_of(norms)`` (a row's factor depends on its own norm only, e.g. its clipping factor), what
    :func:`delta_norms` then :func:`clipped_delta_sum` compute, with one subtraction per block of rows instead of
    two (the same blocks, the same values: bit for bit)."""
    total = torch.zeros_like(origin)
    if not len(rows):
        return rows.new_zeros(0, dtype=torch.float64), total
    norms = []
    for b in row_blocks(rows):
        delta = rows[b] - origin
        n = row_norms(delta)
        total += factors_of(n).to(rows.dtype) @ delta
        norms.append(n)
        del delta
    return torch.cat(norms), total


def example_loss(template: nn.Module, spec: FlatParams, loss: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(theta, x_i, y_i) -> loss`` of ONE example (a batch of one, :func:`masked_loss`): the function whose
    ``grad`` per-example gradients are (``vmap`` over examples; for ``rmse`` the example's absolute error)."""
    check_loss(loss)

    def one(theta: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        ones = torch.ones(1, dtype=torch.bool, device=xi.device)
        return forward_and_loss(template, spec, theta, xi.unsqueeze(0), yi.unsqueeze(0), ones, loss)[1]

    return one


def client_losses(template: nn.Module, spec: FlatParams, hypotheses: Tensor, x: Tensor, y: Tensor, mask: Tensor,
                  loss: str, engine: str = "vmap") -> Tensor:
    """Loss of every hypothesis on every client's whole data set, shape (clients, k).

    Args:
        hypotheses: (k, P) flat parameter vectors.
        x: padded client inputs (C, Nmax, ...).
        y: padded client targets (C, Nmax, ...).
        mask: (C, Nmax), ``mask[c, i]`` marks client c's real examples.
    """
    return client_outputs_and_losses(template, spec, hypotheses, x, y, mask, loss, engine)[1]


def choose_hypotheses(losses: Tensor) -> Tensor:
    """Each client's argmin over hypotheses (ties go to the lowest index)."""
    return losses.argmin(dim=1)


def assigned_hypotheses(seed: int, client_ids: Sequence[Any], k: int) -> Tensor:
    """A fixed public assignment of clients to k hypotheses, the start of a warm-up round
    (``FederatedRound(warm_start_rounds=...)``): client c gets ``floor(k u_c)`` with ``u_c = d / 2^63`` for
    ``d = derived_seed(seed, "warm-start", c)`` (a hash of the public seed and the client's id), uniform over the k
    and independent across clients.

    A pure function of the public seed and the client's id: not of its data, of its position in a client list, of
    which other clients are drawn with it or in which process, nor of the population (IFCA's code instead splits a
    random permutation of all clients into k equal groups, which one client's presence changes for every other).
    Keyed by id, not position: the sites of a Flower deployment number their clients from 0 each.
    Returns a (len(client_ids),) long tensor on the CPU.
    """
    from lightning_dp.datamodules.federated import derived_seed  # the datamodules' hash (lazy: no import cycle)

    k = checks.positive_int("k", k, owner="assigned_hypotheses")
    return torch.tensor([(derived_seed(seed, _WARM_START_KEY, c) * k) >> 63 for c in client_ids], dtype=torch.long)


#: the key of :func:`assigned_hypotheses`' hash (a public stream of the round's ``seed``)
_WARM_START_KEY = "warm-start"


#: A function ``epoch -> keys`` giving (C, Nmax) uniform [0, 1) shuffle keys of the call's clients.
KeyFunction = Callable[[int], Tensor]
Generators = Union[torch.Generator, Sequence[torch.Generator], KeyFunction, None]


def _epoch_order(mask: Tensor, generator: Generators, epoch: int = 0) -> tuple[Tensor, Tensor]:
    """Per-client random orders of the valid examples, and the valid counts.

    Returns ``order`` (C, Nmax) whose first ``counts[c]`` entries are a uniformly random
    permutation of client c's valid positions (sorting i.i.d. uniform keys). With one
    generator per client, or a key function that depends on the client and not on its
    companions, client c's order does not depend on which other clients share the call nor
    on the padding (what lets a round be sharded across processes).
    """
    if callable(generator) and not isinstance(generator, torch.Generator):
        keys = generator(epoch).to(mask.device)
        if keys.shape != mask.shape:
            raise ValueError(f"the key function returned shape {tuple(keys.shape)} for clients of shape "
                             f"{tuple(mask.shape)}; return one key per (client, position)")
        keys = torch.where(mask, keys, torch.full_like(keys, 2.0))
    elif isinstance(generator, Sequence):
        if len(generator) != mask.shape[0]:
            raise ValueError(f"got {len(generator)} generators for {mask.shape[0]} clients; pass one per client")
        keys = torch.full(mask.shape, 2.0, device=mask.device)
        for c, g in enumerate(generator):
            keys[c, mask[c]] = torch.rand(int(mask[c].sum()), generator=g, device=mask.device)
    else:
        keys = torch.rand(mask.shape, generator=generator, device=mask.device)
        keys = torch.where(mask, keys, torch.full_like(keys, 2.0))
    return keys.argsort(dim=1, stable=True), mask.sum(1)


def local_sgd(template: nn.Module, spec: FlatParams, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *,
              epochs: int, lr: float, batch_size: int, loss: str,
              generator: Generators = None, chain: Any = None) -> Tensor:
    """E epochs of mini-batch SGD on every client at once.

    Args:
        template: the model (its parameters are not used, only its forward).
        spec: the flat-parameter layout of ``template``.
        start: (C, P) each client's starting parameters (its chosen hypothesis).
        x: padded client inputs (C, Nmax, ...).
        y: padded client targets (C, Nmax, ...).
        mask: (C, Nmax), ``mask[c, i]`` marks client c's real examples.
        epochs: E of Algorithm 1.
        lr: s of Algorithm 1.
        batch_size: B_s of Algorithm 1.
        loss: one of :data:`LOSSES`.
        generator: draws each epoch's per-client shuffles: one generator for all clients,
            a sequence with one generator per client, or a function ``epoch -> (C, Nmax)``
            uniform keys (with either of the last two, a client's shuffles need not depend
            on the other clients of the call).
        chain: the model's :class:`~lightning_dp.federated.dense.DenseChain`: its hand-written gradients, applied
            layer by layer in place, instead of ``vmap(grad)`` (the same values to float32 rounding; shapes and
            labels checked here).

    Returns:
        (C, P) the clients' parameters after local training.

    Example:
        >>> model = nn.Linear(2, 1, bias=False)
        >>> spec = FlatParams.of(model)
        >>> x = torch.randn(3, 4, 2); y = x @ torch.tensor([1.0, -1.0]); mask = torch.ones(3, 4, dtype=torch.bool)
        >>> local_sgd(model, spec, torch.zeros(3, 2), x, y, mask, epochs=1, lr=0.1, batch_size=2, loss="rmse").shape
        torch.Size([3, 2])
    """
    check_loss(loss)
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"epochs={epochs}, batch_size={batch_size} must be >= 1 and lr={lr} > 0")
    c, nmax = mask.shape

    def batch_loss(theta: Tensor, xb: Tensor, yb: Tensor, mb: Tensor) -> Tensor:
        return forward_and_loss(template, spec, theta, xb, yb, mb, loss)[1]

    step_grad = vmap(grad(batch_loss), randomness="different")  # dropout: each client its own masks
    if chain is not None:
        why = chain.refusal(template, spec, x, y, loss, start)
        if why:
            raise ValueError(f"the dense engine cannot train on these clients: {why}; use the vmap engine")
        if loss == "cross_entropy":
            chain.check_labels(y, mask, tuple(x.shape[2:]))
    # the dense engine's first step writes start + step into a new tensor (no copy of start to step in place)
    theta = start.clone() if chain is None else None
    # a batch is gathered as rows of the flattened (C * Nmax, ...) data: index_select copies whole rows, several
    # times faster than advanced indexing x[rows, idx] for MNIST-sized examples
    flat_x, flat_y = x.reshape(c * nmax, *x.shape[2:]), y.reshape(c * nmax, *y.shape[2:])
    offsets = (torch.arange(c, device=mask.device) * nmax).unsqueeze(1)
    # the batches are gathered into one buffer each for inputs and targets (a fresh 5 MB tensor every step costs
    # more than the copy into it)
    width = min(batch_size, nmax)
    buffer_x, buffer_y = flat_x.new_empty((c * width, *x.shape[2:])), flat_y.new_empty((c * width, *y.shape[2:]))
    for epoch in range(epochs):
        order, counts = _epoch_order(mask, generator, epoch)
        for first in range(0, nmax, batch_size):
            pos = torch.arange(first, min(first + batch_size, nmax), device=mask.device)
            idx = (order[:, pos] + offsets).reshape(-1)  # (C * b,) rows of the flattened data
            valid = pos.unsqueeze(0) < counts.unsqueeze(1)  # (C, b)
            active = valid.any(dim=1)
            if not bool(active.any()):
                break
            xb = torch.index_select(flat_x, 0, idx, out=buffer_x[:len(idx)]).view(c, len(pos), *x.shape[2:])
            yb = torch.index_select(flat_y, 0, idx, out=buffer_y[:len(idx)]).view(c, len(pos), *y.shape[2:])
            # theta - lr * g for the clients with examples in this batch: g * -lr is -(lr * g) exactly and the
            # addition is a separate one (not addcmul_, whose fused multiply-add rounds differently), so this is bit
            # for bit the former theta - lr * g * active
            scale = (active.to(start.dtype) * -lr).unsqueeze(1)
            if theta is None:
                theta = chain.step_from(start, xb, yb, valid, loss, scale)
            elif chain is not None:
                chain.descend(theta, xb, yb, valid, loss, scale)
            else:
                theta += step_grad(theta, xb, yb, valid) * scale
    return theta if theta is not None else start.clone()


def _fast_layout(model: nn.Module, x: Tensor, spec: FlatParams | None = None,
                 start: Tensor | None = None) -> torch.memory_format | None:
    """``torch.channels_last`` for a model with 2-d convolutions or pooling trained on images (C, N, ch, H, W) on
    CPU, where it computes what the model computes as written, else None. PyTorch's CPU max-pooling of NCHW tensors
    is not vectorized: in McMahan et al.'s CIFAR CNN it took 22 % of an SGD step of 16 images, 14 times its
    channels-last time, and the whole step is 15-20 % faster channels-last (measured, one thread, torch 2.13).

    A layout is no part of a model's meaning, but a forward can depend on it: ``x.view(-1, n)`` after a
    convolution raises on channels-last tensors, and a custom operator may read memory in NCHW order. So the
    layout is kept only when copies of the model in both layouts give the same outputs on the first client's
    first examples (at its starting point ``start[0]``, with the same random state; 3-d weights or any error:
    NCHW). The values then agree up to the order of the convolutions' additions."""
    if x.device.type != "cpu" or x.dim() != 5 or not len(x) or not x.shape[1]:
        return None
    if not any(isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)) for m in model.modules()):
        return None
    import copy

    try:
        plain, fast = copy.deepcopy(model), copy.deepcopy(model)
        if spec is not None and start is not None:
            with torch.no_grad():
                for twin in (plain, fast):
                    for n, value in spec.unflatten(start[0]).items():
                        twin.get_parameter(n).copy_(value)
        fast = fast.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        batch = x[0, :8]
        outputs = []
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for twin, inputs in ((plain, batch), (fast, batch.contiguous(memory_format=torch.channels_last))):
                torch.manual_seed(0)
                outputs.append(twin(inputs))
    except Exception:  # noqa: BLE001 - a forward that cannot run channels-last keeps NCHW
        return None
    a, b = outputs
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape):
        return None
    return torch.channels_last if outputs_agree(b, a) else None


def outputs_agree(ours: Tensor, reference: Tensor) -> bool:
    """Whether two computations of one model's outputs (same shape) agree up to float32 rounding of a different
    order of additions: relative 1e-4, absolute 1e-5 of the reference's largest finite magnitude (at least 1). A NaN
    or infinite output agrees with the same in the other (a client's broken example, issue 49: the engine a round
    trains with must not depend on whether its data is finite)."""
    finite = reference[torch.isfinite(reference)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(ours, reference, rtol=1e-4, atol=1e-5 * max(1.0, scale), equal_nan=True)


def local_sgd_loop(template: nn.Module, spec: FlatParams, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *,
                   epochs: int, lr: float, batch_size: int, loss: str,
                   generator: Generators = None) -> Tensor:
    """Reference implementation of :func:`local_sgd`: one client at a time, ``torch.optim.SGD``.

    Draws the same shuffles from ``generator``, so both functions agree to rounding; used by
    the tests and as the baseline of ``benchmarks/bench_federated_round.py``.
    """
    import copy

    check_loss(loss)
    c, nmax = mask.shape
    orders = []
    for epoch in range(epochs):
        orders.append(_epoch_order(mask, generator, epoch))
    # written row by row: a list of rows then a stack would hold the (C, P) result twice (14 GB for 1,000 clients of a
    # 1.7 M-parameter CNN)
    out = start.new_empty((c, spec.numel))
    model = copy.deepcopy(template)  # one working copy, reloaded for every client
    layout = _fast_layout(model, x, spec, start)
    if layout is not None:
        model = model.to(memory_format=layout)  # type: ignore[call-overload]  # torch's stub lacks it
    params = [model.get_parameter(n) for n in spec.names]
    for ci in range(c):
        with torch.no_grad():
            for p, value in zip(params, spec.unflatten(start[ci]).values()):
                p.copy_(value)
        opt = torch.optim.SGD(params, lr=lr)
        for order, counts in orders:
            n = int(counts[ci])
            perm = order[ci, :n]
            for first in range(0, n, batch_size):
                idx = perm[first:first + batch_size]
                opt.zero_grad()
                ones = torch.ones(idx.numel(), dtype=torch.bool, device=x.device)
                xb = x[ci, idx] if layout is None else x[ci, idx].contiguous(memory_format=layout)
                masked_loss(model(xb), y[ci, idx], ones, loss).backward()
                opt.step()
        spec.flatten(model, out=out[ci])
    return out
