"""DPSGD's plan: its validated settings, the refusal of a fit that cannot be private, the training data's facts, the
noise multiplier (given, restored or calibrated when training starts), the budget's stop, and what a planned run is
accounted as. The counting is :mod:`lightning_dp.privacy.planning`'s, the lengths' decision
:mod:`~lightning_dp.callbacks.run_length`'s, the budget's :mod:`~lightning_dp.callbacks.budget`'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, NamedTuple

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, Subset

from lightning_dp import checks
from lightning_dp.callbacks import dp_sgd_record, virtual_batches
from lightning_dp.callbacks.budget import Budget
from lightning_dp.callbacks.clipping import ClipStrategy, FixedClip, resolve_clip_strategy
from lightning_dp.callbacks.run_length import Lengths
from lightning_dp.privacy import planning
from lightning_dp.privacy.accounting import (
    check_adjacency,
    check_delta,
    check_examples_per_user,
    check_target_epsilon,
    get_accountant,
)
from lightning_dp.privacy.calibration import calibrate_noise_multiplier
from lightning_dp.privacy.delta import check_delta_for_size
from lightning_dp.privacy.noise import check_noise_multiplier
from lightning_dp.privacy.planning import BatchShape, DataFacts
from lightning_dp.privacy.sampling import (
    PassMarkingBatchSampler,
    check_partition_sampler,
    poisson_dataloader,
    rebuild_dataloader,
    user_poisson_dataloader,
    with_dataset,
)
from lightning_dp.privacy.seeds import check_seed
from lightning_dp.privacy.users import (
    PRIVACY_UNITS,
    Contributions,
    check_collate_keeps_order,
    count_bounded,
    kept_records,
    user_ids_of,
)
from lightning_dp.privacy.validators import (describe_mixing_layers, describe_noise_broken_parametrizations,
                                             find_mixing_layers, find_noise_broken_parametrizations)

__all__ = ["PRECISIONS", "Calibration", "PlannedMechanism", "Settings", "check_fit"]

#: Trainer precisions DPSGD supports (the engine computes per-sample norms and sums in at least float32)
PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "32", "64")


class PlannedMechanism(NamedTuple):
    """What a planned DP-SGD run is accounted as: ``events`` x Gaussian(``multiplier_scale * sigma``) at rate q."""

    sample_rate: float
    events: int
    multiplier_scale: float


#: a calibrated sigma whose planned spend is below this share of the target is reported (DPSGD._calibrate)
UNDERSHOOT = 0.75

#: a max_batch_size that a Poisson batch exceeds with more than this probability per step is warned about
OVERFLOW_WARNING = 1e-3


@dataclass
class Settings:
    """DPSGD's constructor arguments, validated (:meth:`of`); see :class:`~lightning_dp.callbacks.DPSGD`."""

    noise_multiplier: float | None  #: the sigma given (None: calibrated)
    target_epsilon: float | None
    target_delta: float
    epochs: int | None
    max_steps: int | None
    calibrate_for: str
    accountant_name: str
    accountant_kwargs: dict[str, Any]
    poisson_sampling: bool
    adjacency: str
    replace_batchnorm: bool
    log_nonprivate_metrics: bool
    max_physical_batch_size: int | None
    privacy_unit: str = "example"  #: "example", or "user" (lightning_dp.privacy.users)
    max_examples_per_user: int | None = None  #: k, the records one user keeps (privacy_unit="user")
    user_accounting: str = "mixture"  #: how a user-level spend is stated (accounting.USER_ACCOUNTING)
    sampling: str = "example"  #: what Poisson sampling draws: examples, or users with their records (ULS)
    max_batch_size: int | str | None = None  #: batches of one shape: the most examples of a step, or "auto"
    overflow_probability: float = 1e-6  #: "auto"'s chance per step that a rank's Poisson batch exceeds its bound
    compile_step: dict[str, Any] | None = None  #: torch.compile's options for the private pass (None: eager)

    @classmethod
    def of(cls, who: str, *, noise_multiplier: float | None, target_epsilon: float | None, target_delta: float,
           max_grad_norm: float | None, clipping: ClipStrategy | str, epochs: int | None, max_steps: int | None,
           calibrate_for: str, accountant: str, accountant_kwargs: dict[str, Any] | None, poisson_sampling: bool,
           seed: int | None, replace_batchnorm: bool, log_nonprivate_metrics: bool, adjacency: str | None,
           max_physical_batch_size: int | None, privacy_unit: str = "example",
           max_examples_per_user: int | None = None, user_accounting: str | None = None,
           sampling: str = "example", max_batch_size: int | str | None = None,
           batch_overflow_probability: float = 1e-6,
           compile_step: bool | dict[str, Any] = False) -> tuple[Settings, ClipStrategy, Any]:
        """The settings, the clipping strategy and the accountant, every argument checked in the signature's order.

        Raises:
            ValueError: the first argument that is not allowed, with the allowed values and the fix.
        """
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError(
                "DPSGD needs noise_multiplier=<sigma> or target_epsilon=<budget> (or both): with neither there is "
                "no noise and no budget. Example: DPSGD(target_epsilon=3.0, target_delta=1e-5, epochs=10)")
        sigma = None if noise_multiplier is None else check_noise_multiplier(noise_multiplier)
        target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon, finite=True)
        target_delta = check_delta(target_delta, name="target_delta")
        strategy = _resolve_clipping(who, clipping, max_grad_norm)
        epochs = None if epochs is None else checks.positive_int("epochs", epochs, hint="or None")
        max_steps = None if max_steps is None else checks.positive_int("max_steps", max_steps, hint="or None")
        if epochs is not None and max_steps is not None:
            raise ValueError(f"pass epochs={epochs} or max_steps={max_steps} for calibration, not both")
        if calibrate_for not in planning.CALIBRATE_FOR:
            raise ValueError(f"calibrate_for={calibrate_for!r} is not allowed: pass one of "
                             f"{', '.join(planning.CALIBRATE_FOR)} "
                             "(which planned length a calibrated noise multiplier is for when this callback's "
                             "epochs/max_steps and the Trainer's limits disagree)")
        kwargs, poisson = dict(accountant_kwargs or {}), bool(poisson_sampling)
        adjacency = _resolve_adjacency(adjacency, kwargs, accountant, poisson)
        if poisson and adjacency == "replace":
            kwargs["adjacency"] = "replace"
        given = user_accounting is not None
        user_accounting = _resolve_sampling(sampling, privacy_unit, user_accounting, max_physical_batch_size)
        k = _resolve_unit(privacy_unit, max_examples_per_user, user_accounting, poisson=poisson, adjacency=adjacency,
                          accountant=accountant, kwargs=kwargs, user_accounting_given=given)
        accountant_object = get_accountant(accountant, **kwargs)  # validates the name
        check_seed(seed, "seed")  # the run-level protocol keeps it
        physical = (None if max_physical_batch_size is None else
                    checks.positive_int("max_physical_batch_size", max_physical_batch_size, hint="or None"))
        shape = _resolve_shape(max_batch_size, batch_overflow_probability, poisson=poisson, privacy_unit=privacy_unit,
                               adjacency=adjacency, accountant=accountant, kwargs=kwargs)
        compiled = _resolve_compile(compile_step, shape, sampling)
        if sigma is not None:
            strategy.check_noise(sigma, None)  # what does not depend on the data, now
        settings = cls(sigma, target_epsilon, target_delta, epochs, max_steps, calibrate_for, accountant, kwargs,
                       poisson, adjacency, bool(replace_batchnorm), bool(log_nonprivate_metrics), physical,
                       str(privacy_unit), k, str(user_accounting), str(sampling), shape,
                       float(batch_overflow_probability), compiled)
        return settings, strategy, accountant_object


def _resolve_shape(max_batch_size: Any, overflow_probability: Any, *, poisson: bool, privacy_unit: str,
                   adjacency: str, accountant: str, kwargs: dict[str, Any]) -> int | str | None:
    """``max_batch_size`` checked (None, ``"auto"`` or a whole number >= 1) against the rest of the plan."""
    if not checks.is_real(overflow_probability) or not 0 < overflow_probability < 1:
        raise ValueError(f"batch_overflow_probability={overflow_probability!r} is not allowed: pass a number in (0, 1), "
                         "the chance per step that a Poisson batch holds more than max_batch_size examples when "
                         "max_batch_size='auto' chooses it (e.g. 1e-6).")
    for key in ("truncated_batch_size", "dataset_size"):
        if key in kwargs:
            raise ValueError(f"accountant_kwargs[{key!r}] is set by DPSGD from max_batch_size and the training data: "
                             "pass max_batch_size instead.")
    if max_batch_size is None:
        return None
    if max_batch_size != "auto" and (not checks.is_int(max_batch_size) or max_batch_size < 1):
        raise ValueError(f"max_batch_size={max_batch_size!r} is not allowed: pass a whole number >= 1 (the most "
                         "examples of one step, all processes and micro-batches together), 'auto' (the bound that a "
                         "Poisson batch exceeds with probability batch_overflow_probability), or None (batches of "
                         "varying size).")
    problems = []
    if not poisson:
        problems.append("poisson_sampling=False (shuffled batches have one size already)")
    if privacy_unit != "example":
        problems.append(f"privacy_unit={privacy_unit!r} (dp-accounting has no truncated event for a user's records)")
    if adjacency != "add_remove":
        problems.append(f"adjacency={adjacency!r} (the truncated event is stated for add/remove)")
    if str(accountant).lower() != "pld":
        problems.append(f"accountant={accountant!r} (the truncated event has a privacy loss distribution only: use "
                        "'pld')")
    if kwargs.get("pessimistic_estimate") is False:
        problems.append("accountant_kwargs['pessimistic_estimate']=False (the truncated event's distribution is "
                        "built pessimistically only)")
    if problems:
        raise ValueError(f"max_batch_size={max_batch_size!r} (batches of one shape, accounted as dp-accounting's "
                         "TruncatedSubsampledGaussianDpEvent) is not supported with " + "; ".join(problems) + ".")
    return max_batch_size if max_batch_size == "auto" else int(max_batch_size)


#: the torch.compile arguments ``compile_step`` may set
COMPILE_OPTIONS = ("backend", "mode", "options", "fullgraph")


def _resolve_compile(compile_step: Any, shape: int | str | None, sampling: str) -> dict[str, Any] | None:
    """``compile_step`` checked: None (eager) or the options of ``torch.compile`` (True: its defaults)."""
    if compile_step is False or compile_step is None:
        return None
    if compile_step is True:
        options: dict[str, Any] = {}
    elif isinstance(compile_step, dict) and set(compile_step) <= set(COMPILE_OPTIONS):
        options = dict(compile_step)
    else:
        raise ValueError(f"compile_step={compile_step!r} is not allowed: pass False (the private pass runs eagerly), "
                         f"True (torch.compile's defaults) or a dict of torch.compile's {', '.join(COMPILE_OPTIONS)} "
                         "(e.g. {'mode': 'reduce-overhead'} for CUDA graphs).")
    if sampling != "example":
        raise ValueError(f"compile_step is not supported with sampling={sampling!r}: the compiled pass clips each "
                         "example, not each sampled user's group. Pass compile_step=False.")
    if shape is None:
        raise ValueError("compile_step needs batches of one shape: pass max_batch_size=<bound> or 'auto' too. With "
                         "Poisson batches of varying size every new size compiles a new graph (and dynamo falls back "
                         "to eager after a few).")
    return options


def _resolve_sampling(sampling: str, privacy_unit: str, user_accounting: str | None,
                      max_physical_batch_size: int | None) -> str:
    """The user-level statement that ``sampling`` implies: ``"users"`` for user sampling (ULS), else the one given
    (default ``"mixture"``)."""
    if sampling not in ("example", "user"):
        raise ValueError(f"sampling={sampling!r} is not allowed; choose 'example' (Poisson sampling of records: "
                         "DP-SGD, or ELS per user) or 'user' (Poisson sampling of users with their records, each "
                         "user's gradient clipped as one: ULS, privacy_unit='user').")
    if sampling == "example":
        if user_accounting == "users":
            raise ValueError("user_accounting='users' states the spend of user sampling: pass sampling='user'.")
        return user_accounting or "mixture"
    if privacy_unit != "user":
        raise ValueError(f"sampling='user' samples users, so the guarantee is per user: pass privacy_unit='user' "
                         f"(privacy_unit={privacy_unit!r} was given) with max_examples_per_user=k.")
    if user_accounting not in (None, "users"):
        raise ValueError(f"user_accounting={user_accounting!r} states example-level sampling (ELS); sampling='user' "
                         "clips each sampled user as one unit and is accounted as the sampled Gaussian at the users' "
                         "rate. Drop user_accounting, or pass sampling='example'.")
    if max_physical_batch_size is not None:
        raise ValueError(f"sampling='user' with max_physical_batch_size={max_physical_batch_size} is not supported: "
                         "a user's records would be cut over several passes, and each user's gradient is clipped as "
                         "one. Use Trainer(accumulate_grad_batches=n), which splits a batch between users.")
    return "users"


def _resolve_unit(privacy_unit: str, k: int | None, user_accounting: str, *, poisson: bool, adjacency: str,
                  accountant: str, kwargs: dict[str, Any], user_accounting_given: bool = False) -> int | None:
    """``k`` for a user-level run (its accountant's arguments set in ``kwargs``), None for an example-level one."""
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit={privacy_unit!r} is not allowed; choose 'example' (one training example "
                         "added or removed: the usual DP-SGD guarantee) or 'user' (every record of one user, "
                         "with max_examples_per_user=k).")
    for key in ("examples_per_user", "user_accounting"):
        if key in kwargs:  # an accountant that states a user-level spend for a run that bounds no user: refused
            raise ValueError(f"accountant_kwargs[{key!r}] is set by DPSGD's privacy_unit, max_examples_per_user and "
                             "user_accounting: pass those instead.")
    if privacy_unit == "example":
        if k is not None:
            raise ValueError(f"max_examples_per_user={k!r} bounds a user's records for privacy_unit='user'; with "
                             "privacy_unit='example' it has no effect. Pass privacy_unit='user' or drop it.")
        if user_accounting_given:
            raise ValueError(f"user_accounting={user_accounting!r} states a user-level spend; with "
                             "privacy_unit='example' it has no effect. Pass privacy_unit='user' or drop it.")
        return None
    k = check_examples_per_user(k, name="max_examples_per_user")
    if k is None:
        raise ValueError("privacy_unit='user' needs max_examples_per_user=k: the most records one user contributes "
                         "(the others are left out before training), which the user-level epsilon is stated for. "
                         "Example: DPSGD(privacy_unit='user', max_examples_per_user=8, target_epsilon=4.0)")
    if not poisson:
        raise ValueError("privacy_unit='user' needs poisson_sampling=True: its accounting is Poisson sampling of "
                         "every kept record (a mixture over how many of a user's k records a batch holds).")
    if adjacency != "add_remove":
        raise ValueError(f"privacy_unit='user' states a user added or removed with all their records; "
                         f"adjacency={adjacency!r} is not supported. Use adjacency='add_remove' (the default).")
    if str(accountant).lower() != "pld":
        raise ValueError(f"privacy_unit='user' needs accountant='pld' (accountant={accountant!r}): dp_accounting's "
                         "mixture of Gaussians, and the group-privacy conversion, are computed from privacy loss "
                         "distributions.")
    kwargs.update(examples_per_user=k, user_accounting=user_accounting)
    return k


def _resolve_clipping(who: str, clipping: ClipStrategy | str, max_grad_norm: float | None) -> ClipStrategy:
    """The strategy; ``max_grad_norm`` is the fixed strategy's C (an adaptive one has ``initial_clip``)."""
    if clipping == "fixed" and max_grad_norm is not None:
        return FixedClip(max_grad_norm)
    strategy = resolve_clip_strategy(clipping)
    if max_grad_norm is not None and strategy.adaptive:
        raise ValueError(f"{who} with the {strategy.name!r} clipping strategy learns the clipping "
                         f"threshold: pass initial_clip=<C_0> instead of max_grad_norm={max_grad_norm!r}")
    if max_grad_norm is not None and max_grad_norm != strategy.clip:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} and clipping={strategy!r} (C = {strategy.clip}) "
                         "disagree: pass one of them")
    return strategy


def _resolve_adjacency(adjacency: str | None, accountant_kwargs: dict[str, Any], accountant: str,
                       poisson_sampling: bool) -> str:
    given = accountant_kwargs.pop("adjacency", None)
    if given is not None and adjacency is not None and given != adjacency:
        raise ValueError(f"adjacency={adjacency!r} and accountant_kwargs['adjacency']={given!r} disagree; "
                         "pass adjacency only")
    adjacency = adjacency if adjacency is not None else given
    if adjacency is None:
        return "add_remove" if poisson_sampling else "replace"
    adjacency = check_adjacency(adjacency)
    if not poisson_sampling and adjacency == "add_remove":
        raise ValueError(
            "poisson_sampling=False with adjacency='add_remove' is not allowed: shuffled batches partition the "
            "data, and adding an example shifts the partition of every later one; the bound is stated for "
            "adjacency='replace' only. Use poisson_sampling=True for add/remove.")
    if poisson_sampling and adjacency == "replace" and str(accountant).lower() == "rdp":
        raise ValueError(
            "adjacency='replace' with Poisson sampling needs accountant='pld': dp_accounting has no RDP bound for "
            "the Poisson-subsampled Gaussian under replacement.")
    return adjacency


def check_model(pl_module: LightningModule, *, replaced_later: bool = False) -> None:
    """Refuse a model that private training cannot train as claimed: layers that mix the batch's examples (unless
    ``replaced_later``: ``replace_batchnorm`` replaces them in setup), and parametrizations that the noise breaks
    (orthogonal's Householder map). Run by :func:`check_fit`, and again when training starts and whenever the
    engine follows a change of the trainable parameters: a model built or changed in ``setup`` or
    ``configure_model`` (which run after the callbacks' setup), or a layer unfrozen mid-fit, is checked too."""
    mixing = [] if replaced_later else find_mixing_layers(pl_module)
    if mixing:
        raise MisconfigurationException(describe_mixing_layers(mixing))
    broken = find_noise_broken_parametrizations(pl_module)
    if broken:
        raise MisconfigurationException(describe_noise_broken_parametrizations(broken))


def check_fit(settings: Settings, trainer: Trainer, pl_module: LightningModule,
              ckpt_path: str | os.PathLike[str] | None, *, lengths: bool, who: str) -> None:
    """:meth:`DPSGD.check_fit <lightning_dp.callbacks.DPSGD.check_fit>`: the refusals that need no data."""
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "DPSGD supports automatic optimization only (automatic_optimization=False was set): it replaces the "
            "gradients between backward and the optimizer step. Use automatic optimization.")
    virtual_batches.check_schedule(trainer)
    if settings.target_epsilon is not None and (trainer.min_steps or trainer.min_epochs):
        raise MisconfigurationException(
            f"min_steps={trainer.min_steps} / min_epochs={trainer.min_epochs} conflict with target_epsilon: "
            "Lightning would keep training after the budget is spent. Remove min_steps/min_epochs.")
    if str(trainer.precision) not in PRECISIONS:
        raise MisconfigurationException(
            f"precision={trainer.precision!r} is not supported by DPSGD: it supports {', '.join(PRECISIONS[:5])} "
            "(per-sample norms, clipped sums and noise in float32 whatever the forward ran in). "
            + ("16-true has no loss scaling, so float16 gradients underflow; use precision='16-mixed' (float16 "
               "autocast with loss scaling) or 'bf16-true'." if str(trainer.precision) == "16-true" else
               "Use one of those."))
    if not settings.poisson_sampling and trainer.world_size > 1:
        raise MisconfigurationException(
            "poisson_sampling=False is not supported under DDP (DistributedSampler repeats examples to pad "
            "shards, which breaks the per-epoch bound). Use poisson_sampling=True.")
    check_model(pl_module, replaced_later=settings.replace_batchnorm)
    if lengths and settings.noise_multiplier is None and ckpt_path is None:
        Lengths.of(settings, trainer).check_epochs(target_epsilon=settings.target_epsilon, who=who)


class Calibration:
    """The run's noise multiplier, its training data's facts and its budget: what each step is accounted as.

    Args:
        settings: DPSGD's (:meth:`fix` changes its noise and budget before ``fit``).
        clipping: the strategy (started with sigma when training starts).
        accountant: the run's accountant (its history, restored from checkpoints).
        who: the owner's class name in messages.
    """

    def __init__(self, settings: Settings, clipping: ClipStrategy, accountant: Any, who: str) -> None:
        self.settings, self.clipping, self.accountant, self.who = settings, clipping, accountant, who
        self.sigma: float | None = None
        self.restored_sigma: float | None = None
        self.sigma_source = ""  # given, calibrated for ..., from the checkpoint (for the end summary)
        self.facts: DataFacts | None = None  # of the training loader, once Lightning asked for it
        self.logged_rate: float | None = None  # the sample rate logged as a param at fit start
        self.rate_varies = False  # a reloaded loader changed it since: privacy/sample_rate becomes a metric
        self.budget = Budget()  # the events target_epsilon allows, and those taken
        self.passes = 0  # passes started over a shuffled loader; each is one accounted event
        self.charged_pass = 0
        self.contributions: Contributions | None = None  # users and records of a user-level run's training data
        self.user_sampler: Any = None  # ULS: the batch sampler that says which records of a batch are one user's
        self.shape: BatchShape | None = None  # batches of one shape (max_batch_size), once the data is known
        self.shape_sampler: Any = None  # their batch sampler, which says how many rows of a batch are real

    @property
    def epsilon(self) -> float:
        return self.accountant.get_epsilon(self.settings.target_delta)

    @property
    def data(self) -> DataFacts:
        if self.facts is None:
            raise MisconfigurationException("DPSGD did not see the training DataLoader; was setup() skipped?")
        return self.facts

    def lengths(self, trainer: Trainer) -> Lengths:
        """The plan's and ``trainer``'s lengths (:class:`~lightning_dp.callbacks.run_length.Lengths`)."""
        return Lengths.of(self.settings, trainer)

    def fix(self, noise_multiplier: float, *, target_epsilon: float | None, target_delta: float | None) -> None:
        """:meth:`DPSGD.fix_noise_multiplier <lightning_dp.callbacks.DPSGD.fix_noise_multiplier>`."""
        self.settings.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.restored_sigma = None
        self.settings.target_epsilon = (None if target_epsilon is None else
                                        check_target_epsilon(target_epsilon, finite=True))
        if target_delta is not None:
            self.settings.target_delta = check_delta(target_delta, name="target_delta")

    # ------------------------------------------------------------------ the training data
    def facts_of(self, loader: Any, world: int, extra_slots: int = 0, parts: int = 1) -> DataFacts:
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
        if self.settings.max_examples_per_user is not None:  # N: the records the bound keeps (sizes only, no draw)
            if extra_slots:
                raise MisconfigurationException(
                    f"{self.who}(privacy_unit='user') cannot take an audit's canary slots: a canary belongs to no "
                    "user, and the audit's epsilon is stated per example. Audit an example-level run.")
            self.contributions = self._contributions(loader.dataset)
            n = self.contributions.users if self.settings.sampling == "user" else self.contributions.kept
        if loader.batch_size is None:
            raise MisconfigurationException(
                "the training DataLoader has batch_size=None (a custom batch_sampler?); DPSGD takes the expected "
                "batch size from DataLoader(batch_size=...). Pass batch_size and no batch_sampler.")
        try:
            facts = DataFacts.of(dataset_size=n, batch_size=loader.batch_size, world_size=world, parts=parts,
                                 poisson_sampling=self.settings.poisson_sampling,
                                 batches_per_epoch=None if self.settings.poisson_sampling else len(loader))
            self._shape(facts, world)
        except ValueError as err:
            raise MisconfigurationException(f"{self.who}: {err}") from None
        return facts

    def _shape(self, facts: DataFacts, world: int) -> None:
        """Batches of one shape for ``facts``, and the accountant's truncated event (refused where a run that took
        steps would change it: its steps were another mechanism)."""
        requested = self.settings.max_batch_size
        if requested is None:
            return
        shape = BatchShape.of(requested, facts, world_size=world,
                              overflow_probability=self.settings.overflow_probability)
        self.accountant.truncate(dataset_size=shape.accounted_size, truncated_batch_size=shape.max_batch_size)
        self.settings.accountant_kwargs.update(dataset_size=shape.accounted_size,
                                               truncated_batch_size=shape.max_batch_size)
        if self.shape is None or self.shape != shape:
            rank_zero_info(f"{self.who}: batches of one shape: at most {shape.max_batch_size} examples per step "
                           f"({shape.per_rank} per process, padded), expected {facts.expected_batch_size}; a Poisson "
                           f"batch exceeds it with probability {shape.overflow_probability:.2g} per step (accounted: "
                           "dp-accounting's truncated event).")
            if shape.overflow_probability > OVERFLOW_WARNING:
                rank_zero_warn(f"{self.who}(max_batch_size={shape.max_batch_size}): a Poisson batch exceeds the bound "
                               f"with probability {shape.overflow_probability:.2g} per step (expected batch "
                               f"{facts.expected_batch_size}); every overflow is a step of twice the sensitivity, and "
                               "epsilon grows with it (MNIST at q = 256/60,000, 2,350 steps: 1.10 plain, 2.35 at an "
                               "overflow probability of 1e-3, 7.9 at M = 256). max_batch_size='auto' picks the bound "
                               f"for batch_overflow_probability (1e-6 by default).", category=UserWarning)
        self.shape = shape

    def _contributions(self, dataset: Any) -> Contributions:
        k = self.settings.max_examples_per_user
        assert k is not None
        try:
            return count_bounded(user_ids_of(dataset), k)
        except ValueError as err:
            raise MisconfigurationException(f"{self.who}: {err}") from None

    def bounded(self, loader: DataLoader, seed: int) -> tuple[DataLoader, list[list[int]]]:
        """``loader`` over the records a user-level run keeps (at most ``k`` per user, drawn from the secret ``seed``:
        :func:`~lightning_dp.privacy.users.kept_records`), and every user's positions in it (users in the order of
        their first record); ``loader`` itself and no users for an example-level run."""
        k = self.settings.max_examples_per_user
        if k is None:
            return loader, []
        users = kept_records(user_ids_of(loader.dataset), k, seed=seed)
        kept = sorted(i for records in users for i in records)
        position = {index: p for p, index in enumerate(kept)}
        positions = [[position[i] for i in records] for records in sorted(users, key=lambda records: records[0])]
        return with_dataset(loader, Subset(loader.dataset, kept)), positions

    def privatize(self, loader: DataLoader, data: DataFacts, trainer: Trainer, *, seed: Callable[[], int],
                  start_step: Callable[[], int]) -> DataLoader:
        """``loader`` (of facts ``data``) Poisson-sampled from the secret ``seed``, or its shuffled passes marked; a
        user-level run's loader holds at most ``k`` records of every user first."""
        if not self.settings.poisson_sampling:
            try:
                check_partition_sampler(loader)
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            self.facts = data
            self.update_budget(trainer)
            return rebuild_dataloader(loader, batch_sampler=PassMarkingBatchSampler(loader.batch_sampler,
                                                                                    self._start_pass))
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            rank_zero_warn(f"DPSGD replaces the training DataLoader's {type(loader.sampler).__name__} by Poisson "
                           "sampling (every example enters every batch with probability q); its own sampling is "
                           "not used.")
        self.facts = data
        if self.logged_rate is not None and data.sample_rate != self.logged_rate:
            self.rate_varies = True  # logged as a metric from now on (the param holds the rate at fit start)
        self.update_budget(trainer)  # a reloaded loader may bring a new sampling rate
        loader, users = self.bounded(loader, seed())
        if self.settings.sampling == "user":  # ULS: users drawn with their records, each user clipped as one
            try:
                check_collate_keeps_order(loader.collate_fn, loader.dataset)
            except ValueError as err:
                raise MisconfigurationException(f"{self.who}: {err}") from None
            sampled = user_poisson_dataloader(loader, users=users, sample_rate=data.sample_rate, seed=seed(),
                                              rank=trainer.global_rank, world_size=trainer.world_size,
                                              start_step=start_step, parts=data.parts,
                                              steps_per_epoch=data.steps_per_epoch)
            self.user_sampler = sampled.batch_sampler
            return sampled
        shape = self.shape
        try:
            sampled = poisson_dataloader(
                loader, sample_rate=data.sample_rate, seed=seed(), rank=trainer.global_rank,
                world_size=trainer.world_size, start_step=start_step, parts=data.parts,
                steps_per_epoch=data.steps_per_epoch,  # the plan's count, not ceil(1/q) again
                max_batch_size=None if shape is None else shape.max_batch_size)
        except TypeError as err:
            raise MisconfigurationException(f"{self.who}(max_batch_size={self.settings.max_batch_size!r}) pads batches "
                                            f"with blank examples, but {err} Use max_batch_size=None for this "
                                            "dataset.") from None
        self.shape_sampler = None if shape is None else sampled.batch_sampler
        return sampled

    def _start_pass(self) -> None:
        self.passes += 1

    def varying_rate(self) -> float | None:
        """The sample rate, where a reloaded loader changed it since the param was logged (a metric from then)."""
        return float(self.data.sample_rate) if self.rate_varies else None

    # ------------------------------------------------------------------ the accounted event
    def event(self) -> tuple[float, float]:
        """(noise multiplier, sampling rate) of one accounted event."""
        assert self.sigma is not None
        q, scale = planning.event_shape(self.settings.poisson_sampling, self.data.sample_rate)
        return self.sigma * scale, q

    def adds_event(self) -> bool:
        """Whether this step starts an accounted event: every Poisson step; the first step of every shuffled pass."""
        if self.settings.poisson_sampling:
            return True
        if self.passes != self.charged_pass:
            self.charged_pass = self.passes
            return True
        return False

    def plan(self, trainer: Trainer, train_dataloader: Any) -> PlannedMechanism:
        """:meth:`DPSGD.plan <lightning_dp.callbacks.DPSGD.plan>`."""
        virtual_batches.check_schedule(trainer, for_plan=True)
        # an audit that appends canary slots to the training set (OneRunAudit) changes N, q and the steps per epoch
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning, undeclared
        extra = sum(int(getattr(cb, "extra_training_slots", 0)) for cb in callbacks)
        data = self.facts_of(train_dataloader, trainer.world_size, extra_slots=extra,
                             parts=virtual_batches.accumulation_factor(trainer))
        # the run stops at the Trainer's limits, or at this plan (the grid caps each run's budget to it)
        lengths = self.lengths(trainer)
        bounds = [e for e in (lengths.own_events(data), lengths.trainer_events(data)) if e is not None]
        events = min(bounds) if bounds else None
        if events is None:
            raise MisconfigurationException(
                "DPSGD cannot plan a run without a length: pass epochs=... or max_steps=... to DPSGD, or "
                "max_epochs/max_steps to the Trainer.")
        q, scale = planning.event_shape(self.settings.poisson_sampling, data.sample_rate)
        return PlannedMechanism(sample_rate=q, events=events, multiplier_scale=scale)

    # ------------------------------------------------------------------ when training starts
    def start(self, trainer: Trainer) -> dict[str, Any]:
        """The delta warning, sigma (given, restored or calibrated), the budget and the clipping strategy started;
        returns the run's fixed privacy parameters (:func:`~lightning_dp.callbacks.dp_sgd_record.hyperparams`)."""
        settings, data = self.settings, self.data
        # delta >= 1/N: warned, with the wording every accountant shares (lightning_dp.privacy.delta)
        users = self.contributions
        large_delta = (check_delta_for_size(settings.target_delta, users.users, unit="users", who=self.who)
                       if users is not None else
                       check_delta_for_size(settings.target_delta, data.dataset_size, unit="examples", who=self.who))
        if large_delta is not None:
            rank_zero_warn(large_delta)
        lengths = self.lengths(trainer)
        planned = lengths.planned_events(data)
        if settings.noise_multiplier is not None:
            self.sigma, self.sigma_source = settings.noise_multiplier, "given"
        elif self.restored_sigma is not None:
            # the sigma the run was trained with, whatever the lengths say now: a resumed run keeps its noise
            self.sigma, self.sigma_source = self.restored_sigma, "from the checkpoint"
        else:
            planned = self._calibrate(lengths, data)
        self.budget.start()
        self.update_budget(trainer)
        assert self.sigma is not None  # given, restored or calibrated above
        try:
            strategy_params = self.clipping.start(self.sigma, data.expected_batch_size,
                                                  lr_scheduled=bool(trainer.lr_scheduler_configs))
        except ValueError as err:
            raise MisconfigurationException(
                f"{self.who} ({self.clipping.name} clipping, expected batch size m = "
                f"{data.expected_batch_size:g}): {err}") from err
        self.logged_rate, self.rate_varies = data.sample_rate, False
        return dp_sgd_record.hyperparams(
            sigma=self.sigma, clipping=self.clipping, target_epsilon=settings.target_epsilon,
            target_delta=settings.target_delta, accountant=settings.accountant_name,
            poisson_sampling=settings.poisson_sampling, adjacency=settings.adjacency, data=data, planned=planned,
            max_physical_batch_size=settings.max_physical_batch_size, strategy_params=strategy_params,
            privacy_unit=settings.privacy_unit, max_examples_per_user=settings.max_examples_per_user,
            user_accounting=settings.user_accounting, sampling=settings.sampling, shape=self.shape)

    def _calibrate(self, lengths: Lengths, data: DataFacts) -> int:
        """Calibrates sigma for the planned run; returns its planned events."""
        settings = self.settings
        planned = lengths.resolve(data, target_epsilon=settings.target_epsilon, who=self.who)
        if planned is None:
            raise MisconfigurationException(
                "DPSGD(target_epsilon=...) without noise_multiplier needs the planned length to calibrate the "
                "noise: pass epochs=... or max_steps=... to DPSGD, or max_epochs/max_steps to the Trainer.")
        if settings.target_epsilon is None:  # __init__/fix_noise_multiplier: no sigma given means a budget is set
            raise RuntimeError("DPSGD has neither a noise multiplier nor a target_epsilon (internal)")
        q, scale = planning.event_shape(settings.poisson_sampling, data.sample_rate)
        steps = max(planned - len(self.accountant), 1)  # the events still to come
        sigma = calibrate_noise_multiplier(
            target_epsilon=settings.target_epsilon, target_delta=settings.target_delta, sample_rate=q,
            steps=steps, accountant=settings.accountant_name,
            accountant_kwargs=settings.accountant_kwargs)
        self.sigma = sigma / scale  # the event's multiplier is scale x sigma
        self.sigma_source = f"calibrated for {planned} {'steps' if settings.poisson_sampling else 'epochs'}"
        rank_zero_info(f"DPSGD: calibrated noise_multiplier={self.sigma:.4f} for target_epsilon="
                       f"{settings.target_epsilon}, delta={settings.target_delta}, {planned} planned steps, q={q:.4g}")
        reached = get_accountant(settings.accountant_name, **settings.accountant_kwargs).epsilon_after(
            settings.target_delta, noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        if reached < UNDERSHOOT * settings.target_epsilon:
            # sound (the run is private at `reached`) but it spends far less than it may: the accountant's bound
            # jumps (group privacy: below some sigma its delta term exceeds the target's, epsilon becomes inf)
            rank_zero_warn(f"DPSGD: the calibrated noise_multiplier={self.sigma:.4f} reaches epsilon={reached:.4g}, "
                           f"well under target_epsilon={settings.target_epsilon:g}: the accountant's bound jumps to "
                           "no finite epsilon just below this sigma (with user_accounting='group', its delta term), so "
                           "no smaller noise fits. The run is private at the lower epsilon; user_accounting='mixture' "
                           "states the same run tighter.", category=UserWarning)
        return planned

    # ------------------------------------------------------------------ the budget
    def update_budget(self, trainer: Trainer) -> None:
        """How many further events the budget allows, for the event each step is accounted as NOW.

        Computed when training starts and again whenever the event changes (a reloaded
        DataLoader with another dataset or batch size changes q): the stop must follow the
        real cost of the next step, not the cost the run started with.
        """
        target_epsilon = self.settings.target_epsilon
        if target_epsilon is None or self.sigma is None or self.facts is None:
            return
        budget, first = self.budget, self.budget.event is None
        planned = self.lengths(trainer).planned_events(self.data)
        event = self.event()
        if not budget.update(event, accountant=self.accountant, target_epsilon=target_epsilon,
                             target_delta=self.settings.target_delta, planned=planned):
            return
        if not first:
            rank_zero_info(f"DPSGD: the sampling rate is now q={event[1]:.4g} (dataset size {self.data.dataset_size}, "
                           f"expected batch {self.data.expected_batch_size}); {budget.allowed} more steps fit in "
                           f"target_epsilon={target_epsilon}.")
        if budget.allowed == 0 and (planned is None or planned > 0):
            rank_zero_warn(f"DPSGD: no further step fits in the remaining budget (epsilon spent {self.epsilon:.4g} of "
                           f"target_epsilon={target_epsilon}); stopping before the next step.")
            trainer.should_stop = True
            budget.stopped_at = trainer.global_step

    def stop_when_spent(self, trainer: Trainer, batch_idx: int) -> None:
        """After a released step: stop training where the budget (or the plan) allows no further step."""
        budget, settings = self.budget, self.settings
        if not budget.spent or trainer.should_stop:
            return
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        planned_end = (0 < trainer.max_steps <= trainer.global_step) or (
            last_batch and trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs)
        if (settings.poisson_sampling or last_batch) and not planned_end:
            why = (f"DPSGD's planned {budget.allowed} {'steps' if settings.poisson_sampling else 'epochs'} are "
                   "done (its epochs/max_steps; the Trainer would run longer)" if budget.plan_done
                   else f"the next step would exceed target_epsilon={settings.target_epsilon}")
            rank_zero_info(f"DPSGD: stopping after step {trainer.global_step}: {why} (spent {self.epsilon:.4f} of "
                           f"target_epsilon={settings.target_epsilon} at delta={settings.target_delta}).")
            trainer.should_stop = True
            budget.stopped_at = trainer.global_step

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The accountant's history (refused from another accountant) and the sigma the run was trained with."""
        saved, name = state_dict["accountant"], self.settings.accountant_name
        if saved.get("name") != name:
            raise MisconfigurationException(
                f"the checkpoint's privacy history was recorded by the {saved.get('name')!r} accountant but this "
                f"DPSGD uses accountant={name!r}; resume with accountant={saved.get('name')!r}.")
        if (self.settings.max_batch_size is not None and saved.get("truncated_batch_size") is not None
                and getattr(self.accountant, "truncation", None) is None):
            # restored before the training data is known: the checkpoint's truncated event, which the data's shape
            # must then match (Calibration._shape refuses another)
            self.accountant.truncate(dataset_size=int(saved["dataset_size"]),
                                     truncated_batch_size=int(saved["truncated_batch_size"]))
        self.accountant.load_state_dict(saved)
        self.restored_sigma = state_dict.get("noise_multiplier")

