"""Membership attacks of ``lightning-dp audit mia``: one registered class each, producing a score per example.

An attack gets the target and the split (:class:`AttackSetting`) and returns the members' and non-members' scores
with their cost (:class:`AttackScores`). Registered, in the order they run: ``loss``, ``shadow`` (LiRA), ``noisy``
(noisy neighbours). Adding one with :func:`register_attack`: docs/architecture.md, "Extension points".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_dp.privacy.registry import Registry

__all__ = ["AttackScores", "AttackSetting", "MembershipAttack", "register_attack", "registered_attacks",
           "resolve_attacks"]

#: Streams of :func:`~lightning_dp.privacy.noise.derive_generator` under the experiment's seed (the command's too).
INIT_STREAM, DATA_STREAM, NOISE_STREAM, SUBSET_STREAM, SHUFFLE_STREAM = 51, 52, 53, 54, 55


@dataclass(frozen=True)
class AttackSetting:
    """What an attack sees: the trained target, the pool and its split, and the command's settings."""

    target: Any  #: the trained target LightningModule
    pool: Any  #: the pooled dataset
    split: Any  #: :class:`~lightning_dp.audit.mia.MemberSplit` of the pool
    evaluation: Any  #: the evaluated examples: the evaluation members, then the evaluation non-members
    target_losses: np.ndarray  #: the target's loss on every evaluated example
    loss_seconds: float  #: what computing ``target_losses`` took
    config: Any  #: the parsed command (``num_shadows``, ``num_neighbours``, ``batch_size``, ``seed``, ...)
    statistic: str  #: the shadow statistic, resolved ("logit" or "loss")
    seeded: Callable[..., int]  #: ``seeded(stream, k=0)``: a seed derived from the experiment's
    make_model: Callable[[], Any]  #: a fresh, untrained model of the target's config (shadow models)
    trainer_kwargs: Callable[[], dict[str, Any]]  #: Trainer arguments with fresh callbacks

    def batches(self, indices: np.ndarray) -> Any:
        """A DataLoader over the pool's ``indices``, in order."""
        from torch.utils.data import DataLoader, Subset

        return DataLoader(Subset(self.pool, indices.tolist()), batch_size=self.config.batch_size, shuffle=False)


@dataclass
class AttackScores:
    """The scores of the evaluation members and non-members (higher: member) and what they cost."""

    members: np.ndarray
    nonmembers: np.ndarray
    forward_passes: int
    seconds: float
    note: str  #: how the command names the attack's line (``"loss attack"``)
    metrics: dict[str, float] = field(default_factory=dict)  #: further costs to log (``audit/cost/...``)
    search: Any = None  #: a tuning search the command plots (noisy neighbours' sigma)


class MembershipAttack:
    """A membership attack: scores from the target and the examples."""

    name = "attack"

    @staticmethod
    def problems(config: Any) -> list[str]:
        """Why the command's settings do not suit this attack (empty: they do)."""
        return []

    def run(self, setting: AttackSetting) -> AttackScores:
        raise NotImplementedError


_ATTACKS: Registry[type[MembershipAttack]] = Registry("membership attack", base=MembershipAttack, argument="--attacks")


def register_attack(name: str) -> Callable[[type[MembershipAttack]], type[MembershipAttack]]:
    """Class decorator: ``--attacks`` may name the attack."""
    def decorate(cls: type[MembershipAttack]) -> type[MembershipAttack]:
        _ATTACKS.register(name, cls)
        cls.name = name
        return cls
    return decorate


def registered_attacks() -> dict[str, type[MembershipAttack]]:
    """``{name: class}``, in the order the attacks run."""
    return dict(_ATTACKS)


def resolve_attacks(names: list[str]) -> list[MembershipAttack]:
    """The named attacks: the registered ones in registration order, then those named by class path
    (``my_module.Confidence``, a :class:`MembershipAttack` subclass that need not be registered) in the order given;
    an attack named by class path is called by that path (its metrics: ``audit/auc/my_module.Confidence``).

    Raises:
        ValueError: no name, a name that is not registered (with the closest registered one), or a class path that
            does not name a MembershipAttack.
    """
    if not names:
        raise ValueError(f"--attacks={names!r}: choose at least one of {list(_ATTACKS)}")
    chosen: dict[type[MembershipAttack], str] = {}  # class -> the first name that chose it, in the order given
    for name in names:
        chosen.setdefault(_ATTACKS.resolve(name), name)
    attacks = [cls() for cls in _ATTACKS.values() if cls in chosen]  # a registered class keeps its registered name
    for cls, path in chosen.items():
        if cls not in _ATTACKS.values():
            attack = cls()
            attack.name = path
            attacks.append(attack)
    return attacks


@register_attack("loss")
class LossAttack(MembershipAttack):
    """``-loss`` under the target (Yeom et al. 2018; :mod:`lightning_dp.audit.scores`)."""

    def run(self, setting: AttackSetting) -> AttackScores:
        n = setting.split.members.size
        losses = setting.target_losses
        return AttackScores(-losses[:n], -losses[n:], forward_passes=len(setting.evaluation),
                            seconds=setting.loss_seconds, note="loss attack")


@register_attack("shadow")
class ShadowAttack(MembershipAttack):
    """LiRA (Carlini et al. 2022; :mod:`lightning_dp.audit.lira`): ``num_shadows`` models trained by the same
    Lightning code on random halves of the pool (each example IN for half of them), online likelihood ratio with a
    fixed variance."""

    @staticmethod
    def problems(config: Any) -> list[str]:
        if config.num_shadows < 2 or config.num_shadows % 2:
            return [f"--num_shadows={config.num_shadows}: must be even and >= 2 (each example is IN for half)"]
        return []

    def run(self, setting: AttackSetting) -> AttackScores:
        from lightning_dp.audit import lira

        cfg, split, pool = setting.config, setting.split, setting.pool
        masks = lira.inclusion_masks(len(pool), cfg.num_shadows, seed=setting.seeded(DATA_STREAM, 1))
        shadows = lira.train_shadow_models(setting.make_model, pool, masks,
                                           trainer_kwargs=lambda k: setting.trainer_kwargs(),
                                           batch_size=cfg.batch_size, seed=setting.seeded(INIT_STREAM, 1),
                                           score_dataset=setting.evaluation)
        scores = lira.lira_from_losses(setting.target_losses, shadows.losses, masks[:, split.evaluation],
                                       statistic=setting.statistic, online=cfg.shadow_online, fixed_variance=True)
        n = split.members.size
        return AttackScores(scores[:n], scores[n:], forward_passes=shadows.forward_passes + len(setting.evaluation),
                            seconds=shadows.seconds + setting.loss_seconds,
                            note=f"shadow attack ({cfg.num_shadows} shadows, {shadows.seconds:.0f} s)",
                            metrics={"audit/cost/training_forward_passes/shadow": float(shadows.training_passes)})


@register_attack("noisy")
class NoisyNeighbours(MembershipAttack):
    """Noisy neighbours (thesis ch. 4; :mod:`lightning_dp.audit.neighbours`): ``num_neighbours`` neighbours made by
    Gaussian noise at the output of the embedding layer; sigma found on the calibration split by a bracketing
    search on the AUC."""

    def run(self, setting: AttackSetting) -> AttackScores:
        from torch.utils.data import DataLoader

        from lightning_dp.audit import neighbours
        from lightning_dp.privacy.noise import derive_generator

        cfg, split, target = setting.config, setting.split, setting.target
        embedding = neighbours.find_embedding(target, cfg.embedding)
        search = neighbours.search_sigma(target, setting.batches(split.calibration_members),
                                         setting.batches(split.calibration_nonmembers),
                                         num_neighbours=cfg.num_neighbours,
                                         generator_seed=setting.seeded(NOISE_STREAM),
                                         low=cfg.sigma_low, high=cfg.sigma_high, grid=cfg.sigma_grid,
                                         iterations=cfg.sigma_iterations, embedding=embedding)
        start = time.perf_counter()
        near = neighbours.neighbour_losses(target, DataLoader(setting.evaluation, batch_size=cfg.batch_size),
                                           sigma=search.sigma, num_neighbours=cfg.num_neighbours,
                                           generator=derive_generator(cfg.seed, NOISE_STREAM, 1),
                                           embedding=embedding)
        n = split.members.size
        return AttackScores(near.scores[:n], near.scores[n:],
                            forward_passes=near.forward_passes + search.forward_passes,
                            seconds=time.perf_counter() - start + search.seconds,
                            note=f"noisy neighbours (sigma {search.sigma:.4g} from {len(search.evaluated)} searched)",
                            search=search)
