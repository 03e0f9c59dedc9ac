"""``lightning-dp audit``: Deep Leakage from Gradients against a client's sanitized releases, in one MLflow run.

Usage: ``lightning-dp audit --config examples/dlg_digits.yaml`` (``--help`` for the options). Each private image
is released by one client through the ``sanitizer`` at every noise multiplier and attacked with DLG
(:mod:`lightning_dp.audit.dlg`); reconstructions are compared on the pixel scale [0, 1]. The config, the images
and what the run records: docs/audit.md, "The command".
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from jsonargparse import ActionConfigFile
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.audit.dlg_audit import AuditResult, AuditRow, run_dlg_audit
from lightning_dp.audit.sanitizers import SANITIZERS, make_sanitizer_factory

if TYPE_CHECKING:
    from lightning_dp.commands.parser import ShortJsonParser

__all__ = ["build_parser", "input_scale", "load_images", "main"]

DEFAULT_NOISE_MULTIPLIERS = [0.0, 1e-3, 1e-2, 1e-1, 1.0, 3.0, 5.0, 10.0]
#: Stream of :func:`~lightning_dp.privacy.noise.derive_generator` for the model's initialization.
INIT_STREAM = 23


def build_parser() -> ShortJsonParser:
    """The jsonargparse parser of ``lightning-dp audit`` (``model`` and ``data`` as ``class_path``/``init_args``)."""
    from lightning.pytorch import LightningDataModule

    from lightning_dp.commands.parser import ShortJsonParser

    parser = ShortJsonParser(prog="lightning-dp audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML config (examples/dlg_*.yaml)")
    parser.add_argument("--model", type=nn.Module, required=True,
                        help="the audited network (class_path/init_args), e.g. lightning_dp.models.SigmoidLeNet; "
                             "initialized with seed")
    parser.add_argument("--data", type=LightningDataModule, required=True,
                        help="where the private images come from (class_path/init_args), e.g. "
                             "lightning_dp.datamodules.FEMNISTDataModule or lightning_dp.datamodules.DigitsDataModule")
    parser.add_argument("--num_images", type=int, default=4,
                        help="number of private images (federated data: one per validation client)")
    parser.add_argument("--noise_multipliers", type=list[float], default=DEFAULT_NOISE_MULTIPLIERS,
                        help="the audited noise levels nu >= 0 (0: no noise); the metrics' step is the index")
    parser.add_argument("--sanitizer", type=str, default="laplace_per_layer",
                        help="what releases the client's model: " + "; ".join(
                            f"{name}: {doc}" for name, (doc, _) in SANITIZERS.items()))
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="clipping norm C of sanitizer=gaussian")
    parser.add_argument("--min_delta_norm", type=float, default=1e-8,
                        help="calibration floor on the update norm of the laplace sanitizers")
    parser.add_argument("--lr", type=float, default=0.1, help="the client's SGD learning rate (known to the attacker)")
    parser.add_argument("--local_steps", type=int, default=1, help="the client's SGD steps on its image")
    parser.add_argument("--iterations", type=int, default=300, help="L-BFGS steps of the attack (300 in the paper)")
    parser.add_argument("--attack_lr", type=float, default=1.0, help="L-BFGS learning rate of the attack")
    parser.add_argument("--restarts", type=int, default=1,
                        help="attack initializations per release; the lowest gradient-matching loss wins")
    parser.add_argument("--known_label", type=bool, default=False,
                        help="give the attacker the true label (only the image is reconstructed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the noise and the attack")
    parser.add_argument("--input_mean", type=Optional[float], default=None,
                        help="mean the data's inputs were standardized with (None: read it from the DataModule)")
    parser.add_argument("--input_std", type=Optional[float], default=None,
                        help="std the data's inputs were standardized with (None: read it from the DataModule)")
    parser.add_argument("--experiment_name", type=str, default="dlg-audit", help="MLflow experiment")
    parser.add_argument("--run_name", type=Optional[str], default=None, help="MLflow run name")
    return parser


def _settings_problems(cfg: Any) -> list[str]:
    """Every problem of the scalar settings, each with the value, what is allowed and the fix."""
    problems = []

    def real(name: str, low: float, strict: bool, example: str) -> None:
        value = cfg[name]
        ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > low if strict else value >= low)
        if not ok:
            relation = ">" if strict else ">="
            problems.append(f"--{name}={value!r}: must be a finite number {relation} {low:g}; pass e.g. {example}.")

    def need_positive(name: str, example: str) -> None:
        try:
            checks.positive_int(f"--{name}", cfg[name], hint=f"pass e.g. {example}.")
        except ValueError as err:
            problems.append(str(err))

    need_positive("num_images", "--num_images=4")
    need_positive("iterations", "--iterations=300 (the paper)")
    need_positive("restarts", "--restarts=1")
    need_positive("local_steps", "--local_steps=1 (one step: the attacker sees the exact gradient)")
    real("lr", 0.0, True, "--lr=0.1")
    real("attack_lr", 0.0, True, "--attack_lr=1.0")
    real("max_grad_norm", 0.0, True, "--max_grad_norm=1.0")
    real("min_delta_norm", 0.0, False, "--min_delta_norm=1e-8")
    nus = cfg.noise_multipliers
    if not nus or any(not math.isfinite(nu) or nu < 0 for nu in nus):
        problems.append(f"--noise_multipliers={nus!r}: must be a non-empty list of finite numbers >= 0; pass e.g. "
                        f"--noise_multipliers='{DEFAULT_NOISE_MULTIPLIERS}'.")
    elif len(set(nus)) != len(nus):
        problems.append(f"--noise_multipliers={nus!r}: lists a value twice; pass distinct noise levels.")
    if cfg.sanitizer not in SANITIZERS:
        problems.append(f"--sanitizer={cfg.sanitizer!r}: not supported; choose one of {sorted(SANITIZERS)}.")
    if cfg.input_std is not None and not (math.isfinite(cfg.input_std) and cfg.input_std > 0):
        problems.append(f"--input_std={cfg.input_std!r}: must be a finite number > 0, or null to read it from the "
                        "DataModule.")
    if cfg.input_mean is not None and not math.isfinite(cfg.input_mean):
        problems.append(f"--input_mean={cfg.input_mean!r}: must be a finite number, or null.")
    return problems


def load_images(datamodule: Any, num_images: int) -> tuple[Tensor, Tensor, list[str]]:
    """The private images: one per validation client (federated data) or the first validation samples.

    Args:
        datamodule: A :class:`~lightning_dp.datamodules.FederatedDataModule` or any
            LightningDataModule with a ``val_dataloader`` over ``(x, y)`` samples.
        num_images: How many images.

    Returns:
        ``(x, y, sources)``: images ``(num_images, *input_shape)``, labels ``(num_images,)``
        and a description of where each image comes from (``"client <id>, sample 0"``).

    Raises:
        ValueError: If there are fewer than ``num_images`` clients or samples, or the data
            is not a classification data set of image tensors.
    """
    from lightning_dp.datamodules import FederatedDataModule

    owner = type(datamodule).__name__
    datamodule.prepare_data()
    datamodule.setup("fit")
    if isinstance(datamodule, FederatedDataModule):
        if datamodule.task != "classification":
            raise ValueError(f"{owner} is a {datamodule.task} data set; DLG audits classifiers (cross-entropy with "
                             "a soft label). Use a classification DataModule such as lightning_dp.datamodules.FEMNISTDataModule.")
        clients = [client for client in datamodule.clients("val") if len(client) > 0]
        if len(clients) < num_images:
            raise ValueError(f"--num_images={num_images} but {owner} has {len(clients)} non-empty validation clients; "
                             f"pass --num_images={len(clients)} or fewer, or configure more validation clients.")
        chosen = clients[:num_images]
        x = torch.stack([client.x[0] for client in chosen])
        y = torch.stack([client.y[0] for client in chosen])
        sources = [f"validation client {client.client_id}, sample 0" for client in chosen]
    else:
        dataset = datamodule.val_dataloader().dataset
        available = len(dataset)
        if available < num_images:
            raise ValueError(f"--num_images={num_images} but the validation set of {owner} has {available} samples; "
                             f"pass --num_images={available} or fewer.")
        samples = [dataset[i] for i in range(num_images)]
        if not all(isinstance(s, (tuple, list)) and len(s) >= 2 for s in samples):
            raise ValueError(f"the validation samples of {owner} must be (x, y) pairs, got "
                             f"{type(samples[0]).__name__}.")
        x = torch.stack([torch.as_tensor(s[0]) for s in samples])
        y = torch.stack([torch.as_tensor(s[1]) for s in samples])
        sources = [f"validation sample {i}" for i in range(num_images)]
    if not x.dtype.is_floating_point or y.dtype.is_floating_point:
        raise ValueError(f"{owner} must yield floating inputs and integer class labels, got x {x.dtype} and y "
                         f"{y.dtype}; DLG audits classifiers of images.")
    return x, y.long(), sources


def input_scale(datamodule: Any, input_mean: Optional[float] = None,
                input_std: Optional[float] = None) -> tuple[float, float]:
    """``(mean, std)`` that map the data's inputs back to pixels in [0, 1]: ``pixel = x * std + mean``.

    Read from the DataModule when not given: its ``mean`` and ``std`` attributes if it
    has both as numbers and does not say ``normalize=False`` (``DigitsDataModule``,
    ``MNISTDataModule``, ``FashionMNISTDataModule``); ``(0, 1)`` otherwise (``FEMNISTDataModule``:
    pixels in [0, 1] already).
    """
    mean, std = 0.0, 1.0
    if getattr(datamodule, "normalize", True) is not False:
        found_mean, found_std = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
        if isinstance(found_mean, (int, float)) and isinstance(found_std, (int, float)) and found_std > 0:
            mean, std = float(found_mean), float(found_std)
    return (mean if input_mean is None else float(input_mean)), (std if input_std is None else float(input_std))


def _check_model(model: nn.Module, x: Tensor, y: Tensor, datamodule: Any) -> int:
    """Number of classes; raises ValueError when the model cannot classify the data's images."""
    name = type(model).__name__
    try:
        with torch.no_grad():
            logits = model(x[:1])
    except Exception as err:  # any failure of an unknown model's forward: report it with the fix
        raise ValueError(
            f"--model {name} cannot take the data's images of shape {tuple(x.shape[1:])}: {err}. Fix: configure the "
            f"model for that shape, e.g. for SigmoidLeNet --model.init_args.in_channels={x.shape[1]} "
            f"--model.init_args.image_size={x.shape[-1]}."
        ) from None
    if logits.dim() != 2 or logits.shape[0] != 1:
        raise ValueError(f"--model {name} must return logits of shape (batch, num_classes), got {tuple(logits.shape)} "
                         "for one image.")
    outputs = int(logits.shape[1])
    classes = getattr(datamodule, "num_classes", None)
    if isinstance(classes, int) and classes != outputs:
        raise ValueError(f"--model {name} has {outputs} outputs but {type(datamodule).__name__} has {classes} classes; "
                         f"pass --model.init_args.num_classes={classes}.")
    if int(y.max()) >= outputs:
        raise ValueError(f"the labels {y.tolist()} need at least {int(y.max()) + 1} outputs but --model {name} has "
                         f"{outputs}; pass --model.init_args.num_classes=<the number of classes>.")
    return outputs


def _nu_name(nu: float) -> str:
    return f"nu_{nu:g}"


def _log_result(logger: Any, result: AuditResult, sources: Sequence[str]) -> None:
    client, run_id = logger.experiment, logger.run_id
    for step, summary in enumerate(result.summary()):
        nu = summary["noise_multiplier"]
        for key in ("mse", "psnr", "label_recovered", "match_loss"):
            value = summary[key]
            if math.isfinite(value):
                client.log_metric(run_id, f"audit/{key}", value, step=step)
                client.log_metric(run_id, f"audit/{key}/{_nu_name(nu)}", value, step=0)
            else:
                client.set_tag(run_id, f"audit/{key}/{_nu_name(nu)}", str(value))
        client.log_metric(run_id, "audit/noise_multiplier", nu, step=step)
    client.log_text(run_id, result.tsv(), "audit/dlg.tsv")
    sources_table = "image\tlabel\tsource\n" + "".join(
        f"{i}\t{label}\t{source}\n" for i, (label, source) in enumerate(zip(result.labels, sources)))
    client.log_text(run_id, sources_table, "audit/images.tsv")
    client.log_text(run_id, result.table(), "audit/dlg.md")
    client.log_figure(run_id, result.figure(), "audit/dlg_grid.png")


def main(argv: Sequence[str]) -> int:
    """Entry point of ``lightning-dp audit`` (see the module docstring); returns the exit code."""
    from lightning_dp import tracking
    from lightning_dp.config.threads import announce
    from lightning_dp.privacy.noise import derive_generator

    parser = build_parser()
    cfg, config_text = parser.parse_checked(argv, _settings_problems)
    announce()  # the threads lightning-dp gave torch on a shared machine (lightning_dp.config.threads)
    # The model's initialization uses the global RNG (every nn.Module does): seed it from the audit's
    # seed inside fork_rng, so the audit is reproducible and the caller's RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(derive_generator(cfg.seed, INIT_STREAM).initial_seed()) % 2**63)
        init = parser.instantiate_classes(cfg)
    model, datamodule = init.model, init.data
    try:
        x, y, sources = load_images(datamodule, cfg.num_images)
        num_classes = _check_model(model, x, y, datamodule)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    mean, std = input_scale(datamodule, cfg.input_mean, cfg.input_std)
    factory = make_sanitizer_factory(cfg.sanitizer, model=model, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm,
                                     min_delta_norm=cfg.min_delta_norm)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"[audit] {type(model).__name__} ({parameters} parameters) on {len(y)} images of {type(datamodule).__name__} "
          f"{tuple(x.shape[1:])}, sanitizer {cfg.sanitizer}, nu in {list(cfg.noise_multipliers)}, "
          f"{cfg.iterations} L-BFGS steps x {cfg.restarts} restart(s); pixels = x * {std:g} + {mean:g}", flush=True)

    logger = tracking.MLFlowLogger(experiment_name=cfg.experiment_name, run_name=cfg.run_name, save_dir=None,
                                   local_dir=None)
    params = {
        "audit/model": type(model).__name__, "audit/data": type(datamodule).__name__,
        "audit/parameters": parameters, "audit/num_images": cfg.num_images,
        "audit/noise_multipliers": ",".join(f"{nu:g}" for nu in cfg.noise_multipliers),
        "audit/sanitizer": cfg.sanitizer, "audit/lr": cfg.lr, "audit/local_steps": cfg.local_steps,
        "audit/iterations": cfg.iterations, "audit/attack_lr": cfg.attack_lr, "audit/restarts": cfg.restarts,
        "audit/known_label": cfg.known_label, "audit/seed": cfg.seed, "audit/input_mean": mean,
        "audit/input_std": std, "audit/input_shape": "x".join(map(str, x.shape[1:])),
    }
    if cfg.sanitizer == "gaussian":
        params["audit/max_grad_norm"] = cfg.max_grad_norm
    else:
        params["audit/min_delta_norm"] = cfg.min_delta_norm
    params.update({f"versions/{name}": version for name, version in tracking.library_versions().items()})
    status = "failed"
    try:
        logger.log_hyperparams(params)
        run_id = logger.run_id
        if run_id is None:  # only a logger off rank zero has none; this command runs in one process
            raise RuntimeError("lightning-dp audit: the MLflow logger has no run id (internal)")
        logger.experiment.log_text(run_id, config_text, "config.yaml")

        def progress(row: AuditRow) -> None:
            print(f"[audit] image {row.image + 1}/{len(y)} nu={row.noise_multiplier:g}: mse={row.mse:.4g} "
                  f"psnr={row.psnr:.2f} dB label {row.recovered_label} ({'ok' if row.label_recovered else 'wrong'}) "
                  f"matching loss {row.match_loss:.3g} ({row.seconds:.1f} s)", flush=True)

        result = run_dlg_audit(model, x, y, noise_multipliers=cfg.noise_multipliers, lr=cfg.lr,
                               local_steps=cfg.local_steps, iterations=cfg.iterations, attack_lr=cfg.attack_lr,
                               restarts=cfg.restarts, seed=cfg.seed, sanitizer_factory=factory,
                               known_label=cfg.known_label, num_classes=num_classes, input_mean=mean, input_std=std,
                               on_row=progress)
        _log_result(logger, result, sources)
        status = "success"
    finally:
        logger.finalize(status)
    uri = tracking.tracking_uri_of(logger)
    print(result.table(), flush=True)
    print(tracking.run_locations(logger.run_id, logger.experiment_id, uri,
                                 artifacts=["audit/dlg.tsv", "audit/dlg.md", "audit/dlg_grid.png"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
