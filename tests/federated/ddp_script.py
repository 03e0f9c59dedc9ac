"""Run by tests/federated/test_module_ddp.py: the federated round under Lightning DDP (2 CPU processes, gloo).

Usage: python tests/federated/ddp_script.py OUT_DIR DEVICES [fairness|secret|fedavg|population|local_dp_sgd|pfa|
fail_train|fail_eval]
Trains the synthetic personalized-FL setting for a few rounds with DEVICES processes and
writes OUT_DIR/rank{r}.pt (hypotheses, ledger, validation loss) for the test to compare.
With ``fairness``: the SyntheticFairnessDataModule setting (binary labels, sensitive groups), then
``trainer.test``; the test metrics (accuracy, group fairness) are saved too. With ``secret``:
the synthetic setting with default seeds (drawn per process, so every process must adopt rank 0's). With
``fedavg``: client-level DP-FedAvg (Poisson selection, adaptive clipping, central noise drawn once). With
``local_dp_sgd``: record-level DP-SGD inside the clients, calibrated per client, with a per-client ledger. With
``pfa``: per-client budgets and PFA+ with the budget-agnostic split. With ``population``: DP-FedAvg over a
generated population (the drawn clients' rows built in each process, hashed local shuffles). With ``fail_train``
or ``fail_eval``: the fedavg setting, in which rank 1 raises in its clients' training or in its validation.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_dp.datamodules import SyntheticFairnessDataModule, SyntheticLinearMixtureDataModule  # noqa: E402
from lightning_dp.federated import PersonalizedFederatedModule  # noqa: E402
from lightning_dp.models import LinearRegression  # noqa: E402


class Probe(L.Callback):
    def __init__(self):
        self.val, self.train = [], []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val/loss"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["nonprivate/train_loss"]))


def plant_failure(module, where: str) -> None:
    """Rank 1 raises in its share of the second round's training, or of the first validation."""
    def failing(original):
        def call(*args, **kwargs):
            if module.trainer.global_rank == 1 and (where == "eval" or int(module.rounds) == 1):
                raise RuntimeError(f"planted failure in {where} on rank 1")
            return original(*args, **kwargs)
        return call

    if where == "train":
        module.update.train = failing(module.update.train)
    else:
        module.evaluation_sums = failing(module.evaluation_sums)


def main(out: Path, devices: int, mode: str = "") -> None:
    fairness = mode == "fairness"
    seeds = {} if mode == "secret" else {"seed": 0, "noise_seed": 1}
    # U = 7 clients over 2 processes: shards of 4 and 3; 5 validation clients: 3 and 2
    if mode in ("local_dp_sgd", "pfa"):
        from lightning_dp.federated import FederatedRound
        from lightning_dp.federated.budgets import DistributionBudgets
        from lightning_dp.federated.parts import PFA, LocalDPSGD, UniformSelection

        budget = (dict(budgets=DistributionBudgets("MixGauss2", seed=1)) if mode == "pfa"
                  else dict(target_epsilon=4.0))
        module = FederatedRound(LinearRegression(), selection=UniformSelection(7 if mode == "local_dp_sgd" else 9),
                                update=LocalDPSGD(epochs=2, lr=0.1, batch_size=3, delta=1e-3, accountant="rdp",
                                                  **budget),
                                aggregator=PFA(partition="indirect", plus=True, centered=True) if mode == "pfa"
                                else "fedavg", **seeds)
        data = SyntheticLinearMixtureDataModule(num_clients=40 if mode == "local_dp_sgd" else 9, num_val_clients=5, seed=0)
    elif mode == "population":  # DP-FedAvg over a generated population of 100,000 clients, ~12 drawn per round
        from lightning_dp.datamodules.population import SyntheticPopulationDataModule
        from lightning_dp.federated import FederatedRound
        from lightning_dp.federated.parts import CentralGaussian, LocalSGD, PoissonSelection

        module = FederatedRound(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1)),
                                selection=PoissonSelection(1.2e-4), update=LocalSGD(epochs=2, lr=0.1, batch_size=2),
                                server_privacy=CentralGaussian(noise_multiplier=1.0, clip=0.5, target_delta=1e-6),
                                **seeds)
        data = SyntheticPopulationDataModule(100_000, 5, samples=(1, 5), seed=0)
    elif mode in ("fedavg", "fail_train", "fail_eval"):
        from lightning_dp.federated import FederatedRound
        from lightning_dp.federated.parts import CentralGaussian, FedAvg, LocalSGD, PoissonSelection

        module = FederatedRound(LinearRegression(), selection=PoissonSelection(0.3),
                                update=LocalSGD(epochs=2, lr=0.1, batch_size=3), aggregator=FedAvg(),
                                server_privacy=CentralGaussian(noise_multiplier=1.0, clip=0.5, adaptive=True),
                                **seeds)
        data = SyntheticLinearMixtureDataModule(num_clients=40, num_val_clients=5, seed=0)
    elif fairness:  # 7 test clients: shards of 4 and 3, both groups present
        module = PersonalizedFederatedModule(LinearRegression(bias=True), num_hypotheses=2, clients_per_round=7,
                                             local_epochs=2, local_lr=0.5, local_batch_size=3, noise_multiplier=1.0,
                                             loss="binary_cross_entropy", **seeds)
        data = SyntheticFairnessDataModule(num_clients=40, num_val_clients=5, num_test_clients=7, seed=0)
    else:
        module = PersonalizedFederatedModule(LinearRegression(), num_hypotheses=2, clients_per_round=7,
                                             local_epochs=2, local_lr=0.1, local_batch_size=3, noise_multiplier=5.0,
                                             **seeds)
        data = SyntheticLinearMixtureDataModule(num_clients=40, num_val_clients=5, seed=0)
    if mode in ("fail_train", "fail_eval"):  # one process raises inside the round; the others must not wait forever
        plant_failure(module, "train" if mode == "fail_train" else "eval")
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=6,
                        check_val_every_n_epoch=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[probe])
    trainer.fit(module, data)
    tested = {}
    if fairness:
        (result,) = trainer.test(module, data, verbose=False)
        tested = {name: float(value) for name, value in result.items()}
    privacy = getattr(module, "server_privacy", None)
    torch.save({"hypotheses": module.hypotheses.clone(), "ledger": module.ledger.state_dict(),
                "server": None if privacy is None else privacy.state_dict(),
                "update": module.update.state_dict() if hasattr(module, "update") else None,
                "aggregator": module.aggregator.state_dict() if hasattr(module, "aggregator") else None,
                "rounds": int(module.rounds), "val": probe.val, "train": probe.train, "test": tested},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")
