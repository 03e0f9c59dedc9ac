"""Which dimension of a tensor indexes the examples of a batch: established, never assumed.

Shapes of one batch cannot tell a sequence-first ``(T, B, d)`` input with ``T == B`` from a batch-first one.
:func:`batch_dim` runs the same code on batches of :data:`PROBE_SIZES` and takes the dimension whose size
equals the number of examples in EVERY probe. Why, and why not autograd provenance: docs/privacy.md, "The
per-sample gradient engine".
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["PROBE_SIZES", "AmbiguousBatchDimError", "batch_dim", "batch_leaves", "leaf_shape", "map_batch_leaves",
           "split_batch", "tensor_leaves"]

#: Numbers of examples of the probe batches. Distinct and not 1 (a dimension of size 1 is
#: a broadcast dimension as often as a batch of one).
PROBE_SIZES: tuple[int, ...] = (3, 5, 7)


class AmbiguousBatchDimError(ValueError):
    """Several dimensions of one tensor follow the number of examples (e.g. a (B, B) matrix)."""


def batch_dim(shapes: Sequence[Sequence[int]], sizes: Sequence[int] = PROBE_SIZES) -> int | None:
    """The dimension that follows the number of examples across probe runs, or None.

    Args:
        shapes: the shape of the same tensor (same layer, call and argument) in each probe
            run, in the order of ``sizes``.
        sizes: the number of examples of each probe run.

    Returns:
        The dimension whose size equals the number of examples in every probe, or None when
        no dimension does (the tensor does not depend on the batch, such as
        ``torch.arange(T)``, or it folds the batch into another dimension, as
        ``(B * T, d)`` does) or the rank changed between probes.

    Raises:
        AmbiguousBatchDimError: If two or more dimensions follow the number of examples.

    Example:
        >>> batch_dim([(10, 3, 4), (10, 5, 4), (10, 7, 4)], (3, 5, 7))  # sequence-first (T, B, d)
        1
        >>> batch_dim([(10,), (10,), (10,)], (3, 5, 7)) is None  # torch.arange(T)
        True
    """
    if len(shapes) != len(sizes) or len(sizes) < 2:
        raise ValueError(f"need one shape per probe size and at least two probes, got {len(shapes)} shapes "
                         f"for sizes {tuple(sizes)}")
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1:
        return None
    dims = [d for d in range(ranks.pop()) if all(s[d] == n for s, n in zip(shapes, sizes))]
    if len(dims) > 1:
        raise AmbiguousBatchDimError(
            f"dimensions {dims} all follow the number of examples (shapes {[tuple(s) for s in shapes]} for "
            f"{tuple(sizes)} examples): a tensor indexed twice by examples relates examples to each other")
    return dims[0] if dims else None


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in a fixed order: mappings (dicts, Hugging Face ``BatchEncoding``),
    sequences, named tuples and dataclasses.

    Example:
        >>> [t.shape for t in tensor_leaves({"x": torch.zeros(2, 3), "y": [torch.zeros(2)], "id": "a"})]
        [torch.Size([2, 3]), torch.Size([2])]
    """
    return [leaf for leaf in batch_leaves(obj) if isinstance(leaf, torch.Tensor)]


def batch_leaves(obj: Any) -> list[Any]:
    """What of a batch can hold the examples: its tensors, and its lists of non-tensors (e.g. strings).

    A list or tuple whose items are not containers (one string per example) is one leaf, seen
    through its length by :func:`leaf_shape`, so that a batch of raw texts still says how many
    examples it holds.
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [leaf for v in obj.values() for leaf in batch_leaves(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [leaf for f in dataclasses.fields(obj) for leaf in batch_leaves(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        if _is_leaf_list(obj):
            return [obj]
        return [leaf for v in obj for leaf in batch_leaves(v)]
    return []


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """A tensor's shape, or ``(len,)`` of a list of non-tensors (see :func:`batch_leaves`)."""
    return tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else (len(leaf),)


def _is_leaf_list(obj: Any) -> bool:
    return bool(obj) and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) or dataclasses.is_dataclass(v)
                                 for v in obj)


def map_batch_leaves(obj: Any, fn: Any) -> Any:
    """``obj`` with every leaf of :func:`batch_leaves` replaced by ``fn(index, leaf)`` (same order), the structure
    (mappings, named tuples, dataclasses, lists and tuples) rebuilt around them.

    Example:
        >>> map_batch_leaves({"x": torch.zeros(2), "id": ["a", "b"]}, lambda i, leaf: i)
        {'x': 0, 'id': 1}
    """
    counter = iter(range(10**12))

    def rebuild(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return fn(next(counter), o)
        if isinstance(o, Mapping):
            items = {k: rebuild(v) for k, v in o.items()}
            mapping: Any = type(o)
            try:
                return mapping(items)  # dict, OrderedDict, Hugging Face BatchEncoding
            except TypeError:
                return items
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            # every field, in batch_leaves' order (init=False ones too); frozen dataclasses included
            rebuilt = copy.copy(o)
            for f in dataclasses.fields(o):
                object.__setattr__(rebuilt, f.name, rebuild(getattr(o, f.name)))
            return rebuilt
        if isinstance(o, (list, tuple)):
            if _is_leaf_list(o):
                return fn(next(counter), o)
            if isinstance(o, tuple) and hasattr(o, "_fields"):
                return type(o)(*(rebuild(v) for v in o))
            return type(o)(rebuild(v) for v in o)
        return o

    return rebuild(obj)


def split_batch(batch: Any, dims: Sequence[int | None], size: int, examples: int) -> list[Any]:
    """``batch`` of ``examples`` examples cut into consecutive chunks of at most ``size`` examples.

    Args:
        batch: the batch (any structure :func:`batch_leaves` reads).
        dims: where each leaf holds the examples, in the order of :func:`batch_leaves`, as
            established by the probe (:func:`batch_dim`); None: the leaf does not hold examples
            (a shared tensor) and every chunk gets it whole.
        size: the most examples of a chunk (a memory bound).
        examples: the number of examples of ``batch``.

    Raises:
        ValueError: If ``dims`` does not match the batch's leaves, or a leaf without an established
            batch dimension has a dimension of size ``examples`` (it may hold the examples in a way
            that cannot be cut, as a flattened ``(B*T,)`` or a ``(B, B)`` mask).

    Example:
        >>> x, ids = torch.arange(10).view(5, 2), ["a", "b", "c", "d", "e"]
        >>> [(c[0].tolist(), c[1]) for c in split_batch((x, ids), [0, 0], 2, 5)][-1]
        ([[8, 9]], ['e'])
    """
    leaves = batch_leaves(batch)
    if len(leaves) != len(dims):
        raise ValueError(f"the batch has {len(leaves)} leaves but {len(dims)} batch dimensions were established")
    for i, (leaf, d) in enumerate(zip(leaves, dims)):
        shape = leaf_shape(leaf)
        if d is None and examples in shape and examples > 1:
            raise ValueError(
                f"leaf {i} of the batch (shape {shape}) has a dimension of size {examples}, the number of examples, but "
                "no dimension of it followed the number of examples in the probe batches, so it cannot be cut into "
                "micro-batches safely")
        if d is not None and (len(shape) <= d or shape[d] != examples):
            raise ValueError(f"leaf {i} of the batch (shape {shape}) does not hold {examples} examples at its "
                             f"established batch dimension {d}")

    def chunk(start: int, stop: int) -> Any:
        def cut(i: int, leaf: Any) -> Any:
            d = dims[i]
            if d is None:
                return leaf
            if isinstance(leaf, torch.Tensor):
                return leaf.narrow(d, start, stop - start)
            return type(leaf)(leaf[start:stop]) if isinstance(leaf, tuple) else leaf[start:stop]
        return map_batch_leaves(batch, cut)

    return [chunk(start, min(start + size, examples)) for start in range(0, examples, size)]
