"""The privacy unit: which user each training example belongs to, and each user's records bounded to ``k``.

A user-level guarantee protects everything one person contributed. DP-SGD with example-level sampling (ELS, Charles
et al. 2025) keeps at most ``k`` records of every user before training, then samples and clips examples as usual;
the accountant states the spend per user (:class:`~lightning_dp.privacy.accounting.PLDAccountant` with
``examples_per_user=k``). Which ``k`` records: all of a user who has at most ``k``; otherwise ``k`` drawn uniformly
without replacement from a generator of the run's secret seed and that user's id alone, so that adding or removing
one user changes no other user's selection (the neighbouring records of two such runs differ only where the
accountant says). The data states the users: a ``user_ids`` attribute of the training dataset (one id per example,
in the dataset's order), found through ``Subset`` and ``ConcatDataset``. docs/privacy.md, "The privacy unit".

Example:
    >>> bound_contributions(["a", "a", "a", "b"], 2, seed=7) in ([0, 1, 3], [0, 2, 3], [1, 2, 3])
    True
    >>> count_bounded(["a", "a", "a", "b"], 2)
    Contributions(users=2, records=4, kept=3, largest=3)
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import ConcatDataset, Subset

__all__ = ["PRIVACY_UNITS", "Contributions", "bound_contributions", "check_collate_keeps_order", "count_bounded",
           "kept_records", "records_by_user", "user_ids_of"]

#: What one neighbouring dataset differs in: one example (record), or every record of one user.
PRIVACY_UNITS = ("example", "user")
_SELECTION_STREAM = 0x55534552  # "USER": the selection's own stream of the secret seed (sampling and noise have theirs)


class Contributions(NamedTuple):
    """How many users and records a training set holds, and how many records the bound keeps (data facts: like N,
    DP-SGD's planning treats them as public; the accountant's ``k`` does not depend on them)."""

    users: int  #: distinct users
    records: int  #: examples before the bound
    kept: int  #: examples after it: sum over users of min(records, k)
    largest: int  #: the most records one user holds


def _ids(values: Any, size: int, where: str) -> list[Hashable]:
    ids = _plain_ids(values)
    if len(ids) != size:
        raise ValueError(f"{where}.user_ids has {len(ids)} entries for {size} examples: it must hold one user id per "
                         "example, in the dataset's order.")
    return ids


def user_ids_of(dataset: Any) -> list[Hashable]:
    """The user of every example of ``dataset``, in its order.

    Raises:
        ValueError: the dataset (or what it wraps) states no users, or states a different number of them.
    """
    ids = getattr(dataset, "user_ids", None)
    if ids is not None:
        return _ids(ids, len(dataset), type(dataset).__name__)
    if isinstance(dataset, Subset):
        parent = user_ids_of(dataset.dataset)
        return [parent[int(i)] for i in dataset.indices]
    if isinstance(dataset, ConcatDataset):
        return [user for part in dataset.datasets for user in user_ids_of(part)]
    raise ValueError(
        f"privacy_unit='user' needs the user of every training example, and the training dataset "
        f"({type(dataset).__name__}) states none. Give it a `user_ids` attribute: one id per example, in the "
        "dataset's order (the writer of each handwritten character, the patient of each hospital stay); a Subset "
        "or ConcatDataset of such datasets is followed. Or train with privacy_unit='example'.")


def _plain(user: Any) -> Hashable:
    """A NumPy or torch scalar as the Python value it holds (``np.int64(3)``, ``tensor(3)`` and ``3``: one user)."""
    item = getattr(user, "item", None)
    if not callable(item) or isinstance(user, (str, bytes)):
        return user
    try:
        return item()
    except (ValueError, RuntimeError):  # an array or tensor of several values: refused by _checked
        return user


_ID_TYPES = (str, bytes, int, float)


def _checked(user: Any) -> Hashable:
    user = _plain(user)
    if isinstance(user, tuple):
        return tuple(_checked(part) for part in user)
    if isinstance(user, bool) or not isinstance(user, _ID_TYPES) or (isinstance(user, float) and user != user):
        raise ValueError(
            f"user id {user!r} ({type(user).__name__}) is not allowed: a user id must be a string, bytes, an integer, "
            "a finite number or a tuple of these (NaN, None and objects that compare by identity would make every "
            "record its own user, and the bound of k records per user would do nothing). Fill missing ids, or drop "
            "those records.")
    return user


def _plain_ids(user_ids: Any) -> list[Hashable]:
    """The ids as checked Python values (:func:`_checked`), all of one type (``"1"`` and ``1`` would be two users)."""
    raw = user_ids.tolist() if hasattr(user_ids, "tolist") else list(user_ids)
    ids = [_checked(u) for u in raw]
    kinds = {type(u) for u in ids}
    if len(kinds - {int, float}) > 1 or (kinds & {int, float} and kinds - {int, float}):
        raise ValueError(f"user ids of several types ({', '.join(sorted(k.__name__ for k in kinds))}): the same person "
                         "under two types (\"1\" and 1) would count as two users with k records each. Give every id "
                         "one type.")
    return ids


def records_by_user(user_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The positions of every user's records, users in the order of their first record (checked ids:
    :func:`_plain_ids`; the one grouping every user-level step uses).

    Example:
        >>> records_by_user(["b", "a", "b"])
        {'b': [0, 2], 'a': [1]}
    """
    by_user: dict[Hashable, list[int]] = defaultdict(list)
    for index, user in enumerate(_plain_ids(user_ids)):
        by_user[user].append(index)
    return dict(by_user)


def count_bounded(user_ids: Sequence[Hashable], k: int) -> Contributions:
    """Users, records and the records kept by a bound of ``k`` per user (no randomness: the sizes only)."""
    counts = [len(records) for records in records_by_user(user_ids).values()]
    return Contributions(users=len(counts), records=sum(counts), kept=sum(min(c, k) for c in counts),
                         largest=max(counts, default=0))


def check_collate_keeps_order(collate_fn: Any, dataset: Any, examples: int = 5) -> None:
    """Refuse a ``collate_fn`` that reorders the samples it is given (a length-bucketing or sorting collate): user
    sampling finds each user's records by their positions in the batch, so a reordered batch would clip parts of
    two users together, and a user could move the sum by more than C.

    Checked on the dataset's first ``examples`` samples given in two orders: every tensor of the batch whose first
    dimension holds them must come back reversed (tensors of other shapes are not judged).

    Raises:
        ValueError: the collate's output does not follow its input's order.
    """
    import torch

    n = min(int(examples), len(dataset))
    if n < 2:
        return
    samples = [dataset[i] for i in range(n)]
    forward, backward = collate_fn(samples), collate_fn(samples[::-1])
    flat_f, flat_b = _leaves(forward), _leaves(backward)
    same_shape = len(flat_f) == len(flat_b) and all(
        not isinstance(a, torch.Tensor) or (isinstance(b, torch.Tensor) and a.shape == b.shape)
        for a, b in zip(flat_f, flat_b))
    followed = same_shape and all(
        torch.equal(b, a.flip(0)) for a, b in zip(flat_f, flat_b)
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n)
    if not followed:
        raise ValueError(
            f"sampling='user' finds each user's records by their positions in the batch, and the training "
            f"DataLoader's collate_fn ({getattr(collate_fn, '__name__', type(collate_fn).__name__)}) does not keep "
            "the order of the samples it receives (given the same samples reversed, its batch is not the reverse). "
            "A sorting or length-bucketing collate would clip parts of two users together. Use a collate that "
            "keeps the order (padding is fine), or sampling='example' (ELS).")


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree, key=repr) for leaf in _leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def _user_key(user: Hashable) -> int:
    """A stable 64-bit key of a user id (Python's ``hash`` of a string changes from process to process); a NumPy or
    torch scalar is keyed as the Python number it holds (``np.int64(3)`` and ``3`` are one user, one draw)."""
    return int.from_bytes(hashlib.blake2b(repr(_plain(user)).encode(), digest_size=8).digest(), "little")


def kept_records(user_ids: Sequence[Hashable], k: int, *, seed: int) -> list[list[int]]:
    """Every user's kept record indices, sorted, users in the order of their first record: all of a user with at most
    ``k`` records, else ``k`` drawn uniformly without replacement from a generator of ``(seed, the user's id)`` only.

    Args:
        user_ids: the user of every example.
        k: the most records one user keeps (>= 1).
        seed: the run's secret seed (the selection has its own stream of it).
    """
    kept: list[list[int]] = []
    for user, indices in records_by_user(user_ids).items():
        if len(indices) > k:
            rng = np.random.default_rng([int(seed) % 2**64, _SELECTION_STREAM, _user_key(user)])
            indices = sorted(indices[int(j)] for j in rng.choice(len(indices), size=k, replace=False))
        kept.append(indices)
    return kept


def bound_contributions(user_ids: Sequence[Hashable], k: int, *, seed: int) -> list[int]:
    """The indices of the examples kept, sorted (:func:`kept_records`, flattened)."""
    return sorted(i for records in kept_records(user_ids, k, seed=seed) for i in records)
