"""Clipping strategies of DP-SGD: how :class:`~lightning_dp.callbacks.DPSGD` chooses the threshold C of each step.

Registered by name (``DPSGD(clipping="quantile")``): ``fixed`` (:class:`FixedClip`), ``online_sensitivity``
(:class:`OnlineSensitivityClip`, OSO-DPSGD) and ``quantile`` (:class:`QuantileClip`, Andrew et al. 2021). A strategy
that releases a statistic of the batch takes a share of the accounted multiplier
(:func:`~lightning_dp.privacy.adaptive.composed_noise_multiplier`) and draws its noise from
``release.statistic_generator``: it never sees the noise seed. The rules: docs/privacy.md, "Adaptive clipping";
adding one: docs/architecture.md, "Extension points".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_dp import checks
from lightning_dp.privacy.adaptive import (
    OSO_CLIP_LR,
    OSO_INITIAL_CLIP,
    OSO_LR_LR,
    default_count_noise_std,
    oso_noise_split,
    oso_noisy_q_sum,
    oso_q_weights,
    oso_statistics,
    oso_update,
    quantile_clip_update,
    quantile_noise_split,
)
from lightning_dp.privacy.clipping import check_max_grad_norm
from lightning_dp.privacy.noise import derive_secret_generator
from lightning_dp.privacy.registry import Registry

__all__ = ["ClipStrategy", "FixedClip", "OnlineSensitivityClip", "QuantileClip", "Release", "StatisticStream",
           "register_clip_strategy",
           "registered_clip_strategies", "resolve_clip_strategy"]

#: Andrew et al. 2021's recommended step of log C (eta_C) and initial threshold.
QUANTILE_CLIP_LR = 0.2
QUANTILE_INITIAL_CLIP = 0.1



@dataclass(frozen=True)
class Release:
    """One released step, as a strategy sees it after the noise was added and before the optimizer steps.

    ``clipped`` and ``examples`` are the exact counts of the step over all ranks (clipped examples, examples): a
    strategy may release them only with noise of its own, paid by its share of the multiplier.
    """

    step: int  #: the release's number over the run (0 for the first; it keys the step's noise streams)
    noise_multiplier: float  #: the accounted multiplier of the step (the strategy's share is split from it)
    gradient: list[torch.Tensor]  #: the released noisy gradient (what the optimizer receives)
    extra_sums: list[list[torch.Tensor]]  #: the sums weighted by :meth:`ClipStrategy.extra_weights`, NOT noised
    clipped: float
    examples: float
    expected_batch_size: float
    optimizer: Any
    #: ``statistic_generator(device=None)``: the secret generator of this step's statistic noise
    statistic_generator: Callable[..., torch.Generator] = field(repr=False)


class StatisticStream:
    """The secret generator of one step's statistic noise, without showing its seed: no repr of it, no pickling
    (a strategy that kept a release in its checkpoint state would otherwise carry the seed out of the run)."""

    __slots__ = ("_make",)

    def __init__(self, seed: int, *counters: int) -> None:
        def make(device: Any = "cpu") -> torch.Generator:
            return derive_secret_generator(seed, *counters, device=device)
        self._make = make

    def __call__(self, device: Any = "cpu") -> torch.Generator:
        return self._make(device)

    def __repr__(self) -> str:
        return "StatisticStream(<secret>)"

    def __reduce__(self) -> Any:
        raise TypeError("a StatisticStream holds the run's secret seed: it is not pickled")


class ClipStrategy:
    """Chooses C for every step; may release one statistic of the batch, paid by a share of the noise multiplier.

    ``clip`` is the threshold of the next step. ``adaptive`` strategies move it (logged as the metric
    ``privacy/max_grad_norm``, the initial value as the param ``privacy/initial_clip``, plotted at the end); a fixed
    C is the param ``privacy/max_grad_norm``.
    """

    name = "clip_strategy"
    #: whether C moves during the run
    adaptive = False
    #: the plot's title
    title = "clipping"

    def __init__(self, initial_clip: float = 1.0) -> None:
        self.initial_clip = initial_clip
        self.clip = initial_clip
        #: (optimizer step, C used, learning rate used) of every released step (adaptive strategies)
        self.trace: list[tuple[int, float, float]] = []

    def check_noise(self, noise_multiplier: float, expected_batch_size: float | None) -> None:
        """Raise ``ValueError`` if this strategy cannot split ``noise_multiplier`` (``expected_batch_size``: None
        before the data is known, when only what does not depend on it is checked)."""

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float) -> float:
        """The multiplier of the clipped sum's noise: all of the accounted one, or its share."""
        return noise_multiplier

    def start(self, noise_multiplier: float, expected_batch_size: float, *, lr_scheduled: bool) -> dict[str, Any]:
        """Checks the run (``ValueError``) and returns the strategy's params to log (never secrets)."""
        self.check_noise(noise_multiplier, expected_batch_size)
        return {}

    def extra_weights(self, per_sample_norms: torch.Tensor, clip: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per-example weights of further sums released with the clipped sum (noised by :meth:`after_release`);
        ``clip``: this step's C, checked, as a tensor (a compiled pass: a changing float would recompile)."""
        return []

    def after_release(self, release: Release) -> None:
        """Post-processing of the step's release, before the optimizer step: the next C."""

    def trainable_changed(self) -> None:
        """The set of trainable parameters changed: forget what spans the old set."""

    def metrics(self) -> dict[str, float]:
        """What moves, logged with epsilon (``privacy/max_grad_norm``: the C of the last released step)."""
        return {"privacy/max_grad_norm": self.trace[-1][1]} if self.adaptive and self.trace else {}

    def describe(self) -> str:
        """The summary's value of C."""
        if self.adaptive:
            return f"{self.clip:.4g} at the end (adaptive, initial {self.initial_clip:g})"
        return f"{self.clip:.4g}"

    def record(self, step: int, optimizer: Any) -> None:
        """Adds the step's (step, C, learning rate) to the trace."""
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else math.nan
        self.trace.append((step + 1, self.clip, lr))

    def state_dict(self) -> dict[str, Any]:
        return {"max_grad_norm": self.clip, "trace": list(self.trace)} if self.adaptive else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.adaptive and state:
            self.clip = float(state["max_grad_norm"])
            self.trace = [(int(x[0]), float(x[1]), float(x[2])) for x in state.get("trace", [])]


_STRATEGIES: Registry[type[ClipStrategy]] = Registry("clipping strategy", base=ClipStrategy, argument="clipping")


def register_clip_strategy(name: str) -> Callable[[type[ClipStrategy]], type[ClipStrategy]]:
    """Class decorator: ``DPSGD(clipping=name)`` builds the strategy with its defaults.

    Raises:
        ValueError: the name is taken by another class (importing a module must not replace, e.g., ``fixed``).
    """
    def decorate(cls: type[ClipStrategy]) -> type[ClipStrategy]:
        _STRATEGIES.register(name, cls)
        cls.name = name
        return cls
    return decorate


def registered_clip_strategies() -> dict[str, type[ClipStrategy]]:
    """``{name: class}`` of the registered strategies."""
    return dict(_STRATEGIES)


def resolve_clip_strategy(value: ClipStrategy | str) -> ClipStrategy:
    """A strategy from an instance, a registered name or a class path (``my_module.Halving``), built with its
    defaults.

    Raises:
        ValueError: an unknown name (with the registered ones and the closest), a class path that does not name a
            ClipStrategy, or another type.
    """
    if isinstance(value, ClipStrategy):
        return value
    if isinstance(value, str):
        return _STRATEGIES.resolve(value)()
    raise ValueError(f"clipping={value!r} is not allowed: pass a registered name ({sorted(_STRATEGIES)}), a class "
                     "path or a lightning_dp.callbacks.clipping.ClipStrategy")


@register_clip_strategy("fixed")
class FixedClip(ClipStrategy):
    """C = ``max_grad_norm`` at every step (Abadi et al. 2016)."""

    def __init__(self, max_grad_norm: float = 1.0) -> None:
        super().__init__(check_max_grad_norm(max_grad_norm))


@register_clip_strategy("online_sensitivity")
class OnlineSensitivityClip(ClipStrategy):
    """OSO-DPSGD: C and the learning rate adapt at every step (Galli et al., AAAI 2024; thesis Algorithm 3).

    At step ``t`` on the Poisson batch of expected size ``B``, with ``nu_g = (nu^-2 - nu_q^-2)^(-1/2)``:

    * ``g~_t = (sum_i clip_{C_t}(g_i) + N(0, nu_g^2 C_t^2 I)) / B``, the gradient the optimizer receives;
    * ``q~_t = (sum_i q_i + N(0, nu_q^2 I)) / B``, ``q_i = g_i / ||g_i||`` if ``||g_i|| > C_t`` else 0 (eq. 3.17;
      Algorithm 3 line 13 misprints its std as ``nu_g``);
    * the optimizer steps with ``rho_t``; ``C_{t+1} = C_t exp(rho_c sign(g~_t . q~_{t-1}))``,
      ``rho_{t+1} = rho_t exp(rho_r sign(g~_t . g~_{t-1}))`` (eqs. 3.20, 3.21), post-processing;
    * accounted as one Poisson-subsampled Gaussian with ``nu`` (Proposition 1).

    ``rho_0`` is the optimizer's learning rate; every parameter group's ``lr`` is scaled by ``rho_t / rho_0``.

    Args:
        initial_clip: ``C_0``.
        clip_lr: ``rho_c``, the step of ``log C``.
        lr_lr: ``rho_r``, the step of ``log rho``; 0 keeps the optimizer's learning rate (and allows a scheduler).
        q_noise_multiplier: ``nu_q`` (> ``nu``); None: ``7.124 nu`` (the thesis' heuristic, ``nu_g = 1.01 nu``).
    """

    adaptive = True
    title = "OSO-DPSGD"

    def __init__(self, initial_clip: float = OSO_INITIAL_CLIP, clip_lr: float = OSO_CLIP_LR,
                 lr_lr: float = OSO_LR_LR, q_noise_multiplier: float | None = None) -> None:
        super().__init__(checks.positive_real("initial_clip", initial_clip,
                                              hint="it is C_0, the clipping threshold of the first step (e.g. 0.1)"))
        self.clip_lr = checks.non_negative_real(
            "clip_lr", clip_lr, hint=f"it is rho_c, the step of log C per update (default {OSO_CLIP_LR})")
        self.lr_lr = checks.non_negative_real(
            "lr_lr", lr_lr, hint=f"it is rho_r, the step of log(lr) per update (default {OSO_LR_LR})")
        self.q_noise_multiplier = None if q_noise_multiplier is None else checks.positive_real(
            "q_noise_multiplier", q_noise_multiplier, hint="it is nu_q, the multiplier of the released sum of q_i; "
            "pass None for the default 7.124 * noise_multiplier")
        self.lr_scale = 1.0  #: rho_t / rho_0
        self._base_lrs: list[float] | None = None
        self.g_prev: list[torch.Tensor] | None = None
        self.q_prev: list[torch.Tensor] | None = None

    def noise_split(self, noise_multiplier: float) -> tuple[float, float]:
        """``(nu_g, nu_q)`` for the accounted ``nu``."""
        return oso_noise_split(noise_multiplier, q_noise_multiplier=self.q_noise_multiplier)

    def check_noise(self, noise_multiplier: float, expected_batch_size: float | None) -> None:
        self.noise_split(noise_multiplier)

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float) -> float:
        return self.noise_split(noise_multiplier)[0]

    def start(self, noise_multiplier: float, expected_batch_size: float, *, lr_scheduled: bool) -> dict[str, Any]:
        nu_g, nu_q = self.noise_split(noise_multiplier)
        if self.lr_lr > 0 and lr_scheduled:
            raise ValueError(
                f"lr_lr={self.lr_lr} adapts the learning rate, but configure_optimizers also returns a learning-rate "
                "scheduler; the two would overwrite each other. Remove the scheduler, or pass lr_lr=0 to keep your "
                "schedule and adapt only the clipping threshold.")
        return {"privacy/method": "oso-dpsgd", "privacy/initial_clip": self.initial_clip,
                "privacy/clip_lr": self.clip_lr, "privacy/lr_lr": self.lr_lr,
                "privacy/gradient_noise_multiplier": nu_g, "privacy/q_noise_multiplier": nu_q}

    def extra_weights(self, per_sample_norms: torch.Tensor, clip: torch.Tensor | None = None) -> list[torch.Tensor]:
        if clip is None:
            return [oso_statistics(per_sample_norms, self.clip).q_weights]
        return [oso_q_weights(per_sample_norms, clip)]

    def trainable_changed(self) -> None:
        # the released vectors of the previous steps span the old trainable set: the next step updates nothing
        self.g_prev, self.q_prev = None, None

    def after_release(self, release: Release) -> None:
        optimizer = release.optimizer
        if self._base_lrs is None:
            self._base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if len(self._base_lrs) != len(optimizer.param_groups):
            raise ValueError(
                f"OSO saw {len(self._base_lrs)} parameter groups when it started and {len(optimizer.param_groups)} "
                "now; it scales every group's learning rate and needs them fixed.")
        for group, base in zip(optimizer.param_groups, self._base_lrs):
            group["lr"] = base * self.lr_scale  # rho_t for this step
        self.record(release.step, optimizer)
        q_noisy = oso_noisy_q_sum(release.extra_sums[0], q_noise_multiplier=self.noise_split(release.noise_multiplier)[1],
                                  generator=release.statistic_generator(device=release.gradient[0].device))
        self.clip, self.lr_scale = oso_update(self.clip, self.lr_scale, release.gradient, self.g_prev, self.q_prev,
                                              clip_lr=self.clip_lr, lr_lr=self.lr_lr)
        self.g_prev = [g.detach().clone() for g in release.gradient]
        self.q_prev = [q.detach() for q in q_noisy]

    def metrics(self) -> dict[str, float]:
        metrics = super().metrics()
        if self.trace:
            metrics["train/lr"] = self.trace[-1][2]
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "lr_scale": self.lr_scale, "base_lrs": self._base_lrs,
                "g_prev": None if self.g_prev is None else [t.cpu() for t in self.g_prev],
                "q_prev": None if self.q_prev is None else [t.cpu() for t in self.q_prev]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state:
            self.lr_scale = float(state.get("lr_scale", 1.0))
            self._base_lrs = state.get("base_lrs")
            self.g_prev, self.q_prev = state.get("g_prev"), state.get("q_prev")


@register_clip_strategy("quantile")
class QuantileClip(ClipStrategy):
    """C tracks a quantile of the gradient norms (Andrew et al., NeurIPS 2021, Algorithm 1; the thesis' FixedQuantile).

    At each step, on the Poisson batch of expected size ``m``:

    * ``b~ = clamp((sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2, 0, 1)``;
    * ``C <- C exp(-eta_C (b~ - gamma))``;
    * the clipped sum receives ``N(0, (z_Delta C)^2 I)``, ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so that the
      step is accounted as ONE Gaussian mechanism with ``z`` (``noise_multiplier``).

    Logs ``privacy/unclipped_fraction_estimate`` (``b~``).

    Args:
        initial_clip: ``C_0``.
        target_quantile: ``gamma`` in [0, 1], the fraction of examples left unclipped.
        clip_lr: ``eta_C``.
        count_noise_std: ``sigma_b`` (> ``z / 2``); None: ``m / 20`` (Andrew et al.).
    """

    adaptive = True
    title = "quantile clipping"

    def __init__(self, initial_clip: float = QUANTILE_INITIAL_CLIP, target_quantile: float = 0.5,
                 clip_lr: float = QUANTILE_CLIP_LR, count_noise_std: float | None = None) -> None:
        super().__init__(checks.positive_real("initial_clip", initial_clip,
                                              hint="it is C_0, the clipping threshold of the first step (e.g. 0.1)"))
        self.target_quantile = checks.probability(
            "target_quantile", target_quantile, hint="gamma, the fraction of examples the threshold should leave "
            "unclipped (Andrew et al. recommend 0.5)")
        self.clip_lr = checks.non_negative_real(
            "clip_lr", clip_lr, hint=f"it is eta_C, the step of log C (Andrew et al.: {QUANTILE_CLIP_LR})")
        self.requested_count_noise_std = None if count_noise_std is None else checks.positive_real(
            "count_noise_std", count_noise_std, hint="it is sigma_b, the std of the noise on the unclipped count; "
            "None uses expected_batch_size / 20")
        self.last_estimate: float | None = None

    def count_noise_std(self, expected_batch_size: float | None) -> float | None:
        """``sigma_b``: the one given, or ``m / 20``; None while neither is known (no ``m`` yet)."""
        if self.requested_count_noise_std is not None:
            return self.requested_count_noise_std
        return None if expected_batch_size is None else default_count_noise_std(expected_batch_size)

    def split(self, noise_multiplier: float, expected_batch_size: float | None) -> float | None:
        """``z_Delta`` for the accounted ``z`` (None while ``sigma_b`` is not known)."""
        sigma_b = self.count_noise_std(expected_batch_size)
        return None if sigma_b is None else quantile_noise_split(noise_multiplier, count_noise_std=sigma_b)

    def check_noise(self, noise_multiplier: float, expected_batch_size: float | None) -> None:
        self.split(noise_multiplier, expected_batch_size)

    def gradient_noise_multiplier(self, noise_multiplier: float, expected_batch_size: float) -> float:
        z_delta = self.split(noise_multiplier, expected_batch_size)
        assert z_delta is not None  # sigma_b is known once m is
        return z_delta

    def start(self, noise_multiplier: float, expected_batch_size: float, *, lr_scheduled: bool) -> dict[str, Any]:
        z_delta = self.gradient_noise_multiplier(noise_multiplier, expected_batch_size)
        return {"privacy/method": "quantile-clipping", "privacy/initial_clip": self.initial_clip,
                "privacy/target_quantile": self.target_quantile, "privacy/clip_lr": self.clip_lr,
                "privacy/count_noise_std": self.count_noise_std(expected_batch_size),
                "privacy/gradient_noise_multiplier": z_delta}

    def after_release(self, release: Release) -> None:
        self.record(release.step, release.optimizer)
        m = release.expected_batch_size
        sigma_b = self.count_noise_std(m)
        assert sigma_b is not None  # known once m is
        self.clip, self.last_estimate = quantile_clip_update(
            self.clip, release.examples - release.clipped, int(release.examples), m,
            target_quantile=self.target_quantile, clip_lr=self.clip_lr, count_noise_std=sigma_b,
            generator=release.statistic_generator())

    def metrics(self) -> dict[str, float]:
        metrics = super().metrics()
        if self.last_estimate is not None:
            metrics["privacy/unclipped_fraction_estimate"] = self.last_estimate
        return metrics
