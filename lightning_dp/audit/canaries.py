"""Canaries for the one-run audit: input canaries in the training data, and gradient canaries in the sum.

Input canaries (``"mislabeled"``, ``"random_inputs"``) are SLOTS appended to the dataset, empty when the audit's
coin says "excluded" (:class:`DropAbsent`), so ``q = B / (N + m)`` does not depend on the coins; gradient
canaries (:class:`DiracCanaries`) enter the clipped sum before the noise. Why this is the add/remove relation:
docs/audit.md, "One-run audit of DP-SGD".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_dp.privacy.noise import derive_generator, derive_secret_generator

__all__ = ["ABSENT", "CANARY_KINDS", "CanaryDataset", "DiracCanaries", "DropAbsent", "draw_inclusions",
           "make_input_canaries"]

#: Stream identifiers of :func:`~lightning_dp.privacy.noise.derive_generator` under the AUDIT's seed.
CANARY_INCLUSION, CANARY_DATA, CANARY_SAMPLING = 31, 32, 33

CANARY_KINDS = ("mislabeled", "random_inputs", "gradient")


class _Absent:
    """The item of an excluded canary's slot (dropped by :class:`DropAbsent`)."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self) -> str:  # one instance across worker processes
        return "ABSENT"


ABSENT = _Absent()


def draw_inclusions(num_canaries: int, *, seed: int) -> np.ndarray:
    """The audit's secret coins: canary ``i`` is included with probability 1/2, independently."""
    if isinstance(num_canaries, bool) or int(num_canaries) != num_canaries or num_canaries < 1:
        raise ValueError(f"num_canaries={num_canaries!r} must be a positive integer")
    generator = derive_generator(seed, CANARY_INCLUSION)
    return (torch.rand(int(num_canaries), generator=generator) < 0.5).numpy()


class CanaryDataset(Dataset):
    """``base`` followed by ``len(canaries)`` slots; slot ``i`` holds ``canaries[i]`` if ``included[i]``."""

    def __init__(self, base: Any, canaries: Sequence[Any], included: Sequence[bool] | np.ndarray) -> None:
        if len(canaries) != len(included):
            raise ValueError(f"{len(canaries)} canaries but {len(included)} inclusion bits")
        self.base, self.canaries = base, list(canaries)
        self.included = np.asarray(included, dtype=bool)
        self.base_size = len(base)

    def __len__(self) -> int:
        return self.base_size + len(self.canaries)

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        if index < self.base_size:
            return self.base[index]
        slot = index - self.base_size
        return self.canaries[slot] if self.included[slot] else ABSENT


class DropAbsent:
    """A collate function that drops empty canary slots; a batch of empty slots only becomes an empty batch
    with the structure of a real one (as :class:`~lightning_dp.privacy.sampling.EmptySafeCollate` does)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], dataset: CanaryDataset) -> None:
        from lightning_dp.privacy.sampling import EmptySafeCollate

        self.collate_fn, self.dataset = collate_fn, dataset
        self._empty_safe = EmptySafeCollate(collate_fn, dataset.base)

    def __call__(self, samples: list[Any]) -> Any:
        return self._empty_safe([s for s in samples if s is not ABSENT])


def _like(value: Any, label: int) -> Any:
    """``label`` in the type of the dataset's labels (a tensor of the same dtype, or a Python int)."""
    if isinstance(value, Tensor):
        return torch.tensor(label, dtype=value.dtype)
    return int(label)


def make_input_canaries(dataset: Any, num_canaries: int, *, kind: str, num_classes: int | None,
                        seed: int) -> list[Any]:
    """``num_canaries`` canary items in the format of ``dataset``'s items (see the module docstring).

    ``dataset`` items are ``(x, y)`` pairs with a tensor ``x`` and an integer label, or one integer tensor of
    token ids (``num_classes`` is then the vocabulary size). Drawn from the audit's own generator.
    """
    if kind not in ("mislabeled", "random_inputs"):
        raise ValueError(f"canary={kind!r} is not an input canary; choose 'mislabeled' or 'random_inputs'")
    if num_classes is None or int(num_classes) < 2:
        raise ValueError(f"num_classes={num_classes!r}: input canaries need the number of classes (>= 2; the "
                         "vocabulary size for token sequences) to draw their labels. Pass num_classes=...")
    n = len(dataset)
    if n == 0:
        raise ValueError("the training dataset is empty")
    g = derive_generator(seed, CANARY_DATA)
    first = dataset[0]
    if isinstance(first, Tensor) and not first.is_floating_point():  # token ids
        if kind == "mislabeled":
            raise ValueError("canary='mislabeled' needs (x, y) examples; for token sequences use 'random_inputs'")
        return [torch.randint(int(num_classes), first.shape, generator=g, dtype=first.dtype)
                for _ in range(num_canaries)]
    if not (isinstance(first, (tuple, list)) and len(first) == 2 and isinstance(first[0], Tensor)):
        raise ValueError(f"input canaries need dataset items (x, y) with a tensor x, or token-id tensors; got "
                         f"{type(first).__name__}. Use canary='gradient' (white-box) for other data.")
    labels = torch.randint(int(num_classes), (num_canaries,), generator=g)
    if kind == "mislabeled":
        sources = torch.randint(n, (num_canaries,), generator=g)
        shifts = torch.randint(1, int(num_classes), (num_canaries,), generator=g)
        out = []
        for src, shift in zip(sources.tolist(), shifts.tolist()):
            x, y = dataset[src]
            out.append((x.clone(), _like(y, (int(y) + shift) % int(num_classes))))
        return out
    sample = torch.stack([dataset[i][0].double() for i in torch.randint(n, (min(n, 256),), generator=g).tolist()])
    mean, std = sample.mean(0), sample.std(0, unbiased=False)
    return [((mean + std * torch.randn(mean.shape, generator=g, dtype=torch.float64)).to(first[0].dtype),
             _like(first[1], int(label))) for label in labels.tolist()]


class DiracCanaries:
    """White-box gradient canaries (module docstring): where they are, when they enter, and their scores.

    The per-step sampling coins of the canaries come from the audit's seed, which the auditor knows: a score
    must not use them (the sum over ALL steps does not). A score that looked only at the steps where a canary
    was sampled would see through the subsampling that epsilon's amplification relies on, and could exceed
    epsilon without any bug.

    Args:
        included: the inclusion bits.
        seed: the audit's seed (coordinates and per-step sampling).
    """

    def __init__(self, included: Sequence[bool] | np.ndarray, *, seed: int) -> None:
        self.included = np.asarray(included, dtype=bool)
        self.seed = int(seed)
        self.coordinates: list[tuple[int, int]] | None = None  # (parameter index, flat index)
        self.shapes: list[tuple[int, ...]] | None = None
        self.scores = np.zeros(self.included.size)
        self.steps = 0
        self._groups: list[tuple[int, Tensor, np.ndarray]] | None = None

    def _place(self, shapes: list[tuple[int, ...]]) -> None:
        sizes = [int(np.prod(s)) for s in shapes]
        total = sum(sizes)
        m = self.included.size
        if m > total:
            raise ValueError(f"{m} gradient canaries need as many coordinates, but the model has {total} trainable "
                             "parameters; lower num_canaries")
        flat = torch.randperm(total, generator=derive_generator(self.seed, CANARY_DATA))[:m].tolist()
        offsets = np.cumsum([0] + sizes)
        params = np.searchsorted(offsets, flat, side="right") - 1
        self.coordinates = [(int(p), int(f - offsets[p])) for p, f in zip(params, flat)]
        self.shapes = shapes
        self._groups = None

    def groups(self) -> list[tuple[int, Tensor, np.ndarray]]:
        """``(parameter index, flat indices, canary ids)`` per parameter holding canaries (vectorized access)."""
        if self._groups is None:
            coords = np.asarray(self.coordinates, dtype=np.int64).reshape(-1, 2)
            self._groups = [(int(p), torch.from_numpy(coords[coords[:, 0] == p, 1].copy()),
                             np.flatnonzero(coords[:, 0] == p)) for p in np.unique(coords[:, 0])]
        return self._groups

    def _check(self, tensors: Sequence[Tensor]) -> None:
        shapes = [tuple(t.shape) for t in tensors]
        if self.shapes is None:
            self._place(shapes)
        elif shapes != self.shapes:
            raise RuntimeError("the trainable parameters changed during an audited run (a layer was frozen or "
                               "unfrozen); gradient canaries are placed once. Audit a run with a fixed set of "
                               "trainable parameters.")

    def add_to_sums(self, sums: Sequence[Tensor], *, step: int, sample_rate: float, max_grad_norm: float) -> None:
        """Adds the step's Poisson-sampled included canaries (``C e_j`` each) to the clipped sums, in place."""
        self._check(sums)
        g = derive_secret_generator(self.seed, CANARY_SAMPLING, step)  # DPSGD accounts these coins: secret
        sampled = (torch.rand(self.included.size, generator=g) < sample_rate).numpy() & self.included
        for p, index, ids in self.groups():
            chosen = index[torch.from_numpy(sampled[ids])].to(sums[p].device)
            if chosen.numel() == 0:
                continue
            target = sums[p]
            flat = target.view(-1) if target.is_contiguous() else target.reshape(-1).clone()
            flat.index_add_(0, chosen, torch.full((chosen.numel(),), float(max_grad_norm), dtype=target.dtype,
                                                  device=target.device))
            if not target.is_contiguous():  # a strided sum: write the flat copy back
                target.copy_(flat.view(target.shape))

    def observe(self, grads: Sequence[Tensor]) -> None:
        """Adds the released mean gradient at every canary's coordinate to its score."""
        self._check(grads)
        for p, index, ids in self.groups():
            self.scores[ids] += grads[p].detach().reshape(-1)[index.to(grads[p].device)].double().cpu().numpy()
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"coordinates": self.coordinates, "shapes": self.shapes, "scores": self.scores.tolist(),
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coordinates = [tuple(c) for c in state["coordinates"]] if state.get("coordinates") else None
        self.shapes = [tuple(s) for s in state["shapes"]] if state.get("shapes") else None
        self.scores = np.asarray(state.get("scores", self.scores), dtype=np.float64)
        self.steps = int(state.get("steps", 0))
        self._groups = None
