"""OneRunAudit: an empirical epsilon lower bound measured in the same run that DPSGD accounts.

Thin Lightning shell around :mod:`lightning_dp.audit.canaries` (the canaries) and
:mod:`lightning_dp.audit.one_run` (the bounds); see docs/audit.md.

    >>> from lightning_dp.callbacks import DPSGD, OneRunAudit
    >>> callbacks = [DPSGD(target_epsilon=8.0, epochs=10), OneRunAudit(num_canaries=1000, num_classes=10)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from lightning_dp.audit.canaries import (
    CANARY_KINDS,
    CanaryDataset,
    DiracCanaries,
    DropAbsent,
    draw_inclusions,
    make_input_canaries,
)
from lightning_dp.audit.one_run import METHODS, AccountedFamily, OneRunResult, check_methods, one_run_audit
from lightning_dp.callbacks.dp_sgd import DPSGD
from lightning_dp.privacy.sampling import with_dataset
from lightning_dp.privacy.seeds import SECRET_KEY, check_seed, fresh_seed

__all__ = ["OneRunAudit"]

# metric names per method: the bound and, beside it, its ceiling (the largest value the audit can report)
_BOUND_NAMES = {"steinke": "audit/epsilon_lower_bound", "fdp_accounted": "audit/epsilon_lower_bound_fdp",
                "fdp_gaussian": "audit/epsilon_lower_bound_gdp"}
_CEILING_NAMES = {"steinke": "audit/epsilon_ceiling", "fdp_accounted": "audit/epsilon_ceiling_fdp",
                  "fdp_gaussian": "audit/epsilon_ceiling_gdp"}


class OneRunAudit(Callback):
    """Audits a :class:`~lightning_dp.callbacks.DPSGD` run from the inside (Steinke, Nasr & Jagielski 2023).

    Before training, ``num_canaries`` canaries are drawn and each is included with probability 1/2 (input
    canaries as extra slots of the training set, gradient canaries in the clipped sums; see
    :mod:`lightning_dp.audit.canaries`). At the end of training every canary is scored (black-box: ``-loss``
    of the final model; white-box: the released gradients at its coordinate), the top and bottom scores are
    guessed included and excluded, and the correct guesses give epsilon lower bounds at ``confidence``. They
    are logged beside ``privacy/epsilon`` in the same run:

    * ``audit/epsilon_lower_bound``: Steinke et al.'s (epsilon, delta) bound at DPSGD's ``target_delta``;
    * ``audit/epsilon_lower_bound_fdp``: the f-DP bound of Mahloujifar, Melis & Chaudhuri 2024 against the
      run's own accounted mechanism (its noise scaled down until the guesses reject it);
    * ``audit/epsilon_lower_bound_gdp``: the f-DP bound against mu-GDP;
    * ``audit/epsilon_ceiling``, ``audit/epsilon_ceiling_fdp``, ``audit/epsilon_ceiling_gdp``: the largest value
      each bound can take with these ``num_canaries`` (every guess correct,
      :func:`~lightning_dp.audit.one_run.epsilon_ceiling`): the audit's power;
    * ``audit/claim_refuted``: 1 when a bound refutes the accounted epsilon (Steinke et al.'s above it, or the f-DP
      test rejecting the accounted curve itself);
    * ``audit/claim_above_ceiling``: 1 when the accounted epsilon is at or above the ceiling of every method that
      can refute it (``steinke``, ``fdp_accounted``): no outcome of this audit could refute the claim, so "not
      refuted" carries no information (raise ``num_canaries``, or add ``fdp_accounted``);
    * ``audit/epsilon_accounted`` (DPSGD's epsilon), ``audit/canaries``, ``audit/included``,
      ``audit/guesses`` and ``audit/correct_guesses`` of the best candidate, ``audit/canary_auc``;

    with the artifacts ``audit/one_run.tsv`` (every canary's inclusion bit and score), ``audit/one_run.md``
    (every guess candidate's bounds and the ceiling) and ``audit/canary_roc.png``; the end-of-training summary
    prints each bound beside its ceiling. A bound above the accounted epsilon means the run did not deliver its
    guarantee (a warning says so); a bound far below it is expected, above all for black-box audits.

    The canaries are trained on: an audited run is a run for auditing, not the model to ship. The inclusion
    bits are the audit's own secret, drawn from ``seed`` (not DPSGD's): anyone who knows them can read the
    canaries' membership off the model, which is the point of the audit and reveals nothing about real data.

    Args:
        num_canaries: m, the number of canaries (about half are included).
        canary: ``"mislabeled"`` (training inputs with a wrong label), ``"random_inputs"`` (Gaussian inputs
            or random token ids with random labels) or ``"gradient"`` (white-box Dirac gradient canaries).
        num_classes: the number of classes (vocabulary size for token sequences) for input canaries; default
            the module's ``hparams.num_classes``.
        confidence: the probability with which each reported bound holds.
        candidates: ``(k+, k-)`` guess counts (default: 1-50 % of m, see
            :func:`~lightning_dp.audit.one_run.default_guess_candidates`), Bonferroni-corrected.
        methods: which bounds to compute (``steinke``, ``fdp_accounted``, ``fdp_gaussian``).
        seed: the audit's seed (canaries, inclusion bits, gradient-canary sampling). Default: a fresh one,
            saved in checkpoints so that a resumed run keeps its canaries.
        batch_size: batch size for scoring the canaries.
    """

    #: Constructor arguments that are secrets: redacted from configs logged by ``lightning-dp`` (the seed draws the
    #: inclusion bits; a fixed one in the logged config would let the audited run's reader know them in advance).
    SECRET_ARGUMENTS: tuple[str, ...] = ("seed",)

    def __init__(self, *, num_canaries: int = 1000, canary: str = "mislabeled", num_classes: int | None = None,
                 confidence: float = 0.95, candidates: Sequence[Sequence[int]] | None = None,
                 methods: Sequence[str] = METHODS, seed: int | None = None, batch_size: int = 256) -> None:
        if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 2:
            raise ValueError(f"num_canaries={num_canaries!r} must be an integer >= 2 (the paper uses 1000 or more)")
        if canary not in CANARY_KINDS:
            raise ValueError(f"canary={canary!r}: choose one of {list(CANARY_KINDS)}")
        if not 0 < confidence < 1:
            raise ValueError(f"confidence={confidence!r} must be in (0, 1), e.g. 0.95")
        self.candidates: list[tuple[int, int]] | None = None
        if candidates is not None:
            pairs: list[Any] = [tuple(int(k) for k in c) for c in candidates]  # checked to be pairs below
            if not pairs or any(len(p) != 2 or min(p) < 0 or sum(p) == 0 or sum(p) > num_canaries for p in pairs):
                raise ValueError(f"candidates={candidates!r} must be (positives, negatives) pairs of non-negative "
                                 f"counts with 0 < positives + negatives <= num_canaries={num_canaries}")
            self.candidates = pairs
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
        self.num_canaries, self.canary, self.num_classes = num_canaries, canary, num_classes
        self.confidence, self.methods, self.batch_size = float(confidence), check_methods(methods), batch_size
        self._requested_seed = check_seed(seed)
        self._seed: int | None = None
        self._included: np.ndarray | None = None
        self._canaries: list[Any] | None = None
        self._collate: Any = None
        self._gradient: DiracCanaries | None = None
        self._dpsgd: DPSGD | None = None
        self.result: OneRunResult | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(canary=self.canary, num_canaries=self.num_canaries)

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        found = [cb for cb in trainer.callbacks if isinstance(cb, DPSGD)]  # type: ignore[attr-defined]  # undeclared
        if len(found) != 1:
            raise MisconfigurationException(
                f"OneRunAudit audits a DPSGD run; this Trainer has {len(found)} DPSGD callbacks. Add exactly one "
                "lightning_dp.callbacks.DPSGD (or a subclass) beside it.")
        self._dpsgd = found[0]
        if self.canary != "gradient" and self.num_classes is None:
            self.num_classes = getattr(pl_module, "hparams", {}).get("num_classes")
            if self.num_classes is None:
                raise MisconfigurationException(
                    f"OneRunAudit(canary={self.canary!r}) needs num_classes (the vocabulary size for token "
                    f"sequences) and {type(pl_module).__name__} has no hparams.num_classes: pass num_classes=...")
        dp_seed = getattr(self._dpsgd, "_requested_seed", None)
        if self._requested_seed is not None and self._requested_seed == dp_seed:
            raise MisconfigurationException(
                f"OneRunAudit(seed={self._requested_seed}) equals DPSGD's seed: the audit's seed is stored in plain in "
                "checkpoints and logs, and DPSGD's is the secret that regenerates its noise. Give the audit another "
                "seed, or none (a fresh one).")
        if self.canary == "gradient":
            trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            if self.num_canaries > trainable:
                raise MisconfigurationException(
                    f"OneRunAudit(canary='gradient', num_canaries={self.num_canaries}) needs a coordinate per canary but "
                    f"{type(pl_module).__name__} has {trainable} trainable parameters; lower num_canaries.")
        if self._seed is None:
            seed = self._requested_seed if self._requested_seed is not None else fresh_seed()
            self._seed = int(trainer.strategy.broadcast(seed, src=0))
        if self._included is None:
            self._included = draw_inclusions(self.num_canaries, seed=self._seed)
        if self.canary == "gradient" and self._gradient is None:
            self._gradient = DiracCanaries(self._included, seed=self._seed)
        self._dpsgd.attach_audit(self)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = {"audit/canary": self.canary, "audit/num_canaries": self.num_canaries,
                  "audit/confidence": self.confidence, "audit/methods": ",".join(self.methods),
                  "audit/mechanism": type(self._dpsgd).__name__}
        for logger in trainer.loggers:
            logger.log_hyperparams(params)

    # ------------------------------------------------------- hooks called by DPSGD
    def transform_loader(self, loader: Any) -> Any:
        """The training loader with the canary slots appended (input canaries); unchanged for gradient canaries."""
        if self.canary == "gradient":
            return loader
        if not isinstance(loader, DataLoader):
            raise MisconfigurationException(f"OneRunAudit needs a torch DataLoader for training, got "
                                            f"{type(loader).__name__}")
        base = loader.dataset
        if isinstance(base, CanaryDataset):
            return loader
        assert self._seed is not None and self._included is not None  # drawn in setup()
        if self._canaries is None:
            try:
                self._canaries = make_input_canaries(base, self.num_canaries, kind=self.canary,
                                                     num_classes=self.num_classes, seed=self._seed)
            except ValueError as err:
                raise MisconfigurationException(f"OneRunAudit: {err}") from None
        self._collate = loader.collate_fn
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            rank_zero_warn(f"DPSGD replaces the training DataLoader's {type(loader.sampler).__name__} by Poisson "
                           "sampling (every example and canary slot enters every batch with probability q); its own "
                           "sampling is not used.")
        dataset = CanaryDataset(base, self._canaries, self._included)
        # DPSGD replaces the sampler by Poisson sampling over all N + m slots; the batch size sets q
        return with_dataset(loader, dataset, collate_fn=DropAbsent(loader.collate_fn, dataset))

    def add_to_sums(self, sums: list[torch.Tensor], *, step: int, sample_rate: float, max_grad_norm: float) -> None:
        if self._gradient is not None:
            self._gradient.add_to_sums(sums, step=step, sample_rate=sample_rate, max_grad_norm=max_grad_norm)

    def observe(self, grads: list[torch.Tensor]) -> None:
        if self._gradient is not None:
            self._gradient.observe(grads)

    # ------------------------------------------------------------------ the audit
    def scores(self, pl_module: LightningModule) -> np.ndarray:
        """Every canary's membership score under the current model (higher = guessed included)."""
        if self._gradient is not None:
            return self._gradient.scores.copy()
        if self._canaries is None:
            raise RuntimeError("no canaries were made: the audit did not see the training data")
        from lightning_dp.audit.scores import loss_scores

        # a list of items is a map-style dataset to DataLoader, though torch annotates Dataset
        loader: DataLoader = DataLoader(self._canaries, batch_size=self.batch_size, shuffle=False,  # type: ignore[arg-type]
                                        collate_fn=self._collate)
        return loss_scores(pl_module, loader)

    @property
    def extra_training_slots(self) -> int:
        """Slots this audit appends to the training set (DPSGD plans q = B / (N + slots) with them)."""
        return 0 if self.canary == "gradient" else self.num_canaries

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dpsgd = self._dpsgd
        if dpsgd is None or self._included is None or not dpsgd.accountant.history or not trainer.is_global_zero:
            return  # the scores and bounds are the same on every rank: computed and logged on rank zero
        scores = self.scores(pl_module)
        family = None
        if "fdp_accounted" in self.methods:
            family = AccountedFamily(dpsgd.accountant.history)
        self.result = result = one_run_audit(scores, self._included, delta=dpsgd.target_delta,
                                             confidence=self.confidence, candidates=self.candidates,
                                             methods=self.methods, accounted=family)
        accounted = dpsgd.epsilon
        self._report(trainer, scores, result, accounted)

    def _report(self, trainer: Trainer, scores: np.ndarray, result: OneRunResult, accounted: float) -> None:
        from lightning_dp import tracking
        from lightning_dp.audit.statistics import roc

        inc = self._included
        assert inc is not None
        metrics = {_BOUND_NAMES[m]: float(result.epsilon[m]) for m in result.epsilon}
        ceiling = result.ceiling
        assert ceiling is not None  # one_run_audit always computes it
        metrics.update({_CEILING_NAMES[m]: float(ceiling.epsilon[m]) for m in ceiling.epsilon})
        first = result.best[self.methods[0]]
        metrics.update({"audit/epsilon_accounted": float(accounted), "audit/canaries": float(result.canaries),
                        "audit/included": float(result.included), "audit/guesses": float(first.guesses),
                        "audit/correct_guesses": float(first.correct), "audit/confidence": self.confidence})
        curve = None
        if 0 < inc.sum() < inc.size:
            curve = roc(scores[inc], scores[~inc])
            metrics["audit/canary_auc"] = curve.auc
        refuted = self._refutations(result, accounted)
        above = ceiling.claim_above(accounted)
        metrics["audit/claim_refuted"] = float(bool(refuted))
        # no refuting method computed (mu-GDP alone) is the same situation: the audit cannot refute anything
        metrics["audit/claim_above_ceiling"] = float(all(above.values()))
        self._summary(trainer, result, accounted, refuted, above)
        if refuted:
            rank_zero_warn(
                "OneRunAudit: " + "; ".join(refuted) + ". This run did not deliver its privacy guarantee (noise "
                "missing or too small, gradients that bypass clipping, or an accounting error), unless a chance event "
                f"of probability at most {len(refuted)} x (1 - confidence) = {len(refuted) * (1 - self.confidence):.3g} "
                "happened. Investigate before trusting the reported epsilon.")
        if not trainer.is_global_zero:
            return
        step = max(trainer.global_step - 1, 0)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        rows = ["canary\tincluded\tscore"] + [f"{i}\t{int(b)}\t{s:.9g}" for i, (b, s) in enumerate(zip(inc, scores))]
        tracking.log_text(trainer, "\n".join(rows) + "\n", "audit/one_run.tsv")
        header = (f"# One-run audit\n\n{self.canary} canaries: {result.canaries} ({result.included} included); "
                  f"delta {result.delta:g}; confidence {result.confidence}; accounted epsilon {accounted:.4f}\n\n")
        if all(above.values()):
            header += ("The accounted epsilon is above the ceiling of every method that can refute it (the last row: "
                       "every guess correct): this audit could not refute the claim, and \"not refuted\" carries no "
                       "information.\n\n")
        tracking.log_text(trainer, header + result.table() + "\n", "audit/one_run.md")
        if curve is not None and tracking.mlflow_loggers(trainer):
            from lightning_dp.audit.plots import roc_figure

            tracking.log_figure(trainer, roc_figure({"canaries": curve}, title=f"one-run audit, AUC {curve.auc:.3f}"),
                                "audit/canary_roc.png")

    def _summary(self, trainer: Trainer, result: OneRunResult, accounted: float, refuted: list[str],
                 above: dict[str, bool]) -> None:
        """The end-of-training summary: every bound beside its ceiling, then what the audit says about the claim."""
        from lightning_dp.callbacks.summary import print_summary

        ceiling = result.ceiling
        assert ceiling is not None
        rows = []
        for name, bound in result.epsilon.items():
            note = ""
            if name in above:
                note = "; the claim is above it" if above[name] else "; the claim is below it"
            rows.append((name, f"{bound:.3f} (ceiling {ceiling.epsilon[name]:.3f} with {result.canaries} "
                               f"canaries{note})"))
        rows.append(("accounted epsilon", f"{accounted:.3f} at delta {result.delta:g}"))
        if refuted:
            verdict = "REFUTED: " + "; ".join(refuted)
        elif not above:
            verdict = ("not refuted, which carries no information: the mu-GDP bound alone refutes no claim (add "
                       "'steinke' or 'fdp_accounted' to methods)")
        elif all(above.values()):
            reach = ", ".join(f"{m} {ceiling.epsilon[m]:.3f}" for m in above)
            verdict = (f"not refuted, which carries no information: the claim {accounted:.3f} is above what this "
                       f"audit can refute (ceilings: {reach}); with {result.canaries} canaries no outcome, not even "
                       "every guess correct, could refute it. More canaries raise the f-DP ceiling (Steinke et al.'s "
                       "only while 2 m delta stays small; docs/audit.md).")
        else:
            verdict = ("not refuted (within reach of " + ", ".join(m for m, out in above.items() if not out)
                       + ": a perfect attack could have refuted it)")
        rows.append(("claim", verdict))
        print_summary(trainer, f"OneRunAudit: {self.canary} canaries, {result.included}/{result.canaries} included, "
                      f"epsilon lower bounds at {self.confidence:.0%} confidence", rows)

    @staticmethod
    def _refutations(result: OneRunResult, accounted: float) -> list[str]:
        """The tests that refute the run's claim: Steinke et al.'s strict (eps, delta) bound above the accounted
        epsilon, or the f-DP test rejecting the accounted curve itself (scale 1 or above). The mu-GDP bound is
        not a strict (eps, delta) statement and refutes nothing on its own."""
        out = []
        if "steinke" in result.epsilon and math.isfinite(accounted) and result.epsilon["steinke"] > accounted:
            out.append(f"the (eps, delta) lower bound {result.epsilon['steinke']:.3f} exceeds the accounted epsilon "
                       f"{accounted:.3f}")
        scales = [v for k, v in result.params.items() if k.startswith("fdp_accounted/") and v is not None]
        if scales and min(scales) <= 1.0:
            out.append(f"the f-DP test rejects the accounted mechanism itself (every curve down to noise x "
                       f"{min(scales):.3g} of the claimed)")
        return out

    def privacy_spend(self) -> list[Any]:
        """Nothing of its own: the audited DPSGD accounts the canary slots with the training data
        (:mod:`lightning_dp.privacy.spend`)."""
        return []

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        # the seed draws the inclusion bits and the canaries' sampling coins: local checkpoints only
        return {SECRET_KEY: {"seed": self._seed},
                "included": None if self._included is None else self._included.tolist(),
                "gradient": None if self._gradient is None else self._gradient.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        seed = state_dict.get(SECRET_KEY, {}).get("seed", state_dict.get("seed"))  # "seed": before issue 24
        if seed is not None:
            self._seed = int(seed)
        if state_dict.get("included") is not None:
            self._included = np.asarray(state_dict["included"], dtype=bool)
        if state_dict.get("gradient") is not None and self._included is not None and self._seed is not None:
            self._gradient = DiracCanaries(self._included, seed=self._seed)
            self._gradient.load_state_dict(state_dict["gradient"])

