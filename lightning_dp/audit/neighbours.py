"""Noisy neighbours: membership inference without shadow models (Galli, Melis & Cucinotta, "Noisy neighbors:
efficient membership inference attacks against LLMs", PrivateNLP 2024; thesis ch. 4).

A sample's score is its noisy neighbours' mean loss minus its own (higher = member); the neighbours add
``N(0, sigma^2 I)`` at the embedding layer's output, drawn from the caller's ``torch.Generator`` in an order
that does not depend on ``chunk``, and :func:`search_sigma` finds sigma on a calibration split. The score, why it
works, an example: docs/audit.md, "Noisy neighbours".
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.audit.scores import _to, default_per_example_loss
from lightning_dp.privacy.noise import check_noise_multiplier

__all__ = ["EMBEDDING_NAMES", "NeighbourLosses", "SigmaSearch", "find_embedding", "neighbour_losses",
           "noisy_neighbour_scores", "search_sigma"]

#: Attribute names of token embeddings in common models, preferred by :func:`find_embedding` when a model has
#: several ``nn.Embedding`` (GPT-2 ``wte``, LLaMA/OPT ``embed_tokens``, BERT ``word_embeddings``, ...).
EMBEDDING_NAMES = ("wte", "embed_tokens", "word_embeddings", "token_embedding", "token_embeddings", "tok_embeddings",
                   "embed_in")
# Streams of lightning_dp.privacy.noise.derive_generator in search_sigma: members' and non-members' neighbours.
_MEMBER_STREAM, _NONMEMBER_STREAM = 41, 42


# --------------------------------------------------------------------------- the embedding layer


def find_embedding(model: nn.Module, name: str | None = None) -> nn.Module:
    """The module whose output the neighbours perturb.

    With ``name``, the submodule of that dotted name (``model.get_submodule(name)``; any module type). Without, the
    model's token embedding: among its ``nn.Embedding`` modules (in registration order), the first whose attribute
    name is one of :data:`EMBEDDING_NAMES`, else the first. For :class:`~lightning_dp.models.CausalLanguageModel`
    around :class:`~lightning_dp.models.GPT2` this is the token embedding ``network.model.transformer.wte``; GPT-2 adds
    its position embedding ``wpe`` after it, so the noise perturbs the tokens' vectors, not the positions' (the
    thesis' embedding layer).

    Raises:
        ValueError: if ``name`` names no submodule (the message lists the model's embedding modules), or if the
            model has no ``nn.Embedding`` and no ``name`` is given.

    Example:
        >>> from lightning_dp.models import GPT2, CausalLanguageModel
        >>> lm = CausalLanguageModel(GPT2(vocab_size=30, max_positions=16, embed_dim=16, num_layers=1, num_heads=2))
        >>> find_embedding(lm) is lm.network.model.transformer.wte
        True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if name is not None:
        modules = dict(model.named_modules())
        if name not in modules or name == "":
            candidates = [n for n, _ in embeddings] or [n for n in modules if n][:20]
            raise ValueError(f"embedding={name!r} is no submodule of {type(model).__name__}; candidates: "
                             f"{candidates}. Pass the dotted name of the layer whose output should be perturbed")
        return modules[name]
    if not embeddings:
        raise ValueError(f"{type(model).__name__} has no torch.nn.Embedding; pass embedding=<dotted name> of the "
                         "layer whose output is the input representation to perturb")
    for n, module in embeddings:
        if n.rsplit(".", 1)[-1] in EMBEDDING_NAMES:
            return module
    return embeddings[0][1]


def _resolve_embedding(model: nn.Module, embedding: nn.Module | str | None) -> nn.Module:
    if isinstance(embedding, nn.Module):
        if not any(m is embedding for m in model.modules()):
            raise ValueError(f"embedding={type(embedding).__name__} is not a submodule of {type(model).__name__}; "
                             "pass one of its modules, its dotted name, or None for find_embedding's choice")
        return embedding
    if embedding is None or isinstance(embedding, str):
        return find_embedding(model, embedding)
    raise ValueError(f"embedding={embedding!r} must be an nn.Module of the model, its dotted name, or None")


# --------------------------------------------------------------------------- neighbours' losses


@dataclass(frozen=True)
class NeighbourLosses:
    """Every example's loss and its neighbours'.

    Attributes:
        own: ``(N,)`` float64, the loss of each example.
        neighbours: ``(N, m)`` float64, the loss of each of its m noisy neighbours (column j: the j-th draw).
        forward_passes: example forward passes spent, ``(m + 1) N`` (a batch of B examples counts B), comparable with
            :attr:`lightning_dp.audit.lira.ShadowResult.forward_passes`.
    """

    own: np.ndarray
    neighbours: np.ndarray
    forward_passes: int

    @property
    def scores(self) -> np.ndarray:
        """The noisy-neighbour membership scores: mean neighbour loss minus own loss (higher = member)."""
        return self.neighbours.mean(1) - self.own


def _repeat(batch: Any, times: int) -> Any:
    """The batch with every tensor repeated ``times`` along dim 0 (copy c holds rows ``c B .. (c + 1) B - 1``)."""
    if isinstance(batch, Tensor):
        return batch.repeat(times, *([1] * (batch.dim() - 1))) if batch.dim() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_repeat(b, times) for b in batch)
    if isinstance(batch, dict):
        return {k: _repeat(v, times) for k, v in batch.items()}
    return batch


class _NoiseHook:
    """A forward hook adding ``sigma *`` the pending draws to the embedding output (pass-through when none)."""

    def __init__(self, sigma: float) -> None:
        self.sigma, self.calls = sigma, 0
        self.pending: tuple[int, int, torch.Generator | None] | None = None

    def __call__(self, module: nn.Module, inputs: Any, output: Tensor) -> Tensor | None:
        self.calls += 1
        if self.pending is None:
            return None
        draws, self.pending = self.pending, None
        if not isinstance(output, Tensor) or output.shape[0] != draws[0] * draws[1]:
            raise ValueError(f"the embedding output has shape {getattr(output, 'shape', None)}, expected the "
                             f"repeated batch ({draws[0]} neighbours x {draws[1]} examples) along dim 0; pass "
                             "embedding= the layer whose output holds one row per example")
        copies, rows, generator = draws
        assert generator is not None  # None only with num_neighbours=0, which draws nothing
        shape = (rows, *output.shape[1:])
        noise = torch.cat([torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
                           for _ in range(copies)])
        return output + self.sigma * noise.to(device=output.device, dtype=output.dtype)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, (tuple, list)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    raise ValueError(f"cannot find the batch size of a batch of type {type(batch).__name__}: batches must be tensors "
                     "or tuples/lists/dicts of tensors with the examples along dim 0")


def _losses(model: nn.Module, batches: Iterable[Any], *, sigma: float, num_neighbours: int,
            generator: torch.Generator | None, embedding: nn.Module, loss: Callable, chunk: int,
            own: bool) -> tuple[np.ndarray | None, np.ndarray, int]:
    """Own losses (if ``own``) and neighbours' losses of every example; the example forward passes spent."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    hook = _NoiseHook(sigma)
    handle = embedding.register_forward_hook(hook)
    was_training = model.training
    model.eval()
    own_out: list[Tensor] = []
    neighbours_out: list[np.ndarray] = []
    passes = 0
    try:
        with torch.no_grad():
            for batch in batches:
                batch = _to(batch, device)
                rows = _batch_size(batch)
                if own:
                    own_out.append(_checked(loss(model, batch), rows))
                    passes += rows
                columns: list[Tensor] = []
                for start in range(0, num_neighbours, chunk):  # neighbours start .. start + copies - 1 of the batch
                    copies = min(chunk, num_neighbours - start)
                    hook.pending, hook.calls = (copies, rows, generator), 0
                    values = _checked(loss(model, _repeat(batch, copies)), copies * rows)
                    if hook.calls != 1 or hook.pending is not None:
                        raise ValueError(f"the embedding module ran {hook.calls} times in one forward pass; the noise "
                                         "must perturb one embedding output per pass: pass embedding= a layer that "
                                         "runs exactly once")
                    columns.append(values.view(copies, rows).T)
                    passes += copies * rows
                neighbours_out.append(torch.cat(columns, 1).numpy() if columns else np.zeros((rows, 0)))
    finally:
        handle.remove()
        hook.pending = None
        model.train(was_training)
    if not neighbours_out:  # no batch
        raise ValueError("batches gave no example; pass a non-empty, re-iterable collection of batches (a list or a "
                         "DataLoader, not a used-up generator)")
    own_losses = np.concatenate(own_out) if own else None
    return own_losses, np.concatenate(neighbours_out), passes


def _checked(values: Any, rows: int) -> Tensor:
    if not isinstance(values, Tensor) or values.shape != (rows,):
        raise ValueError(f"the per-example loss must be a 1-D tensor of {rows} values (one per example), got "
                         f"{type(values).__name__} of shape {getattr(values, 'shape', None)}")
    return values.detach().double().cpu()


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def neighbour_losses(model: nn.Module, batches: Iterable[Any], *, sigma: float, num_neighbours: int,
                     generator: torch.Generator, embedding: nn.Module | str | None = None,
                     loss: Callable[[nn.Module, Any], Tensor] | None = None,
                     chunk: int | None = None) -> NeighbourLosses:
    """The loss of every example and of its ``num_neighbours`` noisy neighbours (module docstring).

    A forward hook on the embedding module adds ``sigma * rho`` to its output, ``rho`` standard normal of the
    output's shape drawn from ``generator`` (float32, on the generator's device) in the order batch by batch,
    neighbour by neighbour; ``chunk`` neighbours of a batch share one forward pass (the batch repeated ``chunk``
    times along dim 0), which changes the memory used, not the draws. The draws do depend on the batches' sizes and
    order: keep them fixed to reproduce scores. The model runs in eval mode without gradients; its mode is restored
    and the hook removed afterwards, also on errors. The embedding must run once per forward pass with the examples
    along dim 0 of its output (else ValueError).

    Args:
        model: the target model (any ``nn.Module``; a LightningModule is one).
        batches: the examples, in order (a list of batches or a non-shuffling DataLoader).
        sigma: std of the noise (>= 0; 0 gives neighbours equal to the example).
        num_neighbours: m >= 1.
        generator: the source of every noise draw.
        embedding: the module to perturb, its dotted name, or None for :func:`find_embedding`'s choice.
        loss: ``(model, batch) -> (B,)``; default :func:`lightning_dp.audit.scores.default_per_example_loss`.
        chunk: neighbours per forward pass (default: all m at once).

    Returns:
        :class:`NeighbourLosses`; its ``scores`` are :func:`noisy_neighbour_scores`.
    """
    _check_model(model)
    sigma = check_noise_multiplier(sigma, name="sigma", allow_zero=True,
                                   meaning="the std of the noise added to the embedding output",
                                   fix="Find one with search_sigma.")
    m = checks.positive_int("num_neighbours", num_neighbours, hint="pass e.g. num_neighbours=16")
    chunk = m if chunk is None else checks.positive_int("chunk", chunk, hint="the number of neighbours per forward pass")
    own, neighbours, passes = _losses(model, batches, sigma=sigma, num_neighbours=m,
                                      generator=checks.generator("generator", generator, required=True),
                                      embedding=_resolve_embedding(model, embedding),
                                      loss=loss or default_per_example_loss, chunk=min(chunk, m), own=True)
    assert own is not None  # own=True
    return NeighbourLosses(own=own, neighbours=neighbours, forward_passes=passes)


def noisy_neighbour_scores(model: nn.Module, batches: Iterable[Any], *, sigma: float, num_neighbours: int,
                           generator: torch.Generator, embedding: nn.Module | str | None = None,
                           loss: Callable[[nn.Module, Any], Tensor] | None = None,
                           chunk: int | None = None) -> np.ndarray:
    """Membership scores ``mean_j loss(neighbour_j) - loss(x)`` of every example (higher = member), shape ``(N,)``.

    Arguments as :func:`neighbour_losses`.
    """
    return neighbour_losses(model, batches, sigma=sigma, num_neighbours=num_neighbours, generator=generator,
                            embedding=embedding, loss=loss, chunk=chunk).scores


# --------------------------------------------------------------------------- choosing sigma


@dataclass(frozen=True)
class SigmaSearch:
    """The result of :func:`search_sigma`.

    Attributes:
        sigma: the sigma of the largest calibration AUC found.
        auc: that AUC.
        evaluated: every ``(sigma, auc)`` evaluated, sorted by sigma (the AUC-vs-sigma curve).
        forward_passes: example forward passes spent (own losses once, m neighbours per example and sigma).
        seconds: wall time.
    """

    sigma: float
    auc: float
    evaluated: tuple[tuple[float, float], ...]
    forward_passes: int
    seconds: float


_GOLDEN = (math.sqrt(5) - 1) / 2  # 1 / golden ratio


def _reiterable(batches: Iterable[Any]) -> Iterable[Any]:
    if iter(batches) is batches:  # a one-shot iterator: evaluated at many sigmas, so keep its batches
        batches = list(batches)
    return batches


def search_sigma(model: nn.Module, member_batches: Iterable[Any], nonmember_batches: Iterable[Any], *,
                 num_neighbours: int, generator_seed: int, low: float = 1e-4, high: float = 10.0, grid: int = 9,
                 iterations: int = 10, embedding: nn.Module | str | None = None,
                 loss: Callable[[nn.Module, Any], Tensor] | None = None, chunk: int | None = None) -> SigmaSearch:
    """The sigma maximizing the AUC of the noisy-neighbour scores of known members against known non-members.

    The thesis' search (ch. 4): the AUC (:func:`lightning_dp.audit.statistics.roc`) as a function of sigma has one
    sharp peak. Stage 1 evaluates ``grid`` log-spaced sigmas in ``[low, high]``; the best one and its two grid
    neighbours bracket the peak. Stage 2 evaluates ``iterations`` more sigmas by golden-section search on
    ``log sigma`` inside the bracket. Every sigma uses the same noise draws (common random numbers: the
    generators are re-seeded from ``generator_seed`` for members and non-members at every sigma), so the AUC differs
    between sigmas only through sigma (keep the batches fixed too: the draws follow them). The own losses do not depend on sigma and are computed once. A peak at ``low``
    or ``high`` warns: widen the range. Ties keep the smaller sigma.

    Args:
        model: the target model.
        member_batches: the members of the labelled calibration split (re-iterable; a one-shot iterator is
            stored as a list).
        nonmember_batches: its non-members, likewise.
        num_neighbours: m >= 1 neighbours per example.
        generator_seed: integer >= 0; seeds the noise (:func:`lightning_dp.privacy.noise.derive_generator`).
        low: the lower end of the range of sigma, ``0 < low < high``.
        high: its upper end.
        grid: number of grid sigmas (>= 3).
        iterations: sigmas evaluated by the golden-section stage (>= 0): its two first interior points, then one
            per step, each step shrinking the bracket by the golden ratio 0.618.
        embedding: as :func:`neighbour_losses`.
        loss: as :func:`neighbour_losses`.
        chunk: as :func:`neighbour_losses`.

    Returns:
        :class:`SigmaSearch`; ``len(evaluated)`` is at most ``grid + iterations`` (a repeated sigma is not evaluated
        again) and ``forward_passes = N (1 + m len(evaluated))`` for N calibration examples.

    Example:
        >>> import torch
        >>> from lightning_dp.models import GPT2, CausalLanguageModel
        >>> lm = CausalLanguageModel(GPT2(vocab_size=30, max_positions=16, embed_dim=16, num_layers=1, num_heads=2))
        >>> ids = torch.randint(30, (8, 16), generator=torch.Generator().manual_seed(0))
        >>> found = search_sigma(lm, [ids[:4]], [ids[4:]], num_neighbours=4, generator_seed=0, grid=5, iterations=3)
        >>> len(found.evaluated), found.forward_passes
        (8, 264)
    """
    from lightning_dp.audit.statistics import roc
    from lightning_dp.privacy.noise import derive_generator

    _check_model(model)
    m = checks.positive_int("num_neighbours", num_neighbours, hint="pass e.g. num_neighbours=16")
    chunk = m if chunk is None else checks.positive_int("chunk", chunk, hint="the number of neighbours per forward pass")
    if isinstance(generator_seed, bool) or not isinstance(generator_seed, numbers.Integral) or generator_seed < 0:
        raise ValueError(f"generator_seed={generator_seed!r} must be an integer >= 0; pass e.g. generator_seed=0")
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
            raise ValueError(f"{name}={value!r} must be a finite number > 0 (sigma is searched on a log scale)")
    if not low < high:
        raise ValueError(f"low={low!r} must be below high={high!r}; pass e.g. low=1e-4, high=10.0")
    if isinstance(grid, bool) or not isinstance(grid, numbers.Integral) or grid < 3:
        raise ValueError(f"grid={grid!r} must be an integer >= 3 (a bracket needs a point between two others); "
                         "pass e.g. grid=9")
    if isinstance(iterations, bool) or not isinstance(iterations, numbers.Integral) or iterations < 0:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 0; pass e.g. iterations=10")
    module = _resolve_embedding(model, embedding)
    loss = loss or default_per_example_loss
    members, nonmembers = _reiterable(member_batches), _reiterable(nonmember_batches)
    start = time.perf_counter()
    common = {"embedding": module, "loss": loss, "chunk": min(chunk, m)}
    own_in, _, passes_in = _losses(model, members, sigma=0.0, num_neighbours=0, generator=None, own=True, **common)
    own_out, _, passes_out = _losses(model, nonmembers, sigma=0.0, num_neighbours=0, generator=None, own=True,
                                     **common)
    passes = passes_in + passes_out
    cache: dict[float, float] = {}

    def evaluate(sigma: float) -> float:
        nonlocal passes
        if sigma not in cache:
            _, near_in, used_in = _losses(model, members, sigma=sigma, num_neighbours=m, own=False,
                                          generator=derive_generator(int(generator_seed), _MEMBER_STREAM), **common)
            _, near_out, used_out = _losses(model, nonmembers, sigma=sigma, num_neighbours=m, own=False,
                                            generator=derive_generator(int(generator_seed), _NONMEMBER_STREAM),
                                            **common)
            passes += used_in + used_out
            cache[sigma] = roc(near_in.mean(1) - own_in, near_out.mean(1) - own_out).auc
        return cache[sigma]

    sigmas = np.geomspace(float(low), float(high), int(grid))
    sigmas[0], sigmas[-1] = float(low), float(high)
    values = [evaluate(float(s)) for s in sigmas]
    best = int(np.argmax(values))  # the first maximum: ties keep the smaller sigma
    a, b = math.log(sigmas[max(best - 1, 0)]), math.log(sigmas[min(best + 1, len(sigmas) - 1)])
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    if iterations >= 1:
        fc = evaluate(math.exp(c))
    if iterations >= 2:
        fd = evaluate(math.exp(d))
    for _ in range(int(iterations) - 2):  # each step shrinks the bracket [a, b] by the golden ratio
        if fc >= fd:  # the peak is in [a, d]
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = evaluate(math.exp(c))
        else:  # the peak is in [c, b]
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = evaluate(math.exp(d))
    evaluated = tuple(sorted(cache.items()))
    sigma, value = max(evaluated, key=lambda pair: (pair[1], -pair[0]))
    if sigma in (float(low), float(high)):
        warnings.warn(f"search_sigma: the best AUC {value:.4f} is at the edge of the range (sigma={sigma:g}); widen "
                      f"low={low!r} / high={high!r} to bracket the peak", stacklevel=2)
    return SigmaSearch(sigma=float(sigma), auc=float(value), evaluated=evaluated, forward_passes=int(passes),
                       seconds=time.perf_counter() - start)
