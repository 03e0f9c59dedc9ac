"""The batch probe of DPSGD: where every layer and every tensor of a training batch holds the examples.

When training starts (and whenever the set of trainable parameters changes) DPSGD runs ``training_step`` on three
small probe batches (3, 5 and 7 examples of the training set, :data:`~lightning_dp.privacy.batch_dims.PROBE_SIZES`)
through Lightning's own batch path (precision, transfer), then on two batches of 7 that share their first three
examples (:data:`~lightning_dp.privacy.grad_sample.probing.INDEPENDENCE_PROBE`), each from the same random state.
Nothing is logged, metric states and the RNGs are restored, nothing is released. The engine learns each layer's
batch dimension and checks that no example's gradient depends on the batch's other examples (a loss that mixes
them is refused: :meth:`~lightning_dp.privacy.grad_sample.GradSampleEngine.probe`); the batch's own tensors tell
how many examples a later batch holds (:func:`examples_in`); and the names ``training_step`` passes to ``self.log`` and
``self.log_dict`` are noted as the loggers would receive them (:class:`LoggedNames`), so that DPSGD can refuse every
undeclared one before the first private step (:func:`lightning_dp.gate.check_metric_names`).

What the probe cannot learn: names the module logs in its other hooks (``on_train_batch_end``,
``on_train_epoch_end``, ...), and names ``training_step`` logs only on some batches (``if batch_idx % 100 == 0``
holds for the probe's ``batch_idx=0``; a condition on ``global_step`` or the data may not). Those hooks are not
run by the probe: they act on the outputs of real steps and on state the probe cannot put back (a metric's
``compute`` and ``reset``, an appended list, a scheduler), and they run after a step has trained. The gate refuses
such a name when the loggers first write it (every ``log_every_n_steps`` steps, or at the epoch's end).

Every probe batch starts from the module as it was: the tensors ``training_step`` leaves on the module and its
submodules (plain attributes, not parameters, buffers or torchmetrics states: :class:`ModuleState`) are put back
after each. State that holds the batch's examples and that the next step reads (an RNN's hidden state kept on the
module) is refused before the first step (:func:`lightning_dp.privacy.validators.find_carried_state`): one
example would influence later steps beyond its clipped contribution. A crash of the module's own code in a probe
batch is raised as :class:`BatchProbeError`, from the original error.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from torch import nn

from lightning_dp.privacy.batch_dims import (
    PROBE_SIZES,
    AmbiguousBatchDimError,
    batch_dim,
    batch_leaves,
    leaf_shape,
    tensor_leaves,
)
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from lightning_dp.privacy.grad_sample.probing import INDEPENDENT_COMMON
from lightning_dp.privacy.validators import describe_carried_state, find_carried_state

__all__ = ["BatchProbeError", "LoggedNames", "ModuleState", "examples_in", "probe", "side_effect_free"]

_SIZES = ", ".join(map(str, PROBE_SIZES[:-1])) + f" and {PROBE_SIZES[-1]}"


class BatchProbeError(RuntimeError):
    """The module's own code (``training_step``, a collate function, a batch hook) failed on a probe batch; the
    original error is its ``__cause__``."""


class LoggedNames(dict[str, str]):
    """The metric names a ``training_step`` logs, as Lightning's loggers would receive them, each mapped to the name
    logged (``self.log("train_acc", acc, on_epoch=True)`` gives ``train_acc_step`` and ``train_acc_epoch``, each
    mapped to ``train_acc``). A value logged with ``logger=False`` reaches no logger and is not noted (the progress bar
    shows only what the record may hold, :mod:`lightning_dp.gate`).

    Lightning's own rules make the names: its defaults for ``training_step`` (``on_step=True``, ``on_epoch=False``)
    and its ``_step``/``_epoch`` suffixes of a value logged both ways (``_FxValidator`` and ``_Metadata`` of
    ``lightning.pytorch.trainer.connectors.logger_connector``, private).
    """

    def log(self, name: str, value: Any = None, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, *args: Any, **kwargs: Any) -> None:
        """What ``LightningModule.log`` would write (its signature's leading arguments); nothing is logged."""
        if logger is False or not isinstance(name, str):
            return
        on_step, on_epoch = _FxValidator.get_default_logging_levels("training_step", on_step, on_epoch)
        if not (on_step or on_epoch):
            return  # Lightning refuses this call itself when training_step runs for real
        meta = _Metadata(fx="training_step", name=name, on_step=on_step, on_epoch=on_epoch)
        for written in (meta.forked_name(True), meta.forked_name(False)):
            self.setdefault(written, name)

    def log_dict(self, dictionary: Any, prog_bar: bool = False, logger: bool | None = None,
                 on_step: bool | None = None, on_epoch: bool | None = None, *args: Any, **kwargs: Any) -> None:
        """What ``LightningModule.log_dict`` would write: :meth:`log` of each key (a ``MetricCollection``'s keys with
        its prefix and postfix; nothing of a metric is computed)."""
        from torchmetrics import MetricCollection

        keys = dictionary.keys(keep_base=False) if isinstance(dictionary, MetricCollection) else dictionary.keys()
        for name in keys:
            self.log(str(name), None, prog_bar, logger, on_step, on_epoch)


@contextlib.contextmanager
def side_effect_free(pl_module: LightningModule, logged: LoggedNames | None = None) -> Iterator[Callable[[], None]]:
    """Runs ``training_step`` for the probe without leaving a trace.

    ``self.log``/``log_dict`` log nothing (they only note, in ``logged`` when given, the names the loggers would
    receive: :class:`LoggedNames`; no randomness is drawn for it), torchmetrics states are restored afterwards (a
    ``self.train_acc(preds, y)`` would otherwise count the probe batches), and the torch, Python and NumPy RNGs
    (dropout masks, random transforms) are restored. The tensors and Python numbers left in the module's plain
    attributes are put back by :func:`probe` (:class:`ModuleState`), as are its buffers and the generators the data
    and the module hold; other side effects of ``training_step`` (a list of floats appended to, a global counter, a
    file written) do happen for the probe batches: keep them out of ``training_step`` or tolerate the extra calls.
    It yields a function that sets the torch, Python and NumPy RNGs back to where they were on entry.
    """
    import random

    import numpy as np
    from torchmetrics import Metric

    metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]
    saved = [({name: _copied(getattr(m, name)) for name in m._defaults},
              getattr(m, "_update_count", None), getattr(m, "_computed", None)) for m in metrics]
    devices = [pl_module.device] if pl_module.device.type == "cuda" else []
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    names = logged if logged is not None else LoggedNames()
    pl_module.log = names.log  # type: ignore[method-assign]
    pl_module.log_dict = names.log_dict  # type: ignore[method-assign]
    try:
        with torch.random.fork_rng(devices=devices):
            torch_rng = torch.get_rng_state()
            cuda_rng = [torch.cuda.get_rng_state(d) for d in devices]

            def rewind() -> None:  # every generator back to where the probe batch started
                torch.set_rng_state(torch_rng)
                for d, state in zip(devices, cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                random.setstate(python_rng)
                np.random.set_state(numpy_rng)

            yield rewind
    finally:
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)
        for m, (states, count, computed) in zip(metrics, saved):
            for name, value in states.items():
                setattr(m, name, value)
            if count is not None:
                m._update_count = count
            m._computed = computed


class _Generators:
    """The random generators held by the training data and the module, outside the global ones (a dataset's
    ``np.random.default_rng(0)`` or ``torch.Generator``, a ``random.Random``, a transform's), with their states now,
    to be set again before each probe batch and after the probe: a per-example augmentation drawn from one gives
    the probe's common examples the same draws in every batch, and the probe draws nothing the training sees.

    Found in the attributes of the dataset, the collate function and every submodule (each with its own bound),
    their items (of plain lists, tuples and dicts) and their attributes' attributes, a few levels deep and a bounded
    number of objects (a dataset holding a list of a million examples is not walked through); a generator held
    deeper, in a closure, or whose state cannot be read (``random.SystemRandom``) is not found.
    """

    _DEPTH, _ITEMS = 4, 64
    _DATA_OBJECTS, _MODULE_OBJECTS = 4096, 1024  # per root

    def __init__(self, data: tuple[Any, ...], module: nn.Module) -> None:
        self.held: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        modules = list(module.modules())
        self.roots = {id(m) for m in modules}  # walked from themselves, not again from their parents
        for root in data:
            self._walk(root, seen, self._DATA_OBJECTS)
        for root in modules:  # each with its own bound: a model of thousands of modules does not crowd out the data
            self._walk(root, seen, self._MODULE_OBJECTS)

    def _walk(self, root: Any, seen: set[int], bound: int) -> None:
        """Breadth first from ``root``: an attribute of the root is found before its neighbours' items."""
        import collections
        import itertools
        import random

        import numpy as np

        queue, visited = collections.deque([(root, 0)]), 0
        while queue and visited < bound:
            obj, depth = queue.popleft()
            try:
                if id(obj) in seen or obj is None or isinstance(obj, (
                        str, bytes, int, float, bool, torch.Tensor, np.ndarray, type, types.ModuleType, Trainer,
                        Callback)) or (obj is not root and id(obj) in self.roots):
                    continue  # not the trainer's world (its callbacks hold the run's secret generators); the
                    # model's submodules are roots of their own
                seen.add(id(obj))
                visited += 1
                if isinstance(obj, torch.Generator):
                    self.held.append((obj, obj.get_state()))
                elif isinstance(obj, np.random.Generator):
                    self.held.append((obj, obj.bit_generator.state))
                elif isinstance(obj, np.random.RandomState):
                    self.held.append((obj, obj.get_state()))
                elif isinstance(obj, random.Random):
                    self.held.append((obj, obj.getstate()))
                elif depth < self._DEPTH:
                    # only plain containers are walked through their items (a list subclass's __getitem__ is user
                    # code); any other object through its own __dict__, read without its __getattr__
                    if type(obj) is dict:
                        children = list(itertools.islice(obj.values(), self._ITEMS))
                    elif type(obj) in (list, tuple):
                        children = list(itertools.islice(obj, self._ITEMS))
                    else:
                        held = object.__getattribute__(obj, "__dict__")
                        children = list(held.values()) if type(held) is dict else []
                    queue.extend((c, depth + 1) for c in children)
            except Exception:  # noqa: BLE001  (no state to read: random.SystemRandom; no __dict__: __slots__; a
                continue  # proxy whose attributes raise)

    def restore(self) -> None:
        import random

        import numpy as np

        for gen, saved in self.held:
            if isinstance(gen, torch.Generator):
                gen.set_state(saved)
            elif isinstance(gen, np.random.Generator):
                gen.bit_generator.state = saved
            elif isinstance(gen, np.random.RandomState):
                gen.set_state(saved)
            elif isinstance(gen, random.Random):
                gen.setstate(saved)


class _Buffers:
    """The module's buffers as they are now (each tensor, where it is registered, and a copy of its values), to be
    put back, rebound or changed in place, before each probe batch and after the probe: a spectral norm's power
    iteration moves its vectors in place on every training forward. Not after each batch: the probe differentiates
    a batch's result after it ran, and a buffer saved for the backward pass must not have changed by then."""

    def __init__(self, module: nn.Module) -> None:
        self.held = [(owner, name, b, b._version) for owner in module.modules()
                     for name, b in owner._buffers.items() if b is not None]
        self.copies = {id(b): b.detach().clone() for _, _, b, _ in self.held}

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, b, version in self.held:
                if owner._buffers.get(name) is not b:
                    owner._buffers[name] = b
                if b._version != version:
                    b.copy_(self.copies[id(b)])


def _is_number(value: Any) -> bool:
    """An int or a float (a step counter, a schedule's value); not a bool (a module's ``training`` flag, which the
    probe itself sets for dropout modules)."""
    return type(value) in (int, float)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if type(value) is tuple:
        return tuple(_copied(v) for v in value)
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    return value


def _state_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors an attribute holds, parameters left out (``nn.LSTM._flat_weights`` lists its own)."""
    return [t for t in tensor_leaves(value) if not isinstance(t, nn.Parameter)]


class ModuleState:
    """The plain attributes of a module and its submodules (``vars()``: not parameters, buffers or submodules, nor
    torchmetrics' states, which :func:`side_effect_free` restores), as they were when created: which attributes
    holding tensors a ``training_step`` changed (rebound, added, or their tensors, lists or dicts changed in place),
    and which holding a Python number (a step counter), and how to put them back. A copy of every such tensor is
    kept meanwhile, for changes in place.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> state = ModuleState(m)
        >>> m.cache = torch.zeros(3)
        >>> list(state.changed())
        ['self.cache']
        >>> state.restore(state.changed())
        >>> hasattr(m, "cache")
        False
    """

    _INTERNALS = frozenset({"_parameters", "_buffers", "_modules"})

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.values = self._attributes()
        self.tensors = {name: [(t, t._version) for t in _state_tensors(v)] for name, (_, _, v) in self.values.items()}
        self.contents = {name: (list(v) if isinstance(v, list) else dict(v))
                         for name, (_, _, v) in self.values.items()
                         if type(v) in (list, dict)}  # an empty list that a step appends tensors to
        self.copies = {id(t): t.detach().clone() for held in self.tensors.values() for t, _ in held}

    def _attributes(self) -> dict[str, tuple[nn.Module, str, Any]]:
        from torchmetrics import Metric

        metrics = {id(s) for m in self.module.modules() if isinstance(m, Metric) for s in m.modules()}
        found: dict[str, tuple[nn.Module, str, Any]] = {}
        for path, mod in self.module.named_modules():
            if id(mod) in metrics:
                continue
            for key, value in vars(mod).items():
                if key not in self._INTERNALS:
                    found[f"self.{path}.{key}" if path else f"self.{key}"] = (mod, key, value)
        return found

    def changed(self) -> dict[str, tuple[nn.Module, str, Any]]:
        """``name: (owner, key, value now)`` of every attribute holding tensors, or a Python number (a step counter),
        now or before that differs."""
        out = {}
        for name, (owner, key, value) in self._attributes().items():
            now = _state_tensors(value)
            if name not in self.values:
                if now or _is_number(value):
                    out[name] = (owner, key, value)
                continue
            before, original = self.tensors[name], self.values[name][2]
            if value is not original:
                if now or before or ((_is_number(value) or _is_number(original))
                                     and not (_is_number(value) and _is_number(original) and value == original)):
                    out[name] = (owner, key, value)
            elif len(now) != len(before) or any(t is not b or t._version != v for t, (b, v) in zip(now, before)):
                out[name] = (owner, key, value)
        for name, (owner, key, original) in self.values.items():  # deleted
            if name not in out and key not in vars(owner) and (self.tensors[name] or _is_number(original)):
                out[name] = (owner, key, None)
        return out

    def restore(self, changed: dict[str, tuple[nn.Module, str, Any]]) -> None:
        """Puts back every attribute of ``changed`` (:meth:`changed`) as it was."""
        for name, (owner, key, _) in changed.items():
            if name not in self.values:
                vars(owner).pop(key, None)
                continue
            original = self.values[name][2]
            vars(owner)[key] = original
            if name in self.contents:
                saved = self.contents[name]
                if isinstance(original, list):
                    original[:] = saved
                else:
                    original.clear()
                    original.update(saved)
            with torch.no_grad():
                for t, version in self.tensors[name]:
                    if t._version != version:
                        t.copy_(self.copies[id(t)])
            self.tensors[name] = [(t, t._version) for t, _ in self.tensors[name]]


def probe(engine: GradSampleEngine, trainer: Trainer, pl_module: LightningModule, data: tuple[Any, Any],
          training_step: Any, logged: LoggedNames | None = None) -> list[int | None]:
    """Runs ``training_step`` on the probe batches of ``data`` (``(dataset, collate_fn)``): the engine learns the
    layers' batch dimensions; returns, for every leaf of the batch, the dimension that holds the examples (None:
    ambiguous or absent). ``logged``, when given, receives the metric names ``training_step`` logs
    (:class:`LoggedNames`).

    Every probe batch starts from the module's plain tensor attributes and buffers as they were
    (:class:`ModuleState`, :class:`_Buffers`; put back before each batch, not after it, since the engine
    differentiates a batch's result after it ran), and they are left as they were. Its ``training_step`` starts
    from the random state the batch's collation started from (:func:`side_effect_free`).

    Raises:
        MisconfigurationException: a layer whose per-sample gradients cannot be computed, or state kept on the
            module from one batch for the next that holds the examples and that the next step reads
            (:func:`~lightning_dp.privacy.validators.describe_carried_state`).
        BatchProbeError: the module's own code failed on a probe batch (the original error is its cause).
    """
    dataset, collate = data
    size = len(dataset)
    with_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)
    precision = trainer.precision_plugin
    shapes: dict[int, list[tuple[int, ...]]] = {}
    state = ModuleState(pl_module)
    buffers = _Buffers(pl_module)
    generators = _Generators((dataset, collate), pl_module)
    left: dict[int, dict[str, Any]] = {}  # per probe size, the attributes its first run changed, as it left them
    results: dict[int, list[torch.Tensor]] = {}
    common: list[list[Any] | None] = []  # per batch of the independence check, its leaves' rows (_example_rows)

    def run(n: int, carried: dict[str, Any] | None = None) -> Any:  # the first n examples
        return examples(list(range(n)), carried, nested=True)

    def examples(indices: list[int], carried: dict[str, Any] | None = None, nested: bool = False) -> Any:
        # these examples, through Lightning's own batch path (precision, transfer), from the module's state before
        # the probe (or with ``carried`` set) and the same random state; only the nested batches are noted
        n = len(indices)
        buffers.restore()  # what the last batch changed, put back only now: its result has been differentiated
        state.restore(state.changed())
        generators.restore()
        for owner, key, value in (carried or {}).values():
            vars(owner)[key] = _copied(value)
        try:
            with side_effect_free(pl_module, logged) as rewind:
                batch = collate([dataset[i % size] for i in indices])
                rewind()  # a dataset's transforms drew as many numbers as its examples needed: training_step
                # starts from the same random state for every probe batch
                if not nested:
                    common.append(_example_rows(batch, _leaf_dims(shapes)))
                    why = _collation_differs(common[0], common[-1], INDEPENDENT_COMMON) if len(common) > 1 else None
                    if why is not None:
                        rank_zero_warn(
                            f"DPSGD could not check that {type(pl_module).__name__}'s loss keeps the examples apart "
                            f"(the batch probe's two batches with the same first {INDEPENDENT_COMMON} examples "
                            f"{why}); a loss that mixes the examples (an in-batch contrastive loss, mixup) would "
                            "not be refused. Pad to a fixed length and keep the batch's order in the collate "
                            "function to have it checked (docs/per_sample_gradients.md, 'What the engine does not "
                            "check').")
                        return None  # nothing the engine compares
                if nested:
                    shapes[n] = [leaf_shape(leaf) for leaf in batch_leaves(batch)]
                batch = precision.convert_input(batch)
                batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
                batch = trainer.strategy.batch_to_device(batch, dataloader_idx=0)
                with precision.train_step_context():
                    out = training_step(batch, 0) if with_idx else training_step(batch)
        except (PerSampleGradientError, MisconfigurationException, BatchProbeError):
            raise  # the engine's and Lightning's refusals explain themselves
        except Exception as err:
            raise BatchProbeError(
                f"{type(err).__name__}: {err} -- raised by {type(pl_module).__name__}'s own code in the batch probe "
                f"(DPSGD runs training_step on {_SIZES} examples before the first step), on a batch of {n} "
                f"examples{'' if nested else f' (the training set examples {indices})'}; the error above is the "
                "original.") from err
        finally:
            if nested and carried is None and n not in left:
                left[n] = {name: (owner, key, _copied(value)) for name, (owner, key, value) in state.changed().items()}
        if nested and carried is None:
            results.setdefault(n, [t.detach().clone() for t in tensor_leaves(out)])
        return out

    try:
        try:
            engine.probe(run, PROBE_SIZES, examples=examples if size > INDEPENDENT_COMMON else None)
        except PerSampleGradientError as err:
            _refuse_carried_state(pl_module, run, left, results)  # the more basic problem, when the probe saw it
            raise MisconfigurationException(f"DPSGD cannot clip per example: {err}") from None
        _refuse_carried_state(pl_module, run, left, results)
    finally:  # the module, and the generators, as they were: the first step starts from there
        buffers.restore()
        state.restore(state.changed())
        generators.restore()
    return _leaf_dims(shapes)


def _leaf_dims(shapes: dict[int, list[tuple[int, ...]]]) -> list[int | None]:
    """For every leaf of the batch, the dimension that holds the examples, from its shapes in the nested probe
    batches (None: ambiguous or absent; an empty list when the batches' structures differ)."""
    dims: list[int | None] = []
    if all(n in shapes for n in PROBE_SIZES) and len({len(shapes[n]) for n in PROBE_SIZES}) == 1:
        for leaf in zip(*(shapes[n] for n in PROBE_SIZES)):
            try:
                dims.append(batch_dim(leaf, PROBE_SIZES))
            except AmbiguousBatchDimError:
                dims.append(None)
    return dims


def _example_rows(batch: Any, dims: list[int | None]) -> list[Any] | None:
    """Each leaf of a collated batch with its examples first, where its batch dimension is known (a list of
    non-tensors as it is; None for a leaf whose dimension is not known, or a sparse tensor); None when the batch's
    structure is not the one the nested probe batches had."""
    leaves = batch_leaves(batch)
    if not dims or len(leaves) != len(dims):
        return None
    return [leaf.detach().movedim(d, 0) if isinstance(leaf, torch.Tensor) and d is not None and leaf.dim() > d
            and leaf.layout == torch.strided and leaf.device.type != "meta"
            else list(leaf) if d == 0 and isinstance(leaf, (list, tuple)) else None
            for leaf, d in zip(leaves, dims)]


def _equal(x: Any, y: Any) -> bool:
    """Whether two examples' parts of a batch are equal (NaN equal to NaN; objects without an equality of their own
    by identity); parts whose comparison fails are."""
    import math

    import numpy as np

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        same = x == y
        if x.is_floating_point() or x.is_complex():
            same |= x.isnan() & y.isnan()
        return bool(same.all())
    try:
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc" if isinstance(x, np.ndarray) else False))
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return bool(x == y)  # identity, for an object without an equality of its own (_collation_differs)
    except Exception:  # noqa: BLE001  (a comparison that fails: not what tells the examples apart)
        return True


def _by_identity(leaf: Any) -> bool:
    """Whether a leaf is a list of objects that compare only by identity (no equality of their own)."""
    return isinstance(leaf, list) and bool(leaf) and all(
        not isinstance(v, (torch.Tensor, str, bytes, int, float, complex)) and type(v).__eq__ is object.__eq__
        for v in leaf)


def _collation_differs(first: list[Any] | None, second: list[Any] | None, k: int) -> str | None:
    """Why the engine cannot compare two probe batches that hold the same first ``k`` examples (:func:`_example_rows`
    of each), or None where it can: the batches' structure is not the nested probe batches' (the examples cannot be
    found in them), their collated leaves have other shapes (padded to each batch's longest sequence), or the first
    ``k`` examples differ but ``k`` whole examples of the first batch (every leaf of one row) are in the second, each
    matched once (the collate reordered the batch). Examples that differ otherwise (a collate that changes them by
    the batch, an augmentation from a generator the probe does not find) are left to the check, which compares what
    each layer receives."""
    if first is None or second is None or len(first) != len(second):
        return "were collated into batches whose examples the probe cannot find"
    # a list of objects compared only by identity says something only where the dataset returns the same objects
    # each time (its stored records): not where __getitem__ makes fresh ones
    pairs = [(x, y) for x, y in zip(first, second) if x is not None and y is not None
             and not (_by_identity(x) and not any(a is b for a in x for b in y))]
    if any(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape[1:] != y.shape[1:]
           for x, y in pairs):
        return "were collated into tensors of other shapes, padded to each batch's longest sequence"
    rows = min((len(x) for x, _ in pairs), default=0)
    if rows < k or all(_equal(x[i], y[i]) for x, y in pairs for i in range(k)):
        return None
    unmatched = list(range(min(len(y) for _, y in pairs)))
    found = 0
    for i in range(rows):
        j = next((j for j in unmatched if all(_equal(x[i], y[j]) for x, y in pairs)), None)
        if j is not None:
            unmatched.remove(j)
            found += 1
    return "hold them in other rows: the collate function reorders the batch" if found >= k else None


def _refuse_carried_state(pl_module: LightningModule, run: Any, left: dict[int, dict[str, Any]],
                          results: dict[int, list[torch.Tensor]]) -> None:
    """Refuses the attributes a probe batch left holding its examples that the next step reads: the smallest probe
    batch, run again from the state its first run left in one such attribute, fails or gives another result."""
    if any(n not in left for n in PROBE_SIZES):
        return
    names = set().union(*(left[n] for n in PROBE_SIZES))
    shapes = {name: [[leaf_shape(t) for t in _state_tensors(left[n][name][2])] if name in left[n] else []
                     for n in PROBE_SIZES] for name in names}
    first = PROBE_SIZES[0]
    read = []
    for name, shape, dim in find_carried_state(shapes, PROBE_SIZES):
        try:
            again = [t.detach() for t in tensor_leaves(run(first, carried={name: left[first][name]}))]
        except Exception:  # noqa: BLE001  (the step fails on the state a batch left: it reads it)
            read.append((name, shape, dim))
            continue
        plain = results.get(first, [])
        if len(again) != len(plain) or not all(
                a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7, equal_nan=True)
                for a, b in zip(again, plain)):
            read.append((name, shape, dim))
    if read:
        raise MisconfigurationException("DPSGD cannot clip per example: " + describe_carried_state(
            type(pl_module).__name__, read, first))


def examples_in(batch: Any, dims: list[int | None]) -> int | None:
    """The number of examples in a training batch, read where the probe found the batch dimension (None: not found
    or the batch's structure differs from the probe's)."""
    leaves = batch_leaves(batch)
    if len(leaves) == len(dims):
        for leaf, d in zip(leaves, dims):
            shape = leaf_shape(leaf)
            if d is not None and len(shape) > d:
                return int(shape[d])
    return None
