"""The fallback rule: exact per-sample gradients of any module with ``torch.func`` (vmap over vjp).

Used for every module that owns trainable parameters and has no registered rule (custom
layers, ``nn.Bilinear``, ...). Each example's call is replayed alone (its inputs sliced at the
batch dimensions the engine established, keyword tensors included, with a batch of one
put back where the module expects it) and pulled back through the recorded output
gradients. Exact, and slower than a dedicated rule: register one for a layer that matters
(:func:`~lightning_dp.privacy.grad_sample.registry.register_rule`). Layers with their own
randomness (dropout inside the forward) are refused: a replay cannot draw the forward's
masks again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import Dense
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError

__all__ = ["FunctorchRule", "check_buffers_unchanged", "per_example_grads"]


def _unsqueeze(tree: Any, dims: Any) -> Any:
    return pytree.tree_map(lambda a, d: a.unsqueeze(d) if isinstance(a, Tensor) and isinstance(d, int) else a,
                           tree, dims)


def _forward_at(module: nn.Module, state: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module.forward(*args, **kwargs)`` with its parameters and buffers taken from ``state``, without the hooks
    a call of the module runs (its own and the global ones): a replay computes what the forward computed from the
    inputs it received (after the forward pre-hooks) up to the output the engine recorded (before any forward hook
    that changes it, which the engine refuses, and before the hooks registered after the engine's, which autograd
    carries from the recorded output). ``torch.func.functional_call`` calls the module, so it would run its
    pre-hooks again on inputs they already changed: its own context manager is used around ``forward`` instead (a
    private torch function, as functional_call itself uses it; tied names bound together as functional_call does)."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, state, tie_weights=True):
        return module.forward(*args, **kwargs)


def per_example_grads(layer, records, batch_size: int) -> dict[str, Tensor]:
    """``{name: (B, *shape)}`` per-sample gradients of ``layer``'s trainable parameters, summed over its calls."""
    from torch.func import vjp, vmap

    module = layer.module
    total: dict[str, Tensor] = {}
    with layer.replaying():
        state = layer.replay_state()  # every parameter and buffer in the records' dtype (float32 under bf16-true)
        params = {n: state[n] for n in layer.trainable}
        fixed = {n: t for n, t in state.items() if n not in params}
        versions = {n: b._version for n, b in module.named_buffers()}
        for r in records:
            kept = r.extra.get("replay_state", {})  # state a rule kept from this call's forward, as replay_state has it
            fixed_r = {**fixed, **{n: t.to(fixed[n].dtype) if n in fixed else t for n, t in kept.items()}}
            if r.broadcast:  # shared inputs: every example calls the module on the same arguments
                args, kwargs = r.call_args, r.call_kwargs
                arg_dims = pytree.tree_map(lambda _: None, (args, kwargs))
            else:
                args, kwargs = r.args, r.kwargs
                arg_dims = (r.arg_dims, r.kwarg_dims)
            vmap_dims = pytree.tree_map(lambda d: None if d is None else 0, arg_dims)
            grad_dims = [None if g is None else 0 for g in r.grad_outputs]

            def one(grads_i: list, args_i: tuple, kwargs_i: dict, _r=r, _dims=arg_dims,
                    _fixed=fixed_r) -> dict[str, Tensor]:
                call_args, call_kwargs = (args_i, kwargs_i) if _r.broadcast else _unsqueeze((args_i, kwargs_i), _dims)
                # torch.func.vjp is annotated for has_aux=True as well: a 2- or 3-tuple
                out, pullback = vjp(lambda p: _forward_at(module, {**_fixed, **p}, tuple(call_args),  # type: ignore[misc]
                                                          dict(call_kwargs)), params)
                leaves, spec = pytree.tree_flatten(out)
                cot = []
                for leaf, g, d in zip(leaves, grads_i, _r.output_dims):
                    if g is None or not isinstance(leaf, Tensor):
                        cot.append(torch.zeros_like(leaf) if isinstance(leaf, Tensor) else leaf)
                    elif _r.broadcast:
                        cot.append(g.reshape(leaf.shape))
                    else:
                        cot.append(g.unsqueeze(d))
                return pullback(pytree.tree_unflatten(cot, spec))[0]

            try:
                grads = vmap(one, in_dims=(grad_dims, *vmap_dims))(r.grad_outputs, args, kwargs)
            except Exception as err:  # torch.func raises many types; say what failed and why
                hint = ("it draws random numbers in its forward (dropout?), which a replay cannot reproduce: move the "
                        "dropout out of this module or set its probability to 0"
                        if "random" in str(err).lower() else f"{type(err).__name__}: {err}")
                raise PerSampleGradientError(
                    f"torch.func could not compute per-sample gradients of {layer.name} ({type(module).__name__}): "
                    f"{hint}. Freeze this module, replace it with supported layers, or register a rule for it "
                    "(lightning_dp.privacy.grad_sample.register_rule).") from err
            for n, g in grads.items():
                total[n] = g if n not in total else total[n] + g
    check_buffers_unchanged(layer, module, versions)
    return total


def check_buffers_unchanged(layer: Any, module: nn.Module, versions: dict[str, int]) -> None:
    """Raises if a buffer of ``module`` changed since ``versions`` (its buffers' version counters before a replay):
    the replay ran state updates of the forward again (a running statistic, a counter, ...)."""
    changed = [n for n, b in module.named_buffers() if n in versions and b._version != versions[n]]
    if changed:
        raise PerSampleGradientError(
            f"{layer.name} ({type(module).__name__}) changes its buffers {changed} when its forward runs: the "
            "torch.func replay that computes its per-sample gradients ran that update again, so the model's state "
            "now differs from a non-private run, and the replayed forward may not be the one that ran. Make the "
            "forward leave its buffers alone in training (or update them outside it), freeze this module, or "
            "register a rule for it (lightning_dp.privacy.grad_sample.register_rule).")


class FunctorchRule(LayerRule):
    """Any module: ``vmap`` over the per-example ``vjp`` of the module alone."""

    def contributions(self, layer, records, batch_size):
        return {n: Dense(g) for n, g in per_example_grads(layer, records, batch_size).items()}
