"""DP-SGD's private step as one object, as Opacus' ``DPOptimizer.pre_step``: clip every example of each pass and
accumulate the clipped sums over the logical batch (virtual batches); all-reduce them over ranks; add the noise once,
from the secret generator; divide by the expected batch size; take the accountant's step. Around it, what a step
needs from Lightning: the engine and the batch probe, the checks of the loss, the accumulation and skipped steps, and
the release guard. The formulas are :mod:`lightning_dp.privacy`'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_dp.callbacks import batch_probe, training_data, virtual_batches
from lightning_dp.callbacks.clipping import ClipStrategy, Release, StatisticStream
from lightning_dp.callbacks.dp_sgd_plan import Calibration, Settings, check_fit, check_model
from lightning_dp.callbacks.release_guard import ReleaseGuard
from lightning_dp.privacy.batch_dims import split_batch
from lightning_dp.privacy.clipping import check_max_grad_norm, clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from lightning_dp.privacy.grad_sample.engine import _no_autocast
from lightning_dp.privacy.noise import CLIP_STATISTIC, NOISE, derive_secret_generator, noisy_mean
from lightning_dp.privacy.validators import find_mixing_layers, replace_batchnorm
from lightning_dp.protocol import RunProtocol

__all__ = ["PrivateStep", "compiled_pass", "fused_pass", "keeps_buffers", "loss_scale", "pass_weights"]

#: growth interval that fixes a GradScaler's scale for any run (2**62 steps)
_FIXED_GROWTH_INTERVAL = 2**62


def keeps_buffers(*, one_shape: bool, device_type: str, compiled: bool) -> bool:
    """Whether DPSGD's engine keeps its work buffers from one step to the next (:meth:`PrivateStep._engine`): on a
    CPU, where a fresh allocation faults its pages in again, and with batches of one shape; not under a compiled
    pass, which allocates in its graph."""
    return (one_shape or device_type == "cpu") and not compiled


def loss_scale(trainer: Trainer) -> float:
    """The loss scale of the Trainer's GradScaler (``precision="16-mixed"``), 1.0 without one."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


_SUM_REDUCTION = 2  # torch's reduction enum (at::Reduction::Sum), saved by the loss functions' autograd nodes


def _ends_with_sum(loss: torch.Tensor, batch_size: int | None = None) -> bool:
    """Whether the loss' last operation, looking through Lightning's scaling, is a sum: ``.sum()``, or a loss
    function with ``reduction="sum"`` (its node saves the reduction); not when the scaling on the way divides by
    ``batch_size`` (``F.binary_cross_entropy(..., reduction="sum") / len(x)`` is a mean). A heuristic: a sum of two
    summed terms is not seen."""
    fn = loss.grad_fn
    divisors: list[float] = []
    while fn is not None and type(fn).__name__ in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        other = getattr(fn, "_saved_other", None)
        if isinstance(other, torch.Tensor) and other.numel() == 1:
            other = float(other)
        if isinstance(other, (int, float)) and other != 0:
            divisors.append(float(other) if type(fn).__name__.startswith("Div") else 1.0 / float(other))
        fn = fn.next_functions[0][0] if fn.next_functions else None
    summed = fn is not None and (type(fn).__name__.startswith("SumBackward")
                                 or getattr(fn, "_saved_reduction", None) == _SUM_REDUCTION)
    return summed and not (batch_size and any(math.isclose(d, batch_size, rel_tol=1e-6) for d in divisors))


def exact_seed(examples: int, accumulate: int) -> tuple[float, int]:
    """The factor DPSGD multiplies a pass' backward seed by, and the power of two its examples' gradients then carry:
    ``(n / 2^k, k)`` for ``n = examples x accumulate`` and ``k = ceil(log2 n)``.

    The loss is a mean over the pass' examples, divided by Lightning's accumulation factor: every example's gradient
    is scaled by ``1 / n``, rounded, and its float32 rounding from there on depends on that number's mantissa, so on
    the batch's size. An example whose terms cancel amplifies that rounding, and many identical such examples move
    together: one example added to the batch moved neighbouring clipped sums 50 C apart (1,023 copies; convolutions,
    norm layers, recurrent and attention biases, parametrizations; docs/per_sample_gradients.md, "Floating point").
    Seeded with ``n / 2^k`` (exact: ``n`` below 2^24), the division by the accumulation factor and the mean's by the
    examples (``F.cross_entropy``, ``F.nll_loss``, ``.mean()``, ``.sum() / n``) are exact, and every example's
    gradient is its own times ``2^-k`` (within a factor 2 of ``1 / n``: no new overflow under float16): the same
    numbers, up to a power of two, whatever the batch's size. Losses whose backward multiplies by a rounded
    reciprocal (``F.mse_loss``, ``F.binary_cross_entropy_with_logits``, label smoothing) keep a rounding that
    depends on it; the floors of the rules (``term_floor``) bound what it moves."""
    n = max(1, examples * accumulate)
    k = math.ceil(math.log2(n))
    return n / 2.0 ** k, k


def _fix_loss_scale(trainer: Trainer) -> bool:
    """16-mixed: the GradScaler's scale stays where it starts; returns whether the run is in half precision.

    DPSGD drops an example whose gradient is not finite (a float16 overflow; its contribution
    becomes zero, within the clipping bound), so the released gradient is always finite and the
    scaler never sees an overflow. Its scale would still double every ``growth_interval`` steps,
    on and on, until most examples overflow and are dropped; and a scale that backed off when a
    private example overflowed would carry that example into every later step. So the scale is
    fixed (no growth, no back-off): public, the same on every step.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    half = str(trainer.precision) in ("bf16-mixed", "16-mixed", "bf16-true")
    if scaler is None or not scaler.is_enabled():
        return half
    scaler.set_backoff_factor(1.0)  # the release is always finite; should anything else overflow, no back-off
    if scaler.get_growth_interval() < _FIXED_GROWTH_INTERVAL:
        scaler.set_growth_interval(_FIXED_GROWTH_INTERVAL)
        rank_zero_info(f"DPSGD: the loss scale of precision='16-mixed' stays at its initial value "
                       f"{scaler.get_scale():g} (a scale that "
                       "moved with overflows would follow the private examples); an example whose float16 "
                       "gradient still overflows is dropped from its step (nonprivate/overflowed_fraction).")
    return half


def pass_weights(norms: torch.Tensor, clip: float | torch.Tensor, extra: list[torch.Tensor],
                 real: int | torch.Tensor | None, *, dropped: int | None = None
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The per-example weights of a pass' sums (the clip factors, then a strategy's ``extra``) and its counts.

    Args:
        norms: the per-example norms, +inf for an example dropped for a non-finite gradient.
        clip: C. extra: the strategy's further weights.
        real: batches of one shape: the first ``real`` rows are sampled examples, the rest padding, weighted 0 and
            counted nowhere. None: every row is an example.
        dropped: the number of dropped examples when the caller knows it (0 in the common case: no count to take).

    Returns:
        The weights, and the counts ``[clipped (dropped ones included: their norm is +inf), examples, dropped]``.
    """
    weights = [clip_factors(norms, clip), *extra]
    over = norms > clip
    examples: int | torch.Tensor = norms.numel()
    inf = torch.isinf(norms) if dropped is None else None
    if real is not None:
        sampled = torch.arange(norms.numel(), device=norms.device) < real
        weights = [torch.where(sampled, w, torch.zeros_like(w)) for w in weights]
        over = over & sampled
        inf = None if inf is None else inf & sampled
        examples = real
    counts = [over.sum(), torch.as_tensor(examples, device=norms.device),
              inf.sum() if inf is not None else torch.as_tensor(dropped, device=norms.device)]
    return weights, torch.stack([c.to(norms.dtype) for c in counts])


def fused_pass(engine: GradSampleEngine, clipping: ClipStrategy, scale: torch.Tensor, clip: torch.Tensor,
               real: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]], torch.Tensor]:
    """A pass' norms, sums and counts as one function of tensors, what ``DPSGD(compile_step=...)`` compiles:
    :meth:`GradSampleEngine.fused_pass` with :func:`pass_weights` (the eager path's formulas)."""
    found: list[torch.Tensor] = []

    def weights_of(norms: torch.Tensor) -> list[torch.Tensor]:
        weights, stats = pass_weights(norms, clip, clipping.extra_weights(norms, clip), real)
        found.append(stats)
        return weights

    norms, sums = engine.fused_pass(scale, weights_of)
    return norms, sums, found[0].to(sums[0][0].dtype)


def check_extra_weights(clipping: ClipStrategy, who: str) -> None:
    """Refuses, before any data, a strategy whose ``extra_weights`` cannot take C as a tensor (a compiled pass
    passes it so: a float that changes every step would recompile)."""
    import inspect

    try:
        inspect.signature(clipping.extra_weights).bind(torch.zeros(1), torch.zeros(()))
    except TypeError as err:
        raise MisconfigurationException(
            f"{who}(compile_step=...): {type(clipping).__name__}.extra_weights(per_sample_norms) takes no clip "
            "argument; the compiled pass calls extra_weights(per_sample_norms, clip) with this step's C as a tensor. "
            "Add `clip: torch.Tensor | None = None` to its signature (None: use self.clip), or pass "
            "compile_step=False.") from err


def compiled_pass(options: dict[str, Any]) -> Callable[..., Any]:
    """:func:`fused_pass` under ``torch.compile(dynamic=False, **options)``, with a code object of its own: dynamo
    keeps compiled graphs per code object (at most ``recompile_limit``), and a process that trains several models
    (a grid, tests) would otherwise fill one cache and fall back to eager; this copy's graphs go with it."""
    import types

    own = types.FunctionType(fused_pass.__code__.replace(), fused_pass.__globals__, "fused_pass")
    return torch.compile(own, dynamic=False, **options)


class PrivateStep:
    """The private step of a DPSGD run, from the first micro-batch of a logical batch to its accounted release.

    Args:
        settings: DPSGD's; clipping: its strategy (C of each step, and what it releases besides);
        calibration: sigma, the data's facts and the budget; protocol: the secret seed, the gate;
        who: the owner's class name in messages.
    """

    def __init__(self, *, settings: Settings, clipping: ClipStrategy, calibration: Calibration,
                 protocol: RunProtocol, who: str) -> None:
        self.settings, self.clipping, self.calibration, self.protocol, self.who = (settings, clipping, calibration,
                                                                                   protocol, who)
        self.engine: GradSampleEngine | None = None
        self.shadows = training_data.Shadows()  # wrapped hooks, replaced data sources: put back at teardown
        self.logical = virtual_batches.LogicalStep()  # where the current logical batch stands
        self.guard = ReleaseGuard()
        self.audits: list[Any] = []  # one-run audits (lightning_dp.callbacks.OneRunAudit) attached to this run
        # Steps released over all fits (restored from checkpoints). It keys the noise and sampling streams:
        # Trainer.global_step restarts at 0 in a second fit, and the same noise on two releases would cancel.
        self.released = 0
        self.last_stats: torch.Tensor | None = None  # clipped, examples, dropped of the last step (nonprivate/)
        self.batch_size: int | None = None  # examples of the pass being recorded
        self.batch_dims: list[int | None] = []  # where the batch's tensors hold the examples
        self.probe_data: tuple[Any, Any] | None = None  # (dataset, collate_fn) of the probe batches
        self.user_training_step: Any = None
        self.loss_checked = False
        # the pass' exact seed (exact_seed): its power of two, and whether the backward ran through the hook
        self.seed_exponent: int | None = None
        self.seed_fired = False
        self.half_precision = False  # bf16-mixed, 16-mixed or bf16-true: nonprivate/overflowed_fraction is logged
        self.real_rows: int | None = None  # batches of one shape: sampled rows of the micro-batch not yet clipped
        self.fused: Callable[..., Any] | None = None  # the compiled pass (DPSGD(compile_step=...)), from setup

    # ------------------------------------------------------------------ a fit
    def setup(self, trainer: Trainer, pl_module: LightningModule, privatize: Callable[[Any], Any]) -> None:
        """From ``setup("fit")``: the fit refused or prepared (loss scale, normalization layers, the protocol, the
        engine, the training data through ``privatize``, the chunked training step)."""
        check_fit(self.settings, trainer, pl_module, None, lengths=False, who=self.who)
        self.half_precision = _fix_loss_scale(trainer)
        if self.settings.replace_batchnorm and find_mixing_layers(pl_module):
            names = replace_batchnorm(pl_module)
            rank_zero_warn(f"DPSGD replaced {names} by GroupNorm (replace_batchnorm=True)")
        check_model(pl_module)
        self.protocol.setup(trainer)  # uploads refused, the gate installed, the secret seed fixed on every process
        self.engine = self._engine(trainer, pl_module)
        options = self.settings.compile_step
        if options is not None:
            check_extra_weights(self.clipping, self.who)
        self.fused = None if options is None else compiled_pass(options)
        training_data.attach(trainer, privatize, self.shadows)
        self.logical.restart()
        self.user_training_step = pl_module.training_step
        if self.settings.max_physical_batch_size is not None:
            user_step = self.user_training_step

            @functools.wraps(user_step)
            def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
                return self._train_in_chunks(trainer, batch, lambda chunk: user_step(chunk, *args, **kwargs))

            self.shadows.set(pl_module, "training_step", training_step)

    def _engine(self, trainer: Trainer, pl_module: LightningModule) -> GradSampleEngine:
        """The per-sample gradient engine. Its work buffers are kept from one step to the next on a CPU (grown to the
        largest batch seen: a fresh allocation there faults its pages in again, 6 % of the MNIST CNN's private step)
        and with batches of one shape (their size is the shape's); on a GPU with Poisson batches they are freed, so
        that the caching allocator lends their memory to the next forward (docs/privacy.md, "Memory"). A compiled
        pass allocates in its graph."""
        keep = keeps_buffers(one_shape=self.settings.max_batch_size is not None,
                             device_type=trainer.strategy.root_device.type,
                             compiled=self.settings.compile_step is not None)
        return GradSampleEngine(pl_module, keep_buffers=keep)

    def attach_audit(self, audit: Any) -> None:
        """:meth:`DPSGD.attach_audit <lightning_dp.callbacks.DPSGD.attach_audit>`."""
        settings = self.settings
        if not settings.poisson_sampling or settings.adjacency != "add_remove":
            raise MisconfigurationException(
                f"a one-run audit needs DPSGD(poisson_sampling=True, adjacency='add_remove'); this run has "
                f"poisson_sampling={settings.poisson_sampling}, adjacency={settings.adjacency!r}. The audit's game "
                "includes or excludes each canary, which is the add/remove relation; shuffled batches and replacement "
                "adjacency state epsilon for another relation.")
        if audit not in self.audits:
            self.audits.append(audit)

    def take(self, loader: Any, parts: int) -> None:
        """The training loader's data, for the probe, and its micro-batches per logical batch."""
        self.probe_data = (loader.dataset, loader.collate_fn)
        self.logical.parts = parts

    def start(self, trainer: Trainer) -> None:
        """When training starts: a sparse optimizer refused; the release guard over the optimizers."""
        sparse = [type(opt).__name__ for opt in trainer.optimizers if isinstance(opt, torch.optim.SparseAdam)]
        if sparse:
            raise MisconfigurationException(
                f"{sparse[0]} needs sparse gradients, but DP-SGD's released gradient is dense: the Gaussian noise "
                "covers every row of an embedding table (a row that no example used still moves, or the release "
                "would say which rows the batch used). Use torch.optim.Adam or SGD; nn.Embedding(sparse=True) itself "
                "is fine.")
        # the model as it trains (configure_model and the module's setup run after the callbacks' setup)
        check_model(trainer.lightning_module)
        # the last line of defence, right before the optimizer updates (after every callback and clipping)
        self.guard.install(trainer.optimizers)

    def teardown(self, trainer: Trainer) -> None:
        """From ``teardown("fit")``: the engine, the guard, the audits, the shadows and the gate removed."""
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        self.guard.remove()
        self.audits = []  # attached again by the audit's own setup in a next fit
        self.shadows.restore()
        self.protocol.teardown(trainer)

    # ------------------------------------------------------------------ before a pass
    def check_accumulation(self, trainer: Trainer, when: str) -> None:
        """The accumulation factor now (any callback or hook may set it) is the one the epoch's data was sampled
        for (virtual batches): checked before every micro-batch and every backward pass.

        Raises:
            MisconfigurationException: with both factors, where it was seen, and the fix.
        """
        factor = trainer.accumulate_grad_batches
        if self.calibration.facts is not None and factor != self.logical.parts:
            raise virtual_batches.mismatch(factor, self.logical.parts, f"seen {when}")

    def epoch_start(self, trainer: Trainer) -> None:
        parts = self.logical.parts
        if parts > 1 and self.settings.poisson_sampling and trainer.num_training_batches % parts:
            raise MisconfigurationException(
                f"the epoch runs {trainer.num_training_batches} training batches, not a multiple of "
                f"accumulate_grad_batches={parts}: its last logical batch would be released with only some of its "
                "micro-batches, a selection of the sampled examples that depends on the others. Set "
                f"limit_train_batches to a multiple of {parts} (or leave it unset).")

    def batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Before a micro-batch: the checks, the logical step begun at its first, the recording started."""
        # after every on_train_epoch_start (a GradientAccumulationScheduler sets the factor there) and before anything
        # of this micro-batch is computed: the factor must be the one the data was sampled for
        self.check_accumulation(trainer, f"before batch {batch_idx} of epoch {trainer.current_epoch}")

        self.protocol.cover(trainer)  # a logger added by a hook since (wraps only what is new: a few lookups)
        step = self.logical
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
        assert self.engine is not None
        if step.part == 0:
            self._begin(trainer, pl_module)
        elif self.engine.trainable_changed():
            raise MisconfigurationException(
                f"the set of trainable parameters changed in the middle of a logical batch (before micro-batch "
                f"{step.part + 1} of {step.parts}); the micro-batches of one step must train the same parameters. "
                "Change requires_grad in on_train_epoch_start (as BackboneFinetuning does) or at a step boundary.")
        step.part += 1
        self._start_examples(batch_probe.examples_in(batch, self.batch_dims))
        if self.batch_size is None:
            raise MisconfigurationException(
                "DPSGD cannot tell how many examples this training batch holds: none of its tensors (or lists) has "
                "the dimension that followed the number of examples in the probe batches, or the batch's structure "
                "differs from theirs. Without it, a training_step that splits or merges examples would go "
                "unnoticed. Return batches with a tensor (or a list) holding one entry per example.")
        self.real_rows = self._real_rows()

    def _real_rows(self) -> int | None:
        """Batches of one shape: how many of this micro-batch's rows are sampled examples (the first ones; the rest
        are blank padding, masked out of every sum and count). None: every row is an example."""
        sampler, shape = self.calibration.shape_sampler, self.calibration.shape
        if sampler is None or shape is None:
            return None
        rows = shape.per_rank // self.logical.parts
        if self.batch_size != rows:
            raise MisconfigurationException(
                f"{self.who}(max_batch_size={shape.max_batch_size}): this micro-batch holds {self.batch_size} examples, "
                f"not the {rows} rows every padded micro-batch holds; the DataLoader's collate_fn (or a hook) added or "
                "removed examples, so the padding cannot be told from the data. Keep one example per sample.")
        return int(sampler.rows(self.released, self.logical.part - 1))

    def _begin(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """What happens once per optimizer step, before its first micro-batch: the budget, the engine, DDP."""
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            # gradients are reduced by DPSGD (clipped sums, once per step), not by DDP's reducer
            model.require_backward_grad_sync = False
        self.guard.clear()
        self.logical.pending, self.logical.pending_stats = None, None
        self.logical.adds_event = self.calibration.adds_event()
        if self.logical.adds_event and self.calibration.budget.spent:
            raise RuntimeError(
                f"DPSGD: the privacy budget target_epsilon={self.settings.target_epsilon} is spent (epsilon="
                f"{self.calibration.epsilon:.4g}) but training continued; refusing to release another step.")
        assert self.engine is not None
        if self.engine.trainable_changed():
            # a layer was unfrozen (BackboneFinetuning, a hook setting requires_grad) or frozen: follow it
            rank_zero_info("DPSGD: the set of trainable parameters changed; rebuilding the per-sample gradient engine.")
            check_model(pl_module)
            self.engine.remove()
            self.engine = self._engine(trainer, pl_module)
            self.clipping.trainable_changed()
        if not self.engine.probed:
            self._probe(trainer, pl_module)

    def _start_examples(self, examples: int | None) -> None:
        """Starts recording a forward/backward pass of ``examples`` examples (a micro-batch or one of its chunks)."""
        assert self.engine is not None
        self.batch_size = examples
        self.logical.backward_seen = False
        self.engine.start(batch_size=examples)

    def _train_in_chunks(self, trainer: Trainer, batch: Any, step: Any) -> Any:
        """The training step with ``max_physical_batch_size``: a batch of more examples runs in chunks."""
        limit, examples = self.settings.max_physical_batch_size, self.batch_size
        if limit is None or examples is None or examples <= limit or self.engine is None:
            return step(batch)
        try:
            chunks = split_batch(batch, self.batch_dims, limit, examples)
        except ValueError as err:
            raise MisconfigurationException(
                f"DPSGD(max_physical_batch_size={limit}) cannot cut this batch of {examples} examples into chunks: "
                f"{err}. Return batches whose every tensor that holds the examples keeps them in one dimension, or "
                "raise max_physical_batch_size.") from None
        sizes = [min(limit, examples - start) for start in range(0, examples, limit)]
        divisor, optimizer = trainer.accumulate_grad_batches, trainer.optimizers[0]

        def inner(on: bool) -> None:
            self.logical.in_chunks = on

        # the backward of every chunk but the last runs here, through the strategy (precision plugin, hooks);
        # the last chunk's backward is the Trainer's own, on the loss returned (divided by the same factor)
        return virtual_batches.run_in_chunks(
            chunks, sizes, step=step, start=self._start_examples, inner=inner,
            backward=lambda loss: trainer.strategy.backward(loss / divisor, optimizer))

    def _probe(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Establishes where the layers and the batch hold the examples
        (:func:`~lightning_dp.callbacks.batch_probe.probe`), and refuses, in one error, every metric name
        ``training_step`` logs that the record would refuse: the first probe runs before the first private step and
        before any metric is written.

        Names the module logs in its other hooks (``on_train_batch_end``, ``on_train_epoch_end``) are not learned:
        the probe does not run those hooks (they act on real steps' outputs and on state it cannot put back,
        :mod:`~lightning_dp.callbacks.batch_probe`); the gate refuses such a name when the loggers first write it.
        """
        assert self.engine is not None and self.probe_data is not None
        training_step = self.user_training_step or pl_module.training_step  # not the chunk loop
        logged = batch_probe.LoggedNames()
        self.batch_dims = batch_probe.probe(self.engine, trainer, pl_module, self.probe_data, training_step, logged)
        self.protocol.check_names(trainer, logged, source=f"{type(pl_module).__name__}.training_step")

    def before_backward(self, trainer: Trainer, loss: torch.Tensor) -> None:
        """Before a backward pass: the accumulation factor, and (once) the loss a mean of per-example losses."""
        # the module's own on_train_batch_start runs after DPSGD's: it could change the factor for this batch
        self.check_accumulation(trainer, f"before a backward in epoch {trainer.current_epoch}")
        self.logical.backward_seen = True
        self.seed_exponent, self.seed_fired = None, False
        if self.engine is None or not self.batch_size:
            return  # an empty Poisson batch says nothing about the reduction
        if loss.requires_grad and loss.dim() == 0 and loss.dtype in (torch.float32, torch.float64):
            # every example's gradient exact up to a power of two, whatever the batch's size (exact_seed); a loss in
            # a half dtype cannot hold the factor exactly and keeps the mean's rounding
            factor, self.seed_exponent = exact_seed(self.batch_size, trainer.accumulate_grad_batches)

            def seed(grad: torch.Tensor) -> torch.Tensor:
                self.seed_fired = True
                return grad * factor

            loss.register_hook(seed)
        if self.loss_checked:
            return
        if loss.dim() != 0:
            raise MisconfigurationException(
                f"training_step returned a loss of shape {tuple(loss.shape)}; DPSGD needs the scalar batch MEAN of "
                "per-example losses (e.g. F.cross_entropy(logits, y) with reduction='mean').")
        if _ends_with_sum(loss, self.batch_size):
            raise MisconfigurationException(
                "training_step returned a summed loss (its last operation is a sum: .sum() or reduction='sum'); "
                "DPSGD needs the batch MEAN of per-example losses, because per-sample gradients are recovered as "
                "batch_size x the recorded ones (a sum would scale every example's gradient by the batch size "
                "before clipping). Use .mean() or reduction='mean', or divide the sum by the batch size; a weighted "
                "mean (w * l).sum() / w.sum() is refused too (one example's weight would scale every other's "
                "gradient): use (w * l).mean().")
        self.loss_checked = True

    # ------------------------------------------------------------------ after a pass: clip, accumulate, release
    @property
    def recording(self) -> bool:
        """Whether a backward pass of a private step just ran (its examples are to be clipped)."""
        return self.engine is not None and not self.logical.awaiting_step and self.logical.backward_seen

    def after_backward(self, trainer: Trainer, pl_module: LightningModule,
                       noise_multiplier: Callable[[], float]) -> None:
        """Clips the examples of the pass just run; the last pass of the logical batch releases the step."""
        self._clip_and_accumulate(trainer, pl_module)
        # Lightning steps on an epoch's last batch
        last_batch = self.logical.batch_idx + 1 >= trainer.num_training_batches
        if not self.logical.in_chunks and (self.logical.part >= self.logical.parts or last_batch):
            self.release(trainer, trainer.optimizers[0], noise_multiplier)

    def _step_batch_size(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """The step's batch size at the layers' established batch dimensions (probing again once if the
        step's structure differs from the probe's, e.g. a layer that only some batches use)."""
        engine = self.engine
        assert engine is not None
        try:
            return engine.batch_size()
        except PerSampleGradientError:
            self._probe(trainer, pl_module)
            return engine.batch_size()

    def _clip_and_accumulate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Per-sample norms of the recorded pass, and its clipped (and extra weighted) sums added to the step's."""
        engine = self.engine
        assert engine is not None
        engine.stop()
        engine.check_parameter_gradients()
        seen = self._step_batch_size(trainer, pl_module)
        if self.batch_size is not None and seen != self.batch_size:
            raise MisconfigurationException(
                f"the layers with trainable parameters saw {seen} examples at their batch dimensions but the batch "
                f"holds {self.batch_size} examples. Per-sample clipping needs each layer to keep the examples in one "
                "dimension (a model that flattens (B, T, d) to (B*T, d) would clip tokens, not examples, and "
                "under-state the sensitivity). Keep a batch dimension, e.g. apply nn.Linear to (B, T, d).")
        # the loss was a mean over `seen` examples, divided by Lightning's accumulation factor, and multiplied by
        # the loss scale of 16-mixed: unscaled here, before the norms and the clipping; seeded exactly (exact_seed),
        # every example's gradient carries 2^-k instead of 1 / (seen x accumulation)
        exponent = self.seed_exponent if self.seed_fired else None
        scale = (seen * trainer.accumulate_grad_batches if exponent is None else 2.0 ** exponent) / loss_scale(trainer)
        clip = check_max_grad_norm(self.clipping.clip)  # a strategy's C, checked at every step it clips with
        real = None
        if self.real_rows is not None:
            # batches of one shape: the pass' first `real` rows are sampled examples (a chunk takes them in order),
            # the rest blank padding, whose weights are 0: nothing of theirs enters a sum or a count
            real = min(self.real_rows, seen)
            self.real_rows -= real
        if self.fused is not None:
            # one captured graph (DPSGD(compile_step=...)): the checks a graph cannot make first, then norms, weights
            # and sums with no host synchronization; the numbers (C, the scale, the rows) enter as tensors, so that a
            # value that changes from step to step does not recompile
            assert self.calibration.user_sampler is None and real is not None  # refused by Settings.of
            engine.check_inputs_unchanged()
            device = engine.parameters[0].device
            with _no_autocast(device):
                norms, (sums, *extra_sums), stats = self.fused(
                    engine, self.clipping, torch.tensor(scale, dtype=torch.float64, device=device),
                    torch.tensor(clip, dtype=torch.float64, device=device), torch.tensor(real, device=device))
            # copied out of the graph's memory: under CUDA graphs (mode="reduce-overhead") the next replay (the next
            # micro-batch's pass) overwrites its outputs, which the logical batch still accumulates into
            sums = [[t.clone() for t in sums], *([t.clone() for t in e] for e in extra_sums)]
            stats = stats.clone()
        else:
            norms = engine.per_sample_norms(loss_scale=scale)
            sampler = self.calibration.user_sampler
            if sampler is not None:  # ULS: each sampled user's mean gradient is clipped as one unit
                sizes = sampler.groups(self.released, self.logical.part - 1)
                if sum(sizes) != seen:
                    raise MisconfigurationException(
                        f"DPSGD(sampling='user'): this batch holds {seen} examples but its {len(sizes)} sampled users "
                        f"hold {sum(sizes)} records: the DataLoader's collate_fn (or the training step) added or "
                        "removed examples, so the records of each user cannot be found. Keep one example per record.")
                norms = engine.group_norms(sizes)
            # the dropped examples: counted from the norms (+inf) only when some were dropped and padding is
            # to be left out (a user's group norm stays finite: the engine's count of examples is the one)
            weights, stats = pass_weights(norms, clip, self.clipping.extra_weights(norms), real,
                                          dropped=engine.dropped if real is None or not engine.dropped else None)
            sums = [engine.clipped_sum(w) for w in weights]
            stats = stats.to(sums[0][0].dtype)
        engine.clear()
        if self.logical.pending is None or self.logical.pending_stats is None:
            self.logical.pending, self.logical.pending_stats = sums, stats
            return
        for acc, new in zip(self.logical.pending, sums):
            for a, t in zip(acc, new):
                a.add_(t)
        self.logical.pending_stats.add_(stats)

    def _reduce(self, trainer: Trainer) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """The step's clipped sums and counts, taken from the logical batch and summed over all ranks."""
        releases, stats = self.logical.pending, self.logical.pending_stats
        assert releases is not None and stats is not None
        self.logical.pending, self.logical.pending_stats = None, None
        if trainer.world_size > 1:
            # one all-reduce for every weighted sum and the counts
            flat = trainer.strategy.reduce(torch.cat([t.reshape(-1) for r in releases for t in r] + [stats]),
                                           reduce_op="sum")
            chunks = iter(torch.split(flat[:-stats.numel()], [t.numel() for r in releases for t in r]))
            releases = [[next(chunks).view_as(t) for t in r] for r in releases]
            stats = flat[-stats.numel():]
        return releases, stats

    def release(self, trainer: Trainer, optimizer: Any, noise_multiplier: Callable[[], float]) -> None:
        """The step's release: the clipped sums of all its passes (all ranks), noised once; then the accounting."""
        engine, calibration = self.engine, self.calibration
        assert engine is not None and calibration.sigma is not None
        params = engine.parameters
        (sums, *extra_sums), stats = self._reduce(trainer)
        clip, data = self.clipping.clip, calibration.data
        for audit in self.audits:  # gradient canaries enter the clipped sum (after the all-reduce: once in aggregate)
            audit.add_to_sums(sums, step=self.released, sample_rate=data.sample_rate, max_grad_norm=clip)
        multiplier = noise_multiplier()
        expected = data.expected_batch_size
        generator = derive_secret_generator(self.protocol.seed, NOISE, self.released, device=sums[0].device)
        grads = noisy_mean(sums, noise_multiplier=multiplier, max_grad_norm=clip,
                           expected_batch_size=expected, generator=generator)
        # 16-mixed: the gradients go to the optimizer through the GradScaler, which unscales them next
        scale = loss_scale(trainer)
        for p, g in zip(params, grads):
            if not p.requires_grad:  # frozen since the batch started (a module hook, training_step): not trained
                continue
            p.grad = (g * scale if scale != 1.0 else g).to(p.dtype)
            self.guard.mark(p)
        for audit in self.audits:
            audit.observe(grads)
        set_noise_std = getattr(optimizer, "set_noise_std", None)
        if callable(set_noise_std):  # AdamWOSM: its fixed second moment is this step's noise std per coordinate
            set_noise_std(multiplier * clip / expected)
        self.last_stats = stats.detach()
        release = Release(step=self.released, noise_multiplier=calibration.sigma, gradient=grads,
                          extra_sums=extra_sums, clipped=float(stats[0]), examples=float(stats[1]),
                          expected_batch_size=expected, optimizer=optimizer,
                          statistic_generator=StatisticStream(self.protocol.seed, CLIP_STATISTIC, self.released))
        try:
            self.clipping.after_release(release)
        except ValueError as err:
            raise MisconfigurationException(f"{self.who} ({self.clipping.name} clipping): {err}") from err
        self.released += 1
        self.logical.part, self.logical.awaiting_step, self.logical.released_in_batch = 0, True, True
        if self.logical.adds_event:
            sigma_e, q_e = calibration.event()
            calibration.accountant.step(noise_multiplier=sigma_e, sample_rate=q_e)
            calibration.budget.take()

    def gradient_noise_multiplier(self) -> float:
        """The multiplier of the clipped sum's noise: the accounted sigma, or the clipping strategy's share of it.

        Raises:
            RuntimeError: a strategy's share below the accounted sigma or not finite: any split of one Gaussian
                mechanism between two releases gives the gradient MORE than sigma (``nu_g^-2 + nu_q^-2 = nu^-2``), so
                less would release with less noise than the accountant records.
        """
        sigma = self.calibration.sigma
        assert sigma is not None
        share = self.clipping.gradient_noise_multiplier(sigma, self.calibration.data.expected_batch_size)
        if not (math.isfinite(share) and share >= sigma):
            raise RuntimeError(
                f"{self.who}: the clipping strategy {type(self.clipping).__name__} gives the gradient noise "
                f"multiplier {share!r}, below the accounted {sigma!r}; refusing to release with less noise "
                "than epsilon is computed for (a strategy's share of one Gaussian mechanism is at least sigma).")
        return share

    def before_optimizer_step(self, trainer: Trainer) -> None:
        """The optimizer steps only on a released step: a skipped step or a changed factor is refused."""
        if self.logical.awaiting_step:
            self.logical.awaiting_step = False
            return
        if not self.logical.backward_seen:
            raise MisconfigurationException(
                "training_step returned None (the step was skipped) while DPSGD trains: every step must be released, "
                "an empty Poisson batch included (noise only), since skipping one would reveal that it was empty. "
                "Return a loss connected to the parameters, e.g. model(x).sum() * 0.0 for an empty batch.")
        raise virtual_batches.mismatch(
            trainer.accumulate_grad_batches, self.logical.parts,
            f"the optimizer is about to step after micro-batch {self.logical.part} of {self.logical.parts} of a "
            "logical batch")

    # ------------------------------------------------------------------ the record and checkpoints
    def nonprivate_metrics(self) -> dict[str, float]:
        """The last step's exact clipped (and overflowed) fraction: NOT covered by epsilon (docs/privacy.md, "What
        epsilon covers"); empty with ``log_nonprivate_metrics=False``."""
        stats = self.last_stats
        if not self.settings.log_nonprivate_metrics or stats is None or not stats[1] > 0:
            return {}
        metrics = {"nonprivate/clipped_fraction": float(stats[0] / stats[1])}
        if self.half_precision:
            metrics["nonprivate/overflowed_fraction"] = float(stats[2] / stats[1])
        return metrics

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches of a logical batch accumulated but not released (a checkpoint saved in between)."""
        return self.logical.part if self.logical.pending is not None else 0

    @staticmethod
    def check_resumable(state_dict: dict[str, Any]) -> None:
        """Refuses a checkpoint saved in the middle of a logical batch."""
        pending = int(state_dict.get("pending_micro_batches", 0))
        if pending:
            raise MisconfigurationException(
                f"this checkpoint was saved in the middle of a logical batch ({pending} micro-batch(es) accumulated, "
                "not yet released); their clipped sums are private and are not saved, so the run cannot continue that "
                "step exactly. Resume from a checkpoint saved at an optimizer step (ModelCheckpoint saves there: "
                "every_n_train_steps, every epoch), or train without accumulation.")
