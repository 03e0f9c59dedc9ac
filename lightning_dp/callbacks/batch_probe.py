"""The batch probe of DPSGD: where every layer and every tensor of a training batch holds the examples.

When training starts (and whenever the set of trainable parameters changes) DPSGD runs ``training_step`` on three
small probe batches (3, 5 and 7 examples of the training set, :data:`~lightning_dp.privacy.batch_dims.PROBE_SIZES`)
through Lightning's own batch path (precision, transfer). Nothing is logged, metric states and the RNGs are
restored, nothing is released. The engine learns each layer's batch dimension; the batch's own tensors tell how many
examples a later batch holds (:func:`examples_in`); and the names ``training_step`` passes to ``self.log`` and
``self.log_dict`` are noted as the loggers would receive them (:class:`LoggedNames`), so that DPSGD can refuse every
undeclared one before the first private step (:func:`lightning_dp.gate.check_metric_names`).

What the probe cannot learn: names the module logs in its other hooks (``on_train_batch_end``,
``on_train_epoch_end``, ...), and names ``training_step`` logs only on some batches (``if batch_idx % 100 == 0``
holds for the probe's ``batch_idx=0``; a condition on ``global_step`` or the data may not). Those hooks are not
run by the probe: they act on the outputs of real steps and on state the probe cannot put back (a metric's
``compute`` and ``reset``, an appended list, a scheduler), and they run after a step has trained. The gate refuses
such a name when the loggers first write it (every ``log_every_n_steps`` steps, or at the epoch's end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_dp.privacy.batch_dims import PROBE_SIZES, AmbiguousBatchDimError, batch_dim, batch_leaves, leaf_shape
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError

__all__ = ["LoggedNames", "examples_in", "probe", "side_effect_free"]


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
def side_effect_free(pl_module: LightningModule, logged: LoggedNames | None = None) -> Iterator[None]:
    """Runs ``training_step`` for the probe without leaving a trace.

    ``self.log``/``log_dict`` log nothing (they only note, in ``logged`` when given, the names the loggers would
    receive: :class:`LoggedNames`; no randomness is drawn for it), torchmetrics states are restored afterwards (a
    ``self.train_acc(preds, y)`` would otherwise count the probe batches), and the torch, Python and NumPy RNGs
    (dropout masks, random transforms) are restored. Other side effects of ``training_step`` (appending to a list, a call counter) do happen
    for the probe batches: keep them out of ``training_step`` or tolerate three extra calls.
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
            yield
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


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def probe(engine: GradSampleEngine, trainer: Trainer, pl_module: LightningModule, data: tuple[Any, Any],
          training_step: Any, logged: LoggedNames | None = None) -> list[int | None]:
    """Runs ``training_step`` on the probe batches of ``data`` (``(dataset, collate_fn)``): the engine learns the
    layers' batch dimensions; returns, for every leaf of the batch, the dimension that holds the examples (None:
    ambiguous or absent). ``logged``, when given, receives the metric names ``training_step`` logs
    (:class:`LoggedNames`).

    Raises:
        MisconfigurationException: a layer whose per-sample gradients cannot be computed.
    """
    dataset, collate = data
    size = len(dataset)
    with_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)
    precision = trainer.precision_plugin
    shapes: dict[int, list[tuple[int, ...]]] = {}

    def run(n: int) -> Any:  # the first n examples, through Lightning's own batch path (precision, transfer)
        with side_effect_free(pl_module, logged):
            batch = collate([dataset[i % size] for i in range(n)])
            shapes[n] = [leaf_shape(leaf) for leaf in batch_leaves(batch)]
            batch = precision.convert_input(batch)
            batch = pl_module._on_before_batch_transfer(batch, dataloader_idx=0)
            batch = trainer.strategy.batch_to_device(batch, dataloader_idx=0)
            with precision.train_step_context():
                return training_step(batch, 0) if with_idx else training_step(batch)

    try:
        engine.probe(run, PROBE_SIZES)
    except PerSampleGradientError as err:
        raise MisconfigurationException(f"DPSGD cannot clip per example: {err}") from None
    dims: list[int | None] = []
    if len({len(s) for s in shapes.values()}) == 1:
        for leaf in zip(*(shapes[n] for n in PROBE_SIZES)):
            try:
                dims.append(batch_dim(leaf, PROBE_SIZES))
            except AmbiguousBatchDimError:
                dims.append(None)
    return dims


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
