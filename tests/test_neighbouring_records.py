"""The neighbouring-record test (issue 24, item 3; DESIGN.md, "Secrets and the record").

For every run kind, the real command (``lightning-dp fit``, ``grid``, ``audit``) runs on D, again on D (the twin),
and on a neighbour D' (one training example, or one training client, changed drastically: tests/neighbours.py)
with identical seeds and ``log_nonprivate_metrics=False``; the MLflow records are then compared item by item
(metrics with full histories, params, tags, artifact contents, the printed output):

(a) every metric, tag and artifact is declared in lightning_dp/privacy/record.py; params are configuration and
    identical in both records (unless the table declares one a release);
(b) no ``nonprivate/`` item exists;
(c) every item that differs between D and D' is a declared release (Kind.RELEASE);
(d) at least one release differs, and the twin's record equals D's (so that a difference means something).

A new example is covered by adding it to :data:`KINDS` (``lightning-dp fit``) or :data:`AUDITS`: its config files
under ``examples/`` and the overrides that scale it down to seconds (every seed set explicitly, nonprivate metrics
off, enough participation that the changed example or client takes part), or a skip with its reason;
``test_every_example_is_in_the_lists`` fails until it is there. ``grid`` is tested on dpsgd_digits.yaml, and the
comparison itself on hand-made records and on a run with nonprivate metrics on (negative controls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_dp import cli, grid
from lightning_dp.datamodules.idx import write_idx
from tests.helpers import seed_store
from tests.neighbours import Record, canonical, check_neighbours, neighbouring, read_record, released_out, \
    run_ids_since

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# --------------------------------------------------------------------------- overrides shared by the kinds

#: Every run: quiet, seeded (seed_everything: initialization and the other public streams).
COMMON = ["--seed_everything=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
#: The DP-SGD callback (the LAST callback of a config): its secret seed fixed, its nonprivate metrics off; and the
#: model's (ImageClassifier: training loss and accuracy).
DPSGD = ["--trainer.callbacks.init_args.seed=1", "--trainer.callbacks.init_args.log_nonprivate_metrics=false",
         "--model.init_args.log_nonprivate_metrics=false"]
#: Three DP-SGD steps, then one validation (a release), counted over epochs.
DPSGD_SHORT = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.check_val_every_n_epoch=null",
               "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1"]
#: Poisson batches of about 80 % of the training set, so that the changed example takes part in one of the three
#: steps (it misses all three with probability 0.2^3 < 1 %; the seeds are fixed, so the outcome is too): 1,257
#: digits, 320 images of the generated MNIST (:func:`mnist_dir`).
DIGITS_BATCH = ["--data.init_args.batch_size=1000"]
MNIST_BATCH = ["--data.init_args.batch_size=256"]
#: The federated round: public seed, secret noise seed (noise and client selection), nonprivate metrics off.
FEDERATED = ["--model.init_args.seed=0", "--model.init_args.noise_seed=1",
             "--model.init_args.log_nonprivate_metrics=false", "--trainer.check_val_every_n_epoch=1",
             "--trainer.log_every_n_steps=1"]
#: The MNIST examples read the official t10k files: here a small generated copy (:func:`mnist_dir`).
MNIST = ["--data.init_args.data_dir={mnist}"]
#: The federated MNIST examples on that copy: 320 training images in partitions of about 27.
FEDERATED_MNIST = [*MNIST, "--data.init_args.num_test_clients=2"]
#: The language-model examples on a generated WikiText-2 (:func:`wikitext_dir`, 45 words) with a tiny GPT-2.
WIKITEXT = ["--data.init_args.data_dir={wikitext}", "--data.init_args.vocab_size=45",
            "--data.init_args.block_size=16"]
TINY_GPT2 = ["--model.init_args.network.init_args.vocab_size=45",
             "--model.init_args.network.init_args.max_positions=16", "--model.init_args.network.init_args.embed_dim=16",
             "--model.init_args.network.init_args.num_layers=1", "--model.init_args.network.init_args.num_heads=2"]
#: DP-FedAvg on that copy: 20 clients of 16 images, Poisson selection at q = 0.8, 3 rounds.
FEDAVG_MNIST = ["--data.init_args.num_clients=20", "--data.init_args.num_val_clients=2",
                "--model.init_args.selection.init_args.sample_rate=0.8", "--trainer.max_epochs=3"]
#: Local DP-SGD inside the clients (record-level DP): Poisson batches at q = 16 / 27, one step per local epoch,
#: 3 epochs, 2 rounds: the changed record misses all 6 steps with probability 0.4^6 < 1 %.
LOCAL_DPSGD = ["--trainer.max_epochs=2", "--model.init_args.update.init_args.batch_size=16",
               "--model.init_args.update.init_args.epochs=3"]
#: User-level DP-SGD over a CentralizedView (examples/user_level): the federated DataModule's clients are the users,
#: so D' changes one training client (unit "client"): one user, all their records. 100 generated users of 10 samples
#: bounded to k = 4 (N = 400) in Poisson batches of 320 (q = 0.8): the changed user's 4 records all miss the 3 steps
#: with probability 0.2^12.
USER_SYNTHETIC = ["--data.init_args.federated.init_args.num_clients=100",
                  "--data.init_args.federated.init_args.num_val_clients=20",
                  "--data.init_args.federated.init_args.num_test_clients=20",
                  "--data.init_args.federated.init_args.batch_size=320"]
#: The same on a generated LEAF directory (:func:`femnist_dir`): 16 training writers of 10 images bounded to k = 8
#: (N = 128), Poisson batches of 100 (q = 0.78).
USER_FEMNIST = ["--data.init_args.federated.init_args.data_dir={femnist}",
                "--data.init_args.federated.init_args.batch_size=100"]


#: The fine-tuning examples start from a random base instead of lm/gpt2_public_pretrain.yaml's checkpoint (YAML null:
#: on the command line jsonargparse would read it as the string 'None').
RANDOM_BASE = {"model": {"init_args": {"network": {"init_args": {"checkpoint": None}}}}}
RANDOM_LORA_BASE = {"model": {"init_args": {"network": {"init_args": {"network": {"init_args": {"checkpoint": None}}}}}}}


def kind(name: str, configs: Sequence[str | dict[str, Any]], overrides: Sequence[str], *marks: Any,
         unit: str = "client") -> Any:
    """One run kind: config files under examples/ (or inline YAML overlays, dicts), overrides, and the unit of
    privacy that D' changes in a federated DataModule (tests/neighbours.change_data): ``"client"`` for
    client-level DP (sanitizers, DP-FedAvg, d-privacy), ``"example"`` for record-level DP inside the clients."""
    return pytest.param(list(configs), list(overrides), unit, id=name, marks=marks)


def one_run_audit(canary: str) -> dict[str, Any]:
    """examples/audit/one_run_mnist*.yaml's callbacks with the audit's own secret seed (canaries and their inclusion
    bits) fixed, which the command line cannot reach (--trainer.callbacks.init_args.* sets the LAST callback's),
    and 20 canaries instead of 1,000."""
    return {"trainer": {"callbacks": [
        {"class_path": "lightning_dp.callbacks.OneRunAudit",
         "init_args": {"num_canaries": 20, "canary": canary, "confidence": 0.95, "seed": 2}},
        {"class_path": "lightning_dp.callbacks.DPSGD",
         "init_args": {"target_epsilon": 8.0, "target_delta": 1.0e-5, "max_grad_norm": 0.1, "epochs": 40,
                       "accountant": "pld"}}]}}


#: Every ``lightning-dp fit`` kind: (id, configs under examples/, overrides).
KINDS = [
    kind("dpsgd", ["dpsgd_digits.yaml"], [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH]),
    # the clipping strategy named in YAML (DPSGD with clipping: QuantileClip): its C_t and count estimate
    kind("dpsgd-quantile-strategy", ["dpsgd_digits_quantile.yaml"], [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH]),
    kind("oso-online", ["oso/mnist_t10k.yaml", "oso/online.yaml"],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT, "--trainer.logger.init_args.run_name=oso"]),
    kind("oso-fixed-quantile", ["oso/mnist_t10k.yaml", "oso/fixed_quantile.yaml"],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT, "--trainer.logger.init_args.run_name=oso"]),
    kind("oso-adamwosm", ["oso/mnist_t10k.yaml", "oso/adamwosm.yaml"],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT, "--trainer.logger.init_args.run_name=oso"]),
    kind("oso-fixed-threshold", ["oso/mnist_t10k.yaml", "oso/fixed_threshold.yaml"],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT, "--trainer.logger.init_args.run_name=oso"]),
    # about 100 training blocks of 16 tokens: batches of 80
    kind("dpsgd-gpt2", ["dpsgd_gpt2_wikitext2.yaml"],
         [*WIKITEXT, *TINY_GPT2, "--data.init_args.batch_size=80", *DPSGD, *DPSGD_SHORT]),
    # virtual batches: logical Poisson batches of about 1,000 (4 micro-batches of 250, chunks of at most 32)
    kind("dpsgd-virtual-batches", ["dpsgd_digits_virtual.yaml"],
         [*DPSGD, *DPSGD_SHORT, "--data.init_args.batch_size=250"]),
    kind("dpsgd-bf16-mixed", ["dpsgd_digits_bf16.yaml"], [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH]),
    # weight-normalized layers (lightning_dp.models.Parametrized): the originals' gradients pulled back per example
    kind("dpsgd-weight-norm", ["dpsgd_digits_weight_norm.yaml"], [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH]),
    # batches of one shape (issue 53): truncated Poisson batches, padded; the padding must not move a release
    kind("dpsgd-static-shape", ["dpsgd_digits_static.yaml"], [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH]),
    # the compiled private pass (dynamo's capture and guards, without inductor's code generation: seconds, not a minute)
    kind("dpsgd-compiled-pass", ["dpsgd_digits_compiled.yaml"],
         [*DPSGD, *DPSGD_SHORT, *DIGITS_BATCH, '--trainer.callbacks.init_args.compile_step={"backend": "eager"}']),
    # DP fine-tuning from a random base (the real pipeline starts from lm/gpt2_public_pretrain.yaml's checkpoint):
    # LoRA adapters only, and every weight; logical batches of 80 blocks (2 micro-batches of 40) in bfloat16
    kind("dp-lora-gpt2", ["lm/dp_lora_wikitext2.yaml", RANDOM_LORA_BASE],
         [*WIKITEXT, *(a.replace(".network.init_args.", ".network.init_args.network.init_args.") for a in TINY_GPT2),
          "--model.init_args.network.init_args.target_modules=[c_attn]", "--data.init_args.batch_size=40",
          *DPSGD, *DPSGD_SHORT]),
    kind("dp-full-gpt2", ["lm/dp_full_wikitext2.yaml", RANDOM_BASE],
         [*WIKITEXT, *TINY_GPT2, "--data.init_args.batch_size=40", *DPSGD, *DPSGD_SHORT]),
    kind("dpsgd-mnist-t10k", ["dpsgd_mnist_t10k.yaml"], [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT]),
    kind("dpsgd-autoencoder", ["oso_mnist_autoencoder.yaml"], [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT]),
    kind("one-run-audit", ["audit/one_run_mnist.yaml", one_run_audit("mislabeled")],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT]),
    kind("one-run-audit-whitebox", ["audit/one_run_mnist_whitebox.yaml", one_run_audit("gradient")],
         [*MNIST, *MNIST_BATCH, *DPSGD, *DPSGD_SHORT]),
    # 80 of the 100 clients per round (the example: 7), so that the changed client takes part (misses: 0.2^3)
    kind("fl-d-privacy", ["fl_synthetic.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.clients_per_round=80"]),
    # IFCA's trained initialization (examples/femnist/warm_start.yaml, 20 rounds) over the synthetic round, cut to 2
    # warm-up rounds of the 3: the public assignment, then the choice on the clients' data
    kind("fl-d-privacy-warm-start", ["fl_synthetic.yaml", "femnist/warm_start.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.clients_per_round=80",
          "--model.init_args.warm_start_rounds=2"]),
    kind("fl-fairness", ["fairness/synthetic.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--data.init_args.num_clients=100",
          "--data.init_args.num_val_clients=20", "--data.init_args.num_test_clients=20",
          "--model.init_args.clients_per_round=80"]),
    kind("dp-fedavg-sector", ["fl_sector_synthetic.yaml"], [*FEDERATED, "--trainer.max_epochs=3"]),
    kind("dp-fedavg-no-sanitizer", ["fl_sector_synthetic.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.sanitizer=none"]),
    # Poisson selection at q = 0.8 (the examples: 0.2), for the same reason
    kind("dp-fedavg-poisson", ["fedavg_dp_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *FEDAVG_MNIST]),
    kind("dp-fedavg-replace", ["fl_replacement_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *FEDAVG_MNIST]),
    kind("dp-fedavg-adaptive", ["fedavg_adaptive_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *FEDAVG_MNIST]),
    kind("dp-fedavg-adaptive-sector", ["fl_sector_synthetic.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.server_privacy.init_args.adaptive=true"]),
    # the deployment's DP-FedAvg config (clip sanitizer on the clients, central Gaussian) run as a simulation, at
    # q = 0.8 (the example: 0.3); on a Flower deployment the same parts run (tests/flower/test_deployment.py)
    kind("dp-fedavg-deploy-config", ["fl_deploy_fedavg.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.selection.init_args.sample_rate=0.8"]),
    kind("local-dp-gaussian", ["fl_local_dp_synthetic.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.selection.init_args.clients_per_round=80"]),
    kind("local-dpsgd", ["fl_local_dpsgd_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD], unit="example"),
    kind("local-dpsgd-budgets", ["pdpfl/fedavg_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD],
         unit="example"),
    kind("local-dpsgd-at-minimum", ["pdpfl/minimum_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD],
         unit="example"),
    kind("local-dpsgd-norms", ["pdpfl/norms_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD],
         unit="example"),
    kind("pfa-direct", ["pdpfl/direct_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD], unit="example"),
    kind("pfa-indirect", ["pdpfl/indirect_mnist.yaml"], [*FEDERATED, *FEDERATED_MNIST, *LOCAL_DPSGD], unit="example"),
    kind("user-level-els-synthetic", ["user_level/els_synthetic.yaml"], [*DPSGD, *DPSGD_SHORT, *USER_SYNTHETIC]),
    kind("user-level-group-synthetic", ["user_level/group_synthetic.yaml"], [*DPSGD, *DPSGD_SHORT, *USER_SYNTHETIC]),
    kind("user-level-els-femnist", ["user_level/els_femnist.yaml"], [*DPSGD, *DPSGD_SHORT, *USER_FEMNIST]),
    kind("user-level-uls-synthetic", ["user_level/uls_synthetic.yaml"], [*DPSGD, *DPSGD_SHORT, *USER_SYNTHETIC[:3],
                                                                         "--data.init_args.federated.init_args.batch_size=80"]),
    # ULS on the generated writers: about 13 of the training writers per step (q ~ 0.8)
    kind("user-level-uls-femnist", ["user_level/uls_femnist.yaml"], [*DPSGD, *DPSGD_SHORT, USER_FEMNIST[0],
                                                                     "--data.init_args.federated.init_args.batch_size=13"]),
    # the deployments' local-DP configs run as simulations (on a deployment the same parts run on the nodes, each site
    # charging its own ledger: tests/flower/test_protocol.py), 32 of the 40 clients per round so the changed one
    # takes part
    kind("local-dp-deploy-config", ["fl_deploy_local_dp.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.selection.init_args.clients_per_round=32"]),
    kind("local-dpsgd-deploy-config", ["fl_deploy_local_dpsgd.yaml"],
         [*FEDERATED, "--trainer.max_epochs=3", "--model.init_args.selection.init_args.clients_per_round=32"],
         unit="example"),
    # --- examples not run here, each with its reason (the dataset configs oso/mnist.yaml, oso/fashion_mnist.yaml and
    # oso/mnist_t10k.yaml are composed with the strategies above; dlg_digits.yaml and audit/mia_lm_dpsgd.yaml run in
    # test_an_audit_of_a_neighbouring_dataset_changes_only_declared_releases)
    kind("dpsgd-mnist", ["dpsgd_mnist.yaml"], [], pytest.mark.skip(reason=(
        "full MNIST's training files (60,000 images) are not generated here; the same modules (DPSGD, "
        "ImageClassifier, MNISTConvNet, MNISTDataModule) run in dpsgd-mnist-t10k"))),
    kind("fl-femnist", ["fl_femnist.yaml"], [], pytest.mark.skip(reason=(
        "needs LEAF FEMNIST files; PersonalizedFederatedModule with the Euclidean Laplace sanitizer runs in "
        "fl-d-privacy and fl-fairness"))),
    kind("fl-femnist-convergence", ["fl_femnist.yaml", "femnist/convergence.yaml"], [], pytest.mark.skip(reason=(
        "needs LEAF FEMNIST files; the overlay changes only the stopping rule and the validation share of "
        "fl-femnist, whose modules run in fl-d-privacy and fl-fairness"))),
    kind("fl-femnist-stated-model", ["fl_femnist.yaml", "femnist/stated_model.yaml"], [], pytest.mark.skip(reason=(
        "needs LEAF FEMNIST files; the overlay changes only the kernel size of fl-femnist's network, whose modules "
        "run in fl-d-privacy and fl-fairness (the overlay's parameter count is checked in tests/test_examples.py)"))),
    kind("fairness-femnist", ["fairness/femnist.yaml"], [], pytest.mark.skip(reason=(
        "needs LEAF FEMNIST files; its modules run in fl-fairness"))),
    kind("fl-hospital", ["fl_hospital.yaml"], [], pytest.mark.skip(reason=(
        "needs the CMS inpatient CSV; PersonalizedFederatedModule runs in fl-d-privacy"))),
    kind("oso-agnews", ["oso_agnews.yaml"], [], pytest.mark.skip(reason=(
        "needs the AG News CSV files and word vectors; DPSGD runs in dpsgd and the OSO strategies in oso-*"))),
    kind("fl-deploy-d-privacy", ["fl_deploy_personalized.yaml"], [], pytest.mark.skip(reason=(
        "PersonalizedFederatedModule on the synthetic mixture, as fl-d-privacy (this config is its deployment's, "
        "tests/flower/test_deployment.py)"))),
    kind("dp-fedavg-population", ["fedavg_population.yaml"], [], pytest.mark.skip(reason=(
        "its 1,000,000 clients are generated from the public seed (no dataset to change one client of); its "
        "parts (PoissonSelection, LocalSGD, CentralGaussian) run in dp-fedavg-poisson and dp-fedavg-deploy-config"))),
    kind("digits-nonprivate", ["digits_nonprivate.yaml"], [], pytest.mark.skip(reason=(
        "non-private baseline: it claims no DP, and its model is not a DP release"))),
    kind("lm-public-pretraining", ["lm/gpt2_public_pretrain.yaml"], [], pytest.mark.skip(reason=(
        "non-private pretraining on the public file (the base model of the DP fine-tuning kinds): it claims no DP"))),
    kind("pdpfl-nonprivate", ["pdpfl/nonprivate_mnist.yaml"], [], pytest.mark.skip(reason=(
        "non-private baseline (plain local SGD, no noise): it claims no DP"))),
    kind("fedavg-cosine", ["fedavg_cosine_mnist.yaml"], [], pytest.mark.skip(reason=(
        "non-private FedAvg whose point is the nonprivate/ update and gradient cosines (diagnostics=True requires "
        "log_nonprivate_metrics=True)"))),
]

# --------------------------------------------------------------------------- fixtures and running


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> Path:
    """The two official t10k files of MNIST, generated: 400 random 28x28 images, balanced labels (the examples'
    split: 320 train, 40 validation, 40 test)."""
    directory = tmp_path_factory.mktemp("mnist")
    g = torch.Generator().manual_seed(0)
    n = 400
    labels = (torch.arange(n) % 10)[torch.randperm(n, generator=g)].to(torch.uint8)
    images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
    write_idx(directory / "t10k-images-idx3-ubyte", images)
    write_idx(directory / "t10k-labels-idx1-ubyte", labels)
    return directory


@pytest.fixture(scope="module")
def femnist_dir(tmp_path_factory) -> Path:
    """LEAF FEMNIST's train/ and test/ JSON folders, generated (tests/datamodules/test_federated_femnist.write_leaf):
    20 writers of 10 training and 2 test images (the examples' split: 16 training writers, 4 validation)."""
    from tests.datamodules.test_federated_femnist import write_leaf

    directory = tmp_path_factory.mktemp("femnist")
    writers = [f"f{i:04d}_{i:02d}" for i in range(20)]
    write_leaf(directory, train_sizes=dict.fromkeys(writers, 10), test_sizes=dict.fromkeys(writers, 2))
    return directory


@pytest.fixture(scope="module")
def wikitext_dir(tmp_path_factory) -> Path:
    """WikiText-2's valid and test files, generated: 60 lines of 30 words from a vocabulary of 40."""
    directory = tmp_path_factory.mktemp("wikitext")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    for split in ("valid", "test"):
        lines = [" " + " ".join(rng.choice(words) for _ in range(30)) + " " for _ in range(60)]
        (directory / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


def _store(template: Path, workdir: Path, monkeypatch) -> str:
    """A fresh MLflow store in ``workdir``; its artifacts are read without progress bars (which would print)."""
    seed_store(template, workdir / "mlruns" / "mlflow.db")
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return f"sqlite:///{workdir}/mlruns/mlflow.db"


def _config_args(configs: Sequence[str | dict[str, Any]], directory: Path) -> list[str]:
    args = []
    for i, config in enumerate(configs):
        if isinstance(config, dict):
            path = directory / f"overlay{i}.yaml"
            path.write_text(yaml.safe_dump(config))
        else:
            path = EXAMPLES / config
        args += ["--config", str(path)]
    return args


@contextlib.contextmanager
def _every_warning(out: list[str]):
    """Warnings are part of what a run prints: shown every time (not once per process, as by default; pytest would
    keep them to itself) and appended to ``out``. Deprecation warnings are about the code, not the run, and some
    libraries show them once per process (jsonargparse): left out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    out += [f"warning: {w.category.__name__}: {w.message}" for w in caught
            if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))]


def _printed(capfd, extra: Sequence[str]) -> str:
    """stdout, stderr and the warnings of one command; MLflow's note that it creates the experiment (which the first
    run of a store alone prints: a function of the store, not of the data) is left out."""
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if not re.search(r"Experiment with name .* not found", line)]
    return canonical("\n".join([*lines, *extra]))


def _command(command: list[str] | Callable[[], Any], uri: str, known: set[str], capfd, monkeypatch, *,
             neighbour: bool, changes: int = 1, unit: str = "client", split: str = "train",
             how: str = "scale") -> tuple[list[Record], str]:
    """Run one ``lightning-dp`` command (argv, or a function) on D, or on D' when ``neighbour`` (then ``changes``
    DataModules change, ``how``: tests/neighbours.change_data); return the records of the runs it created and what
    it printed."""
    shown: list[str] = []
    context = neighbouring(monkeypatch, unit, split, how) if neighbour else contextlib.nullcontext([])
    with context as changed, _every_warning(shown):
        if callable(command):
            command()
        else:
            assert cli.main(command) in (None, 0)
    assert len(changed) == (changes if neighbour else 0), changed
    printed = _printed(capfd, shown)
    return [read_record(uri, run_id) for run_id in run_ids_since(uri, known)], printed


# --------------------------------------------------------------------------- lightning-dp fit


@pytest.mark.parametrize(("configs", "overrides", "unit"), KINDS)
def test_a_neighbouring_dataset_changes_only_declared_releases(configs, overrides, unit, workdir, store_template,
                                                                 mnist_dir, wikitext_dir, femnist_dir, capfd,
                                                                 monkeypatch):
    uri = _store(store_template, workdir, monkeypatch)
    argv = ["fit", *_config_args(configs, workdir), *COMMON,
            *(o.replace("{mnist}", str(mnist_dir)).replace("{wikitext}", str(wikitext_dir))
              .replace("{femnist}", str(femnist_dir)) for o in overrides)]
    known: set[str] = set()
    records = []
    for neighbour in (False, False, True):
        (record,), printed = _command(argv, uri, known, capfd, monkeypatch, neighbour=neighbour, unit=unit)
        record.printed = printed
        records.append(record)
    check_neighbours(*records)
    if records[0].params.get("privacy/level") == "client":
        # central DP amplifies by the secret selection: the round's counts and the statistics of its participants
        # are nonprivate/ (the table's round/* row holds only where no accountant amplifies; issue 24, item 3)
        assert not [n for r in records for n in r.metrics if n.startswith("round/")]


#: The federated kinds (every preset of the round that runs here): their D' with one non-finite feature.
FEDERATED_KINDS = [p for p in KINDS if any("--model.init_args.noise_seed=1" == o for o in p.values[1])
                   and not p.marks]


@pytest.mark.parametrize(("configs", "overrides", "unit"), FEDERATED_KINDS)
def test_a_non_finite_feature_in_one_client_changes_only_declared_releases(configs, overrides, unit, workdir,
                                                                           store_template, mnist_dir, capfd,
                                                                           monkeypatch):
    """Issue 49: one client's one feature NaN or +inf. Before, DP-FedAvg released a NaN model from that client's
    first round on (the release told D' from D with certainty) and the personalized round stopped (the stop told
    the same). Now its update is dropped (zero), the round is released and accounted as planned: the run ends,
    every metric is finite, and D' differs from D only in declared releases (with nonprivate metrics off, the
    count of dropped updates is not in the record)."""
    uri = _store(store_template, workdir, monkeypatch)
    argv = ["fit", *_config_args(configs, workdir), *COMMON, *(o.replace("{mnist}", str(mnist_dir)) for o in overrides)]
    known: set[str] = set()
    records = []
    for neighbour, how in ((False, "scale"), (False, "scale"), (True, "nan"), (True, "inf")):
        (record,), printed = _command(argv, uri, known, capfd, monkeypatch, neighbour=neighbour, unit=unit, how=how)
        record.printed = printed
        records.append(record)
        assert record.status == "FINISHED"
        bad = {name: values for name, values in record.metrics.items() if not all(math.isfinite(v) for _, v in values)}
        assert bad == {}, f"{how}: metrics not finite {bad}"
    for neighbour in records[2:]:
        check_neighbours(*records[:2], neighbour)


# --------------------------------------------------------------------------- lightning-dp grid


def test_a_grid_on_a_neighbouring_dataset_changes_only_declared_releases(workdir, store_template, capfd,
                                                                           monkeypatch):
    """A grid of two DP-SGD runs (grid seed fixed: every run's noise seed derived from it): its parent run (the
    composed spend, the report of its runs) and each run, compared as above."""
    uri = _store(store_template, workdir, monkeypatch)

    def run() -> None:  # lightning-dp grid --config ... --set model.init_args.lr=0.1,0.2 --seed 5 -- ..., with the
        # grid's id fixed (the command draws a random one, like a run id, in the parent's name and the tags)
        grid.run_grid([str(EXAMPLES / "dpsgd_digits.yaml")], [("model.init_args.lr", [0.1, 0.2])], grid_id="nbr",
                      seed=5, extra=[*COMMON, *DPSGD, *DPSGD_SHORT, *DIGITS_BATCH])

    known: set[str] = set()
    grids = []
    for neighbour in (False, False, True):
        runs, printed = _command(run, uri, known, capfd, monkeypatch, neighbour=neighbour, changes=2)
        (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.tags]
        parent.printed = printed  # the whole grid's output, compared once
        grids.append([parent, *sorted((r for r in runs if r is not parent), key=lambda r: r.name)])
    d, twin, neighbour = grids
    assert len(d) == 3 and [r.name for r in d] == [r.name for r in neighbour]
    # the parent's report rounds its runs' val/* metrics to 4 digits: D' need not change it; its runs show the effect
    check_neighbours(d[0], twin[0], neighbour[0], expect_effect=False)
    for a, b, c in zip(d[1:], twin[1:], neighbour[1:]):
        check_neighbours(a, b, c)


# --------------------------------------------------------------------------- lightning-dp audit


def audit(name: str, command: Sequence[str], config: str, overrides: Sequence[str], split: str, *marks: Any) -> Any:
    """One audit command: ``lightning-dp <command> --config examples/<config> <overrides>``, and the split whose
    example 0 D' changes."""
    return pytest.param([*command, "--config", str(EXAMPLES / config), *overrides], split, config, id=name,
                        marks=marks)


#: The audit commands. ``audit`` (DLG) attacks one client's sanitized release of the first validation example: that
#: example is its private data. ``audit mia`` pools train, val and test into members and non-members: training
#: example 0 is one of them; its target model is a run of its own (DP-SGD; the loss attack only: the shadow models
#: and noisy neighbours take minutes).
AUDITS = [
    audit("audit-dlg", ["audit"], "dlg_digits.yaml",
          ["--iterations=2", "--num_images=1", "--restarts=1", "--noise_multipliers=[0, 1]"], "val"),
    audit("audit-mia", ["audit", "mia"], "audit/mia_lm_dpsgd.yaml",
          [*WIKITEXT, *TINY_GPT2, "--trainer={max_epochs: 2}", "--batch_size=16", "--attacks=[loss]",
           "--callbacks=[{class_path: lightning_dp.callbacks.DPSGD, init_args: {target_epsilon: 8.0, "
           "target_delta: 1.0e-5, max_grad_norm: 1.0, epochs: 2, seed: 1, log_nonprivate_metrics: false}}]"], "train"),
    audit("audit-mia-nonprivate", ["audit", "mia"], "audit/mia_lm.yaml", [], "train", pytest.mark.skip(
        reason="its target trains without DP (the attack's non-private reference): no DP claim to check")),
    audit("audit-dlg-femnist", ["audit"], "dlg_femnist.yaml", [], "val", pytest.mark.skip(
        reason="needs LEAF FEMNIST files; the DLG command runs in audit-dlg")),
]


@pytest.mark.parametrize(("argv", "split", "config"), AUDITS)
def test_an_audit_of_a_neighbouring_dataset_changes_only_declared_releases(argv, split, config, workdir,
                                                                            store_template, wikitext_dir, capfd,
                                                                            monkeypatch):
    """The audit commands write the auditor's record (record.py's ``audit/*`` row: results on the audited data, which
    may hold that data). What they print is their report of those results (per-image errors, recovered labels,
    attack tables) beside wall-clock timings: it is not compared; their metrics, params, tags and artifacts are."""
    uri = _store(store_template, workdir, monkeypatch)
    args = [a.replace("{wikitext}", str(wikitext_dir)) for a in argv]
    known: set[str] = set()
    runs = [sorted(_command(args, uri, known, capfd, monkeypatch, neighbour=n, split=split)[0], key=lambda r: r.name)
            for n in (False, False, True)]
    assert [r.name for r in runs[0]] == [r.name for r in runs[2]]
    changed = [check_neighbours(d, twin, neighbour, expect_effect=False) for d, twin, neighbour in zip(*runs)]
    # the effect may be in one run only: audit mia's target run records its spend alone (no model, no metric of it)
    assert any(changed), "D and D' gave identical records: the changed example had no visible effect"


# --------------------------------------------------------------------------- the test of the test


def test_the_comparison_refuses_each_kind_of_leak():
    """Negative controls: what check_neighbours must refuse, on hand-made records (the real runs above pass)."""
    d = Record("a", "run", "FINISHED", metrics={"val/loss": ((0, 1.0),), "privacy/epsilon": ((0, 2.0),)},
               params={"lr": "0.1", "best_checkpoint/score": "1.0"}, tags={"summary.epsilon": "2"},
               artifacts={"model/final.ckpt": {"state_dict": {"w": torch.zeros(2)}}, "config.yaml": "lr: 0.1"},
               printed="DPSGD: 3 private steps\n  epsilon  2.0\n  val/loss  1.0\nrestored (val/loss=1.0)")
    released = dataclasses.replace(d, metrics={**d.metrics, "val/loss": ((0, 1.5),)},
                                   params={**d.params, "best_checkpoint/score": "1.5"},
                                   artifacts={**d.artifacts, "model/final.ckpt": {"state_dict": {"w": torch.ones(2)}}},
                                   printed="DPSGD: 3 private steps\n  epsilon  2.0\n  val/loss  1.5\nrestored "
                                           "(val/loss=1.5)")
    assert check_neighbours(d, d, released) == [("metric", "val/loss"), ("param", "best_checkpoint/score"),
                                                ("artifact", "model/final.ckpt")]
    assert released_out("restored (val/loss=1.5) at epoch=2") == "restored (val/loss=<release>) at epoch=2"
    refused = [
        (dataclasses.replace(released, metrics={**released.metrics, "privacy/epsilon": ((0, 2.5),)}),
         "not declared releases differ"),
        (dataclasses.replace(released, params={**released.params, "lr": "0.2"}), "params .* differ"),
        (dataclasses.replace(released, tags={**released.tags, "summary.epsilon": "3"}), "not declared releases"),
        (dataclasses.replace(released, artifacts={**released.artifacts, "config.yaml": "lr: 0.2"}),
         "not declared releases"),
        (dataclasses.replace(released, metrics={**released.metrics, "train_loss": ((0, 1.0),)}), "undeclared metric"),
        (dataclasses.replace(released, metrics={**released.metrics, "nonprivate/train_loss": ((0, 1.0),)}),
         "nonprivate items"),
        (dataclasses.replace(released, printed=released.printed.replace("epsilon  2.0", "epsilon  2.5")), "printed"),
        (dataclasses.replace(released, status="FAILED"), "ended FAILED"),
        (d, "identical records"),
    ]
    for neighbour, message in refused:
        with pytest.raises(AssertionError, match=message):
            check_neighbours(d, d, neighbour)
    with pytest.raises(AssertionError, match="not deterministic"):
        check_neighbours(d, released, released)


def test_the_records_show_nonprivate_statistics_when_they_are_on(workdir, store_template, capfd, monkeypatch):
    """A negative control through the real command: with DPSGD's and the model's nonprivate metrics on, the records
    hold nonprivate/ items that differ between D and D' (exact losses of the changed example's batches), and the
    comparison refuses them unless told that the run logs them."""
    uri = _store(store_template, workdir, monkeypatch)
    argv = ["fit", "--config", str(EXAMPLES / "dpsgd_digits.yaml"), *COMMON, *DPSGD_SHORT, *DIGITS_BATCH,
            "--trainer.callbacks.init_args.seed=1"]
    known: set[str] = set()
    records = [_command(argv, uri, known, capfd, monkeypatch, neighbour=n)[0][0] for n in (False, False, True)]
    changed = check_neighbours(*records, nonprivate=True)
    assert any(name.startswith("nonprivate/") for _, name in changed)
    with pytest.raises(AssertionError, match="nonprivate items"):
        check_neighbours(*records)


#: Configs that name a dataset only, composed with a strategy config of their folder (KINDS composes oso/mnist_t10k);
#: their files are not generated here. oso/fashion_mnist_autoencoder.yaml's modules (Autoencoder, ConvAutoencoder,
#: DPSGD) run in the oso_mnist_autoencoder kind; oso/mnist_t10k_thesis_model.yaml is oso/mnist_t10k.yaml's data and
#: modules with another network shape, batch size and length.
DATASET_CONFIGS = {"oso/mnist.yaml", "oso/fashion_mnist.yaml", "oso/fashion_mnist_autoencoder.yaml",
                   "oso/mnist_t10k_thesis_model.yaml"}


def test_every_example_is_in_the_lists():
    """A new config under examples/ needs an entry in KINDS or AUDITS (run, or skipped with its reason)."""
    listed = {c for p in KINDS for c in p.values[0] if isinstance(c, str)} | {p.values[2] for p in AUDITS}
    found = {path.relative_to(EXAMPLES).as_posix() for path in EXAMPLES.rglob("*.yaml")}
    assert sorted(found - listed - DATASET_CONFIGS) == []
    assert sorted(listed - found) == []
