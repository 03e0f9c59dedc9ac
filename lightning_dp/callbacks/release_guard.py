"""The last line of defence of DPSGD: an optimizer step refuses any gradient that DPSGD did not release.

Every path that bypasses clipping and noise (a parameter unfrozen inside ``training_step``, a parameter added to the
optimizer but not owned by the module, a callback writing raw gradients after DPSGD) ends here: the step is refused
before the optimizer reads the gradient. A gradient must be the very tensor DPSGD set; in-place post-processing of it
(gradient clipping) is allowed.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ReleaseGuard", "UnprivatizedGradientError"]


class UnprivatizedGradientError(RuntimeError):
    """An optimizer step was about to use a gradient that did not go through clipping and noise."""


class ReleaseGuard:
    """Optimizer step pre-hooks that check every gradient against the ones released (:meth:`mark`)."""

    def __init__(self) -> None:
        self._released: dict[int, torch.Tensor] = {}
        self._hooks: list[Any] = []

    def install(self, optimizers: list[Any]) -> None:
        self.remove()
        self._hooks = [opt.register_step_pre_hook(self._checked_closure) for opt in optimizers]

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def clear(self) -> None:
        """A new step begins: nothing is released yet."""
        self._released = {}

    def mark(self, parameter: torch.Tensor) -> None:
        """``parameter.grad`` is the release of this step."""
        self._released[id(parameter)] = parameter.grad  # type: ignore[assignment]

    def _checked_closure(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Makes the step check its gradients right before it updates.

        Lightning's automatic optimization runs the forward, the backward and every ``on_before_optimizer_step``
        hook INSIDE ``optimizer.step(closure)``, so a pre-hook alone would look at the gradients before they exist:
        the closure is replaced by one that runs it and then :meth:`check` (torch lets a step pre-hook return new
        arguments).
        """
        # torch passes the step's own arguments with the optimizer first: (optimizer, closure?) or closure=...
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:  # step() without a closure (a GradScaler's step after the closure ran): check now
            self.check(optimizer)
            return None

        def checked() -> Any:
            result = closure()
            self.check(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return (args[0], checked, *args[2:]), kwargs

    def check(self, optimizer: Any) -> None:
        """Raises :class:`UnprivatizedGradientError` for a gradient that is not the one released."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and self._released.get(id(p)) is not p.grad:
                    raise UnprivatizedGradientError(
                        f"DPSGD: an optimizer step was about to use the gradient of a parameter of shape "
                        f"{tuple(p.shape)} that did not go through per-sample clipping and noise (a parameter that "
                        "became trainable inside training_step, a parameter outside the LightningModule, or a "
                        "gradient written after DPSGD). The step is refused so that nothing unprivatized is released. "
                        "Change requires_grad in a hook that runs before the batch (e.g. on_train_epoch_start, as "
                        "BackboneFinetuning does), or freeze the parameter.")
