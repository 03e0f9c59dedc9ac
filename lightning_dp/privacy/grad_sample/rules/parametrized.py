"""Layers with parametrized tensors (``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``,
``orthogonal``, a user's parametrization).

The optimizer updates the parametrizations' originals ``theta`` (``parametrizations.weight.original0``, ...); the
layer reads the tensor ``W = P(theta)`` they compute. Per example, ``dtheta_b = J_P(theta)^T dW_b``: the chain rule
through a map that does not depend on the example. So a parametrized ``nn.Linear`` or convolution gets ``dW_b`` from
its own rule (the layer's records, no replay of the layer) and pulls every example's ``dW_b`` back through ``P`` with
one batched vector-Jacobian product of the parametrization alone (``torch.func.vmap`` over ``torch.func.vjp``):
the layer's step at its rule's price plus one pass over the per-example gradients (written here because neither
torch.func nor Opacus composes a layer rule with a parametrization). Any other parametrized module, and inputs
shared by all examples, take the exact fallback over the module and its parametrizations, as before.

Two parametrizations have a pull-back in closed form, which needs no per-example gradient of the originals:
``weight_norm`` (:class:`_WeightNormPullback`) and ``spectral_norm`` (:class:`_SpectralPullback`); their per-example
norms come from a few per-example inner products of ``dW_b`` with fixed tensors (from the layer's factors where it
has them: no per-example gradient at all), their clipped sums from the rule's clipped sum of ``dW_b``, pulled back
once (``J^T`` is linear).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps, _SpectralNorm, _WeightNorm

from lightning_dp.privacy.grad_sample.contributions import (Contribution, Dense, Factored, Groups, add_terms, floor_of,
                                                            floored)
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError
from lightning_dp.privacy.grad_sample.rules.conv import ConvRule, ConvTransposeRule
from lightning_dp.privacy.grad_sample.rules.embedding import EmbeddingBagRule, EmbeddingRule
from lightning_dp.privacy.grad_sample.rules.functorch import FunctorchRule, check_buffers_unchanged
from lightning_dp.privacy.grad_sample.rules.linear import LinearRule, TransposedLinearRule

__all__ = ["ParametrizedRule", "CHAINED_RULES"]

#: The rules whose per-sample gradients of the tensors a layer reads come from the layer's records and its
#: hyperparameters alone (never the values of its weights, which a parametrization computes): a parametrized layer
#: of theirs is chained through its parametrizations (an embedding without ``max_norm``, which renormalizes the table
#: in place before each forward). Exact types: a user's subclass of one may read more.
CHAINED_RULES = (LinearRule, TransposedLinearRule, ConvRule, ConvTransposeRule, EmbeddingRule, EmbeddingBagRule)

_PREFIX = "parametrizations."


class ParametrizedRule(FunctorchRule):
    """A module with parametrized tensors: its own rule chained through the parametrizations (``inner``: a rule of
    :data:`CHAINED_RULES` for the module's type), else the exact fallback over the module and its parametrizations.

    Its trainable parameters are the module's own and its parametrizations' (``parametrizations.weight.original0``,
    ...), which the forward turns into the tensor it reads; the per-sample gradients are those of the parameters the
    optimizer updates. ``spectral_norm`` in training mode updates its power-iteration vectors in place in each
    forward, then divides by the norm they give: each call's vectors are kept after its forward (:meth:`after_call`)
    and the pull-back (or the replay) of that call divides by them without iterating again (the parametrization in
    eval mode meanwhile). A parametrization that changes its buffers when it runs is refused after the step's
    computation, as the fallback refuses it."""

    claims_subtree = True

    def __init__(self, inner: LayerRule | None = None) -> None:
        self.inner = inner if type(inner) in CHAINED_RULES else None

    def check(self, module: nn.Module, trainable: dict[str, nn.Parameter]) -> None:
        """Refuse, before any data, what neither path can compute: a recurrent layer with a parametrized weight
        (the recurrent rule gives the gradient of the weight the recurrence reads; torch.func cannot replay the fused
        recurrence per example). The chain is kept for a module whose parameters are its own and its
        parametrizations' (nothing else in its subtree) and that its rule accepts."""
        super().check(module, trainable)
        for name, m in module.named_modules():
            if isinstance(m, nn.RNNBase) and parametrize.is_parametrized(m):
                tensors = ", ".join(getattr(m, "parametrizations", {}))
                raise PerSampleGradientError(
                    f"{name or type(m).__name__} ({type(m).__name__}) has a parametrized weight "
                    f"({tensors}): the recurrent rule computes the gradients of the weights the "
                    "recurrence reads, not of a parametrization's parameters, and the exact torch.func fallback "
                    "cannot replay the fused recurrence per example. Remove the parametrization, freeze its "
                    "parameters, or apply it outside the recurrent layer.")
        if self.inner is None:
            return
        children = {name for name, _ in module.named_children()}
        if not parametrize.is_parametrized(module) or children != {"parametrizations"} \
                or getattr(module, "max_norm", None) is not None:
            self.inner = None
            return
        try:
            self.inner.check(module, _inner_trainable(trainable))
        except PerSampleGradientError:
            self.inner = None  # the fallback computes it, or refuses it with its own reason

    def check_dims(self, module: nn.Module, inputs: Any, outputs: Any, broadcast: bool) -> None:
        """The layouts the chained rule refuses (a convolution's batch elsewhere than dimension 0) take the
        fallback, which handles any."""
        check = getattr(self.inner, "check_dims", None)
        if check is not None:
            try:
                check(module, inputs, outputs, broadcast)
            except PerSampleGradientError:
                self.inner = None

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module, extra: dict[str, Any]) -> Iterator[None]:
        # spectral_norm in training moves its vectors at every read of the weight: a forward that reads it twice
        # computed with two weights, of which the replay (with the vectors after the forward) knows only the last
        reads: dict[int, int] = {}
        handles = [p.register_forward_hook(lambda m, args, out: reads.__setitem__(id(m), reads.get(id(m), 0) + 1))
                   for p in _spectral_norms(module) if p.training]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        if any(count > 1 for count in reads.values()):
            raise PerSampleGradientError(
                f"{type(module).__name__}'s forward read a spectral_norm-parametrized weight {max(reads.values())} "
                "times in training mode: each read moves the power iteration, so the reads used different weights, "
                "which the per-sample replay cannot tell apart. Read the weight once per forward (w = self.weight), "
                "run the forward inside torch.nn.utils.parametrize.cached(), or put the parametrization in eval "
                "mode.")

    def after_call(self, module: nn.Module, args: Any, output: Any, extra: dict[str, Any]) -> None:
        extra["replay_state"] = {name: buf.detach().clone() for name, buf in _power_iteration_buffers(module)}

    def contributions(self, layer, records, batch_size):
        iterating = [p for p in _spectral_norms(layer.module) if p.training]
        for p in iterating:
            p.train(False)
        # inside parametrize.cached() the tensor would be read from the cache (computed from the parameters, not
        # from each example's replayed ones): the replay computes it afresh
        caching, parametrize._cache_enabled = parametrize._cache_enabled, 0
        try:
            if self._chains(layer, records, batch_size):
                return self._chained(layer, records, batch_size)
            return super().contributions(layer, records, batch_size)
        finally:
            parametrize._cache_enabled = caching
            for p in iterating:
                p.train(True)

    def _chains(self, layer, records, batch_size: int) -> bool:
        """Whether this step's records take the chain. Not with inputs shared by all examples (the layer broadcast
        to the batch). Not while a hook sits on a parametrization or its list, or any global forward hook or
        pre-hook exists (checked every step: they may come and go): it runs when the forward reads the tensor, as
        part of what it computes, which the chain's formulas do not see and the replay (the layer's forward,
        reading the tensor through its parametrizations) runs. No memory bound here: where the chain instantiates
        per-example gradients of the computed tensor (its batched pull-back, or a closed form on a source without
        factors), the replay instantiates as many."""
        if self.inner is None or any(r.broadcast for r in records):
            return False
        if _global_forward_hooks or _global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks
                       for m in layer.module.parametrizations.modules())

    def _chained(self, layer, records, batch_size: int) -> dict[str, Any]:
        module = layer.module
        inner = self.inner
        assert inner is not None
        chained = _chained_tensors(layer.trainable)
        own = {n: p for n, p in layer.trainable.items() if not n.startswith(_PREFIX)}
        result: dict[str, Any] = {}
        with layer.replaying():
            state = layer.replay_state()
            one_call = records[0].extra.get("replay_state", {}) if len(records) == 1 else {}
            forms = {t: _closed_form(module.parametrizations[t], {**_under(state, t), **_under(one_call, t)},
                                     len(records) == 1 or not any(_under(r.extra.get("replay_state", {}), t)
                                                                  for r in records), chained[t]) for t in chained}
            closed = [t for t, form in forms.items() if form is not None]
            batched = [t for t, form in forms.items() if form is None]
            # the closed forms run no parametrization (weight_norm and spectral_norm out of training leave their
            # buffers alone when the rule reads the tensor's shape); the batched pull-back runs the others, which
            # must neither change their buffers nor draw random numbers (a DropConnect mask drawn again would not be
            # the forward's): both checked after it
            versions = {n: b._version for n, b in module.named_buffers()} if batched else None
            rng = _rng_states(module) if batched else None
            with _computed_once():
                # the module's own parameters (a bias not parametrized) and the tensors with a closed-form pull-back
                # (the same map for every call) from all calls at once, as the rule gives them; the others call by
                # call (spectral_norm's vectors in training differ between calls)
                together = inner.contributions(_InnerView(layer, {**own, **{t: None for t in closed}}, "all:"),
                                               records, batch_size) if own or closed else {}
                parts = [inner.contributions(_InnerView(layer, {t: None for t in batched}, f"{i}:"), [r], batch_size)
                         for i, r in enumerate(records)] if batched else []
            for t in closed:
                pullback = forms[t](together[t])
                result.update({f"{_PREFIX}{t}.{n}": Pulled(pullback, n) for n in chained[t]})
            summed: dict[str, Tensor] = {}
            # each original's floor: the source's terms times the bound on its pull-back (None: no bound known)
            terms: dict[str, tuple[Tensor, Tensor] | None] = {}
            for r, part in zip(records, parts):
                kept = r.extra.get("replay_state", {})  # this call's power-iteration vectors (spectral_norm)
                for t in batched:
                    at = {**_under(state, t), **_under(kept, t)}
                    pulled = _pull_back(layer, module.parametrizations[t], part[t].dense(), at, chained[t])
                    bounds = _lipschitz(module.parametrizations[t], at, chained[t]) or {}
                    source = part[t].term_sizes() if any(b is not None for b in bounds.values()) else None
                    for name, grads in pulled.items():
                        key = f"{_PREFIX}{t}.{name}"
                        summed[key] = grads if key not in summed else summed[key] + grads
                        bound = bounds.get(name)
                        if source is None or bound is None or (key in terms and terms[key] is None):
                            terms[key] = None  # no bound known, or its share carried by another original
                        else:
                            terms[key] = add_terms(terms.get(key), (source[0] * bound, source[1]))
        if versions is not None:
            check_buffers_unchanged(layer, module, versions)
        if rng is not None and any(not torch.equal(a, b) for a, b in zip(rng, _rng_states(module))):
            raise PerSampleGradientError(
                f"{layer.name} ({type(module).__name__}): a parametrization of it draws random numbers when it runs "
                "(a mask on the weights, DropConnect?): its per-sample gradients would be pulled back through another "
                "draw than the forward's. Apply the randomness outside the parametrization (dropout on the layer's "
                "input or output), or freeze its parameters.")
        result.update({k: Dense(g, terms=terms[k]) for k, g in summed.items()})
        result.update({n: together[n] for n in own})
        return result


class _InnerView:
    """The layer as its own rule sees it: the engine's view with the trainable tensors named as the forward reads them
    (``weight``, not ``parametrizations.weight.original0``), and work buffers of its own (``tag``): the rule runs once
    per call here, and a convolution's per-sample gradients live in its buffers until they are pulled back."""

    def __init__(self, view: Any, trainable: dict[str, Any], tag: str) -> None:
        self._view, self.trainable, self._tag = view, trainable, tag

    def workspace(self, key: str, shape: tuple[int, ...], like: Tensor, *, shared: bool = False) -> Tensor:
        return self._view.workspace(key if shared else self._tag + key, shape, like, shared=shared)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


def _chained_tensors(trainable: dict[str, Any]) -> dict[str, list[str]]:
    """``{tensor: [names in its ParametrizationList]}`` of the parametrized tensors with a trainable parameter."""
    found: dict[str, list[str]] = {}
    for name in trainable:
        if name.startswith(_PREFIX):
            tensor, rest = name[len(_PREFIX):].split(".", 1)
            found.setdefault(tensor, []).append(rest)
    return found


def _inner_trainable(trainable: dict[str, Any]) -> dict[str, Any]:
    """The names the module's forward reads whose gradients the chain needs: its own trainable parameters and every
    parametrized tensor with a trainable parameter."""
    own = {n: p for n, p in trainable.items() if not n.startswith(_PREFIX)}
    return {**own, **{t: None for t in _chained_tensors(trainable)}}


def _within(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``state`` whose names start with ``prefix``, named without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _under(state: dict[str, Tensor], tensor: str) -> dict[str, Tensor]:
    """The entries of a module's state under ``parametrizations.<tensor>.``, named within that list."""
    return _within(state, f"{_PREFIX}{tensor}.")


def _rng_states(module: nn.Module) -> list[Tensor]:
    """The states of the default generators a parametrization on ``module``'s device could draw from."""
    states = [torch.random.get_rng_state()]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


@contextlib.contextmanager
def _computed_once() -> Iterator[None]:
    """The layer's rule reads its parametrized tensors (their shapes) as the forward does: computed once while it
    runs (``parametrize.cached``'s cache, with the cache of a caller's own ``cached()`` context put aside and back)."""
    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 1, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


def _pull_back(layer: Any, plist: nn.Module, grads: Tensor, state: dict[str, Tensor],
               names: list[str]) -> dict[str, Tensor]:
    """``{name: (B, *shape)}``: every example's gradient ``grads[b]`` of the computed tensor pulled back to the
    trainable entries ``names`` of the parametrization list ``plist`` (its originals, its parametrizations' own
    parameters), at the values ``state``."""
    from torch.func import vjp, vmap

    params = {n: state[n] for n in names}
    fixed = {n: t for n, t in state.items() if n not in params}
    try:
        # torch.func.vjp is annotated for has_aux=True as well: a 2- or 3-tuple
        _, pullback = vjp(lambda p: _computed(plist, {**fixed, **p}), params)  # type: ignore[misc]
        return vmap(lambda g: pullback(g)[0])(grads)
    except Exception as err:  # torch.func raises many types; say what failed and why
        raise PerSampleGradientError(
            f"torch.func could not pull the per-sample gradients of {layer.name} ({type(layer.module).__name__}) back "
            f"through its parametrization: {type(err).__name__}: {err}. Make the parametrization a function of its "
            "inputs and parameters (no state updated in its forward), freeze its parameters, or remove it.") from err


def _computed(plist: Any, state: dict[str, Tensor]) -> Tensor:
    """``ParametrizationList.forward`` at ``state`` (its originals, its parametrizations' parameters and buffers,
    named as in the list): the first parametrization on the originals, each next one on the result. ``weight_norm``
    is written out (``v * (g / ||v||)``, the norms over every dimension but ``dim``): its fused operator has no
    batching rule, so a batched pull-back through it would run example by example (torch warns)."""
    from torch.func import functional_call

    originals = [state["original"]] if plist.is_tensor else [state[f"original{i}"] for i in range(plist.ntensors)]
    x: Tensor | None = None
    i = 0
    while hasattr(plist, str(i)):
        m = getattr(plist, str(i))
        inputs: list[Tensor] = originals if x is None else [x]
        if type(m) is _WeightNorm and len(inputs) == 2:
            g, v = inputs
            dims = [d for d in range(v.dim()) if d != m.dim % max(v.dim(), 1)] if m.dim != -1 else list(range(v.dim()))
            # no dimension left to reduce (a 1-D tensor along its dimension): every entry its own norm, as torch's
            # norm_except_dim gives it (vector_norm over dim=[] would reduce over everything)
            norm = torch.linalg.vector_norm(v, dim=dims, keepdim=True) if dims else v.abs()
            x = v * (g / norm)
        else:
            x = functional_call(m, _within(state, f"{i}."), tuple(inputs))
        i += 1
    assert x is not None
    return x


def _closed_form(plist: Any, state: dict[str, Tensor], one_map: bool, names: list[str]) -> Any:
    """For a parametrization list with a pull-back in closed form, a function from the source contribution (the
    per-example gradients of the computed tensor) to its :class:`_Pullback`; else None (the batched ``torch.func``
    pull-back). ``weight_norm`` alone; ``spectral_norm`` alone on a weight of two dimensions or more where every call
    was pulled back by the same map (``one_map``: one call, or no call kept vectors of its own: eval mode)."""
    if not hasattr(plist, "0") or hasattr(plist, "1"):
        return None
    m = plist[0]
    if type(m) is _WeightNorm and not plist.is_tensor and plist.ntensors == 2 \
            and (state["original1"].dim() > 1 or m.dim == -1):
        g, v = state["original0"], state["original1"]
        return lambda source: _WeightNormPullback(source, g, v, m.dim, names)
    if type(m) is _SpectralNorm and plist.is_tensor and state["original"].dim() > 1 and one_map:
        theta = state["original"]
        return lambda source: _SpectralPullback(source, theta, state["0._u"], state["0._v"], m.dim)
    return None


def _weight_norm_bounds(s: Tensor, names: Any) -> dict[str, Tensor | None]:
    """``weight_norm``'s bounds for :func:`_lipschitz`, float64 scalars, for the trainable originals ``names`` of
    ``g`` (``original0``) and ``v`` (``original1``), from the rows' scales ``s`` (:func:`_row_scales`). Per row ``o`` (:func:`_rows`), ``dg_o = <dW_o, vhat_o>`` and
    ``dv_o = s_o (dW_o - dg_o vhat_o)`` (``s_o = g_o / ||v_o||``): orthogonal parts of ``dW_o`` scaled by 1 and
    ``|s_o|``, so ``||(dg, dv)|| <= max(1, max_o |s_o|) ||dW||``, ``||dg|| <= ||dW||``, ``||dv|| <= max_o |s_o|
    ||dW||`` (the last also what bounds the rounding of ``v``'s pull-back where ``v`` is 1-D along its dimension,
    whose exact pull-back is 0). Both trained: the pair's bound goes to ``v`` and None (no floor) to ``g``, whose
    gradient (one direction of each row) is often near an eighth of ``dW``'s: floored on its own by ``||dW|| / 8``
    it raised every honest example's norm 0.2-3 % (a batch of 32, 3 seeds); ``max(||dv||^2, F^2) + ||dg||^2`` is at
    least ``max(||(dg, dv)||^2, F^2)``, the floor of the pair."""
    s = s.detach().abs().max().double()
    one = torch.ones((), dtype=torch.float64, device=s.device)
    if "original0" in names and "original1" in names:
        return {"original0": None, "original1": torch.maximum(s, one)}
    return {"original0": one} if "original0" in names else {"original1": s}


def _row_scales(g: Tensor, v: Tensor, dim: int) -> Tensor:
    """``s_o = g_o / ||v_o||`` per row of ``weight_norm`` (:func:`_rows`; a 1-D tensor along its dimension: every
    entry its own row)."""
    rows = _rows(v, dim) if v.dim() > 1 or dim == -1 else v.reshape(-1, 1)
    return g.reshape(-1) / torch.linalg.vector_norm(rows, dim=1)


def _spectral_bound(theta: Tensor, u: Tensor, v: Tensor, eps: float) -> Tensor:
    """The operator norm of ``spectral_norm``'s pull-back at ``theta`` (float64 scalar). A matrix: ``J^T dW = (dW -
    a <z, dW>) / sigma`` with ``a = M^-1(u v^T)`` and ``z = theta / sigma``, ``<z, a> = 1``: ``I - a z^T`` is a
    projection, whose norm is ``||a|| ||z||`` (that of ``a z^T``: any projection other than 0 and I has the norm of
    its complement), so ``||u|| ||v|| ||theta|| / sigma^2``. A vector (``F.normalize``): ``1 / max(||theta||,
    eps)``."""
    f64 = torch.float64
    norm = torch.linalg.vector_norm(theta.detach().double())
    if theta.dim() == 1:
        return 1 / norm.clamp_min(eps)
    # sigma as the forward computes it, from M(theta) (``theta`` given with the rows' dimension first)
    sigma = torch.vdot(u.double(), torch.mv(theta.detach().double().flatten(1), v.double()))
    return torch.linalg.vector_norm(u.to(f64)) * torch.linalg.vector_norm(v.to(f64)) * norm / sigma.square()


def _lipschitz(plist: Any, state: dict[str, Tensor], names: list[str]) -> dict[str, Tensor | None] | None:
    """``{name: bound}``: for each trainable entry ``names`` of the parametrization list ``plist`` at ``state``, a
    bound (float64 scalar) on the operator norm of the pull-back from the computed tensor to it, or None for an entry
    whose share of the floor another entry carries (weight_norm's ``g``); the whole is None where a bound is not
    known. A pulled-back gradient moves by at most that times what its source's rounding moves, so its floor
    (docs/per_sample_gradients.md, "Floating point") is its source's terms times it (:class:`Pulled`).

    Known, for a list of one parametrization on its originals: ``weight_norm`` (:func:`_weight_norm_bounds`),
    ``spectral_norm`` (:func:`_spectral_bound`), ``orthogonal`` by the matrix exponential or the Cayley map on a
    real tensor (``sqrt(2) ||base||_2``: ``X -> A = tril(X) - tril(X)^T`` at most doubles a square, both maps'
    derivatives at a skew-symmetric ``A`` are at most 1 in the Frobenius norm (the exponential's an average of
    rotations ``e^{sA} dA e^{(1-s)A}``; the Cayley map's ``(I - A/2)^-1 (dA / 2) (Q + I)``, whose outer factors are
    at most 1 and 2), and the columns kept, the transpose and ``base @`` are at most 1 and ``||base||_2``); by the
    Householder map ``2 sqrt(2 k) ||base||_2`` for ``k`` columns (``Q`` the first ``k`` columns of ``H_1 ... H_k``,
    ``H_i`` the exact reflection along ``v_i = e_i + a_i``, ``a_i`` column ``i`` of ``tril(X, -1)``, ``||v_i|| >= 1``:
    ``||dH_i||_F = 2 sqrt(2) ||d vhat_i|| <= 2 sqrt(2) ||da_i||``, the other factors orthogonal, and ``sum_i ||da_i||
    <= sqrt(k) ||dX||``; the columns' factors ``int(X_ii)``, +-1 as registered, are not differentiated, and scale
    the bound by their largest magnitude). Not for stacked parametrizations, a parametrization's own parameters or
    your own: those keep no floor (docs/per_sample_gradients.md, "What the engine does not check")."""
    if not hasattr(plist, "0") or hasattr(plist, "1"):
        return None
    m = plist[0]
    if type(m) is _WeightNorm and not plist.is_tensor and plist.ntensors == 2:
        v = state["original1"]
        dim = m.dim if m.dim == -1 else m.dim % max(v.dim(), 1)
        bounds = _weight_norm_bounds(_row_scales(state["original0"], v, dim), names)
    elif type(m) is _SpectralNorm and plist.is_tensor:
        theta = state["original"]
        if theta.dim() > 1:  # M(theta) with rows along dim
            theta = theta.movedim(m.dim, 0)
        bounds = {"original": _spectral_bound(theta, state.get("0._u", theta.new_ones(1)),
                                              state.get("0._v", theta.new_ones(1)), m.eps)}
    elif type(m) is _Orthogonal and plist.is_tensor and not state["original"].is_complex():
        base = state.get("0.base")
        scale = torch.linalg.matrix_norm(base.detach().double(), 2).amax() if base is not None else 1.0
        bound = math.sqrt(2) * torch.as_tensor(scale, dtype=torch.float64)
        if m.orthogonal_map not in (_OrthMaps.matrix_exp, _OrthMaps.cayley):
            # the Householder map: 2 sqrt(k) more for k columns (a tall matrix's, after the transpose), times the
            # largest factor int(X_ii) its columns are multiplied by (+-1 as registered; the noise of DP-SGD moves
            # the diagonal, which has no gradient, and past 2 the factor grows: a review, 1.41x the bound at 2.5)
            x = state["original"].detach()
            tall = x if x.shape[-2] >= x.shape[-1] else x.mT
            signs = tall.diagonal(dim1=-2, dim2=-1).int().abs().amax().clamp_min(1)
            bound = bound * 2 * math.sqrt(min(x.shape[-2:])) * signs.to(torch.float64)
        bounds = {"original": bound}
    else:
        return None
    return bounds if all(n in bounds for n in names) else None


#: Where a closed form's squared norm is a difference of larger terms (``||dW||^2 - <dW, vhat>^2``; the three terms
#: of ``spectral_norm``'s), it is computed in float64 from the float32 factors (relative errors about 1e-13) and
#: trusted only above this fraction of the terms' size; below it, where rounding could hide most of the norm (an input
#: nearly along the weight's direction, which an attacker can craft: a norm of 0 for a gradient of 59 C, found by a
#: review), the norm is replaced by its upper bound ``||J^T||^2 ||dW||^2``: that example is clipped more, never less.
CANCELLATION = 1e-6


class _Pullback:
    """``J^T`` of one parametrization in closed form, applied to a source contribution's per-example gradients
    ``dW_b`` of the tensor it computes: per-example squared norms from a few per-example statistics of ``dW_b``
    (inner products with fixed tensors; from a linear layer's factors, in float64 and guarded against cancellation,
    :data:`CANCELLATION`) or from the per-example gradients ``J^T dW_b`` themselves where the source instantiates
    ``dW_b`` anyway (a convolution's), clipped sums from the source's clipped sum (``J^T`` is linear). Shared by the
    originals' :class:`Pulled` contributions."""

    def __init__(self, source: Contribution) -> None:
        self.source = source
        self._stats: Any = None
        self._grouped: tuple[Groups, _Pullback] | None = None
        self._summed: tuple[Tensor, Tensor] | None = None  # (factors, the source's weighted sum): once for all originals
        self._terms: tuple[Tensor, Tensor] | None = None  # the source's term_sizes(): once for all originals

    def stats(self) -> Any:
        if self._stats is None:
            self._stats = self._compute_stats()
        return self._stats

    def _compute_stats(self) -> Any:
        raise NotImplementedError

    def shape_of(self, name: str) -> torch.Size:
        """The shape of original ``name``."""
        raise NotImplementedError

    def sq_norms(self, name: str) -> Tensor:
        raise NotImplementedError

    def bound(self, name: str) -> Tensor | None:
        """A bound on the operator norm of ``J^T`` to original ``name``, or None where another original carries its
        share of the floor (:func:`_lipschitz`)."""
        raise NotImplementedError

    def pulled_sum(self, name: str, summed: Tensor) -> Tensor:
        """``J^T`` applied to ``summed`` (a tensor of the computed tensor's shape), the part of original ``name``."""
        raise NotImplementedError

    def dense(self, name: str) -> Tensor:
        """Every example's gradient of original ``name``, ``(B, *shape)``."""
        raise NotImplementedError

    def source_sum(self, factors: Tensor) -> Tensor:
        """The source's weighted sum by ``factors``, computed once for the originals that share this pull-back (the
        engine weights every parameter with the same tensor)."""
        if self._summed is None or self._summed[0] is not factors:
            self._summed = (factors, self.source.weighted_sum(factors))
        return self._summed[1]

    def source_terms(self) -> tuple[Tensor, Tensor]:
        """The source's ``term_sizes()``, computed once for the originals that share this pull-back."""
        if self._terms is None:
            self._terms = self.source.term_sizes()
        return self._terms

    def drop(self, examples: Tensor) -> None:
        self.source.drop(examples)  # zero rows: once or twice (one call per original) is the same
        self._stats = self._summed = self._terms = None

    def grouped(self, groups: Groups) -> _Pullback:
        if self._grouped is None or self._grouped[0] is not groups:
            self._grouped = (groups, self._with(self.source.grouped(groups)))
        return self._grouped[1]

    def _with(self, source: Contribution) -> _Pullback:
        raise NotImplementedError


def _rows(t: Tensor, dim: int, lead: int = 0) -> Tensor:
    """``t`` (``lead`` leading dimensions, then a weight's) as rows along the weight's dimension ``dim`` (-1: one row
    of everything): ``(*lead, R, rest)``."""
    if dim == -1:
        return t.reshape(*t.shape[:lead], 1, -1)
    return t.movedim(lead + dim, lead).flatten(lead + 1)


class _WeightNormPullback(_Pullback):
    """``W = v g / ||v||`` (``weight_norm``; norms of the rows along ``dim``, or of the whole tensor for -1). Per row
    ``o``, with ``vhat = v / ||v||`` and ``s = g / ||v||``: ``dg = <dW, vhat>``, ``dv = s (dW - <dW, vhat> vhat)``;
    so ``||dg_b||^2 = sum_o d_bo^2`` and ``||dv_b||^2 = sum_o s_o^2 (||dW_bo||^2 - d_bo^2)`` with
    ``d_bo = <dW_bo, vhat_o>``: one product with ``vhat`` and the rows' squared norms. A linear layer on a batch of
    vectors (``dW_b = go_b (x) x_b``, rows along dimension 0): ``d_b = go_b * (x_b vhat^T)``, ``||dW_bo||^2 =
    go_bo^2 ||x_b||^2``, one matrix product of the batch's inputs."""

    def __init__(self, source: Contribution, g: Tensor, v: Tensor, dim: int, names: list[str]) -> None:
        super().__init__(source)
        self.g, self.v, self.dim, self.names = g, v, (dim if dim == -1 else dim % v.dim()), names
        norm = torch.linalg.vector_norm(_rows(v, self.dim), dim=1)  # (R,)
        self.vhat = _rows(v, self.dim) / norm[:, None]  # (R, rest)
        self.s = _row_scales(g, v, self.dim)  # (R,)
        self._bounds: dict[str, Tensor | None] | None = None

    def _with(self, source: Contribution) -> _Pullback:
        return _WeightNormPullback(source, self.g, self.v, self.dim, self.names)

    def bound(self, name: str) -> Tensor | None:
        if self._bounds is None:
            self._bounds = _weight_norm_bounds(self.s, self.names)
        return self._bounds[name]

    def shape_of(self, name: str) -> torch.Size:
        return self.g.shape if name == "original0" else self.v.shape

    def _compute_stats(self) -> tuple[Tensor, Tensor]:
        """``(||dg_b||^2, ||dv_b||^2)``."""
        src = self.source
        dtype = self.v.dtype
        if isinstance(src, Factored) and src._flat and self.dim == 0:
            # dW_b = left_b (x) right_b, rows p: d_bo = left_bo (right_b . vhat_o), and ||dW_bo||^2 - d_bo^2 =
            # left_bo^2 (||right_b||^2 - (right_b . vhat_o)^2), a difference computed in float64 and guarded
            f64 = torch.float64
            left, right, vhat = src._left.to(f64), src._right.to(f64), self.vhat.to(f64)
            proj = right @ vhat.t()  # (B, p)
            size = right.square().sum(1, keepdim=True)  # (B, 1)
            perp = size - proj.square()
            perp = torch.where(perp < CANCELLATION * size, size, perp)  # the bound where rounding could hide it
            g2 = left.square()
            dg2 = (g2 * proj.square()).sum(1)
            dv2 = (self.s.to(f64).square() * g2 * perp).sum(1)
            return dg2.to(dtype), dv2.to(dtype)
        rows = _rows(src.dense(), self.dim, lead=1)  # (B, R, rest): instantiated by the source anyway
        d = (rows * self.vhat).sum(2)
        resid = rows - d[..., None] * self.vhat  # the direction's part removed explicitly: no cancellation
        return d.square().sum(1), (self.s.square() * resid.square().sum(2)).sum(1)

    def sq_norms(self, name: str) -> Tensor:
        dg2, dv2 = self.stats()
        return dg2 if name == "original0" else dv2

    def pulled_sum(self, name: str, summed: Tensor) -> Tensor:
        rows = _rows(summed, self.dim)  # (R, rest)
        d = (rows * self.vhat).sum(1)
        if name == "original0":
            return d.reshape(self.g.shape)
        return self._unrows(self.s[:, None] * (rows - d[:, None] * self.vhat))

    def dense(self, name: str) -> Tensor:
        rows = _rows(self.source.dense(), self.dim, lead=1)  # (B, R, rest)
        d = (rows * self.vhat).sum(2)
        if name == "original0":
            return d.reshape(-1, *self.g.shape)
        return self._unrows(self.s[:, None] * (rows - d[..., None] * self.vhat), lead=1)

    def _unrows(self, rows: Tensor, lead: int = 0) -> Tensor:
        """:func:`_rows` undone for ``v``'s shape."""
        shape = self.v.shape
        if self.dim == -1:
            return rows.reshape(*rows.shape[:lead], *shape)
        moved = (shape[self.dim], *shape[:self.dim], *shape[self.dim + 1:])
        return rows.reshape(*rows.shape[:lead], *moved).movedim(lead, lead + self.dim)


class _SpectralPullback(_Pullback):
    """``W = theta / sigma`` with ``sigma = u^T M(theta) v`` (``spectral_norm``; ``M`` the weight as a matrix, rows
    along ``dim``; ``u``, ``v`` the forward's power-iteration vectors, fixed). ``J^T dW = dW / sigma - (<theta, dW> /
    sigma^2) M^-1(u v^T)``, so ``||J^T dW_b||^2 = n_b / sigma^2 - 2 a_b c_b / sigma^3 + a_b^2 ||u||^2 ||v||^2 /
    sigma^4`` with ``n_b = ||dW_b||^2``, ``a_b = <theta, dW_b>``, ``c_b = u^T M(dW_b) v``. A linear layer on a batch
    of vectors: ``n_b = ||go_b||^2 ||x_b||^2``, ``a_b = go_b^T theta x_b``, ``c_b = (u . go_b)(x_b . v)``."""

    def __init__(self, source: Contribution, theta: Tensor, u: Tensor, v: Tensor, dim: int) -> None:
        super().__init__(source)
        self.theta, self.u, self.v, self.dim = theta, u, v, dim
        self._bound: Tensor | None = None
        self.sigma = torch.vdot(u, torch.mv(_rows(theta, dim), v))
        outer = torch.outer(u, v)  # M(uv^T) back in the weight's shape
        shape = theta.shape
        moved = (shape[dim], *shape[:dim], *shape[dim + 1:])
        self.uv = outer.reshape(moved).movedim(0, dim)

    def _with(self, source: Contribution) -> _Pullback:
        return _SpectralPullback(source, self.theta, self.u, self.v, self.dim)

    def bound(self, name: str) -> Tensor:
        if self._bound is None:
            self._bound = _spectral_bound(self.theta.movedim(self.dim, 0), self.u, self.v, 0.0)
        return self._bound

    def shape_of(self, name: str) -> torch.Size:
        return self.theta.shape

    def _compute_stats(self) -> Tensor:
        """``||J^T dW_b||^2``."""
        src = self.source
        if isinstance(src, Factored) and src._flat and self.dim == 0 and self.theta.dim() == 2:
            # three terms of which the norm is the difference: float64, guarded (CANCELLATION)
            f64 = torch.float64
            left, right, theta = src._left.to(f64), src._right.to(f64), self.theta.to(f64)
            u, v, sigma = self.u.to(f64), self.v.to(f64), self.sigma.to(f64)
            n = left.square().sum(1) * right.square().sum(1)
            a = ((left @ theta) * right).sum(1)
            c = (left @ u) * (right @ v)
            uv2 = u.square().sum() * v.square().sum()
            value = n / sigma**2 - 2 * a * c / sigma**3 + a.square() * uv2 / sigma**4
            # ||J^T||: at most 1 / |sigma| + ||theta|| ||u|| ||v|| / sigma^2
            bound = n * (1 / sigma.abs() + torch.linalg.vector_norm(theta) * uv2.sqrt() / sigma**2) ** 2
            return torch.where(value < CANCELLATION * bound, bound, value).to(self.theta.dtype)
        dense = self.dense("original")  # the source instantiates dW_b anyway: J^T dW_b explicitly
        return dense.reshape(dense.shape[0], -1).square().sum(1)

    def sq_norms(self, name: str) -> Tensor:
        return self.stats()

    def pulled_sum(self, name: str, summed: Tensor) -> Tensor:
        return summed / self.sigma - ((self.theta * summed).sum() / self.sigma**2) * self.uv

    def dense(self, name: str) -> Tensor:
        dense = self.source.dense()
        a = (dense.flatten(1) @ self.theta.reshape(-1)).view(-1, *([1] * self.theta.dim()))
        return dense / self.sigma - (a / self.sigma**2) * self.uv


class Pulled(Contribution):
    """The per-example gradients of one original of a parametrization, ``J^T dW_b`` (:class:`_Pullback`)."""

    def __init__(self, pullback: _Pullback, name: str) -> None:
        self.pullback, self.name = pullback, name
        self.shape = pullback.shape_of(name)

    def sq_norms(self) -> Tensor:
        """Floored by the source's terms times the pull-back's bound (:func:`_lipschitz`): where the source's terms
        cancel, or its gradient lies where ``J^T`` sends it near 0 (spectral_norm's ``u v^T``, weight_norm's
        ``vhat``), the pulled gradient is the rounding of larger numbers, and moves with the batch as they do."""
        sq = self.pullback.sq_norms(self.name)
        return sq if self.pullback.bound(self.name) is None else floored(sq, floor_of(*self.term_sizes()))

    def term_sizes(self) -> tuple[Tensor, Tensor]:
        bound = self.pullback.bound(self.name)
        if bound is None:  # its share of the floor is another original's: itself as one term
            return super().term_sizes()
        sizes, counts = self.pullback.source_terms()
        return sizes * bound, counts

    def weighted_sum(self, factors: Tensor) -> Tensor:
        return self.pullback.pulled_sum(self.name, self.pullback.source_sum(factors))

    def dense(self) -> Tensor:
        return self.pullback.dense(self.name)

    def drop(self, examples: Tensor) -> None:
        self.pullback.drop(examples)

    def grouped(self, groups: Groups) -> Contribution:
        return Pulled(self.pullback.grouped(groups), self.name)


def _spectral_norms(module: nn.Module) -> list[nn.Module]:
    """The ``spectral_norm`` parametrizations of ``module`` and its descendants (a claimed subtree's too)."""
    return [m for m in module.modules() if isinstance(m, _SpectralNorm)]


def _power_iteration_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name in module, buffer)`` of the power-iteration vectors of the ``spectral_norm``s in training mode of
    ``module`` and its descendants."""
    return [(f"{name}.{b}", getattr(m, b)) for name, m in module.named_modules()
            if isinstance(m, _SpectralNorm) and m.training for b in ("_u", "_v")
            if isinstance(getattr(m, b, None), Tensor)]
