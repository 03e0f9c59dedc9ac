"""Adaptive clipping for DP-SGD: callbacks that move the clipping threshold during training.

Both are :class:`~lightning_dp.callbacks.DPSGD` with one more release per step: the
clipping, the noise, the Poisson sampling, the DDP reduction, the budget enforcement and
the accounting are DPSGD's (one copy), and the formulas are in
:mod:`lightning_dp.privacy.adaptive`. Each step is accounted as ONE Gaussian mechanism
with the overall multiplier (``noise_multiplier``), because the accounted multiplier is
split between the gradient and the statistic of the same batch
(:func:`~lightning_dp.privacy.adaptive.composed_noise_multiplier`): the adaptivity costs
no extra epsilon, only a little more noise on the gradient.

* :class:`OnlineSensitivity`: OSO-DPSGD (Galli et al., AAAI 2024; thesis ch. 3,
  Algorithm 3). The threshold ``C`` and the learning rate follow the signs of two dot
  products of released vectors (hypergradient descent).
* :class:`QuantileClipping`: Andrew et al. (NeurIPS 2021): ``C`` tracks a quantile of
  the per-example gradient norms from a noisy count.

Example:
    >>> from lightning_dp.callbacks import OnlineSensitivity, QuantileClipping
    >>> oso = OnlineSensitivity(noise_multiplier=1.0, seed=0)
    >>> round(oso.gradient_noise_multiplier, 3), round(oso.q_noise_multiplier, 3)
    (1.01, 7.124)
    >>> QuantileClipping(noise_multiplier=1.0, target_quantile=0.5).max_grad_norm
    0.1
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.callbacks.dp_sgd import DPSGD
from lightning_dp.privacy.adaptive import (
    OSO_CLIP_LR,
    OSO_INITIAL_CLIP,
    OSO_LR_LR,
    default_count_noise_std,
    oso_noise_split,
    oso_noisy_q_sum,
    oso_statistics,
    oso_update,
    quantile_clip_update,
    quantile_noise_split,
)
from lightning_dp.privacy.noise import CLIP_STATISTIC, derive_secret_generator

__all__ = ["OnlineSensitivity", "QuantileClipping"]

#: Andrew et al. 2021's recommended step of log C (eta_C) and initial threshold.
QUANTILE_CLIP_LR = 0.2
QUANTILE_INITIAL_CLIP = 0.1


def _finite_positive(name: str, value: Any, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is not allowed: pass a finite number > 0. {hint}")
    return float(value)


def _finite_non_negative(name: str, value: Any, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} is not allowed: pass a finite number >= 0. {hint}")
    return float(value)


class _AdaptiveClipping(DPSGD):
    """What both rules share: a threshold that changes, its trace, its plot and its checkpoint."""

    _title = "adaptive clipping"
    _fixed_clip = False  # C moves: privacy/max_grad_norm is a metric, the param is privacy/initial_clip

    def __init__(self, *, initial_clip: float, **kwargs: Any) -> None:
        initial_clip = _finite_positive("initial_clip", initial_clip,
                                        "It is C_0, the clipping threshold of the first step (e.g. 0.1).")
        super().__init__(max_grad_norm=initial_clip, **kwargs)
        self.initial_clip = initial_clip
        # (optimizer step, C used at that step, learning rate used at that step) for every released step
        self._trace: list[tuple[int, float, float]] = []

    def _trace_step(self, trainer: Trainer, optimizer: Any) -> None:
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else math.nan
        self._trace.append((self._released + 1, self.max_grad_norm, lr))

    def _planned_sigma(self) -> float:
        """The noise multiplier, fixed by ``DPSGD.on_train_start`` before any hook that reads it."""
        assert self._sigma is not None
        return self._sigma

    def _planned_seed(self) -> int:
        """The noise seed, drawn by ``DPSGD.setup`` before any hook that reads it."""
        assert self._seed is not None
        return self._seed

    def _privacy_metrics(self, step: int) -> dict[str, float]:
        metrics = super()._privacy_metrics(step)
        if self._trace:
            metrics["privacy/max_grad_norm"] = self._trace[-1][1]  # C_t of the last released step, not C_{t+1}
        return metrics

    def _summary_rows(self) -> list[tuple[str, str]]:
        return [(label, f"{self.max_grad_norm:.4g} at the end (adaptive, initial {self.initial_clip:g})")
                if label == "clipping norm C" else (label, value) for label, value in super()._summary_rows()]

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero and self._trace:
            from lightning_dp import tracking

            steps, clips, _ = zip(*self._trace)
            fig = tracking.plot_series(steps, clips, xlabel="released step", ylabel="clipping threshold C",
                                       title=f"{self._title}: C_t (sigma={self._sigma:.3g})")
            fig.axes[0].set_yscale("log")
            tracking.log_figure(trainer, fig, "privacy/max_grad_norm.png")

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["adaptive"] = {"max_grad_norm": self.max_grad_norm, "trace": list(self._trace)}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        adaptive = state_dict.get("adaptive")
        if adaptive is not None:
            self.max_grad_norm = float(adaptive["max_grad_norm"])
            self._trace = [tuple(x) for x in adaptive.get("trace", [])]


class OnlineSensitivity(_AdaptiveClipping):
    """OSO-DPSGD: DP-SGD whose clipping threshold and learning rate adapt at every step.

    Galli, Palamidessi & Cucinotta, "Online sensitivity optimization in differentially
    private learning", AAAI 2024 (thesis ch. 3, Algorithm 3). At step ``t``, on the
    Poisson-sampled batch of expected size ``B``:

    * ``nu_g = (nu^-2 - nu_q^-2)^(-1/2)`` (:func:`~lightning_dp.privacy.adaptive.oso_noise_split`);
    * ``g~_t = (sum_i g_i min(1, C_t / ||g_i||) + N(0, nu_g^2 C_t^2 I)) / B``, the gradient
      the optimizer receives;
    * ``q~_t = (sum_i q_i + N(0, nu_q^2 I)) / B`` with ``q_i = g_i / ||g_i||`` if
      ``||g_i|| > C_t`` else 0 (eq. 3.17; Algorithm 3 line 13 misprints its std as ``nu_g``);
    * the optimizer steps with learning rate ``rho_t``;
    * ``C_{t+1} = C_t exp(rho_c sign(g~_t . q~_{t-1}))`` and
      ``rho_{t+1} = rho_t exp(rho_r sign(g~_t . g~_{t-1}))`` (eqs. 3.20, 3.21;
      :func:`~lightning_dp.privacy.adaptive.oso_update`), post-processing of released vectors;
    * accounting: one Poisson-subsampled Gaussian mechanism with multiplier ``nu``
      (Proposition 1), exactly as DP-SGD with ``noise_multiplier=nu``.

    The learning rate ``rho_0`` is the one of your optimizer (``configure_optimizers``);
    the callback scales every parameter group's ``lr`` by ``rho_t / rho_0`` before each
    step. Any torch optimizer works (SGD as in the thesis; with momentum or
    :class:`~lightning_dp.optim.AdamWOSM` the adaptation still scales its step). A
    learning-rate scheduler would fight the adaptation: with one configured, pass
    ``lr_lr=0``.

    Logged every ``log_every_n_steps``: ``privacy/epsilon``, ``privacy/max_grad_norm``
    (``C_t``), ``nonprivate/clipped_fraction``, ``train/lr`` (``rho_t``); at the end the
    artifact ``privacy/max_grad_norm.png``. ``C_t``, ``rho_t``, ``q~_{t-1}``,
    ``g~_{t-1}`` and the accountant are saved in checkpoints: a resumed run continues
    exactly.

    Args:
        noise_multiplier: ``nu``, the overall per-step multiplier the accountant records.
            If omitted, calibrated to ``target_epsilon`` over the planned run (DPSGD).
        target_epsilon: the budget (enforced as in :class:`DPSGD`).
        initial_clip: ``C_0`` (default 0.1).
        clip_lr: ``rho_c``, the step of ``log C`` (default 2.5e-3).
        lr_lr: ``rho_r``, the step of ``log rho`` (default 2.5e-3); 0 keeps the
            optimizer's learning rate.
        q_noise_multiplier: ``nu_q`` (> ``nu``); default ``7.124 nu`` (the thesis'
            heuristic, ``nu_g = 1.01 nu``).
        **kwargs: the other arguments of :class:`DPSGD` (``target_delta``, ``epochs``,
            ``max_steps``, ``calibrate_for``, ``accountant``, ``accountant_kwargs``, ``poisson_sampling``,
            ``seed``, ``replace_batchnorm``), not ``max_grad_norm`` (use ``initial_clip``).
    """

    _title = "OSO-DPSGD"

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        initial_clip: float = OSO_INITIAL_CLIP,
        clip_lr: float = OSO_CLIP_LR,
        lr_lr: float = OSO_LR_LR,
        q_noise_multiplier: float | None = None,
        **kwargs: Any,
    ) -> None:
        if "max_grad_norm" in kwargs:
            raise ValueError("OnlineSensitivity learns the clipping threshold: pass initial_clip=<C_0> instead of "
                             f"max_grad_norm={kwargs['max_grad_norm']!r}")
        super().__init__(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                         initial_clip=initial_clip, **kwargs)
        self.clip_lr = _finite_non_negative("clip_lr", clip_lr,
                                            f"It is rho_c, the step of log C per update (default {OSO_CLIP_LR}).")
        self.lr_lr = _finite_non_negative("lr_lr", lr_lr,
                                          f"It is rho_r, the step of log(lr) per update (default {OSO_LR_LR}).")
        self._requested_q = None if q_noise_multiplier is None else _finite_positive(
            "q_noise_multiplier", q_noise_multiplier,
            "It is nu_q, the multiplier of the released sum of q_i; pass None for the default 7.124 * "
            "noise_multiplier.")
        if noise_multiplier is not None:
            oso_noise_split(noise_multiplier, q_noise_multiplier=self._requested_q)  # nu_q > nu, checked now
        self._lr_scale = 1.0
        self._base_lrs: list[float] | None = None
        self._g_prev: list[torch.Tensor] | None = None
        self._q_prev: list[torch.Tensor] | None = None

    @property
    def q_noise_multiplier(self) -> float | None:
        """``nu_q`` (None until the noise multiplier is known)."""
        nu = self.noise_multiplier
        return None if nu is None else oso_noise_split(nu, q_noise_multiplier=self._requested_q)[1]

    @property
    def gradient_noise_multiplier(self) -> float | None:
        """``nu_g``, the multiplier of the gradient noise (None until the noise multiplier is known)."""
        nu = self.noise_multiplier
        return None if nu is None else oso_noise_split(nu, q_noise_multiplier=self._requested_q)[0]

    @property
    def lr_scale(self) -> float:
        """``rho_t / rho_0``."""
        return self._lr_scale

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        try:
            nu_g, nu_q = oso_noise_split(self._planned_sigma(), q_noise_multiplier=self._requested_q)
        except ValueError as err:
            raise MisconfigurationException(f"OnlineSensitivity: {err}") from err
        if self.lr_lr > 0 and trainer.lr_scheduler_configs:
            raise MisconfigurationException(
                f"OnlineSensitivity(lr_lr={self.lr_lr}) adapts the learning rate itself, but configure_optimizers "
                "also returns a learning-rate scheduler; the two would overwrite each other. Remove the scheduler, "
                "or pass lr_lr=0 to keep your schedule and adapt only the clipping threshold.")
        params = {"privacy/method": "oso-dpsgd", "privacy/initial_clip": self.initial_clip,
                  "privacy/clip_lr": self.clip_lr, "privacy/lr_lr": self.lr_lr,
                  "privacy/gradient_noise_multiplier": nu_g, "privacy/q_noise_multiplier": nu_q}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    def _extra_weights(self, per_sample_norms: torch.Tensor) -> list[torch.Tensor]:
        return [oso_statistics(per_sample_norms, self.max_grad_norm).q_weights]

    def _on_engine_rebuilt(self) -> None:
        # the released vectors of the previous steps span the old trainable set: restart the sign statistics
        # (the next step updates nothing, as the first step of a run does)
        self._g_prev, self._q_prev = None, None

    def _gradient_noise_multiplier(self) -> float:
        nu_g = self.gradient_noise_multiplier
        assert nu_g is not None  # known once DPSGD.on_train_start has planned the noise
        return nu_g

    def _after_release(self, trainer: Trainer, optimizer: Any, grads: list[torch.Tensor],
                       extra_sums: list[list[torch.Tensor]]) -> None:
        if self._base_lrs is None:
            self._base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if len(self._base_lrs) != len(optimizer.param_groups):
            raise MisconfigurationException(
                f"OnlineSensitivity saw {len(self._base_lrs)} parameter groups when it started and "
                f"{len(optimizer.param_groups)} now; it scales every group's learning rate and needs them fixed.")
        for group, base in zip(optimizer.param_groups, self._base_lrs):
            group["lr"] = base * self._lr_scale  # rho_t for this step
        self._trace_step(trainer, optimizer)
        generator = derive_secret_generator(self._planned_seed(), CLIP_STATISTIC, self._released,
                                            device=grads[0].device)
        q_noise_multiplier = self.q_noise_multiplier
        assert q_noise_multiplier is not None  # known once DPSGD.on_train_start has planned the noise
        q_noisy = oso_noisy_q_sum(extra_sums[0], q_noise_multiplier=q_noise_multiplier, generator=generator)
        clip, scale = oso_update(self.max_grad_norm, self._lr_scale, grads, self._g_prev, self._q_prev,
                                 clip_lr=self.clip_lr, lr_lr=self.lr_lr)
        self.max_grad_norm, self._lr_scale = clip, scale
        self._g_prev = [g.detach().clone() for g in grads]
        self._q_prev = [q.detach() for q in q_noisy]

    def _privacy_metrics(self, step: int) -> dict[str, float]:
        metrics = super()._privacy_metrics(step)
        if self._trace:
            metrics["train/lr"] = self._trace[-1][2]
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["adaptive"].update({
            "lr_scale": self._lr_scale, "base_lrs": self._base_lrs,
            "g_prev": None if self._g_prev is None else [t.cpu() for t in self._g_prev],
            "q_prev": None if self._q_prev is None else [t.cpu() for t in self._q_prev]})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        adaptive = state_dict.get("adaptive")
        if adaptive is not None:
            self._lr_scale = float(adaptive.get("lr_scale", 1.0))
            self._base_lrs = adaptive.get("base_lrs")
            self._g_prev = adaptive.get("g_prev")
            self._q_prev = adaptive.get("q_prev")


class QuantileClipping(_AdaptiveClipping):
    """DP-SGD whose clipping threshold tracks a quantile of the gradient norms (Andrew et al. 2021).

    "Differentially private learning with adaptive clipping", NeurIPS 2021, Algorithm 1
    (the thesis' "FixedQuantile" baseline). At each step, on the Poisson-sampled batch
    of expected size ``m``:

    * ``b~ = clamp((sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2, 0, 1)``;
    * ``C <- C exp(-eta_C (b~ - gamma))`` (:func:`~lightning_dp.privacy.adaptive.quantile_clip_update`);
    * the clipped sum receives ``N(0, (z_Delta C)^2 I)``,
      ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``
      (:func:`~lightning_dp.privacy.adaptive.quantile_noise_split`), so that the step is
      accounted as ONE Gaussian mechanism with the original ``z`` (``noise_multiplier``).

    Logged: as :class:`DPSGD` plus ``privacy/unclipped_fraction_estimate`` (``b~``); the
    artifact ``privacy/max_grad_norm.png``. ``C`` is checkpointed.

    Args:
        noise_multiplier: ``z``, the overall multiplier the accountant records (or
            calibrated to ``target_epsilon``).
        target_epsilon: the budget (enforced as in :class:`DPSGD`).
        initial_clip: ``C_0`` (default 0.1).
        target_quantile: ``gamma`` in [0, 1] (default 0.5): the fraction of examples left unclipped.
        clip_lr: ``eta_C`` (default 0.2).
        count_noise_std: ``sigma_b``; default ``m / 20`` (Andrew et al.). Must exceed ``z / 2``.
        **kwargs: the other arguments of :class:`DPSGD`, not ``max_grad_norm``.
    """

    _title = "quantile clipping"

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        initial_clip: float = QUANTILE_INITIAL_CLIP,
        target_quantile: float = 0.5,
        clip_lr: float = QUANTILE_CLIP_LR,
        count_noise_std: float | None = None,
        **kwargs: Any,
    ) -> None:
        if "max_grad_norm" in kwargs:
            raise ValueError("QuantileClipping learns the clipping threshold: pass initial_clip=<C_0> instead of "
                             f"max_grad_norm={kwargs['max_grad_norm']!r}")
        super().__init__(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                         initial_clip=initial_clip, **kwargs)
        if isinstance(target_quantile, bool) or not isinstance(target_quantile, (int, float)) \
                or not 0 <= target_quantile <= 1:
            raise ValueError(f"target_quantile={target_quantile!r} is not allowed: pass gamma in [0, 1], the fraction "
                             "of examples the threshold should leave unclipped (Andrew et al. recommend 0.5).")
        self.target_quantile = float(target_quantile)
        self.clip_lr = _finite_non_negative("clip_lr", clip_lr,
                                            f"It is eta_C, the step of log C (Andrew et al.: {QUANTILE_CLIP_LR}).")
        self._requested_count_std = None if count_noise_std is None else _finite_positive(
            "count_noise_std", count_noise_std,
            "It is sigma_b, the std of the noise on the unclipped count; None uses expected_batch_size / 20.")
        if noise_multiplier is not None and count_noise_std is not None:
            quantile_noise_split(noise_multiplier, count_noise_std=count_noise_std)  # z < 2 sigma_b, now
        self._last_estimate: float | None = None

    def _planned_count_std(self) -> float:
        """``sigma_b`` once the expected batch size is known (from ``on_train_start`` on)."""
        sigma_b = self.count_noise_std
        assert sigma_b is not None
        return sigma_b

    @property
    def count_noise_std(self) -> float | None:
        """``sigma_b`` (None until the expected batch size is known, when it is the default)."""
        if self._requested_count_std is not None:
            return self._requested_count_std
        m = self._data.get("expected_batch_size")
        return None if m is None else default_count_noise_std(m)

    @property
    def gradient_noise_multiplier(self) -> float | None:
        """``z_Delta``, the multiplier of the gradient noise (None until known)."""
        z, sigma_b = self.noise_multiplier, self.count_noise_std
        return None if z is None or sigma_b is None else quantile_noise_split(z, count_noise_std=sigma_b)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        try:
            z_delta = quantile_noise_split(self._planned_sigma(), count_noise_std=self._planned_count_std())
        except ValueError as err:
            raise MisconfigurationException(
                f"QuantileClipping (expected batch size m = {self._data['expected_batch_size']:g}): {err}") from err
        params = {"privacy/method": "quantile-clipping", "privacy/initial_clip": self.initial_clip,
                  "privacy/target_quantile": self.target_quantile, "privacy/clip_lr": self.clip_lr,
                  "privacy/count_noise_std": self.count_noise_std, "privacy/gradient_noise_multiplier": z_delta}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    def _gradient_noise_multiplier(self) -> float:
        nu_g = self.gradient_noise_multiplier
        assert nu_g is not None  # known once DPSGD.on_train_start has planned the noise
        return nu_g

    def _after_release(self, trainer: Trainer, optimizer: Any, grads: list[torch.Tensor],
                       extra_sums: list[list[torch.Tensor]]) -> None:
        self._trace_step(trainer, optimizer)
        assert self._last_stats is not None  # this step's counts, set by DPSGD._release before this hook
        clipped, size = (float(v) for v in self._last_stats[:2])
        generator = derive_secret_generator(self._planned_seed(), CLIP_STATISTIC, self._released)
        self.max_grad_norm, self._last_estimate = quantile_clip_update(
            self.max_grad_norm, size - clipped, int(size), self._data["expected_batch_size"],
            target_quantile=self.target_quantile, clip_lr=self.clip_lr, count_noise_std=self._planned_count_std(),
            generator=generator)

    def _privacy_metrics(self, step: int) -> dict[str, float]:
        metrics = super()._privacy_metrics(step)
        if self._last_estimate is not None:
            metrics["privacy/unclipped_fraction_estimate"] = self._last_estimate
        return metrics
