"""The batch probe of DPSGD: where every layer and every tensor of a training batch holds the examples.

When training starts (and whenever the set of trainable parameters changes) DPSGD runs ``training_step`` on three
small probe batches (3, 5 and 7 examples of the training set, :data:`~lightning_dp.privacy.batch_dims.PROBE_SIZES`)
through Lightning's own batch path (precision, transfer). Nothing is logged, metric states and the RNGs are
restored, nothing is released. The engine learns each layer's batch dimension; the batch's own tensors tell how many
examples a later batch holds (:func:`examples_in`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_dp.privacy.batch_dims import PROBE_SIZES, AmbiguousBatchDimError, batch_dim, batch_leaves, leaf_shape
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError

__all__ = ["examples_in", "probe", "side_effect_free"]


@contextlib.contextmanager
def side_effect_free(pl_module: LightningModule) -> Iterator[None]:
    """Runs ``training_step`` for the probe without leaving a trace.

    ``self.log``/``log_dict`` do nothing, torchmetrics states are restored afterwards (a ``self.train_acc(preds, y)``
    would otherwise count the probe batches), and the torch, Python and NumPy RNGs (dropout masks, random
    transforms) are restored. Other side effects of ``training_step`` (appending to a list, a call counter) do happen
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
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
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
          training_step: Any) -> list[int | None]:
    """Runs ``training_step`` on the probe batches of ``data`` (``(dataset, collate_fn)``): the engine learns the
    layers' batch dimensions; returns, for every leaf of the batch, the dimension that holds the examples (None:
    ambiguous or absent).

    Raises:
        MisconfigurationException: a layer whose per-sample gradients cannot be computed.
    """
    dataset, collate = data
    size = len(dataset)
    with_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)
    precision = trainer.precision_plugin
    shapes: dict[int, list[tuple[int, ...]]] = {}

    def run(n: int) -> Any:  # the first n examples, through Lightning's own batch path (precision, transfer)
        with side_effect_free(pl_module):
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
