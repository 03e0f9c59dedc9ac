"""Layer rules: how the per-sample gradients of one layer type are computed, registered by type.

The most specific registered base class wins; a module without a rule falls back to
:class:`~lightning_dp.privacy.grad_sample.rules.functorch.FunctorchRule` (``torch.func``: exact, slower). A rule
sees one :class:`Record` per forward call (batch in dimension 0) and returns one
:class:`~lightning_dp.privacy.grad_sample.contributions.Contribution` per trainable parameter. Your own rule
(:func:`register_rule`): docs/per_sample_gradients.md and docs/architecture.md, "Extension points".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.privacy.registry import Registry

__all__ = ["LayerRule", "PerSampleGradientError", "Record", "join_graph", "register_rule", "rule_for",
           "registered_rules"]


class PerSampleGradientError(RuntimeError):
    """Raised when per-sample gradients cannot be computed for the model as used."""


class _JoinGraph(torch.autograd.Function):
    """Makes a tensor computed without grad part of the graph, without copying it.

    The output is marked dirty (as an in-place op would be), so it keeps its storage and
    may itself be modified in place later (``nn.ReLU(inplace=True)``). ``anchor`` is a
    0-dim leaf that requires grad; it only gives the node a reason to exist.
    """

    @staticmethod
    def forward(ctx: Any, output: Tensor, anchor: Tensor) -> Tensor:
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def join_graph(output: Tensor, anchor: Tensor) -> Tensor:
    """``output`` (computed without grad: no input carried the graph) joined to the graph through ``anchor``, a
    0-dim leaf that requires grad, so that a hook on it receives the output's gradient (used by the engine and by
    rules that tap functional calls)."""
    return _JoinGraph.apply(output, anchor)


@dataclass
class Record:
    """One forward call of a layer in the recorded step, batch first.

    Attributes:
        args, kwargs: the call's arguments; every tensor that holds the batch has it moved
            to dimension 0 (tensors without a batch dimension are as called, or expanded to
            the batch for a layer whose inputs are shared by all examples, see
            ``broadcast``); tensors are detached.
        grad_outputs: the gradient of each tensor leaf of the output (in
            ``torch.utils._pytree`` order), batch first, as autograd gave them (the loss
            scale is applied by the engine to the norms and the sums' weights: a rule's
            per-sample gradients must be linear in these, as every gradient is); zeros for an
            output the loss does not use; None for a leaf that is not a tensor or has no batch
            dimension.
        arg_dims, kwarg_dims, output_dims: where each tensor leaf held the batch in the
            call itself (None: no batch dimension), for rules that call the module again.
        broadcast: the layer's inputs are shared by all examples (a positional embedding
            of ``torch.arange(T)``); its output was expanded to the batch during the
            forward, so that every example's gradient flows through its own slice.
        extra: what the rule itself recorded during the forward (see :meth:`LayerRule.forward_context`).
        call_args, call_kwargs: the arguments exactly as called (detached), for rules that
            run the module again.
        scale: the factor already applied to ``grad_outputs`` (1: the engine applies the
            loss scale after the rules); gradients a rule records itself (``extra``) must be
            multiplied by it.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad_outputs: list[Tensor | None]
    arg_dims: tuple[Any, ...]
    kwarg_dims: dict[str, Any]
    output_dims: list[int | None]
    broadcast: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    call_args: tuple[Any, ...] = ()
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    scale: float | Tensor = 1.0

    def input(self, index: int = 0, name: str = "input") -> Any:
        """Positional argument ``index``, or keyword ``name`` when it was passed by keyword (batch first)."""
        return self.args[index] if len(self.args) > index else self.kwargs[name]


class LayerRule:
    """Base class of the rules; subclass it and register with :func:`register_rule`.

    Attributes:
        claims_subtree: the rule also computes the per-sample gradients of the module's
            descendants' parameters (``nn.MultiheadAttention`` uses ``out_proj``'s weight
            functionally, never calling ``out_proj``); those descendants are not hooked.
        batch_from_output: accept a layer whose inputs have no batch dimension when its
            output has one.
        unbatched_outputs: hand the rule the gradients of outputs without a batch dimension
            (as they are) instead of refusing them.

    A rule may also define ``check_dims(module, input_dims, output_dims, broadcast)``,
    called after probing with the batch dimension of every input and output leaf, to
    refuse layouts it cannot handle, ``check_call(module, args, kwargs)``, called
    before every probed or recorded forward of the module, to refuse call-time
    configurations, and ``prepare_call(module)``, called there too, to put the module in a
    state that does not depend on the batch (an embedding with ``max_norm`` renormalizes its
    whole table). A :class:`~lightning_dp.privacy.grad_sample.PerSampleGradientError` raised by
    any of them is prefixed with the layer's path in the model. ``after_call(module, args, output,
    extra)``, called after every recorded forward of the module with its inputs and its output as
    the forward returned them (before anything is detached), may keep in ``extra`` what the
    forward computed anyway (GroupNorm: its means and inverse deviations, from the output's
    autograd node), for the record's :attr:`Record.extra`.
    """

    claims_subtree: bool = False
    #: the batch size may be read from the output alone (an ``EmbeddingBag``'s offsets can hold B + 1 entries)
    batch_from_output: bool = False
    #: the rule reads the gradients of outputs without a batch dimension itself (a recurrent layer's packed
    #: output): they reach it as they are (times the scale) instead of being refused
    unbatched_outputs: bool = False

    def check(self, module: nn.Module, trainable: dict[str, nn.Parameter]) -> None:
        """Raise :class:`~lightning_dp.privacy.grad_sample.PerSampleGradientError` for configurations the rule
        cannot handle exactly (before any data is touched). ``trainable`` maps parameter names
        (relative to ``module``) to the trainable parameters the rule must cover."""

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module, extra: dict[str, Any]) -> Iterator[None]:
        """Active while the module's forward runs in a recorded step; may record into ``extra``."""
        yield

    def contributions(self, layer: Any, records: list[Record], batch_size: int) -> dict[str, Any]:
        """Per-sample gradients of ``layer``'s trainable parameters over ``records``.

        Args:
            layer: the engine's view of the layer: ``layer.module``, ``layer.trainable``
                (name -> parameter), ``layer.name``.
            records: the layer's calls in the step (at least one).
            batch_size: B.

        Returns:
            ``{parameter name: Contribution}`` for every trainable parameter of the layer.
        """
        raise NotImplementedError


#: module type (or its qualified name) -> the rule instance for it
_RULES: Registry[LayerRule] = Registry("layer rule", base=LayerRule)


def register_rule(*module_types: type | str) -> Callable[[type[LayerRule]], type[LayerRule]]:
    """Class decorator: use this rule for modules of ``module_types`` (and their subclasses that keep the type's
    ``forward``: :func:`rule_for`).

    A type may be given by its qualified name (``"transformers.pytorch_utils.Conv1D"``), so
    that a rule for a third-party layer does not import that library. A later registration
    for the same type replaces the earlier one, so a user can override a built-in rule (the one
    registry that allows it: a rule is chosen by the layer's type, never by a name in a config).
    """
    def decorate(cls: type[LayerRule]) -> type[LayerRule]:
        rule = cls()
        for t in module_types:
            _RULES.register(t, rule, replace=True)
        return cls
    return decorate


def rule_for(module: nn.Module) -> LayerRule | None:
    """The rule of the most specific registered type in ``type(module)``'s MRO, or None.

    None also where ``type(module)`` overrides that type's ``forward`` (itself or through a class between them), or
    where the instance's ``forward`` is replaced (``module.forward = f``, or wrapped by an accelerate hook other
    than its device hooks; those are excepted): a
    rule's formulas are those of the registered type's forward, and a layer that computes otherwise (a
    weight-standardized convolution, a GroupNorm with another eps) would get per-sample gradients of a computation
    that did not run. Such a layer takes the exact fallback (``torch.func``); register the rule for the subclass
    itself (``register_rule(MyConv)(ConvRule)``) where its forward computes what the parent's does."""
    found = _matched(module)
    return found[1] if found is not None and found[2] is None else None


def _matched(module: nn.Module) -> tuple[type, LayerRule, str | None] | None:
    """The most specific registered type in ``type(module)``'s MRO, its rule, and why the rule is withheld (None:
    it is not; ``"class"``: ``type(module)`` overrides the type's ``forward``; ``"instance"``: the instance's
    ``forward`` is replaced; ``"hook"``: an accelerate hook other than its device hooks wraps it); None where no
    type is registered."""
    found = _registered(type(module))
    if found is None:
        return None
    t, rule = found
    if getattr(type(module), "forward", None) is not getattr(t, "forward", None):
        return t, rule, "class"
    return t, rule, _forward_replaced(module)


#: accelerate's hooks that only move tensors between devices around a forward (or do nothing: the base class)
_DEVICE_HOOKS = frozenset({"AlignDevicesHook", "CpuOffload", "ModelHook"})


def _device_hooks_only(hook: Any) -> bool:
    """Whether ``hook`` (a module's ``_hf_hook``) is one of accelerate's device hooks, or a ``SequentialHook`` of them.
    A subclass (a user's ``ModelHook`` whose ``pre_forward``/``post_forward`` may change the inputs or the output)
    is not: its type is matched exactly."""
    cls = type(hook)
    if cls.__module__ != "accelerate.hooks":
        return False
    if cls.__name__ == "SequentialHook":
        return all(_device_hooks_only(h) for h in getattr(hook, "hooks", ()))
    return cls.__name__ in _DEVICE_HOOKS


def _forward_replaced(module: nn.Module) -> str | None:
    """How ``module.forward`` is replaced on the instance (in its ``__dict__``), or None where it is not or only
    accelerate's device hooks wrap the class's own forward (they keep that forward, bound to the module, as
    ``module._old_forward`` and only move tensors between devices around it): ``"hook"`` where another accelerate
    hook wraps it (``LayerwiseCastingHook``, a user's ``ModelHook``: its ``pre_forward``/``post_forward`` may change
    what the layer computes), ``"instance"`` for anything else (``module.forward = f``)."""
    own = vars(module)
    if "forward" not in own:
        return None
    old = own.get("_old_forward")
    if not (getattr(old, "__self__", None) is module
            and getattr(old, "__func__", None) is getattr(type(module), "forward", None)):
        return "instance"
    return None if _device_hooks_only(own.get("_hf_hook")) else "hook"


def _registered(cls: type) -> tuple[type, LayerRule] | None:
    """The most specific registered type in ``cls``'s MRO and its rule, or None."""
    for t in cls.__mro__:
        rule = _RULES.get(t) or _RULES.get(f"{t.__module__}.{t.__qualname__}")
        if rule is not None:
            return t, rule
    return None


def withheld_rule(module: nn.Module) -> tuple[type, LayerRule, str] | None:
    """The registered type and rule that :func:`rule_for` withholds from ``module`` because its forward is not that
    type's, and why (``"class"``: its class overrides it; ``"instance"``: it is replaced on the instance; ``"hook"``:
    an accelerate hook other than its device hooks wraps it); None where
    it gives the rule, or none is registered. The engine says so when it hooks the layer."""
    found = _matched(module)
    return None if found is None or found[2] is None else (found[0], found[1], found[2])


def registered_rules() -> dict[type | str, LayerRule]:
    """A copy of the registry (module type or qualified name -> rule)."""
    return dict(_RULES)
