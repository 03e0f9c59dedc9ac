"""DP-SGD (Abadi et al. 2016) as a Lightning callback: add it to ``Trainer(callbacks=[...])``, keep your module.

Privacy semantics (docs/privacy.md):

* ``poisson_sampling=True`` (default), add/remove adjacency: every example enters a batch independently with
  probability ``q = batch_size * world_size / N``; each step releases
  ``(sum_i clip_C(g_i) + N(0, (sigma C)^2 I)) / (q N)``, accounted as one Poisson-subsampled Gaussian mechanism.
  ``adjacency="replace"``: the same release under the library's replace-one analysis (``pld`` only).
* ``poisson_sampling=False``: the loader's shuffled batches partition each epoch, so an epoch is one Gaussian
  mechanism with multiplier ``sigma / 2`` (replacement adjacency moves a clipped sum by ``2C``); no amplification
  is claimed; not under DDP.

The callback is a shell over parts with one concern each: :mod:`~lightning_dp.callbacks.training_data` (taking
over the training loader), :mod:`~lightning_dp.callbacks.batch_probe`, :mod:`~lightning_dp.callbacks.clipping`
(the strategy that chooses C), :mod:`~lightning_dp.callbacks.virtual_batches`,
:mod:`~lightning_dp.callbacks.release_guard`, :mod:`~lightning_dp.callbacks.budget` (target_epsilon's stop),
:mod:`~lightning_dp.callbacks.run_length` and
:mod:`lightning_dp.privacy.planning` (the planned length), :mod:`~lightning_dp.callbacks.dp_sgd_record` (what it
writes); per-sample gradients by :class:`~lightning_dp.privacy.grad_sample.GradSampleEngine`, replaced in
``on_after_backward``. Private attributes of other libraries it relies on: Lightning's ``fit_loop._data_source``
(checked, refused loudly if moved), ``LightningModule._on_before_batch_transfer`` and the logger connector's
``_FxValidator`` and ``_Metadata`` (the names ``self.log`` gives:
:class:`~lightning_dp.callbacks.batch_probe.LoggedNames`), torchmetrics' ``Metric._defaults``, ``_update_count`` and
``_computed`` (the probe restores metric states).

The seed of the sampling and noise streams is a secret (:mod:`lightning_dp.privacy.seeds`): kept in local
checkpoints under ``"secret"``, never logged, stripped from uploaded checkpoints.

Example:
    >>> from lightning_dp.callbacks import DPSGD
    >>> dp = DPSGD(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, epochs=5)
    >>> # trainer = lightning.Trainer(max_epochs=5, callbacks=[dp]); trainer.fit(model, datamodule)
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Literal, NamedTuple

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from lightning_dp import checks
from lightning_dp.callbacks import batch_probe, dp_sgd_record, training_data, virtual_batches
from lightning_dp.callbacks.budget import Budget
from lightning_dp.callbacks.clipping import ClipStrategy, FixedClip, Release, StatisticStream, resolve_clip_strategy
from lightning_dp.callbacks.release_guard import ReleaseGuard, UnprivatizedGradientError
from lightning_dp.callbacks.run_length import Lengths
from lightning_dp.privacy import planning
from lightning_dp.privacy.accounting import check_delta, check_target_epsilon, get_accountant
from lightning_dp.privacy.batch_dims import split_batch
from lightning_dp.privacy.calibration import calibrate_noise_multiplier
from lightning_dp.privacy.clipping import check_max_grad_norm, clip_factors
from lightning_dp.privacy.delta import check_delta_for_size
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from lightning_dp.privacy.noise import (
    CLIP_STATISTIC,
    NOISE,
    check_noise_multiplier,
    derive_secret_generator,
    noisy_mean,
)
from lightning_dp.privacy.planning import DataFacts
from lightning_dp.privacy.sampling import (
    PassMarkingBatchSampler,
    check_partition_sampler,
    poisson_dataloader,
    rebuild_dataloader,
)
from lightning_dp.privacy.seeds import SECRET_KEY
from lightning_dp.privacy.spend import Spend
from lightning_dp.privacy.validators import describe_mixing_layers, find_mixing_layers, replace_batchnorm
from lightning_dp.protocol import RunProtocol

__all__ = ["DPSGD", "PlannedMechanism", "UnprivatizedGradientError"]


class PlannedMechanism(NamedTuple):
    """What a planned DP-SGD run is accounted as: ``events`` x Gaussian(``multiplier_scale * sigma``) at rate q."""

    sample_rate: float
    events: int
    multiplier_scale: float


_STATE_VERSION = 2
#: Trainer precisions DPSGD supports (the engine computes per-sample norms and sums in at least float32)
_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "32", "64")


#: growth interval that fixes a GradScaler's scale for any run (2**62 steps)
_FIXED_GROWTH_INTERVAL = 2**62


def _loss_scale(trainer: Trainer) -> float:
    """The loss scale of the Trainer's GradScaler (``precision="16-mixed"``), 1.0 without one."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def _ends_with_sum(loss: torch.Tensor) -> bool:
    """Whether the loss' last operation, looking through Lightning's scaling, is a sum (a heuristic)."""
    fn = loss.grad_fn
    while fn is not None and type(fn).__name__ in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return fn is not None and type(fn).__name__.startswith("SumBackward")


class DPSGD(Callback):
    """Differentially private SGD (Abadi et al. 2016) for an unmodified LightningModule.

    The module's ``training_step`` must return the batch MEAN of per-example losses, use
    one optimizer with automatic optimization, and contain no layer that mixes examples.

    Args:
        noise_multiplier: sigma, the std of the Gaussian noise divided by ``max_grad_norm``.
            If omitted, it is calibrated so that the planned run spends at most
            ``target_epsilon``.
        target_epsilon: the privacy budget. Training stops before a step that would
            exceed it (with or without ``noise_multiplier``).
        target_delta: the delta at which epsilon is reported and enforced (default 1e-5;
            a warning is given when it is not below 1/N).
        max_grad_norm: C, the per-sample L2 clipping threshold (default 1.0): the ``fixed`` strategy's. An adaptive
            strategy takes its initial C as ``initial_clip`` instead.
        clipping: how C is chosen at each step: a registered name (``"fixed"``, ``"online_sensitivity"``,
            ``"quantile"``) or a :class:`~lightning_dp.callbacks.clipping.ClipStrategy` (its own arguments in YAML:
            ``clipping: {class_path: lightning_dp.callbacks.clipping.QuantileClip, init_args: {target_quantile:
            0.7}}``). Default ``"fixed"``.
        epochs: planned epochs, for calibration (default: the Trainer's ``max_epochs``).
        max_steps: planned optimizer steps, for calibration (default: the Trainer's
            ``max_steps``).
        calibrate_for: which planned length a calibrated sigma is for when this callback's ``epochs``/``max_steps``
            and the Trainer's limits disagree. ``"auto"`` (default): the shorter, but a Trainer that would run
            longer than the plan is refused before the first step (its limit may be a safeguard, which the budget
            must not be spread over; Lightning's implicit ``max_epochs=1000`` leaves the plan in charge).
            ``"trainer"``: the Trainer's length. ``"callback"``: this plan (a run over several resumed fits). A given
            ``noise_multiplier`` and the sigma of a resumed checkpoint are kept whatever this says.
        accountant: ``"pld"`` (privacy loss distributions, default) or ``"rdp"``.
        accountant_kwargs: extra arguments of the accountant (e.g.
            ``value_discretization_interval`` for PLD).
        poisson_sampling: sample batches by Poisson sampling (required for the
            add/remove guarantee and for DDP).
        seed: seed of the sampling and noise streams. Default: a fresh secret seed from
            the OS, saved in (local) checkpoints so that a run resumed without ``seed``
            continues the streams, and stripped from everything uploaded. A given seed wins
            over a checkpoint's (the run then draws new noise): branch several runs from one
            checkpoint with different seeds, or they would continue the same noise. A fixed
            seed makes the noise as public as the config that holds it: use it for
            reproducible experiments, never for two runs whose models are both released
            (``lightning-dp grid`` gives every run its own seed).
        replace_batchnorm: replace BatchNorm layers by GroupNorm instead of refusing them.
        log_nonprivate_metrics: also log ``nonprivate/clipped_fraction``, the exact
            fraction of clipped examples of the last step. It is a statistic of the
            private batch that epsilon does NOT cover (hence its namespace); set False to
            keep it off the record.
        adjacency: the neighbouring datasets epsilon is stated for: ``"add_remove"`` (one
            example added or removed; the default with Poisson sampling) or ``"replace"``
            (one example replaced by another: bounded DP, a larger epsilon for the same
            noise, the default and only choice of ``poisson_sampling=False``).
        max_physical_batch_size: the most examples one forward/backward pass may hold (a memory
            bound; None: no bound). A batch that holds more is cut into chunks of at most this many
            examples inside the training step, each clipped after its own backward pass; the step
            releases their sum, noised once (virtual batches, :mod:`lightning_dp.callbacks.virtual_batches`).
            Composes with ``Trainer(accumulate_grad_batches=k)``, which splits every logical batch into
            ``k`` micro-batches of expected size ``batch_size``.
    """

    #: Constructor arguments that are secrets: redacted from configs logged by ``lightning-dp``.
    SECRET_ARGUMENTS: tuple[str, ...] = ("seed",)

    def __init__(
        self,
        *,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float = 1e-5,
        max_grad_norm: float | None = None,
        clipping: ClipStrategy | str = "fixed",
        epochs: int | None = None,
        max_steps: int | None = None,
        calibrate_for: Literal["auto", "trainer", "callback"] = "auto",
        accountant: str = "pld",
        accountant_kwargs: dict[str, Any] | None = None,
        poisson_sampling: bool = True,
        seed: int | None = None,
        replace_batchnorm: bool = False,
        log_nonprivate_metrics: bool = True,
        adjacency: str | None = None,
        max_physical_batch_size: int | None = None,
    ) -> None:
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError(
                "DPSGD needs noise_multiplier=<sigma> or target_epsilon=<budget> (or both): with neither there is "
                "no noise and no budget. Example: DPSGD(target_epsilon=3.0, target_delta=1e-5, epochs=10)")
        self._requested_sigma = None if noise_multiplier is None else check_noise_multiplier(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon, finite=True)
        self.target_delta = check_delta(target_delta, name="target_delta")
        self.clipping = self._resolve_clipping(clipping, max_grad_norm)
        self.epochs = None if epochs is None else checks.positive_int("epochs", epochs, hint="or None")
        self.max_steps = None if max_steps is None else checks.positive_int("max_steps", max_steps, hint="or None")
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError(f"pass epochs={epochs} or max_steps={max_steps} for calibration, not both")
        if calibrate_for not in planning.CALIBRATE_FOR:
            raise ValueError(f"calibrate_for={calibrate_for!r} is not allowed: pass one of "
                             f"{', '.join(planning.CALIBRATE_FOR)} "
                             "(which planned length a calibrated noise multiplier is for when this callback's "
                             "epochs/max_steps and the Trainer's limits disagree)")
        self.calibrate_for = calibrate_for
        self.accountant_name = accountant
        self.accountant_kwargs = dict(accountant_kwargs or {})
        self.poisson_sampling = bool(poisson_sampling)
        self.adjacency = self._resolve_adjacency(adjacency, accountant)
        if self.poisson_sampling and self.adjacency == "replace":
            self.accountant_kwargs["adjacency"] = "replace"
        self._accountant = get_accountant(accountant, **self.accountant_kwargs)  # validates the name
        # the secret seed, the gate, the final spend, the summary: the run-level protocol (lightning_dp.protocol)
        self.protocol = RunProtocol(self, seed=seed)
        self.replace_batchnorm = bool(replace_batchnorm)
        self.log_nonprivate_metrics = bool(log_nonprivate_metrics)
        self.max_physical_batch_size = (None if max_physical_batch_size is None else
                                        checks.positive_int("max_physical_batch_size", max_physical_batch_size,
                                                            hint="or None"))

        self._sigma: float | None = None
        self._restored_sigma: float | None = None
        self._sigma_source = ""  # given, calibrated for ..., from the checkpoint (for the end summary)
        self._logged_rate: float | None = None  # the sample rate logged as a param at fit start
        self._rate_varies = False  # a reloaded loader changed it since: privacy/sample_rate becomes a metric
        self._engine: GradSampleEngine | None = None
        self._shadows = training_data.Shadows()  # wrapped hooks, replaced data sources: put back at teardown
        self._facts: DataFacts | None = None  # of the training loader, once Lightning asked for it
        self._probe_data: tuple[Any, Any] | None = None  # (dataset, collate_fn) of the probe batches
        self._batch_dims: list[int | None] = []  # where the batch's tensors hold the examples
        self._budget = Budget()  # the events target_epsilon allows, and those taken
        self._passes = 0  # passes started over a shuffled loader; each is one accounted event
        self._charged_pass = 0
        self._guard = ReleaseGuard()
        self._last_stats: torch.Tensor | None = None
        self._curve: list[tuple[int, float]] = []
        self._logged_step = -1
        self._loss_checked = False
        self._batch_size: int | None = None
        self._logical = virtual_batches.LogicalStep()  # where the current logical batch stands
        self._user_training_step: Any = None
        self._half_precision = False  # bf16-mixed, 16-mixed or bf16-true: nonprivate/overflowed_fraction is logged
        # Steps released by this callback over all its fits (restored from checkpoints). It keys the
        # noise and sampling streams: Trainer.global_step restarts at 0 in a second fit, and the same
        # noise on two releases would cancel in their difference.
        self._released = 0
        self._audits: list[Any] = []  # one-run audits (lightning_dp.callbacks.OneRunAudit) attached to this run
        if self._requested_sigma is not None:
            self.clipping.check_noise(self._requested_sigma, None)  # what does not depend on the data, now

    def privacy_spend(self) -> list[Spend]:
        """The run's example-level spend: the accountant's history at ``target_delta`` (what ``lightning-dp grid``
        composes over its runs, :mod:`lightning_dp.privacy.spend`). A run that took no step spent epsilon 0."""
        return [Spend.accounted("example", self._accountant, delta=self.target_delta, why=type(self).__name__)]

    def _resolve_clipping(self, clipping: ClipStrategy | str, max_grad_norm: float | None) -> ClipStrategy:
        """The strategy; ``max_grad_norm`` is the fixed strategy's C (an adaptive one has ``initial_clip``)."""
        if clipping == "fixed" and max_grad_norm is not None:
            return FixedClip(max_grad_norm)
        strategy = resolve_clip_strategy(clipping)
        if max_grad_norm is not None and strategy.adaptive:
            raise ValueError(f"{type(self).__name__} with the {strategy.name!r} clipping strategy learns the clipping "
                             f"threshold: pass initial_clip=<C_0> instead of max_grad_norm={max_grad_norm!r}")
        if max_grad_norm is not None and max_grad_norm != strategy.clip:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} and clipping={strategy!r} (C = {strategy.clip}) "
                             "disagree: pass one of them")
        return strategy

    def _resolve_adjacency(self, adjacency: str | None, accountant: str) -> str:
        from lightning_dp.privacy.accounting import check_adjacency

        given = self.accountant_kwargs.pop("adjacency", None)
        if given is not None and adjacency is not None and given != adjacency:
            raise ValueError(f"adjacency={adjacency!r} and accountant_kwargs['adjacency']={given!r} disagree; "
                             "pass adjacency only")
        adjacency = adjacency if adjacency is not None else given
        if adjacency is None:
            return "add_remove" if self.poisson_sampling else "replace"
        adjacency = check_adjacency(adjacency)
        if not self.poisson_sampling and adjacency == "add_remove":
            raise ValueError(
                "poisson_sampling=False with adjacency='add_remove' is not allowed: shuffled batches partition the "
                "data, and adding an example shifts the partition of every later one; the bound is stated for "
                "adjacency='replace' only. Use poisson_sampling=True for add/remove.")
        if self.poisson_sampling and adjacency == "replace" and str(accountant).lower() == "rdp":
            raise ValueError(
                "adjacency='replace' with Poisson sampling needs accountant='pld': dp_accounting has no RDP bound for "
                "the Poisson-subsampled Gaussian under replacement.")
        return adjacency

    # ----------------------------------------------------------- properties
    @property
    def epsilon(self) -> float:
        """Privacy spent so far, at ``target_delta``."""
        return self._accountant.get_epsilon(self.target_delta)

    @property
    def noise_multiplier(self) -> float | None:
        """The noise multiplier in use (given or calibrated); None before calibration."""
        return self._sigma if self._sigma is not None else self._requested_sigma

    @property
    def accountant(self):
        """The accountant (its ``history`` lists every mechanism applied)."""
        return self._accountant

    @property
    def sample_rate(self) -> float | None:
        return None if self._facts is None else self._facts.sample_rate

    @property
    def data_facts(self) -> DataFacts | None:
        """Size, sample rate, expected batch and steps per epoch of the training data (None before Lightning asked
        for the training loader)."""
        return self._facts

    @property
    def _data(self) -> DataFacts:
        if self._facts is None:
            raise MisconfigurationException("DPSGD did not see the training DataLoader; was setup() skipped?")
        return self._facts

    @property
    def max_grad_norm(self) -> float:
        """C of the next step (the clipping strategy's)."""
        return self.clipping.clip

    # ------------------------------------------------------------- set-up
    def _check_accumulation(self, trainer: Trainer, when: str) -> None:
        """The accumulation factor now (any callback or hook may set it) is the one the epoch's data was sampled
        for (virtual batches): checked before every micro-batch and every backward pass.

        Raises:
            MisconfigurationException: with both factors, where it was seen, and the fix.
        """
        factor = trainer.accumulate_grad_batches
        if self._facts is not None and factor != self._logical.parts:
            raise virtual_batches.mismatch(factor, self._logical.parts, f"seen {when}")

    def check_fit(self, trainer: Trainer, pl_module: LightningModule, ckpt_path: str | os.PathLike[str] | None = None,
                  *, lengths: bool = True) -> None:
        """Refuse a fit that cannot be private from the Trainer's and the module's settings alone, before any data
        is read or any model summary printed (``lightning-dp`` calls it before ``Trainer.fit``; :meth:`setup` again
        with ``lengths=False``: Lightning sets ``trainer.ckpt_path`` only after ``setup``, so a resumed run cannot be
        told from a fresh one there, and the lengths are checked when training starts,
        :meth:`~lightning_dp.callbacks.run_length.Lengths.resolve`).

        Raises:
            MisconfigurationException: manual optimization, an unsupported precision, ``min_epochs``/``min_steps``
                with a budget, shuffled batches under DDP, a layer that mixes examples, or a Trainer that runs more
                epochs than this callback's ``epochs`` (see the class docstring, ``calibrate_for``).
        """
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "DPSGD supports automatic optimization only (automatic_optimization=False was set): it replaces the "
                "gradients between backward and the optimizer step. Use automatic optimization.")
        virtual_batches.check_schedule(trainer)
        if self.target_epsilon is not None and (trainer.min_steps or trainer.min_epochs):
            raise MisconfigurationException(
                f"min_steps={trainer.min_steps} / min_epochs={trainer.min_epochs} conflict with target_epsilon: "
                "Lightning would keep training after the budget is spent. Remove min_steps/min_epochs.")
        if str(trainer.precision) not in _PRECISIONS:
            raise MisconfigurationException(
                f"precision={trainer.precision!r} is not supported by DPSGD: it supports {', '.join(_PRECISIONS[:5])} "
                "(per-sample norms, clipped sums and noise in float32 whatever the forward ran in). "
                + ("16-true has no loss scaling, so float16 gradients underflow; use precision='16-mixed' (float16 "
                   "autocast with loss scaling) or 'bf16-true'." if str(trainer.precision) == "16-true" else
                   "Use one of those."))
        if not self.poisson_sampling and trainer.world_size > 1:
            raise MisconfigurationException(
                "poisson_sampling=False is not supported under DDP (DistributedSampler repeats examples to pad "
                "shards, which breaks the per-epoch bound). Use poisson_sampling=True.")
        mixing = [] if self.replace_batchnorm else find_mixing_layers(pl_module)  # replaced in setup otherwise
        if mixing:
            raise MisconfigurationException(describe_mixing_layers(mixing))
        if lengths and self._requested_sigma is None and ckpt_path is None:
            self._lengths(trainer).check_epochs(target_epsilon=self.target_epsilon, who=type(self).__name__)

    def _lengths(self, trainer: Trainer) -> Lengths:
        """This callback's plan and ``trainer``'s limits (:class:`~lightning_dp.callbacks.run_length.Lengths`)."""
        return Lengths.of(self, trainer)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_fit(trainer, pl_module, lengths=False)
        self._fix_loss_scale(trainer)

        mixing = find_mixing_layers(pl_module)
        if mixing and self.replace_batchnorm:
            names = replace_batchnorm(pl_module)
            rank_zero_warn(f"DPSGD replaced {names} by GroupNorm (replace_batchnorm=True)")
            mixing = find_mixing_layers(pl_module)
        if mixing:
            raise MisconfigurationException(describe_mixing_layers(mixing))

        self.protocol.setup(trainer)  # uploads refused, the gate installed, the secret seed fixed on every process
        self._engine = GradSampleEngine(pl_module)
        training_data.attach(trainer, lambda loader: self._privatize(loader, trainer), self._shadows)
        self._logical.restart()
        self._user_training_step = pl_module.training_step
        if self.max_physical_batch_size is not None:
            user_step = self._user_training_step

            @functools.wraps(user_step)
            def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
                return self._train_in_chunks(trainer, batch, lambda chunk: user_step(chunk, *args, **kwargs))

            self._shadows.set(pl_module, "training_step", training_step)

    def _fix_loss_scale(self, trainer: Trainer) -> None:
        """16-mixed: the GradScaler's scale stays where it starts.

        DPSGD drops an example whose gradient is not finite (a float16 overflow; its contribution
        becomes zero, within the clipping bound), so the released gradient is always finite and the
        scaler never sees an overflow. Its scale would still double every ``growth_interval`` steps,
        on and on, until most examples overflow and are dropped; and a scale that backed off when a
        private example overflowed would carry that example into every later step. So the scale is
        fixed (no growth, no back-off): public, the same on every step.
        """
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._half_precision = str(trainer.precision) in ("bf16-mixed", "16-mixed", "bf16-true")
        if scaler is None or not scaler.is_enabled():
            return
        scaler.set_backoff_factor(1.0)  # the release is always finite; should anything else overflow, no back-off
        if scaler.get_growth_interval() < _FIXED_GROWTH_INTERVAL:
            scaler.set_growth_interval(_FIXED_GROWTH_INTERVAL)
            rank_zero_info(f"DPSGD: the loss scale of precision='16-mixed' stays at its initial value "
                           f"{scaler.get_scale():g} (a scale that "
                           "moved with overflows would follow the private examples); an example whose float16 "
                           "gradient still overflows is dropped from its step (nonprivate/overflowed_fraction).")

    def set_secret_seed(self, seed: int) -> None:
        """Replace the seed of the sampling and noise streams before ``fit`` (``lightning-dp grid`` does this,
        so that no two runs of a grid draw the same noise)."""
        self.protocol.give_seed(seed)

    @property
    def _seed(self) -> int | None:
        """The secret seed of the sampling and noise streams (None before ``setup``)."""
        return self.protocol.seed_or_none

    @property
    def _requested_seed(self) -> int | None:
        return self.protocol.requested

    def _drawn_seed(self) -> int:
        """The seed of the sampling and noise streams, drawn (or restored) in ``setup``."""
        return self.protocol.seed

    def attach_audit(self, audit: Any) -> None:
        """Lets a one-run audit (:class:`~lightning_dp.callbacks.OneRunAudit`) into the run before training starts.

        The audit may replace the training loader before it is privatized (``transform_loader(loader)``: the
        canary slots are then part of the data that N, q and the accounting see), and may add gradient
        canaries to each step's clipped sum before the noise (``add_to_sums``) and read the released gradient
        (``observe``). An audit changes what is trained on, never how it is privatized.
        """
        if not self.poisson_sampling or self.adjacency != "add_remove":
            raise MisconfigurationException(
                f"a one-run audit needs DPSGD(poisson_sampling=True, adjacency='add_remove'); this run has "
                f"poisson_sampling={self.poisson_sampling}, adjacency={self.adjacency!r}. The audit's game includes "
                "or excludes each canary, which is the add/remove relation; shuffled batches and replacement "
                "adjacency state epsilon for another relation.")
        if audit not in self._audits:
            self._audits.append(audit)

    def _data_facts(self, loader: Any, world: int, extra_slots: int = 0, parts: int = 1) -> DataFacts:
        """The facts of a training loader (with ``extra_slots`` examples that an audit will append, and ``parts``
        micro-batches per step)."""
        if not isinstance(loader, DataLoader):
            raise MisconfigurationException(
                f"train_dataloader returned {type(loader).__name__}; DPSGD needs one torch DataLoader over a "
                "map-style dataset (it rebuilds the loader with Poisson sampling).")
        try:
            n = len(loader.dataset) + extra_slots  # type: ignore[arg-type]
        except TypeError:
            raise MisconfigurationException(
                "the training dataset has no length (an IterableDataset?); Poisson sampling needs random access "
                "to a map-style dataset of known size N.") from None
        if loader.batch_size is None:
            raise MisconfigurationException(
                "the training DataLoader has batch_size=None (a custom batch_sampler?); DPSGD takes the expected "
                "batch size from DataLoader(batch_size=...). Pass batch_size and no batch_sampler.")
        try:
            return DataFacts.of(dataset_size=n, batch_size=loader.batch_size, world_size=world, parts=parts,
                                poisson_sampling=self.poisson_sampling,
                                batches_per_epoch=None if self.poisson_sampling else len(loader))
        except ValueError as err:
            raise MisconfigurationException(str(err)) from None

    def _privatize(self, loader: Any, trainer: Trainer) -> DataLoader:
        world = trainer.world_size
        for audit in self._audits:
            loader = audit.transform_loader(loader)
        parts = virtual_batches.accumulation_factor(trainer)
        data = self._data_facts(loader, world, parts=parts)
        self._probe_data = (loader.dataset, loader.collate_fn)
        self._logical.parts = parts
        if not self.poisson_sampling:
            try:
                check_partition_sampler(loader)
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            self._facts = data
            self._update_budget(trainer)
            return rebuild_dataloader(loader, batch_sampler=PassMarkingBatchSampler(loader.batch_sampler,
                                                                                    self._start_pass))
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            rank_zero_warn(f"DPSGD replaces the training DataLoader's {type(loader.sampler).__name__} by Poisson "
                           "sampling (every example enters every batch with probability q); its own sampling is "
                           "not used.")
        self._facts = data
        if self._logged_rate is not None and data.sample_rate != self._logged_rate:
            self._rate_varies = True  # logged as a metric from now on (the param holds the rate at fit start)
        self._update_budget(trainer)  # a reloaded loader may bring a new sampling rate
        return poisson_dataloader(loader, sample_rate=data.sample_rate, seed=self._drawn_seed(),
                                  rank=trainer.global_rank, world_size=world, start_step=lambda: self._released,
                                  parts=parts, steps_per_epoch=data.steps_per_epoch)  # the plan's count, not ceil(1/q) again

    def _start_pass(self) -> None:
        self._passes += 1

    # --------------------------------------------------------- calibration
    def _event(self) -> tuple[float, float]:
        """(noise multiplier, sampling rate) of one accounted event."""
        assert self._sigma is not None
        q, scale = planning.event_shape(self.poisson_sampling, self._data.sample_rate)
        return self._sigma * scale, q

    def plan(self, trainer: Trainer, train_dataloader: Any) -> PlannedMechanism:
        """What a fit of ``trainer`` on ``train_dataloader`` would be accounted as, before it runs.

        The budgeted grid search composes the plans of all its runs to choose one noise
        multiplier (:func:`lightning_dp.privacy.calibration.calibrate_composed_noise_multiplier`).

        Raises:
            MisconfigurationException: If the loader cannot be privatized, the run has no
                planned length (no ``epochs``/``max_steps`` here nor ``max_epochs``/``max_steps``
                in the Trainer), or a ``GradientAccumulationScheduler`` changes the factor during the run
                (a plan has one sampling rate; refused before the grid's first run).
        """
        virtual_batches.check_schedule(trainer, for_plan=True)
        # an audit that appends canary slots to the training set (OneRunAudit) changes N, q and the steps per epoch
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
        extra = sum(int(getattr(cb, "extra_training_slots", 0)) for cb in callbacks)
        data = self._data_facts(train_dataloader, trainer.world_size, extra_slots=extra,
                                parts=virtual_batches.accumulation_factor(trainer))
        # the run stops at the Trainer's limits, or at this plan (the grid caps each run's budget to it)
        lengths = self._lengths(trainer)
        bounds = [e for e in (lengths.own_events(data), lengths.trainer_events(data)) if e is not None]
        events = min(bounds) if bounds else None
        if events is None:
            raise MisconfigurationException(
                "DPSGD cannot plan a run without a length: pass epochs=... or max_steps=... to DPSGD, or "
                "max_epochs/max_steps to the Trainer.")
        q, scale = planning.event_shape(self.poisson_sampling, data.sample_rate)
        return PlannedMechanism(sample_rate=q, events=events, multiplier_scale=scale)

    def fix_noise_multiplier(self, noise_multiplier: float, *, target_epsilon: float | None = None,
                             target_delta: float | None = None) -> None:
        """Replace the configured noise and budget before ``fit`` (the budgeted grid search does this).

        Args:
            noise_multiplier: the sigma of every step from now on (no calibration).
            target_epsilon: the new budget of this callback (None: no budget of its own).
            target_delta: the new delta (None: unchanged).
        """
        self._requested_sigma = check_noise_multiplier(noise_multiplier)
        self._restored_sigma = None
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon, finite=True)
        if target_delta is not None:
            self.target_delta = check_delta(target_delta, name="target_delta")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        data = self._data  # refuses a run whose training loader DPSGD did not see

        self.protocol.start(trainer)  # the gate over loggers added since setup; no monitor of a private statistic
        # delta >= 1/N: warned, with the wording every accountant shares (lightning_dp.privacy.delta)
        large_delta = check_delta_for_size(self.target_delta, data.dataset_size, unit="examples",
                                           who=type(self).__name__)
        if large_delta is not None:
            rank_zero_warn(large_delta)
        lengths = self._lengths(trainer)
        planned = lengths.planned_events(data)
        if self._requested_sigma is not None:
            self._sigma, self._sigma_source = self._requested_sigma, "given"
        elif self._restored_sigma is not None:
            # the sigma the run was trained with, whatever the lengths say now: a resumed run keeps its noise
            self._sigma, self._sigma_source = self._restored_sigma, "from the checkpoint"
        else:
            planned = lengths.resolve(data, target_epsilon=self.target_epsilon, who=type(self).__name__)
            if planned is None:
                raise MisconfigurationException(
                    "DPSGD(target_epsilon=...) without noise_multiplier needs the planned length to calibrate the "
                    "noise: pass epochs=... or max_steps=... to DPSGD, or max_epochs/max_steps to the Trainer.")
            if self.target_epsilon is None:  # __init__/fix_noise_multiplier: no sigma given means a budget is set
                raise RuntimeError("DPSGD has neither a noise multiplier nor a target_epsilon (internal)")
            q, scale = planning.event_shape(self.poisson_sampling, data.sample_rate)
            sigma = calibrate_noise_multiplier(
                target_epsilon=self.target_epsilon, target_delta=self.target_delta, sample_rate=q,
                steps=max(planned - len(self._accountant), 1), accountant=self.accountant_name,
                accountant_kwargs=self.accountant_kwargs)
            self._sigma = sigma / scale  # the event's multiplier is scale x sigma
            self._sigma_source = f"calibrated for {planned} {'steps' if self.poisson_sampling else 'epochs'}"
            rank_zero_info(f"DPSGD: calibrated noise_multiplier={self._sigma:.4f} for target_epsilon="
                           f"{self.target_epsilon}, delta={self.target_delta}, {planned} planned steps, q={q:.4g}")
        self._budget.start()
        self._update_budget(trainer)
        try:
            strategy_params = self.clipping.start(self._sigma, data.expected_batch_size,
                                                  lr_scheduled=bool(trainer.lr_scheduler_configs))
        except ValueError as err:
            raise MisconfigurationException(
                f"{type(self).__name__} ({self.clipping.name} clipping, expected batch size m = "
                f"{data.expected_batch_size:g}): {err}") from err
        self._log_hyperparams(trainer, planned, strategy_params)
        sparse = [type(opt).__name__ for opt in trainer.optimizers if isinstance(opt, torch.optim.SparseAdam)]
        if sparse:
            raise MisconfigurationException(
                f"{sparse[0]} needs sparse gradients, but DP-SGD's released gradient is dense: the Gaussian noise covers "
                "every row of an embedding table (a row that no example used still moves, or the release would say "
                "which rows the batch used). Use torch.optim.Adam or SGD; nn.Embedding(sparse=True) itself is fine.")
        # the last line of defence, right before the optimizer updates (after every callback and clipping)
        self._guard.install(trainer.optimizers)

    def _update_budget(self, trainer: Trainer) -> None:
        """How many further events the budget allows, for the event each step is accounted as NOW.

        Computed when training starts and again whenever the event changes (a reloaded
        DataLoader with another dataset or batch size changes q): the stop must follow the
        real cost of the next step, not the cost the run started with.
        """
        if self.target_epsilon is None or self._sigma is None or self._facts is None:
            return
        budget, first = self._budget, self._budget.event is None
        planned = self._lengths(trainer).planned_events(self._data)
        event = self._event()
        if not budget.update(event, accountant=self._accountant, target_epsilon=self.target_epsilon,
                             target_delta=self.target_delta, planned=planned):
            return
        if not first:
            rank_zero_info(f"DPSGD: the sampling rate is now q={event[1]:.4g} (dataset size {self._data.dataset_size}, "
                           f"expected batch {self._data.expected_batch_size}); {budget.allowed} more steps fit in "
                           f"target_epsilon={self.target_epsilon}.")
        if budget.allowed == 0 and (planned is None or planned > 0):
            rank_zero_warn(f"DPSGD: no further step fits in the remaining budget (epsilon spent {self.epsilon:.4g} of "
                           f"target_epsilon={self.target_epsilon}); stopping before the next step.")
            trainer.should_stop = True
            budget.stopped_at = trainer.global_step

    def _log_hyperparams(self, trainer: Trainer, planned: int | None, strategy_params: dict[str, Any]) -> None:
        """The run's fixed privacy parameters as params, once per fit (:func:`dp_sgd_record.hyperparams`)."""
        data = self._data
        self._logged_rate, self._rate_varies = data.sample_rate, False
        params = dp_sgd_record.hyperparams(
            sigma=self._sigma, clipping=self.clipping, target_epsilon=self.target_epsilon,
            target_delta=self.target_delta, accountant=self.accountant_name, poisson_sampling=self.poisson_sampling,
            adjacency=self.adjacency, data=data, planned=planned, max_physical_batch_size=self.max_physical_batch_size,
            strategy_params=strategy_params)
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    # -------------------------------------------------------------- steps
    def _adds_event(self) -> bool:
        """Whether this step starts an accounted event: every Poisson step; the first step of every shuffled pass."""
        if self.poisson_sampling:
            return True
        if self._passes != self._charged_pass:
            self._charged_pass = self._passes
            return True
        return False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        parts = self._logical.parts
        if parts > 1 and self.poisson_sampling and trainer.num_training_batches % parts:
            raise MisconfigurationException(
                f"the epoch runs {trainer.num_training_batches} training batches, not a multiple of "
                f"accumulate_grad_batches={parts}: its last logical batch would be released with only some of its "
                "micro-batches, a selection of the sampled examples that depends on the others. Set "
                f"limit_train_batches to a multiple of {parts} (or leave it unset).")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # after every on_train_epoch_start (a GradientAccumulationScheduler sets the factor there) and before anything
        # of this micro-batch is computed: the factor must be the one the data was sampled for
        self._check_accumulation(trainer, f"before batch {batch_idx} of epoch {trainer.current_epoch}")

        self.protocol.cover(trainer)  # a logger added by a hook since (wraps only what is new: a few lookups)
        step = self._logical
        if step.awaiting_step:  # whatever switched accumulation on: a step was released and never applied
            raise virtual_batches.mismatch(
                max(2, trainer.accumulate_grad_batches), step.parts,
                "the previous training batch released a step but the optimizer did not step; something switched "
                "accumulation on during that batch")
        if step.part and not step.backward_seen:
            raise MisconfigurationException(
                f"training_step returned None for micro-batch {step.part} of {step.parts} (the step was skipped) "
                "while DPSGD trains: every micro-batch of a logical batch must be trained and released, an empty one "
                "included; skipping one would make the release depend on which examples it held. Return a loss "
                "connected to the parameters, e.g. model(x).sum() * 0.0 for an empty batch.")
        step.batch_idx, step.released_in_batch = batch_idx, False
        assert self._engine is not None
        if step.part == 0:
            self._begin_logical_step(trainer, pl_module)
        elif self._engine.trainable_changed():
            raise MisconfigurationException(
                f"the set of trainable parameters changed in the middle of a logical batch (before micro-batch "
                f"{step.part + 1} of {step.parts}); the micro-batches of one step must train the same parameters. "
                "Change requires_grad in on_train_epoch_start (as BackboneFinetuning does) or at a step boundary.")
        step.part += 1
        self._start_examples(batch_probe.examples_in(batch, self._batch_dims))
        if self._batch_size is None:
            raise MisconfigurationException(
                "DPSGD cannot tell how many examples this training batch holds: none of its tensors (or lists) has "
                "the dimension that followed the number of examples in the probe batches, or the batch's structure "
                "differs from theirs. Without it, a training_step that splits or merges examples would go "
                "unnoticed. Return batches with a tensor (or a list) holding one entry per example.")

    def _begin_logical_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """What happens once per optimizer step, before its first micro-batch: the budget, the engine, DDP."""
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            # gradients are reduced by DPSGD (clipped sums, once per step), not by DDP's reducer
            model.require_backward_grad_sync = False
        self._guard.clear()
        self._logical.pending, self._logical.pending_stats = None, None
        self._logical.adds_event = self._adds_event()
        if self._logical.adds_event and self._budget.spent:
            raise RuntimeError(
                f"DPSGD: the privacy budget target_epsilon={self.target_epsilon} is spent (epsilon="
                f"{self.epsilon:.4g}) but training continued; refusing to release another step.")
        assert self._engine is not None
        if self._engine.trainable_changed():
            # a layer was unfrozen (BackboneFinetuning, a hook setting requires_grad) or frozen: follow it
            rank_zero_info("DPSGD: the set of trainable parameters changed; rebuilding the per-sample gradient engine.")
            self._engine.remove()
            self._engine = GradSampleEngine(pl_module)
            self.clipping.trainable_changed()
        if not self._engine.probed:
            self._probe(trainer, pl_module)

    def _start_examples(self, examples: int | None) -> None:
        """Starts recording a forward/backward pass of ``examples`` examples (a micro-batch or one of its chunks)."""
        assert self._engine is not None
        self._batch_size = examples
        self._logical.backward_seen = False
        self._engine.start(batch_size=examples)

    def _train_in_chunks(self, trainer: Trainer, batch: Any, step: Any) -> Any:
        """The training step with ``max_physical_batch_size``: a batch of more examples runs in chunks."""
        limit, examples = self.max_physical_batch_size, self._batch_size
        if limit is None or examples is None or examples <= limit or self._engine is None:
            return step(batch)
        try:
            chunks = split_batch(batch, self._batch_dims, limit, examples)
        except ValueError as err:
            raise MisconfigurationException(
                f"DPSGD(max_physical_batch_size={limit}) cannot cut this batch of {examples} examples into chunks: "
                f"{err}. Return batches whose every tensor that holds the examples keeps them in one dimension, or "
                "raise max_physical_batch_size.") from None
        sizes = [min(limit, examples - start) for start in range(0, examples, limit)]
        divisor, optimizer = trainer.accumulate_grad_batches, trainer.optimizers[0]

        def inner(on: bool) -> None:
            self._logical.in_chunks = on

        # the backward of every chunk but the last runs here, through the strategy (precision plugin, hooks);
        # the last chunk's backward is the Trainer's own, on the loss returned (divided by the same factor)
        return virtual_batches.run_in_chunks(
            chunks, sizes, step=step, start=self._start_examples, inner=inner,
            backward=lambda loss: trainer.strategy.backward(loss / divisor, optimizer))

    def _probe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Establishes where the layers and the batch hold the examples
        (:func:`~lightning_dp.callbacks.batch_probe.probe`), and refuses, in one error, every metric name ``training_step`` logs that the record would refuse: the first
        probe runs before the first private step and before any metric is written.

        Names the module logs in its other hooks (``on_train_batch_end``, ``on_train_epoch_end``) are not learned:
        the probe does not run those hooks (they act on real steps' outputs and on state it cannot put back,
        :mod:`~lightning_dp.callbacks.batch_probe`); the gate refuses such a name when the loggers first write it.
        """
        assert self._engine is not None and self._probe_data is not None
        training_step = self._user_training_step or pl_module.training_step  # not the chunk loop
        logged = batch_probe.LoggedNames()
        self._batch_dims = batch_probe.probe(self._engine, trainer, pl_module, self._probe_data, training_step,
                                             logged)
        self.protocol.check_names(trainer, logged, source=f"{type(pl_module).__name__}.training_step")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # the module's own on_train_batch_start runs after DPSGD's: it could change the factor for this batch
        self._check_accumulation(trainer, f"before a backward in epoch {trainer.current_epoch}")
        self._logical.backward_seen = True
        if self._loss_checked or self._engine is None or self._batch_size == 0:
            return  # an empty Poisson batch says nothing about the reduction
        if loss.dim() != 0:
            raise MisconfigurationException(
                f"training_step returned a loss of shape {tuple(loss.shape)}; DPSGD needs the scalar batch MEAN of "
                "per-example losses (e.g. F.cross_entropy(logits, y) with reduction='mean').")
        if _ends_with_sum(loss):
            raise MisconfigurationException(
                "training_step returned a summed loss (its last operation is a sum); DPSGD needs the batch MEAN of "
                "per-example losses, because per-sample gradients are recovered as batch_size x the recorded ones. "
                "Use .mean() or reduction='mean'.")
        self._loss_checked = True

    def _step_batch_size(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """The step's batch size at the layers' established batch dimensions (probing again once if the
        step's structure differs from the probe's, e.g. a layer that only some batches use)."""
        engine = self._engine
        assert engine is not None
        try:
            return engine.batch_size()
        except PerSampleGradientError:
            self._probe(trainer, pl_module)
            return engine.batch_size()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Clips the examples of the pass just run; the last pass of the logical batch releases the step."""
        if self._engine is None or self._logical.awaiting_step or not self._logical.backward_seen:
            return
        self._harvest(trainer, pl_module)
        # Lightning steps on an epoch's last batch
        last_batch = self._logical.batch_idx + 1 >= trainer.num_training_batches
        if not self._logical.in_chunks and (self._logical.part >= self._logical.parts or last_batch):
            self._release(trainer, trainer.optimizers[0])

    def _harvest(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Per-sample norms of the recorded pass, and its clipped (and extra weighted) sums added to the step's."""
        engine = self._engine
        assert engine is not None
        engine.stop()
        engine.check_parameter_gradients()
        seen = self._step_batch_size(trainer, pl_module)
        if self._batch_size is not None and seen != self._batch_size:
            raise MisconfigurationException(
                f"the layers with trainable parameters saw {seen} examples at their batch dimensions but the batch "
                f"holds {self._batch_size} examples. Per-sample clipping needs each layer to keep the examples in one "
                "dimension (a model that flattens (B, T, d) to (B*T, d) would clip tokens, not examples, and "
                "under-state the sensitivity). Keep a batch dimension, e.g. apply nn.Linear to (B, T, d).")
        # the loss was a mean over `seen` examples, divided by Lightning's accumulation factor, and multiplied by
        # the loss scale of 16-mixed: unscaled here, before the norms and the clipping
        norms = engine.per_sample_norms(loss_scale=seen * trainer.accumulate_grad_batches / _loss_scale(trainer))
        clip = check_max_grad_norm(self.max_grad_norm)  # a strategy's C, checked at every step it clips with
        sums = [engine.clipped_sum(clip_factors(norms, clip))]
        sums += [engine.clipped_sum(w) for w in self.clipping.extra_weights(norms)]
        engine.clear()
        # clipped (dropped ones included: their norm is +inf), total, and dropped for a non-finite gradient
        counts = torch.tensor([norms.numel(), engine.dropped], dtype=sums[0][0].dtype, device=norms.device)
        stats = torch.cat([(norms > clip).sum().to(counts).reshape(1), counts])
        if self._logical.pending is None or self._logical.pending_stats is None:
            self._logical.pending, self._logical.pending_stats = sums, stats
            return
        for acc, new in zip(self._logical.pending, sums):
            for a, t in zip(acc, new):
                a.add_(t)
        self._logical.pending_stats.add_(stats)

    def _release(self, trainer: Trainer, optimizer: Any) -> None:
        """The step's release: the clipped sums of all its passes (all ranks), noised once; then the accounting."""
        engine = self._engine
        assert engine is not None and self._sigma is not None
        releases, stats = self._logical.pending, self._logical.pending_stats
        assert releases is not None and stats is not None
        self._logical.pending, self._logical.pending_stats = None, None
        params = engine.parameters
        if trainer.world_size > 1:
            # one all-reduce for every weighted sum and the counts
            flat = trainer.strategy.reduce(torch.cat([t.reshape(-1) for r in releases for t in r] + [stats]),
                                           reduce_op="sum")
            chunks = iter(torch.split(flat[:-stats.numel()], [t.numel() for r in releases for t in r]))
            releases = [[next(chunks).view_as(t) for t in r] for r in releases]
            stats = flat[-stats.numel():]
        sums, extra_sums = releases[0], releases[1:]
        clip = self.max_grad_norm
        for audit in self._audits:  # gradient canaries enter the clipped sum (after the all-reduce: once in aggregate)
            audit.add_to_sums(sums, step=self._released, sample_rate=self._data.sample_rate, max_grad_norm=clip)
        noise_multiplier = self._gradient_noise_multiplier()
        expected = self._data.expected_batch_size
        generator = derive_secret_generator(self._drawn_seed(), NOISE, self._released, device=sums[0].device)
        grads = noisy_mean(sums, noise_multiplier=noise_multiplier, max_grad_norm=clip,
                           expected_batch_size=expected, generator=generator)
        # 16-mixed: the gradients go to the optimizer through the GradScaler, which unscales them next
        scale = _loss_scale(trainer)
        for p, g in zip(params, grads):
            if not p.requires_grad:  # frozen since the batch started (a module hook, training_step): not trained
                continue
            p.grad = (g * scale if scale != 1.0 else g).to(p.dtype)
            self._guard.mark(p)
        for audit in self._audits:
            audit.observe(grads)
        set_noise_std = getattr(optimizer, "set_noise_std", None)
        if callable(set_noise_std):  # AdamWOSM: its fixed second moment is this step's noise std per coordinate
            set_noise_std(noise_multiplier * clip / expected)
        self._last_stats = stats.detach()
        release = Release(step=self._released, noise_multiplier=self._sigma, gradient=grads, extra_sums=extra_sums,
                          clipped=float(stats[0]), examples=float(stats[1]), expected_batch_size=expected,
                          optimizer=optimizer,
                          statistic_generator=StatisticStream(self._drawn_seed(), CLIP_STATISTIC, self._released))
        try:
            self.clipping.after_release(release)
        except ValueError as err:
            raise MisconfigurationException(f"{type(self).__name__} ({self.clipping.name} clipping): {err}") from err
        self._released += 1
        self._logical.part, self._logical.awaiting_step, self._logical.released_in_batch = 0, True, True
        if self._logical.adds_event:
            sigma_e, q_e = self._event()
            self._accountant.step(noise_multiplier=sigma_e, sample_rate=q_e)
            self._budget.take()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._logical.awaiting_step:
            self._logical.awaiting_step = False
            return
        if not self._logical.backward_seen:
            raise MisconfigurationException(
                "training_step returned None (the step was skipped) while DPSGD trains: every step must be released, "
                "an empty Poisson batch included (noise only), since skipping one would reveal that it was empty. "
                "Return a loss connected to the parameters, e.g. model(x).sum() * 0.0 for an empty batch.")
        raise virtual_batches.mismatch(
            trainer.accumulate_grad_batches, self._logical.parts,
            f"the optimizer is about to step after micro-batch {self._logical.part} of {self._logical.parts} of a "
            "logical batch")

    def _gradient_noise_multiplier(self) -> float:
        """The multiplier of the clipped sum's noise: the accounted sigma, or the clipping strategy's share of it.

        Raises:
            RuntimeError: a strategy's share below the accounted sigma or not finite: any split of one Gaussian
                mechanism between two releases gives the gradient MORE than sigma (``nu_g^-2 + nu_q^-2 = nu^-2``), so
                less would release with less noise than the accountant records.
        """
        assert self._sigma is not None
        share = self.clipping.gradient_noise_multiplier(self._sigma, self._data.expected_batch_size)
        if not (math.isfinite(share) and share >= self._sigma):
            raise RuntimeError(
                f"{type(self).__name__}: the clipping strategy {type(self.clipping).__name__} gives the gradient noise "
                f"multiplier {share!r}, below the accounted {self._sigma!r}; refusing to release with less noise "
                "than epsilon is computed for (a strategy's share of one Gaussian mechanism is at least sigma).")
        return share

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._logical.released_in_batch:
            return  # a micro-batch of a logical batch still being accumulated: no step was taken
        budget = self._budget
        if budget.spent and not trainer.should_stop:
            last_batch = batch_idx + 1 >= trainer.num_training_batches
            planned_end = (0 < trainer.max_steps <= trainer.global_step) or (
                last_batch and trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs)
            if (self.poisson_sampling or last_batch) and not planned_end:
                why = (f"DPSGD's planned {budget.allowed} {'steps' if self.poisson_sampling else 'epochs'} are "
                       "done (its epochs/max_steps; the Trainer would run longer)" if budget.plan_done
                       else f"the next step would exceed target_epsilon={self.target_epsilon}")
                rank_zero_info(f"DPSGD: stopping after step {trainer.global_step}: {why} (spent {self.epsilon:.4f} of "
                               f"target_epsilon={self.target_epsilon} at delta={self.target_delta}).")
                trainer.should_stop = True
                budget.stopped_at = trainer.global_step
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning, undeclared on Trainer
        epoch_end = batch_idx + 1 >= trainer.num_training_batches  # the bar's epsilon is current at every epoch end
        # what Lightning writes at this step: its cadence, or a stop; nothing at all with log_every_n_steps=0
        written = bool(every) and (trainer.global_step % every == 0 or trainer.should_stop)
        if written or epoch_end:
            self._log_privacy(pl_module, trainer.global_step, written=written)

    def _privacy_metrics(self, step: int) -> dict[str, float]:
        eps = self.epsilon
        if not self._curve or self._curve[-1][0] != step:
            self._curve.append((step, eps))
        # what is fixed for the run (delta, sigma, C, q) is a param (_log_hyperparams); only what moves is a metric
        metrics = {"privacy/epsilon": eps}
        if self._rate_varies:  # a reloaded loader changed q since the param was logged: chart it from then on
            metrics["privacy/sample_rate"] = float(self._data.sample_rate)
        if self.log_nonprivate_metrics and self._last_stats is not None and self._last_stats[1] > 0:
            # exact, not covered by epsilon: see docs/privacy.md ("What epsilon covers")
            metrics["nonprivate/clipped_fraction"] = float(self._last_stats[0] / self._last_stats[1])
            if self._half_precision:
                metrics["nonprivate/overflowed_fraction"] = float(self._last_stats[2] / self._last_stats[1])
        metrics.update(self.clipping.metrics())  # what the strategy moves (C, OSO's learning rate), post-processing
        return metrics

    def _log_privacy(self, pl_module: LightningModule, step: int, written: bool = True) -> None:
        """Log the spend at ``step``; ``written``: Lightning writes it to the loggers at this step (its cadence),
        else it only reaches the progress bar and ``on_train_end`` still writes the final value."""
        for name, value in self._privacy_metrics(step).items():
            # float64 tensors: Lightning would store a Python float as float32 and round the spend
            pl_module.log(name, torch.tensor(value, dtype=torch.float64), on_step=True, on_epoch=False,
                          prog_bar=name == "privacy/epsilon")
        if written:
            self._logged_step = step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if step > 0 and self._logged_step != step:
            # Lightning writes step metrics only every log_every_n_steps: the final spend explicitly
            self.protocol.write_final(trainer, self._privacy_metrics(step), step)
            self._logged_step = step
        if trainer.is_global_zero:
            from lightning_dp import tracking

            for fig, name in dp_sgd_record.figures(self._curve, target_delta=self.target_delta, sigma=self._sigma,
                                                   clipping=self.clipping):
                tracking.log_figure(trainer, fig, name)
        self.protocol.end(self._summary_title, self._summary_rows)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.protocol.print_summary(trainer)

    def _summary_title(self) -> str:
        released, per_epoch = self._released, self._data.steps_per_epoch
        return f"{type(self).__name__}: {released} private steps ({released / per_epoch:.3g} epochs of {per_epoch} steps)"

    def _summary_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows of the end-of-training summary (:func:`dp_sgd_record.summary_rows`)."""
        return dp_sgd_record.summary_rows(
            epsilon=self.epsilon, target_epsilon=self.target_epsilon, target_delta=self.target_delta,
            accountant=self.accountant_name, adjacency=self.adjacency, poisson_sampling=self.poisson_sampling,
            data=self._data, rate_varies=self._rate_varies, sigma=self._sigma, sigma_source=self._sigma_source,
            clipping=self.clipping, max_physical_batch_size=self.max_physical_batch_size,
            budget_stop=self._budget.stopped_at, plan_done=self._budget.plan_done)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        self._guard.remove()
        self._audits = []  # attached again by the audit's own setup in a next fit
        self._shadows.restore()
        self.protocol.teardown(trainer)

    # ---------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        # the seed regenerates every noise draw: kept under SECRET_KEY, stripped from whatever is uploaded
        state = {"version": _STATE_VERSION, "accountant": self._accountant.state_dict(), SECRET_KEY: self.protocol.state_dict(),
                 "noise_multiplier": self._sigma, "max_grad_norm": self.max_grad_norm,
                 "poisson_sampling": self.poisson_sampling, "released_steps": self._released,
                 "curve": list(self._curve),
                 # micro-batches of a logical batch accumulated but not released (a checkpoint saved in between)
                 "pending_micro_batches": self._logical.part if self._logical.pending is not None else 0}
        strategy = self.clipping.state_dict()
        if strategy:  # an adaptive C, its trace and what its next update needs (the key of checkpoints before 0.3)
            state["adaptive"] = strategy
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("accountant") is None:
            return
        pending = int(state_dict.get("pending_micro_batches", 0))
        if pending:
            raise MisconfigurationException(
                f"this checkpoint was saved in the middle of a logical batch ({pending} micro-batch(es) accumulated, "
                "not yet released); their clipped sums are private and are not saved, so the run cannot continue that "
                "step exactly. Resume from a checkpoint saved at an optimizer step (ModelCheckpoint saves there: "
                "every_n_train_steps, every epoch), or train without accumulation.")
        saved = state_dict["accountant"]
        if saved.get("name") != self.accountant_name:
            raise MisconfigurationException(
                f"the checkpoint's privacy history was recorded by the {saved.get('name')!r} accountant but this "
                f"DPSGD uses accountant={self.accountant_name!r}; resume with accountant={saved.get('name')!r}.")
        self._accountant.load_state_dict(saved)
        # a given seed wins (runs branched from one checkpoint draw new noise); none saved: a fresh one
        self.protocol.load_state_dict(state_dict.get(SECRET_KEY), legacy=state_dict.get("seed"))  # "seed": before 0.2
        self._restored_sigma = state_dict.get("noise_multiplier")
        self._released = int(state_dict.get("released_steps", 0))
        self._curve = [tuple(x) for x in state_dict.get("curve", [])]
        self.clipping.load_state_dict(state_dict.get("adaptive") or {})
