"""Optimizers for the noisy gradients of DP-SGD, and the one place that builds an optimizer by name.

Public API:
    AdamWOSM: DP-Adam WithOut Second Moment (Mohapatra et al., AAAI 2022).
    build_optimizer: ``"sgd"``, ``"adam"`` or ``"adamwosm"`` over some parameters, for the
        ``configure_optimizers`` of any LightningModule of the project.
    check_optimizer_choice: the validation of a (name, momentum) pair, for constructors that
        want to fail before training starts.
    OPTIMIZERS: the names ``build_optimizer`` accepts.

Everything here is post-processing of the released (clipped, noised) gradient: it reads
the gradient and public constants (sigma, C, the expected batch size) only, so it costs no
privacy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer, ParamsT

from lightning_dp import checks

__all__ = ["AdamWOSM", "OPTIMIZERS", "build_optimizer", "check_optimizer_choice"]

_NOISE_STD_FIX = (
    "pass noise_std = noise_multiplier * max_grad_norm / expected_batch_size (sigma * C / B, the std per "
    "coordinate of the noise in the averaged gradient), or leave it None and train with the "
    "lightning_dp.callbacks.DPSGD callback, which sets it before every step (AdamWOSM.set_noise_std)"
)


def _finite_real(value: Any) -> bool:
    return checks.is_real(value) and math.isfinite(value)


def _check_noise_std(noise_std: Any) -> float:
    if not _finite_real(noise_std) or noise_std <= 0:
        raise ValueError(f"noise_std={noise_std!r} must be a finite number > 0; {_NOISE_STD_FIX}.")
    return float(noise_std)


def _check_hyperparameters(*, lr: Any, beta: Any, noise_std: Any, eps: Any, weight_decay: Any) -> None:
    """Raise on the first invalid hyperparameter of :class:`AdamWOSM` (the message names value, range and fix)."""
    if not _finite_real(lr) or lr < 0:
        raise ValueError(f"lr={lr!r} must be a finite number >= 0; pass e.g. lr=1e-3.")
    if not _finite_real(beta) or not 0.0 <= beta < 1.0:
        raise ValueError(
            f"beta={beta!r} must be in [0, 1); pass e.g. beta=0.9 (Adam's beta1), or beta=0.0 for no momentum.")
    if noise_std is not None:
        _check_noise_std(noise_std)
    if not _finite_real(eps) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a finite number >= 0; pass e.g. eps=1e-8.")
    if not _finite_real(weight_decay) or weight_decay < 0:
        raise ValueError(
            f"weight_decay={weight_decay!r} must be a finite number >= 0; pass 0.0 (none) or e.g. 1e-4.")


class AdamWOSM(Optimizer):
    r"""DP-Adam WithOut Second Moment: Adam whose second moment is the DP noise variance.

    Mohapatra, Sasy, He, Kamath, Thakkar, "The role of adaptive optimizers for honest
    private hyperparameter selection", AAAI 2022 (arXiv:2111.04906), DPAdamWOSM.

    DP-SGD releases ``g_t = (sum_i clip(g_i) + N(0, (sigma C)^2 I)) / B``, so every coordinate
    of ``g_t`` carries Gaussian noise of standard deviation ``noise_std = sigma C / B``
    (``sigma`` the noise multiplier, ``C`` the clipping threshold, ``B`` the expected batch
    size). Its second moment ``E[g_t^2] = E[g_t]^2 + (sigma C / B)^2`` is dominated by the
    noise variance, so Adam's ``sqrt(v_t)`` converges to nearly the same constant on every
    coordinate. DPAdamWOSM uses that constant from the first step on, instead of estimating
    it from noise::

        m_t     = beta * m_{t-1} + (1 - beta) * g_t
        m_hat_t = m_t / (1 - beta^t)
        theta_t = theta_{t-1} * (1 - lr * weight_decay) - lr * m_hat_t / (noise_std + eps)

    i.e. DP-SGD with bias-corrected momentum at the effective learning rate
    ``lr / (sigma C / B)``; the decoupled weight decay is AdamW's (Loshchilov & Hutter 2019),
    0 by default. It keeps one state tensor per parameter (``exp_avg``) instead of Adam's two.

    ``noise_std`` is a per-parameter-group hyperparameter (``group["noise_std"]``). It may be
    ``None`` at construction: the :class:`~lightning_dp.callbacks.DPSGD` callback calls
    :meth:`set_noise_std` with its ``sigma * C / B`` before every optimizer step (so a
    schedule of sigma is followed). ``state_dict``/``load_state_dict`` are
    ``torch.optim.Optimizer``'s; ``noise_std`` travels in ``param_groups``.

    Hand-written because no maintained library ships it: ``torch.optim`` has no DP
    optimizer, and Opacus (1.6) wraps any ``torch.optim`` optimizer in ``DPOptimizer`` but
    contains no Adam variant (no file of the installed package mentions Adam); a
    maintainer's advice for DP-specific Adam variants is a custom optimizer wrapped by
    ``DPOptimizer`` (opacus issue #679, on DP-AdamBC). Conventions follow ``torch.optim.Adam``
    (state ``step``, ``exp_avg``; ``lr`` read from the group at every step, so LR schedulers
    work).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer.
        lr: Learning rate ``alpha`` (>= 0).
        beta: Decay of the first-moment average, Adam's ``beta1``, in ``[0, 1)``.
        noise_std: ``sigma * C / B`` (> 0), or ``None`` to have the DPSGD callback set it.
        eps: Added to ``noise_std`` in the denominator (>= 0).
        weight_decay: Decoupled (AdamW) weight decay coefficient (>= 0).

    Raises:
        ValueError: If a hyperparameter is outside its range (the message names the value,
            the range and the fix).

    Example:
        >>> import torch
        >>> from lightning_dp.optim import AdamWOSM
        >>> w = torch.nn.Parameter(torch.zeros(3))
        >>> opt = AdamWOSM([w], lr=0.01, noise_std=1.0 * 1.0 / 256)  # sigma = 1, C = 1, B = 256
        >>> w.grad = torch.tensor([0.01, -0.02, 0.0])
        >>> opt.step()  # first step: -lr * g / noise_std (bias correction undoes (1 - beta))
        >>> w.detach()
        tensor([-0.0256,  0.0512,  0.0000])
        >>> opt.set_noise_std(2.0 / 256)  # what DPSGD does before each step
        >>> opt.param_groups[0]["noise_std"]
        0.0078125
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        *,
        beta: float = 0.9,
        noise_std: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        _check_hyperparameters(lr=lr, beta=beta, noise_std=noise_std, eps=eps, weight_decay=weight_decay)
        defaults = {
            "lr": lr,
            "beta": beta,
            "noise_std": None if noise_std is None else float(noise_std),
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group as ``torch.optim.Optimizer`` does, then validate its hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(**{k: group[k] for k in ("lr", "beta", "noise_std", "eps", "weight_decay")})

    def set_noise_std(self, noise_std: float) -> None:
        """Set ``noise_std = sigma * C / B`` on every parameter group (called by DPSGD before each step).

        Raises:
            ValueError: If ``noise_std`` is not a finite number > 0.
        """
        value = _check_noise_std(noise_std)
        for group in self.param_groups:
            group["noise_std"] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (see the class docstring for the update).

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Raises:
            RuntimeError: If a group's ``noise_std`` is still ``None``, or a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # checked after the closure: under Lightning, DPSGD's on_before_optimizer_step (which calls
        # set_noise_std) runs inside it; and checked for all groups before any parameter moves
        for i, group in enumerate(self.param_groups):
            if group["noise_std"] is None:
                raise RuntimeError(
                    f"AdamWOSM: param_groups[{i}]['noise_std'] is None, so the step size lr / noise_std is "
                    "undefined. Use AdamWOSM with the lightning_dp.callbacks.DPSGD callback, which sets it before "
                    "every step, or pass noise_std=sigma*C/B (noise_multiplier * max_grad_norm / "
                    "expected_batch_size) to the constructor or to set_noise_std().")
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise RuntimeError("AdamWOSM does not support sparse gradients; use dense parameters.")
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["beta"], group["weight_decay"]
            denominator = group["noise_std"] + group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"].item())
                exp_avg = state["exp_avg"]
                exp_avg.lerp_(grad, 1.0 - beta)  # m_t = beta m_{t-1} + (1 - beta) g_t
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                bias_correction = 1.0 - beta**t
                p.add_(exp_avg, alpha=-lr / (bias_correction * denominator))
        return loss


def _sgd(params: ParamsT, lr: float, momentum: float) -> Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def _adam(params: ParamsT, lr: float, momentum: float) -> Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _adamwosm(params: ParamsT, lr: float, momentum: float) -> Optimizer:
    return AdamWOSM(params, lr=lr)  # noise_std: set by the DPSGD callback before every step


_BUILDERS: dict[str, Callable[[ParamsT, float, float], Optimizer]] = {
    "sgd": _sgd,
    "adam": _adam,
    "adamwosm": _adamwosm,
}

#: The names :func:`build_optimizer` accepts.
OPTIMIZERS: tuple[str, ...] = tuple(_BUILDERS)


def check_optimizer_choice(name: Any, momentum: Any) -> None:
    """Raise ``ValueError`` unless ``name`` is in :data:`OPTIMIZERS` and ``momentum`` fits it.

    ``momentum`` is SGD's, in ``[0, 1)``; the Adam variants have their own first-moment
    average (betas at their defaults) and need ``momentum=0.0``.
    """
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ValueError(f"optimizer={name!r} is not supported; choose one of {list(OPTIMIZERS)}.")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1); pass e.g. momentum=0.9, or 0.0 for plain SGD.")
    if name != "sgd" and momentum != 0.0:
        raise ValueError(
            f"momentum={momentum!r} only applies to optimizer='sgd'; with optimizer={name!r} leave momentum=0.0.")


def build_optimizer(name: str, params: ParamsT, *, lr: float, momentum: float = 0.0) -> Optimizer:
    """The optimizer called ``name`` over ``params``, with the defaults of its class otherwise.

    * ``"sgd"``: ``torch.optim.SGD(params, lr=lr, momentum=momentum)``;
    * ``"adam"``: ``torch.optim.Adam(params, lr=lr)``;
    * ``"adamwosm"``: ``AdamWOSM(params, lr=lr)``; its ``noise_std`` is set by the DPSGD
      callback before every step (without the callback its ``step`` raises).

    Args:
        name: One of :data:`OPTIMIZERS`.
        params: Parameters or parameter groups.
        lr: Learning rate (Adam's alpha for the Adam variants).
        momentum: SGD momentum in ``[0, 1)``; must be 0.0 for the Adam variants.

    Raises:
        ValueError: If ``name`` is unknown or ``momentum`` does not fit it.

    Example:
        >>> import torch
        >>> type(build_optimizer("adamwosm", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3)).__name__
        'AdamWOSM'
    """
    check_optimizer_choice(name, momentum)
    return _BUILDERS[name](params, lr, momentum)
