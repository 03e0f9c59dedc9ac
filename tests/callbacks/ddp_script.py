"""Run by tests/callbacks/test_dp_sgd_ddp.py: DPSGD under Lightning DDP, 2 CPU processes, gloo.

Usage: python tests/callbacks/ddp_script.py OUT_DIR TRACKING_URI
Each rank writes OUT_DIR/rank{r}.pt with what the test checks.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_dp.callbacks import DPSGD, OneRunAudit, OnlineSensitivity, QuantileClipping  # noqa: E402
from lightning_dp.callbacks.faults import NoiselessDPSGD  # noqa: E402
from lightning_dp.tracking import MLFlowLogger  # noqa: E402
from tests.helpers import BlobsData, Classifier, blobs  # noqa: E402


class ZeroGrad(Classifier):
    """Every per-sample gradient is zero: the released gradient is the noise alone."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return (self.net(x) * 0).mean()


class Probe(L.Callback):
    def __init__(self):
        self.grads, self.batches = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].clone())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).clone())


def main(out: Path, tracking_uri: str) -> None:
    common = dict(accelerator="cpu", devices=2, strategy="ddp", enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False)
    # 1. noise once: zero gradients, sigma=2, C=3, q = 2*10/200 = 0.1 -> std = 2*3/20 = 0.3
    probe = Probe()
    dp = DPSGD(noise_multiplier=2.0, max_grad_norm=3.0, seed=7)
    t = L.Trainer(max_steps=1, logger=False, callbacks=[dp, probe], **common)
    t.fit(ZeroGrad(d=100, classes=100, net=nn.Sequential(nn.Linear(100, 100))),
          BlobsData(n=200, batch_size=10, d=100, classes=100))
    noise = probe.grads[0]
    # 2. real training tracked in one MLflow run
    probe2 = Probe()
    torch.manual_seed(0)
    model = Classifier()
    dp2 = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=3)
    logger = MLFlowLogger(experiment_name="ddp-test", tracking_uri=tracking_uri, run_name="ddp")
    t2 = L.Trainer(max_epochs=2, logger=logger, log_every_n_steps=1, callbacks=[dp2, probe2], **common)
    t2.fit(model, BlobsData(n=200, batch_size=10))
    # 3. adaptive clipping: the threshold (and OSO's learning rate) must stay identical on every rank
    adaptive = {}
    for name, cb in (("oso", OnlineSensitivity(noise_multiplier=1.0, clip_lr=0.2, lr_lr=0.1, seed=5)),
                     ("quantile", QuantileClipping(noise_multiplier=1.0, count_noise_std=2.0, seed=6))):
        torch.manual_seed(0)
        m = Classifier()
        L.Trainer(max_epochs=1, logger=False, callbacks=[cb], **common).fit(m, BlobsData(n=200, batch_size=10))
        adaptive[name] = {"trace": list(cb.clipping.trace), "history": cb.accountant.history,
                          "params": torch.cat([p.detach().reshape(-1) for p in m.parameters()])}
    # 4. white-box canaries enter the aggregate once: no noise, zero gradients, so the released gradient is
    # C / (q N) = 3 / 20 at each sampled included canary's coordinate and 0 elsewhere
    probe4 = Probe()
    audit = OneRunAudit(num_canaries=50, canary="gradient", seed=11, methods=("steinke",))
    t4 = L.Trainer(max_steps=1, logger=False, callbacks=[NoiselessDPSGD(noise_multiplier=2.0, max_grad_norm=3.0,
                                                                        seed=7), audit, probe4], **common)
    t4.fit(ZeroGrad(d=100, classes=100, net=nn.Sequential(nn.Linear(100, 100))),
           BlobsData(n=200, batch_size=10, d=100, classes=100))
    # 5. virtual batches: 2 ranks x 2 micro-batches of 5 expected (chunks of at most 3), in float64, against the
    # unsplit DDP step (2 ranks x 10): the same logical Poisson batches, released once
    virtual = {}
    for name, batch, kwargs, dp_kwargs in (("unsplit", 10, {}, {}),
                                           ("split", 5, {"accumulate_grad_batches": 2}, {"max_physical_batch_size": 3}),
                                           # batches of one shape (issue 53): 2 ranks x 2 micro-batches of 16 rows
                                           ("static", 5, {"accumulate_grad_batches": 2},
                                            {"max_physical_batch_size": 3, "max_batch_size": 64}),
                                           # ... with the private pass compiled (dynamo's capture, eager backend)
                                           ("compiled", 5, {"accumulate_grad_batches": 2},
                                            {"max_physical_batch_size": 3, "max_batch_size": 64,
                                             "compile_step": {"backend": "eager"}})):
        torch.manual_seed(0)
        m = Classifier().double()
        cb = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=8, **dp_kwargs)
        x, y = blobs(200).tensors
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y), batch_size=batch)
        tv = L.Trainer(max_epochs=2, logger=False, callbacks=[cb], **common, **kwargs)
        tv.fit(m, train_dataloaders=loader)
        virtual[name] = {"params": torch.cat([p.detach().reshape(-1) for p in m.parameters()]),
                         "history": cb.accountant.history, "steps": tv.global_step,
                         "truncation": getattr(cb.accountant, "truncation", None), "epsilon": cb.epsilon}
    # 6. user-level sampling (ULS): users sharded over ranks, each user's records on one rank, clipped as one
    x, y = blobs(141).tensors
    users = torch.utils.data.TensorDataset(x, y)
    users.user_ids = [u for u in range(30) for _ in range(1 + u % 9)]  # 141 records of 30 users
    torch.manual_seed(0)
    m = Classifier()
    probe6 = Probe()
    cb = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=9, privacy_unit="user", sampling="user",
               max_examples_per_user=3)
    t6 = L.Trainer(max_epochs=1, logger=False, callbacks=[cb, probe6], **common)
    t6.fit(m, train_dataloaders=torch.utils.data.DataLoader(users, batch_size=3))
    rows = {tuple(r.tolist()): users.user_ids[i] for i, r in enumerate(x)}
    uls = {"params": torch.cat([p.detach().reshape(-1) for p in m.parameters()]), "history": cb.accountant.history,
           "users": [sorted({rows[tuple(r.tolist())] for r in b}) for b in probe6.batches], "steps": t6.global_step}
    torch.save({
        "uls": uls,
        "virtual": virtual,
        "canary_grad": probe4.grads[0], "canary_scores": audit._gradient.scores.copy(),
        "audit_result": audit.result is not None,
        "adaptive": adaptive,
        "rank": t2.global_rank, "noise": noise, "sample_rate": dp.sample_rate,
        "history": dp2.accountant.history, "epsilon": dp2.epsilon, "steps": t2.global_step,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "batches": [b for b in probe2.batches], "run_id": logger.run_id if t2.global_rank == 0 else None,
    }, out / f"rank{t2.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
