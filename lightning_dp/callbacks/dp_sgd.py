"""DP-SGD (Abadi et al. 2016) as a Lightning callback: add it to ``Trainer(callbacks=[...])``, keep your module.

A shell over the run-level protocol (:mod:`lightning_dp.protocol`), the plan
(:mod:`~lightning_dp.callbacks.dp_sgd_plan`), the private step (:mod:`~lightning_dp.callbacks.private_step`) and
the record (:mod:`~lightning_dp.callbacks.dp_sgd_record`); the secret seed is kept in local checkpoints only.
Privacy semantics (Poisson or shuffled batches, adjacency): docs/privacy.md, "DP-SGD".

Example:
    >>> from lightning_dp.callbacks import DPSGD
    >>> dp = DPSGD(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, epochs=5)
    >>> # trainer = lightning.Trainer(max_epochs=5, callbacks=[dp]); trainer.fit(model, datamodule)
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_dp.callbacks import dp_sgd_record, virtual_batches
from lightning_dp.callbacks.clipping import ClipStrategy
from lightning_dp.callbacks.dp_sgd_plan import Calibration, PlannedMechanism, Settings
from lightning_dp.callbacks.dp_sgd_record import Record
from lightning_dp.callbacks.private_step import PrivateStep
from lightning_dp.callbacks.release_guard import UnprivatizedGradientError
from lightning_dp.privacy.planning import DataFacts
from lightning_dp.privacy.seeds import SECRET_KEY
from lightning_dp.privacy.spend import Spend
from lightning_dp.protocol import RunProtocol

__all__ = ["DPSGD", "PlannedMechanism", "UnprivatizedGradientError"]

_STATE_VERSION = 2


def _setting(name: str, doc: str) -> Any:
    """A DPSGD attribute kept in its :class:`~lightning_dp.callbacks.dp_sgd_plan.Settings` (read and written there)."""
    return property(lambda self: getattr(self.settings, name), lambda self, v: setattr(self.settings, name, v), doc=doc)


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
        privacy_unit: what a neighbouring dataset differs in: ``"example"`` (one record, the default) or ``"user"``
            (every record of one user; the training dataset states each example's user as ``user_ids``). A
            user-level run keeps at most ``max_examples_per_user`` records of every user (drawn from the secret
            seed), samples and clips examples as usual (ELS, Charles et al. 2025) and states epsilon per user:
            docs/privacy.md, "The privacy unit".
        max_examples_per_user: ``k``, the most records one user contributes (``privacy_unit="user"`` only).
        user_accounting: how the user-level epsilon of example-level sampling is stated: ``"mixture"`` (the
            default: dp-accounting's mixture of Gaussians over how many of a user's ``k`` records a batch holds:
            tight) or ``"group"`` (group privacy of the example-level spend: the papers' baseline, looser).
        sampling: what Poisson sampling draws: ``"example"`` (records; the default) or ``"user"`` (ULS, Charles et
            al. 2025: users drawn with their at most ``k`` records; each user's mean gradient is clipped at C as one
            unit; the DataLoader's ``batch_size`` is then the expected number of USERS per step, and the spend is
            the sampled Gaussian at the users' rate). ``privacy_unit="user"`` only.
        max_physical_batch_size: the most examples one forward/backward pass may hold (a memory
            bound; None: no bound). A batch that holds more is cut into chunks of at most this many
            examples inside the training step, each clipped after its own backward pass; the step
            releases their sum, noised once (virtual batches, :mod:`lightning_dp.callbacks.virtual_batches`).
            Composes with ``Trainer(accumulate_grad_batches=k)``, which splits every logical batch into
            ``k`` micro-batches of expected size ``batch_size``.
        max_batch_size: batches of one shape (None: Poisson batches of varying size, the default): every step
            holds at most this many examples, all processes and micro-batches together (a multiple of both, at
            least the expected batch); a Poisson batch (one draw over the whole set, dealt out to the processes)
            that draws more keeps a uniformly random subset, and every micro-batch is padded with blank rows to
            ``max_batch_size / (processes x micro-batches)`` rows that add nothing to the clipped sum or to any
            statistic of the release (the module's own logged loss does average them in). ``"auto"``: the smallest
            bound a Poisson batch exceeds with probability ``batch_overflow_probability`` per step. Accounted
            exactly as dp-accounting's ``TruncatedSubsampledGaussianDpEvent`` (``accountant="pld"``, add/remove,
            per example). One shape lets ``torch.compile`` compile the model once (and CUDA graphs capture it) and
            bounds memory; the price is the padded rows' compute and, for a bound that batches often exceed,
            privacy: docs/privacy.md, "Batches of one shape".
        batch_overflow_probability: ``max_batch_size="auto"``'s chance per step that a Poisson batch exceeds the
            bound (default ``1e-6``: within 0.1 % of plain Poisson sampling's epsilon over thousands of steps).
        compile_step: with ``max_batch_size``: the private pass after each backward (per-sample gradients from
            the layers' records, norms, the drop of non-finite examples, clip factors, masks, clipped sums, counts)
            runs as one graph of ``torch.compile(dynamic=False)``, compiled once: ``True`` (its defaults) or a dict
            of its ``backend``, ``mode``, ``options``, ``fullgraph`` (``{"mode": "reduce-overhead"}``: CUDA
            graphs). Compile the model's forward yourself (``torch.compile(model, dynamic=False)``). The noise stays
            eager: it is drawn from the secret generator, which a compiled graph's random numbers are not. Same
            release as the eager pass (to float rounding); slower on a CPU (docs/privacy.md, "A compiled private
            pass"). Default False.
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
        privacy_unit: Literal["example", "user"] = "example",
        max_examples_per_user: int | None = None,
        user_accounting: Literal["mixture", "group"] | None = None,
        sampling: Literal["example", "user"] = "example",
        max_batch_size: int | Literal["auto"] | None = None,
        batch_overflow_probability: float = 1e-6,
        compile_step: bool | dict[str, Any] = False,
    ) -> None:
        who = type(self).__name__
        self.settings, self.clipping, self._accountant = Settings.of(
            who, noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
            max_grad_norm=max_grad_norm, clipping=clipping, epochs=epochs, max_steps=max_steps,
            calibrate_for=calibrate_for, accountant=accountant, accountant_kwargs=accountant_kwargs,
            poisson_sampling=poisson_sampling, seed=seed, replace_batchnorm=replace_batchnorm,
            log_nonprivate_metrics=log_nonprivate_metrics, adjacency=adjacency,
            max_physical_batch_size=max_physical_batch_size, privacy_unit=privacy_unit,
            max_examples_per_user=max_examples_per_user, user_accounting=user_accounting, sampling=sampling,
            max_batch_size=max_batch_size, batch_overflow_probability=batch_overflow_probability,
            compile_step=compile_step)
        # the secret seed, the gate, the final spend, the summary: the run-level protocol (lightning_dp.protocol)
        self.protocol = RunProtocol(self, seed=seed)
        self.calibration = Calibration(self.settings, self.clipping, self._accountant, who)
        self.private_step = PrivateStep(settings=self.settings, clipping=self.clipping, calibration=self.calibration,
                                        protocol=self.protocol, who=who)
        self.record = Record()

    def privacy_spend(self) -> list[Spend]:
        """The run's spend at its privacy unit (example or user): the accountant's history at ``target_delta`` (what ``lightning-dp grid``
        composes over its runs, :mod:`lightning_dp.privacy.spend`). A run that took no step spent epsilon 0."""
        return [Spend.accounted(self._accountant.privacy_unit, self._accountant, delta=self.target_delta,
                                why=type(self).__name__)]

    # ----------------------------------------------------------- properties
    @property
    def epsilon(self) -> float:
        """Privacy spent so far, at ``target_delta``."""
        return self._accountant.get_epsilon(self.target_delta)

    @property
    def noise_multiplier(self) -> float | None:
        """The noise multiplier in use (given or calibrated); None before calibration."""
        sigma = self.calibration.sigma
        return sigma if sigma is not None else self.settings.noise_multiplier

    @property
    def accountant(self):
        """The accountant (its ``history`` lists every mechanism applied)."""
        return self._accountant

    @property
    def sample_rate(self) -> float | None:
        facts = self.calibration.facts
        return None if facts is None else facts.sample_rate

    @property
    def data_facts(self) -> DataFacts | None:
        """Size, sample rate, expected batch and steps per epoch of the training data (None before Lightning asked
        for the training loader)."""
        return self.calibration.facts

    @property
    def max_grad_norm(self) -> float:
        """C of the next step (the clipping strategy's)."""
        return self.clipping.clip

    @property
    def _seed(self) -> int | None:
        """The secret seed of the sampling and noise streams (None before ``setup``)."""
        return self.protocol.seed_or_none

    @property
    def _requested_seed(self) -> int | None:
        return self.protocol.requested

    @property
    def _released(self) -> int:
        """Steps released by this callback over all its fits (the key of the noise and sampling streams)."""
        return self.private_step.released

    # the settings (lightning_dp.callbacks.dp_sgd_plan.Settings), read where they were attributes
    target_epsilon = _setting("target_epsilon", "The budget (None: no budget).")
    target_delta = _setting("target_delta", "The delta of epsilon.")
    epochs = _setting("epochs", "Planned epochs (calibration).")
    max_steps = _setting("max_steps", "Planned steps (calibration).")
    calibrate_for = _setting("calibrate_for", "Which length sigma is calibrated for.")
    accountant_name = _setting("accountant_name", "The accountant's name.")
    accountant_kwargs = _setting("accountant_kwargs", "The accountant's arguments.")
    poisson_sampling = _setting("poisson_sampling", "Poisson or shuffled batches.")
    adjacency = _setting("adjacency", "add_remove or replace.")
    replace_batchnorm = _setting("replace_batchnorm", "BatchNorm becomes GroupNorm.")
    log_nonprivate_metrics = _setting("log_nonprivate_metrics",
                                      "Whether nonprivate/ statistics are logged (the gate reads it).")
    max_physical_batch_size = _setting("max_physical_batch_size", "The most examples of one forward/backward pass.")

    # ------------------------------------------------------------- before fit
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
        from lightning_dp.callbacks.dp_sgd_plan import check_fit

        check_fit(self.settings, trainer, pl_module, ckpt_path, lengths=lengths, who=type(self).__name__)

    def set_secret_seed(self, seed: int) -> None:
        """Replace the seed of the sampling and noise streams before ``fit`` (``lightning-dp grid`` does this,
        so that no two runs of a grid draw the same noise)."""
        self.protocol.give_seed(seed)

    def attach_audit(self, audit: Any) -> None:
        """Lets a one-run audit (:class:`~lightning_dp.callbacks.OneRunAudit`) into the run before training starts.

        The audit may replace the training loader before it is privatized (``transform_loader(loader)``: the
        canary slots are then part of the data that N, q and the accounting see), and may add gradient
        canaries to each step's clipped sum before the noise (``add_to_sums``) and read the released gradient
        (``observe``). An audit changes what is trained on, never how it is privatized.

        Raises:
            MisconfigurationException: for a user-level run (a canary belongs to no user, and the audit's epsilon is
                stated per example).
        """
        if self.settings.max_batch_size is not None:
            from lightning.pytorch.utilities.exceptions import MisconfigurationException

            raise MisconfigurationException(
                f"{type(audit).__name__} cannot audit {type(self).__name__}(max_batch_size="
                f"{self.settings.max_batch_size!r}) yet: its accounted trade-off curves are those of plain Poisson "
                "sampling, and a truncated batch is another mechanism. Audit the same run with max_batch_size=None.")
        if self.settings.privacy_unit == "user":
            from lightning.pytorch.utilities.exceptions import MisconfigurationException

            raise MisconfigurationException(
                f"{type(audit).__name__} cannot audit {type(self).__name__}(privacy_unit='user'): its canaries belong "
                "to no user and its epsilon lower bound is stated per example. Audit an example-level run "
                "(privacy_unit='example') of the same configuration.")
        self.private_step.attach_audit(audit)

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
        return self.calibration.plan(trainer, train_dataloader)

    def fix_noise_multiplier(self, noise_multiplier: float, *, target_epsilon: float | None = None,
                             target_delta: float | None = None) -> None:
        """Replace the configured noise and budget before ``fit`` (the budgeted grid search does this).

        Args:
            noise_multiplier: the sigma of every step from now on (no calibration).
            target_epsilon: the new budget of this callback (None: no budget of its own).
            target_delta: the new delta (None: unchanged).
        """
        self.calibration.fix(noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta)

    # ------------------------------------------------------------- hooks: a guard, then one call
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self.private_step.setup(trainer, pl_module, lambda loader: self._privatize(loader, trainer))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(trainer)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.private_step.epoch_start(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.private_step.batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.private_step.before_backward(trainer, loss)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.private_step.recording:  # clips the pass just run; the logical batch's last releases the step
            self.private_step.after_backward(trainer, pl_module, self._gradient_noise_multiplier)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.private_step.before_optimizer_step(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.private_step.logical.released_in_batch:  # else a micro-batch still accumulated: no step taken
            self._after_release(trainer, pl_module, batch_idx)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.protocol.print_summary(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self.private_step.teardown(trainer)

    # ------------------------------------------------------------- what the hooks call
    def _privatize(self, loader: Any, trainer: Trainer) -> DataLoader:
        """The training loader as DPSGD trains on it: the audits' canaries in, Poisson-sampled (or passes marked)."""
        for audit in self.private_step.audits:
            loader = audit.transform_loader(loader)
        data = self.calibration.facts_of(loader, trainer.world_size,
                                         parts=virtual_batches.accumulation_factor(trainer))
        self.private_step.take(loader, data.parts)
        return self.calibration.privatize(loader, data, trainer, seed=lambda: self.protocol.seed,
                                          start_step=lambda: self.private_step.released)

    def _start(self, trainer: Trainer) -> None:
        """When training starts: the gate again, sigma and the budget, the params, the release guard."""
        self.calibration.data  # refuses a run whose training loader DPSGD did not see
        self.protocol.start(trainer)  # the gate over loggers added since setup; no monitor of a private statistic
        params = self.calibration.start(trainer)
        for logger in trainer.loggers:
            logger.log_hyperparams(params)
        self.private_step.start(trainer)

    def _gradient_noise_multiplier(self) -> float:
        """The multiplier of the clipped sum's noise (:meth:`PrivateStep.gradient_noise_multiplier
        <lightning_dp.callbacks.private_step.PrivateStep.gradient_noise_multiplier>`)."""
        return self.private_step.gradient_noise_multiplier()

    def _after_release(self, trainer: Trainer, pl_module: LightningModule, batch_idx: int) -> None:
        """After a released step: stop where the budget allows no more; the spend at Lightning's cadence."""
        self.calibration.stop_when_spent(trainer, batch_idx)
        self.record.log(trainer, pl_module, batch_idx, self._privacy_metrics)

    def _privacy_metrics(self, step: int, interim: bool = False) -> dict[str, float]:
        epsilon = self._accountant.interim_epsilon(self.target_delta) if interim else self.epsilon
        return self.record.metrics(step, epsilon, self.calibration.varying_rate(),
                                   self.private_step.nonprivate_metrics(), self.clipping)

    def _end(self, trainer: Trainer) -> None:
        """When training ends: the final spend and the figures written, the summary due."""
        self.record.end(trainer, self.protocol, self._privacy_metrics, figures=lambda: dp_sgd_record.figures(
            self.record.curve, target_delta=self.target_delta, sigma=self.calibration.sigma, clipping=self.clipping))
        self.protocol.end(self._summary_title, self._summary_rows)

    def _summary_title(self) -> str:
        released, per_epoch = self._released, self.calibration.data.steps_per_epoch
        return (f"{type(self).__name__}: {released} private steps ({released / per_epoch:.3g} epochs of {per_epoch} "
                "steps)")

    def _summary_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows of the end-of-training summary (:func:`dp_sgd_record.summary_rows`)."""
        c, s = self.calibration, self.settings
        return dp_sgd_record.summary_rows(
            epsilon=self.epsilon, target_epsilon=s.target_epsilon, target_delta=s.target_delta,
            accountant=s.accountant_name, adjacency=s.adjacency, poisson_sampling=s.poisson_sampling, data=c.data,
            rate_varies=c.rate_varies, sigma=c.sigma, sigma_source=c.sigma_source, clipping=self.clipping,
            max_physical_batch_size=s.max_physical_batch_size, budget_stop=c.budget.stopped_at,
            plan_done=c.budget.plan_done, max_examples_per_user=s.max_examples_per_user,
            user_accounting=s.user_accounting, shape=c.shape)

    # ---------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        # the seed regenerates every noise draw: kept under SECRET_KEY, stripped from whatever is uploaded
        state = {"version": _STATE_VERSION, "accountant": self._accountant.state_dict(),
                 SECRET_KEY: self.protocol.state_dict(), "noise_multiplier": self.calibration.sigma,
                 "max_grad_norm": self.max_grad_norm, "poisson_sampling": self.poisson_sampling,
                 "released_steps": self._released, "curve": list(self.record.curve),
                 "pending_micro_batches": self.private_step.pending_micro_batches}
        strategy = self.clipping.state_dict()
        if strategy:  # an adaptive C, its trace and what its next update needs (the key of checkpoints before 0.3)
            state["adaptive"] = strategy
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("accountant") is None:
            return
        self.private_step.check_resumable(state_dict)  # refused when saved in the middle of a logical batch
        self.calibration.load_state_dict(state_dict)  # the accountant's history, the sigma trained with
        # a given seed wins (runs branched from one checkpoint draw new noise); none saved: a fresh one
        self.protocol.load_state_dict(state_dict.get(SECRET_KEY), legacy=state_dict.get("seed"))  # "seed": before 0.2
        self.private_step.released = int(state_dict.get("released_steps", 0))
        self.record.curve = [tuple(x) for x in state_dict.get("curve", [])]
        self.clipping.load_state_dict(state_dict.get("adaptive") or {})
