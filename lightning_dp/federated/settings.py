"""What a federated round is, fixed when it is built: its settings, checked together, and its k initial hypotheses.

The round (:class:`~lightning_dp.federated.round.FederatedRound`) keeps the user's choices in one frozen
:class:`RoundSettings` instead of a dozen attributes; its parts (selection, update, sanitizer, aggregator, server
privacy) and its mutable state live elsewhere. The checks run in one function, in the order the constructor always ran
them, so that a bad argument is named the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.federated.local import FlatParams, check_loss
from lightning_dp.federated.parts import resolve_part
from lightning_dp.federated.parts.registry import KINDS
from lightning_dp.federated.streams import _INIT
from lightning_dp.privacy.noise import derive_generator
from lightning_dp.privacy.seeds import check_seed

__all__ = ["RoundSettings", "check_combination", "initial_hypotheses", "round_settings"]


@dataclass(frozen=True)
class RoundSettings:
    """The round's settings (the arguments of :class:`~lightning_dp.federated.round.FederatedRound` of the same
    names; ``k`` is ``num_hypotheses``, ``loss_name`` is ``loss``) and the model's flat layout ``spec``."""

    k: int
    warm_start_rounds: int
    loss_name: str
    client_privacy_cap: float | None
    val_clients_per_check: int | None
    test_every_check: bool
    log_nonprivate_metrics: bool
    diagnostics: bool
    spec: FlatParams


def round_settings(model: Any, *, num_hypotheses: int, warm_start_rounds: int, parts: dict[str, Any], loss: str,
                   client_privacy_cap: float | None, val_clients_per_check: int | None, test_every_check: bool,
                   seed: int | None, noise_seed: int | None, log_nonprivate_metrics: bool,
                   diagnostics: bool) -> tuple[RoundSettings, dict[str, Any]]:
    """The checked settings and the resolved parts (``{kind: part or name}`` in :data:`KINDS`' order).

    Raises:
        TypeError: If ``model`` is not a ``torch.nn.Module``.
        ValueError: Naming the first bad argument, its allowed values and the fix.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    k = checks.positive_int("num_hypotheses", num_hypotheses)
    warm = checks.non_negative_int("warm_start_rounds", warm_start_rounds)
    if warm and k == 1:
        raise ValueError(f"warm_start_rounds={warm_start_rounds} needs num_hypotheses > 1 (with one hypothesis "
                         "every client starts from it): pass warm_start_rounds=0, or num_hypotheses >= 2")
    resolved = {kind: resolve_part(kind, parts[kind]) for kind in KINDS}
    check_loss(loss)
    if client_privacy_cap is not None and not float(client_privacy_cap) > 0:
        raise ValueError(f"client_privacy_cap={client_privacy_cap!r} is not allowed: pass a number > 0 or None")
    if client_privacy_cap is not None and not resolved["sanitizer"].accountable:
        raise ValueError("client_privacy_cap needs a sanitizer that charges the clients (e.g. euclidean_laplace "
                         "with noise_multiplier > 0): without sanitization every participation has an infinite "
                         "cost")
    per_check = (None if val_clients_per_check is None
                 else checks.positive_int("val_clients_per_check", val_clients_per_check))
    check_seed(seed)
    check_seed(noise_seed, "noise_seed")
    if seed is not None and seed == noise_seed and any(resolved[kind].accountable
                                                       for kind in ("sanitizer", "server_privacy", "update")):
        raise ValueError(f"noise_seed={noise_seed} equals seed, which is public (logged, and in the uploaded "
                         "checkpoint): anyone with the record could regenerate every noise draw and recompute "
                         "who took part. Pass another noise_seed, or none (a fresh secret one).")
    if diagnostics and not log_nonprivate_metrics:
        raise ValueError("diagnostics=True logs statistics of unsanitized updates and gradients (nonprivate/*): "
                         "it needs log_nonprivate_metrics=True")
    settings = RoundSettings(
        k=k, warm_start_rounds=warm, loss_name=loss,
        client_privacy_cap=None if client_privacy_cap is None else float(client_privacy_cap),
        val_clients_per_check=per_check, test_every_check=bool(test_every_check),
        log_nonprivate_metrics=bool(log_nonprivate_metrics), diagnostics=bool(diagnostics), spec=FlatParams.of(model))
    return settings, resolved


def initial_hypotheses(template: nn.Module, spec: FlatParams, k: int, seed: int) -> Tensor:
    """k independent initializations of the template (its own ``reset_parameters``), hypothesis j from the public
    stream ``(seed, _INIT, j)``."""
    rows = []
    for j in range(k):
        net = copy.deepcopy(template)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(derive_generator(seed, _INIT, j).initial_seed()) % 2**63)
            for mod in net.modules():
                reset = getattr(mod, "reset_parameters", None)
                if callable(reset):
                    reset()
        rows.append(spec.flatten(net))
    return torch.stack(rows)


def check_combination(parts: dict[str, Any], k: int) -> None:
    """Refuse combinations of parts whose privacy claims would not hold, before any client trains: every part
    checks the combination it is in (:meth:`~lightning_dp.federated.parts.Part.problems`), and all the problems
    are reported together."""
    from lightning_dp.federated.parts import Combination

    combination = Combination(parts["selection"], parts["update"], parts["sanitizer"], parts["aggregator"],
                              parts["server_privacy"], k)
    problems = [problem for kind in KINDS for problem in parts[kind].problems(combination)]
    if len(problems) == 1:
        raise MisconfigurationException(problems[0])
    if problems:
        raise MisconfigurationException(f"{len(problems)} problems with these parts:\n  - " + "\n  - ".join(problems))
