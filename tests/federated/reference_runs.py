"""Stored runs of PersonalizedFederatedModule, for the composable round to reproduce seed for seed (issue 14).

The configurations below were run with the implementation before the round was split into parts
(commit 24f94d2) and their final hypotheses, ledgers and validation losses stored in
``data/reference_runs.json``; regenerated once since, when client selection moved from the public
``seed`` to the secret ``noise_seed`` (issue 24: the same draws, from the other seed), and
``synthetic_vmap_nu5`` once more when its noise seed, equal to its public seed (now refused), became 1. Regenerate (only when a change of results is intended and explained):

    python tests/federated/reference_runs.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_dp.datamodules import SyntheticFairnessDataModule, SyntheticLinearMixtureDataModule  # noqa: E402
from lightning_dp.federated import PersonalizedFederatedModule  # noqa: E402
from lightning_dp.models import HospitalMLP, LinearRegression  # noqa: E402

STORE = Path(__file__).with_name("data") / "reference_runs.json"

CONFIGS = {
    "synthetic_vmap_nu5": dict(
        model=lambda: LinearRegression(), data=lambda: SyntheticLinearMixtureDataModule(num_clients=40, num_val_clients=5, seed=0),
        module=dict(num_hypotheses=2, clients_per_round=7, local_epochs=2, local_lr=0.1, local_batch_size=3,
                    noise_multiplier=5.0, client_engine="vmap", seed=0, noise_seed=1), rounds=6),
    "synthetic_loop_per_layer_cap_skip": dict(
        model=lambda: HospitalMLP(in_features=2), data=lambda: SyntheticLinearMixtureDataModule(num_clients=30, num_val_clients=5, seed=1),
        module=dict(num_hypotheses=3, clients_per_round=6, local_epochs=1, local_lr=0.05, local_batch_size=4,
                    noise_multiplier=2.0, per_layer=True, client_engine="loop", client_privacy_cap=30.0,
                    cap_policy="skip", seed=1, noise_seed=7), rounds=5),
    "fairness_bce_cap_replace": dict(
        model=lambda: LinearRegression(bias=True),
        data=lambda: SyntheticFairnessDataModule(num_clients=30, num_val_clients=4, num_test_clients=4, seed=2),
        module=dict(num_hypotheses=2, clients_per_round=5, local_epochs=1, local_lr=0.5, local_batch_size=5,
                    noise_multiplier=1.0, loss="binary_cross_entropy", client_privacy_cap=3.5,
                    cap_policy="replace", val_clients_per_check=3, seed=2, noise_seed=3), rounds=6),
    "nonprivate_k1": dict(
        model=lambda: LinearRegression(), data=lambda: SyntheticLinearMixtureDataModule(num_clients=20, num_val_clients=4, seed=3),
        module=dict(num_hypotheses=1, clients_per_round=5, local_epochs=1, local_lr=0.1, local_batch_size=10,
                    noise_multiplier=0.0, seed=3, noise_seed=0), rounds=4),
}


def run(name: str) -> dict:
    config = CONFIGS[name]
    torch.manual_seed(0)
    module = PersonalizedFederatedModule(config["model"](), **config["module"])
    val = []

    class Val(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                val.append(float(trainer.callback_metrics["val/loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=config["rounds"], check_val_every_n_epoch=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Val()])
    trainer.fit(module, config["data"]())
    return {"hypotheses": module.hypotheses.tolist(), "ledger": module.ledger.as_dict(), "val": val,
            "rounds": int(module.rounds)}


if __name__ == "__main__":
    STORE.parent.mkdir(exist_ok=True)
    STORE.write_text(json.dumps({name: run(name) for name in CONFIGS}, indent=1))
    print(f"wrote {STORE}")
