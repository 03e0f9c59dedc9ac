"""``lightning-dp audit mia``: membership inference against a model trained here (loss, shadow/LiRA, noisy neighbours).

Usage: ``lightning-dp audit mia --config examples/audit/mia_lm.yaml`` (``--help`` for the options). The thesis'
experiment (ch. 4): the target is trained on a seeded member split, then attacked by the ``loss``, ``shadow``
and ``noisy`` attacks; one MLflow audit run records their AUC, TPR at low FPR, empirical epsilon, cost and
figures. The split and every recorded name: docs/audit.md, "The membership-inference command".
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from jsonargparse import ActionConfigFile

from lightning_dp.audit.attacks import (
    DATA_STREAM,
    INIT_STREAM,
    SHUFFLE_STREAM,
    SUBSET_STREAM,
    AttackSetting,
    registered_attacks,
    resolve_attacks,
)

if TYPE_CHECKING:
    from lightning_dp.commands.parser import ShortJsonParser

__all__ = ["build_parser", "main"]


def build_parser() -> ShortJsonParser:
    from lightning.pytorch import Callback, LightningDataModule, LightningModule

    from lightning_dp.commands.parser import ShortJsonParser

    parser = ShortJsonParser(prog="lightning-dp audit mia", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config (examples/audit/mia_lm.yaml)")
    parser.add_argument("--model", type=LightningModule, required=True,
                        help="the target (and shadow) LightningModule, class_path/init_args")
    parser.add_argument("--data", type=LightningDataModule, required=True,
                        help="where the examples come from (its pool splits after setup)")
    parser.add_argument("--pool", type=list[str], default=["train", "val", "test"],
                        help="the DataModule's datasets pooled into members and non-members (train, val, test)")
    parser.add_argument("--max_examples", type=Optional[int], default=None,
                        help="use a seeded random subset of the pool of this size (null: all of it)")
    parser.add_argument("--member_fraction", type=float, default=0.6, help="members' share of the pool (thesis: 0.6)")
    parser.add_argument("--calibration_fraction", type=float, default=0.2,
                        help="share of members and of non-members kept as the labelled calibration split")
    parser.add_argument("--trainer", type=dict, default={"max_epochs": 10},
                        help="lightning.Trainer arguments of the target and the shadows (no logger here)")
    parser.add_argument("--callbacks", type=Optional[list[Callback]], default=None,
                        help="callbacks of the target's and every shadow's training (e.g. DPSGD); fresh per model")
    parser.add_argument("--batch_size", type=int, default=32, help="training and scoring batch size")
    parser.add_argument("--attacks", type=list[str], default=list(registered_attacks()),
                        help=f"any of {list(registered_attacks())} (registered attacks, lightning_dp.audit.attacks)")
    parser.add_argument("--num_shadows", type=int, default=10, help="LiRA shadow models (even)")
    parser.add_argument("--shadow_online", type=bool, default=True, help="online LiRA (IN and OUT fits)")
    parser.add_argument("--shadow_statistic", type=str, default="auto",
                        help="logit (classification: logit-scaled confidence), loss (-loss), auto (loss for token "
                             "sequences, logit otherwise)")
    parser.add_argument("--num_neighbours", type=int, default=10, help="noisy neighbours per example")
    parser.add_argument("--embedding", type=Optional[str], default=None,
                        help="dotted name of the layer whose output is perturbed (default: found by name)")
    parser.add_argument("--sigma_low", type=float, default=1e-3, help="lower end of the sigma search")
    parser.add_argument("--sigma_high", type=float, default=10.0, help="upper end of the sigma search")
    parser.add_argument("--sigma_grid", type=int, default=9, help="log-spaced sigmas of the search's first stage")
    parser.add_argument("--sigma_iterations", type=int, default=8, help="golden-section steps of the second stage")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the empirical epsilon")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the models, shadows and neighbours")
    parser.add_argument("--experiment_name", type=str, default="mia", help="MLflow experiment")
    parser.add_argument("--run_name", type=Optional[str], default=None, help="MLflow run name of the audit")
    return parser


def _problems(cfg: Any) -> list[str]:
    problems = []
    try:
        resolve_attacks(cfg.attacks)
    except ValueError as err:
        problems.append(str(err))
    problems += [p for name, attack in registered_attacks().items() if name in cfg.attacks for p in attack.problems(cfg)]
    bad_pool = [p for p in cfg.pool if p not in ("train", "val", "test")]
    if bad_pool or not cfg.pool:
        problems.append(f"--pool={cfg.pool!r}: choose from ['train', 'val', 'test']")
    if cfg.shadow_statistic not in ("auto", "logit", "loss"):
        problems.append(f"--shadow_statistic={cfg.shadow_statistic!r}: choose auto, logit or loss")
    for name in ("num_neighbours", "batch_size", "sigma_grid"):
        if cfg[name] < 1:
            problems.append(f"--{name}={cfg[name]}: must be >= 1")
    if not 0 < cfg.sigma_low < cfg.sigma_high:
        problems.append(f"--sigma_low={cfg.sigma_low} / --sigma_high={cfg.sigma_high}: need 0 < low < high")
    if cfg.max_examples is not None and cfg.max_examples < 10:
        problems.append(f"--max_examples={cfg.max_examples}: must be >= 10 or null (all)")
    return problems


def _pool(datamodule: Any, splits: Sequence[str]):
    from torch.utils.data import ConcatDataset

    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.setup("test")
    parts = []
    for split in splits:
        dataset = getattr(datamodule, f"{split}_dataset", None)
        if dataset is None:
            raise ValueError(f"{type(datamodule).__name__} has no {split}_dataset after setup; pool other splits "
                             "(--pool) or use a DataModule with train_dataset/val_dataset/test_dataset")
        parts.append(dataset)
    return ConcatDataset(parts)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp audit mia``; returns the exit code."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, Subset

    from lightning_dp import tracking
    from lightning_dp.audit import lira
    from lightning_dp.audit.mia import attack_result, split_members, table
    from lightning_dp.audit.scores import per_example_losses
    from lightning_dp.config.threads import announce
    from lightning_dp.privacy.noise import derive_generator

    parser = build_parser()
    cfg, config_text = parser.parse_checked(argv, _problems)
    announce()  # the threads lightning-dp gave torch on a shared machine (lightning_dp.config.threads)

    def seeded(stream: int, k: int = 0) -> int:
        return int(derive_generator(cfg.seed, stream, k).initial_seed()) % 2**63

    with torch.random.fork_rng(devices=[]):  # the target's initialization, from the seed; the caller's RNG is kept
        torch.manual_seed(seeded(INIT_STREAM, 0))
        first = parser.instantiate_classes(cfg)
    try:
        pool = _pool(first.data, cfg.pool)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if cfg.max_examples is not None and cfg.max_examples < len(pool):
        chosen = np.sort(np.random.default_rng(seeded(SUBSET_STREAM)).permutation(len(pool))[:cfg.max_examples])
        pool = Subset(pool, chosen.tolist())
    try:
        split = split_members(len(pool), member_fraction=cfg.member_fraction,
                              calibration_fraction=cfg.calibration_fraction, seed=seeded(DATA_STREAM))
    except ValueError as err:
        parser.error(str(err))
    sample = pool[0]
    tokens = isinstance(sample, torch.Tensor) and not sample.is_floating_point()
    statistic = cfg.shadow_statistic if cfg.shadow_statistic != "auto" else ("loss" if tokens else "logit")
    evaluation = Subset(pool, split.evaluation.tolist())
    n_in = split.members.size
    print(f"[mia] pool {len(pool)} examples: {len(split.training)} members ({split.members.size} evaluated), "
          f"{split.nonmembers.size + split.calibration_nonmembers.size} non-members ({split.nonmembers.size} "
          f"evaluated); attacks {cfg.attacks}", flush=True)

    def trainer_kwargs(callbacks: Any, logger: Any = False) -> dict[str, Any]:
        return {**lira.default_trainer_kwargs(), **dict(cfg.trainer), "logger": logger,
                "callbacks": list(callbacks or [])}

    # ---- the target, logged as its own run
    audit_logger = tracking.MLFlowLogger(experiment_name=cfg.experiment_name, run_name=cfg.run_name, save_dir=None,
                                         local_dir=None)
    target_logger = tracking.MLFlowLogger(experiment_name=cfg.experiment_name,
                                          run_name=f"{cfg.run_name or 'mia'}-target", save_dir=None, local_dir=None)
    status = "failed"
    results = []
    try:
        audit_logger.log_hyperparams({
            "audit/model": type(first.model).__name__, "audit/data": type(first.data).__name__,
            "audit/pool": ",".join(cfg.pool), "audit/pool_size": len(pool), "audit/members": len(split.training),
            "audit/evaluated_members": n_in, "audit/evaluated_nonmembers": split.nonmembers.size,
            "audit/attacks": ",".join(cfg.attacks), "audit/num_shadows": cfg.num_shadows,
            "audit/num_neighbours": cfg.num_neighbours, "audit/shadow_statistic": statistic, "audit/seed": cfg.seed,
            **{f"versions/{k}": v for k, v in tracking.library_versions().items()}})
        audit_run, target_run = audit_logger.run_id, target_logger.run_id
        if audit_run is None or target_run is None:  # only loggers off rank zero have none; this runs in one process
            raise RuntimeError("lightning-dp mia: an MLflow logger has no run id (internal)")
        audit_logger.experiment.log_text(audit_run, config_text, "config.yaml")
        client = audit_logger.experiment
        client.set_tag(audit_run, "audit/target_run_id", target_run)
        client.set_tag(target_run, "audit/audit_run_id", audit_run)

        start = time.perf_counter()
        target = first.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeded(INIT_STREAM, 2))
            loader = DataLoader(Subset(pool, split.training.tolist()), batch_size=cfg.batch_size, shuffle=True,
                                generator=derive_generator(cfg.seed, SHUFFLE_STREAM))
            Trainer(**trainer_kwargs(first.callbacks, target_logger)).fit(target, train_dataloaders=loader)
        target_logger.finalize("success")
        print(f"[mia] target trained in {time.perf_counter() - start:.0f} s", flush=True)

        start = time.perf_counter()
        target_losses = per_example_losses(target, DataLoader(evaluation, batch_size=cfg.batch_size))
        setting = AttackSetting(
            target=target, pool=pool, split=split, evaluation=evaluation, target_losses=target_losses,
            loss_seconds=time.perf_counter() - start, config=cfg, statistic=statistic, seeded=seeded,
            make_model=lambda: parser.instantiate_classes(cfg).model,
            trainer_kwargs=lambda: trainer_kwargs(parser.instantiate_classes(cfg).callbacks))
        search, costs = None, {}
        for attack in resolve_attacks(cfg.attacks):
            scores = attack.run(setting)
            results.append(attack_result(attack.name, scores.members, scores.nonmembers,
                                         forward_passes=scores.forward_passes, seconds=scores.seconds,
                                         confidence=cfg.confidence, seed=cfg.seed))
            search = scores.search if scores.search is not None else search
            costs.update(scores.metrics)
            print(f"[mia] {scores.note}: AUC {results[-1].curve.auc:.4f}", flush=True)

        _log(audit_logger, results, search, split, pool, target_logger.run_id)
        for name, value in costs.items():
            client.log_metric(audit_run, name, value)
        by_name = {r.name: r for r in results}
        training_passes = costs.get("audit/cost/training_forward_passes/shadow")
        if training_passes is not None and "noisy" in by_name:
            client.log_metric(audit_run, "audit/cost/ratio_forward_passes_with_training",
                              (by_name["shadow"].forward_passes + training_passes) / by_name["noisy"].forward_passes)
        status = "success"
    finally:
        audit_logger.finalize(status)
    print(table(results), flush=True)
    uri = tracking.tracking_uri_of(audit_logger)
    print(f"The target model's run: {target_logger.run_id}", flush=True)
    print(tracking.run_locations(audit_logger.run_id, audit_logger.experiment_id, uri, what="MLflow audit run"),
          flush=True)
    return 0


def _log(logger: Any, results: list, search: Any, split: Any, pool: Any, target_run_id: str | None) -> None:
    from lightning_dp.audit.mia import epsilon_vs_fpr_figure, table
    from lightning_dp.audit.plots import auc_curve_figure, roc_figure

    client, run = logger.experiment, logger.run_id
    metrics: dict[str, float] = {}
    for result in results:
        metrics.update(result.metrics())
    by_name = {r.name: r for r in results}
    if "shadow" in by_name and "noisy" in by_name:
        metrics["audit/cost/ratio_forward_passes"] = by_name["shadow"].forward_passes / by_name["noisy"].forward_passes
        metrics["audit/cost/ratio_seconds"] = by_name["shadow"].seconds / max(by_name["noisy"].seconds, 1e-9)
        metrics["audit/auc/noisy_over_shadow"] = by_name["noisy"].curve.auc / by_name["shadow"].curve.auc
    if search is not None:
        metrics["audit/noisy/sigma"] = search.sigma
        for i, (sigma, auc) in enumerate(search.evaluated):
            client.log_metric(run, "audit/noisy/auc_vs_sigma", auc, step=i)
        client.log_text(run, "sigma\tauc\n" + "".join(f"{s:.6g}\t{a:.6f}\n" for s, a in search.evaluated),
                        "audit/auc_vs_sigma.tsv")
        refs = {f"{r.name} attack": r.curve.auc for r in results if r.name != "noisy"}
        client.log_figure(run, auc_curve_figure([s for s, _ in search.evaluated], [a for _, a in search.evaluated],
                                                xlabel="sigma (noise at the embedding output)",
                                                title="noisy neighbours: AUC on the calibration split",
                                                references=refs), "audit/auc_vs_sigma.png")
    for name, value in metrics.items():
        if math.isfinite(value):
            client.log_metric(run, name, value)
    curves = {r.name: r.curve for r in results}
    client.log_figure(run, roc_figure(curves, title="membership inference ROC", log=False), "audit/roc.png")
    client.log_figure(run, roc_figure(curves, title="membership inference ROC (log-log)"), "audit/roc_loglog.png")
    client.log_figure(run, epsilon_vs_fpr_figure(results), "audit/epsilon_vs_fpr.png")
    client.log_text(run, table(results) + "\n", "audit/mia.md")
    rows = ["example\tpool_index\tmember\t" + "\t".join(r.name for r in results)]
    n_in = split.members.size
    for i, index in enumerate(split.evaluation):
        scores = [r.members[i] if i < n_in else r.nonmembers[i - n_in] for r in results]
        rows.append(f"{i}\t{index}\t{int(i < n_in)}\t" + "\t".join(f"{s:.9g}" for s in scores))
    client.log_text(run, "\n".join(rows) + "\n", "audit/scores.tsv")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
