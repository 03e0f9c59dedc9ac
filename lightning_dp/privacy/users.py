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
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import ConcatDataset, Subset

__all__ = ["PRIVACY_UNITS", "Contributions", "bound_contributions", "count_bounded", "user_ids_of"]

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
    return item() if callable(item) and not isinstance(user, (str, bytes)) else user


def _plain_ids(user_ids: Any) -> list[Hashable]:
    return user_ids.tolist() if hasattr(user_ids, "tolist") else [_plain(u) for u in user_ids]


def count_bounded(user_ids: Sequence[Hashable], k: int) -> Contributions:
    """Users, records and the records kept by a bound of ``k`` per user (no randomness: the sizes only)."""
    user_ids = _plain_ids(user_ids)
    counts = Counter(user_ids)
    return Contributions(users=len(counts), records=len(user_ids), kept=sum(min(c, k) for c in counts.values()),
                         largest=max(counts.values(), default=0))


def _user_key(user: Hashable) -> int:
    """A stable 64-bit key of a user id (Python's ``hash`` of a string changes from process to process); a NumPy or
    torch scalar is keyed as the Python number it holds (``np.int64(3)`` and ``3`` are one user, one draw)."""
    return int.from_bytes(hashlib.blake2b(repr(_plain(user)).encode(), digest_size=8).digest(), "little")


def bound_contributions(user_ids: Sequence[Hashable], k: int, *, seed: int) -> list[int]:
    """The indices of the examples kept, sorted: every record of a user with at most ``k``, else ``k`` of them drawn
    uniformly without replacement from a generator of ``(seed, the user's id)`` only.

    Args:
        user_ids: the user of every example.
        k: the most records one user keeps (>= 1).
        seed: the run's secret seed (the selection has its own stream of it).
    """
    by_user: dict[Hashable, list[int]] = defaultdict(list)
    for index, user in enumerate(_plain_ids(user_ids)):
        by_user[user].append(index)
    kept: list[int] = []
    for user, indices in by_user.items():
        if len(indices) <= k:
            kept.extend(indices)
            continue
        rng = np.random.default_rng([int(seed) % 2**64, _SELECTION_STREAM, _user_key(user)])
        kept.extend(indices[int(j)] for j in rng.choice(len(indices), size=k, replace=False))
    return sorted(kept)
