"""Client update: what a client computes from its starting model on its own data."""

from __future__ import annotations

import math
from typing import Any, Literal

from torch import Tensor

from lightning_dp.federated.local import local_sgd, local_sgd_loop
from lightning_dp.federated.parts.registry import Part, register_part

__all__ = ["AUTO_VMAP_MAX_PARAMETERS", "ClientUpdate", "LocalSGD", "auto_engine"]

#: models with more parameters than this train their clients one by one ("auto" engine):
#: vmap over clients turns convolutions into grouped ones, slower than a loop on CPU
#: (benchmarks/bench_federated_round.py: 30x faster for 11 parameters, 4x slower for 1.4 M).
AUTO_VMAP_MAX_PARAMETERS = 100_000


def auto_engine(numel: int) -> str:
    """``"vmap"`` over clients for a model of at most :data:`AUTO_VMAP_MAX_PARAMETERS` parameters, else ``"loop"``."""
    return "vmap" if numel <= AUTO_VMAP_MAX_PARAMETERS else "loop"


class ClientUpdate(Part):
    """Trains the round's clients from their starting models."""

    def train(self, template, spec, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *, loss: str,
              shuffles: Any) -> Tensor:
        """``(m, P)`` trained parameter vectors of the m clients (padded data ``x``, ``y``, ``mask``)."""
        raise NotImplementedError


@register_part("update", "local_sgd")
class LocalSGD(ClientUpdate):
    """E epochs of mini-batch SGD (rate s, batch B_s) per client, all clients at once (``"vmap"``) or one by one.

    Args:
        epochs: E.
        lr: s.
        batch_size: B_s.
        engine: ``"vmap"``, ``"loop"`` or ``"auto"`` (vmap up to :data:`AUTO_VMAP_MAX_PARAMETERS` parameters).
    """

    def __init__(self, epochs: int = 1, lr: float = 0.1, batch_size: int = 10,
                 engine: Literal["auto", "vmap", "loop"] = "auto") -> None:
        for name, value in (("local_epochs", epochs), ("local_batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: pass a positive integer")
        if not (float(lr) > 0 and math.isfinite(float(lr))):
            raise ValueError(f"local_lr={lr!r} is not allowed: pass a finite learning rate > 0")
        if engine not in ("auto", "vmap", "loop"):
            raise ValueError(f"client_engine={engine!r} is not allowed; choose 'auto', 'vmap' or 'loop'")
        self.epochs, self.lr, self.batch_size, self.engine = epochs, float(lr), batch_size, engine

    def hparams(self) -> dict[str, Any]:
        return {"local_epochs": self.epochs, "local_lr": self.lr, "local_batch_size": self.batch_size,
                "client_engine": self.engine}

    def resolved_engine(self, numel: int) -> str:
        return auto_engine(numel) if self.engine == "auto" else self.engine

    def train(self, template, spec, start, x, y, mask, *, loss, shuffles):
        fn = local_sgd if self.resolved_engine(spec.numel) == "vmap" else local_sgd_loop
        return fn(template, spec, start, x, y, mask, epochs=self.epochs, lr=self.lr, batch_size=self.batch_size,
                  loss=loss, generator=shuffles)
