"""The paths users take beside the default one: each ends correct, or refused before anything is released.

Regression tests of issue 12: layers unfrozen after set-up, batch dimensions that are not
dimension 0, sampling rates that change, shuffled loaders that repeat examples or resume
mid-epoch, and ``trainer.fit(model, train_dataloaders=...)``.
"""

from __future__ import annotations

import copy
import dataclasses

import dp_accounting as dpa
import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

from lightning_dp.callbacks import DPSGD
from lightning_dp.callbacks.dp_sgd import UnprivatizedGradientError
from tests.helpers import BlobsData, Classifier, blobs, trainer


class StepProbe(L.Callback):
    """Records, per step, the model before the step, the batch, and the gradients handed to the optimizer."""

    def __init__(self):
        self.models, self.batches, self.grads = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.models.append(copy.deepcopy(pl_module))
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def naive_clipped_mean(model, loss_of_example, examples, c, expected_batch):
    """Reference: one backward per example over the trainable parameters, clipped at c, summed, / (q N)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for ex in examples:
        g = torch.autograd.grad(loss_of_example(model, ex), list(params.values()))
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    per = torch.stack(rows)
    factors = (c / (per.norm(dim=1) + 1e-6)).clamp(max=1)
    flat = (factors[:, None] * per).sum(0) / expected_batch
    out, i = {}, 0
    for n, p in params.items():
        out[n] = flat[i:i + p.numel()].view_as(p)
        i += p.numel()
    return out


def library_epsilon(history, delta=1e-5):
    acc = dpa.pld.PLDAccountant()
    for sigma, q, steps in history:
        event = dpa.GaussianDpEvent(sigma) if q == 1 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
        acc.compose(dpa.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


def xy_examples(batch):
    x, y = batch
    return [(x[i:i + 1], y[i:i + 1]) for i in range(x.shape[0])]


def classifier_loss(model, ex):
    return F.cross_entropy(model(ex[0]), ex[1])


# --------------------------------------------------------------------- A2: the trainable set changes
class Finetuned(Classifier):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(6, 6)

    def forward(self, x):
        return self.net(torch.tanh(self.backbone(x)))


def test_layer_unfrozen_by_backbone_finetuning_is_clipped_and_noised():
    """BackboneFinetuning freezes the backbone at fit start and unfreezes it at epoch 1 (a new param group)."""
    c = 0.05
    probe = StepProbe()
    dp = DPSGD(noise_multiplier=1e-4, max_grad_norm=c, seed=3, accountant="rdp")
    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)
    model = Finetuned()
    t = trainer(max_epochs=2, callbacks=[finetune, dp, probe])
    t.fit(model, BlobsData(n=100, batch_size=20))
    assert t.global_step == 10
    first, later = 0, 7  # a step while frozen, a step after unfreezing
    assert "backbone.weight" not in probe.grads[first]
    torch.testing.assert_close(probe.models[first + 1].backbone.weight, probe.models[first].backbone.weight)
    assert set(probe.grads[later]) == {n for n, _ in model.named_parameters()}
    expected = naive_clipped_mean(probe.models[later], classifier_loss, xy_examples(probe.batches[later]), c, 20.0)
    for name, g in expected.items():  # noise std sigma C / (q N) = 2.5e-7: atol 1e-5 is 40 standard deviations
        torch.testing.assert_close(probe.grads[later][name], g, rtol=0, atol=1e-5)


def test_parameter_unfrozen_inside_training_step_is_refused_before_the_step():
    class Sneaky(Classifier):
        def __init__(self):
            super().__init__()
            self.net[0].requires_grad_(False)

        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                self.net[0].requires_grad_(True)  # too late: the batch started with it frozen
            return super().training_step(batch, batch_idx)

    model = Sneaky()
    before = model.net[0].weight.detach().clone()
    with pytest.raises(UnprivatizedGradientError, match="did not go through per-sample clipping and noise"):
        trainer(max_steps=5, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(model, BlobsData())
    torch.testing.assert_close(model.net[0].weight, before)  # the raw gradient was never applied


def test_parameter_outside_the_module_in_the_optimizer_is_refused():
    class External(Classifier):
        def __init__(self):
            super().__init__()
            self.extra = torch.zeros(3, requires_grad=True)  # a plain tensor, not a registered parameter

        def forward(self, x):
            return self.net(x) + self.extra

        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), self.extra], lr=0.1)

    model = External()
    with pytest.raises(UnprivatizedGradientError):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(model, BlobsData())
    assert torch.count_nonzero(model.extra) == 0


# -------------------------------------------------------------- A3: the batch dimension is established
class SequenceFirstData(L.LightningDataModule):
    """Collates x as (T, B, d), sequence first, with T == batch_size == 10."""

    def __init__(self, n=100, t=10, batch_size=10):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, t, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
        self.batch_size = batch_size

    @staticmethod
    def collate(samples):
        x = torch.stack([s[0] for s in samples], dim=1)  # (T, B, d)
        return x, torch.stack([s[1] for s in samples])

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)


class SequenceFirstModel(Classifier):
    def __init__(self):
        super().__init__(net=nn.Linear(4, 3))
        self.mix = nn.Linear(4, 4)

    def forward(self, x):  # (T, B, d)
        return self.net(torch.tanh(self.mix(x)).mean(0))


def test_sequence_first_batches_with_t_equal_to_the_batch_size_are_clipped_per_example():
    c = 0.05
    probe = StepProbe()
    dp = DPSGD(noise_multiplier=1e-4, max_grad_norm=c, seed=4, accountant="rdp")
    trainer(max_steps=3, callbacks=[dp, probe]).fit(SequenceFirstModel(), SequenceFirstData())
    for step in range(3):
        x, y = probe.batches[step]
        examples = [(x[:, i:i + 1], y[i:i + 1]) for i in range(x.shape[1])]
        expected = naive_clipped_mean(probe.models[step], classifier_loss, examples, c, 10.0)
        for name, g in expected.items():
            torch.testing.assert_close(probe.grads[step][name], g, rtol=0, atol=1e-5)


class NanoGPTPositions(Classifier):
    """wpe(arange(T)) as in nanoGPT: one positional embedding shared by every example."""

    def __init__(self, t=20):
        super().__init__(net=nn.Linear(4, 3))
        self.wte = nn.Embedding(7, 4)
        self.wpe = nn.Embedding(t, 4)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return self.net(h.mean(1))


def test_shared_positional_embedding_is_clipped_per_example():
    """wpe(arange(T)) as in nanoGPT, T == 20 == the batch size: before, its gradient was split by position as if
    by example (silently wrong); now its output is expanded to the batch and each example clipped with its share."""
    c = 0.05
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 7, (100, 20), generator=g), torch.randint(0, 3, (100,), generator=g))
    probe = StepProbe()
    dp = DPSGD(noise_multiplier=1e-4, max_grad_norm=c, seed=4, accountant="rdp")
    trainer(max_steps=2, callbacks=[dp, probe]).fit(NanoGPTPositions(), train_dataloaders=DataLoader(data,
                                                                                                   batch_size=20))
    for step in range(2):
        expected = naive_clipped_mean(probe.models[step], classifier_loss, xy_examples(probe.batches[step]), c, 20.0)
        for name, grad in expected.items():
            torch.testing.assert_close(probe.grads[step][name], grad, rtol=0, atol=1e-5)


def test_probe_batches_leave_metrics_logs_and_rng_untouched(tmp_path):
    class Counting(Classifier):
        def __init__(self):
            super().__init__(net=nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3)))
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            self.acc(self(batch[0]).argmax(1), batch[1])
            return super().training_step(batch, batch_idx)

    states = {}

    class Before(L.Callback):  # runs before DPSGD's probe
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            states.setdefault("before", torch.random.get_rng_state())

    class InStep(Counting):
        def training_step(self, batch, batch_idx):
            states.setdefault("step", torch.random.get_rng_state())  # the first REAL step (the probe forks)
            return super().training_step(batch, batch_idx)

    model = InStep()
    trainer(max_steps=4, callbacks=[Before(), DPSGD(noise_multiplier=1.0, seed=0)],
            logger=L.pytorch.loggers.CSVLogger(tmp_path), log_every_n_steps=1).fit(model, BlobsData())
    assert model.calls == 4  # the probe's 5 batches (3 nested, 2 of the independence check) put its counter back
    assert model.acc._update_count == 4  # ... that the metric did not count
    assert torch.equal(states["before"], states["step"])  # nor drew dropout masks from the global RNG
    assert "log" not in vars(model) and "log_dict" not in vars(model)  # logging restored after the probe


# ------------------------------------------------------------------- A4: the sampling rate changes
class GrowingBatches(BlobsData):
    """A loader rebuilt every epoch with a doubled batch size: q = 0.05, 0.1, 0.2, 0.4 ..."""

    def train_dataloader(self):
        epoch = self.trainer.current_epoch if self.trainer else 0
        return DataLoader(self.train_set, batch_size=10 * 2 ** epoch, shuffle=True)


def test_budget_follows_a_sampling_rate_that_changes_on_reload():
    target = 2.0  # sigma 2: 0.51 after epoch 0 (q = 0.05), 0.92, 1.47, 2.29 after epoch 3 (q = 0.4), 3.45
    dp = DPSGD(noise_multiplier=2.0, target_epsilon=target, max_grad_norm=1.0, seed=0)
    t = trainer(max_epochs=5, reload_dataloaders_every_n_epochs=1, callbacks=[dp])
    t.fit(Classifier(), GrowingBatches(n=200))
    rates = [q for _, q, _ in dp.accountant.history]
    assert len(set(rates)) >= 2  # the run went on at a higher q ...
    assert dp.epsilon <= target  # ... and still stopped within the budget
    assert dp.epsilon == pytest.approx(library_epsilon(dp.accountant.history), rel=1e-9)
    sigma, q, steps = dp.accountant.history[-1]
    # stopped because the next step at the rate in force would exceed the target
    over = [*dp.accountant.history[:-1], (sigma, q, steps + 1)]
    assert library_epsilon(over) > target


# ------------------------------------------------------------------------------- A5: shuffled mode
@pytest.mark.parametrize("make_sampler", [
    lambda ds: RandomSampler(ds, replacement=True),
    lambda ds: WeightedRandomSampler(torch.ones(len(ds)), len(ds)),
    lambda ds: RandomSampler(ds, num_samples=2 * len(ds)),
], ids=["with_replacement", "weighted", "two_passes_per_epoch"])
def test_shuffled_mode_refuses_samplers_that_repeat_examples(make_sampler):
    data = blobs()
    loader = DataLoader(data, batch_size=20, sampler=make_sampler(data))
    with pytest.raises(MisconfigurationException, match="can repeat examples"):
        trainer(max_epochs=1, callbacks=[DPSGD(noise_multiplier=2.0, poisson_sampling=False, seed=0)]).fit(
            Classifier(), train_dataloaders=loader)


def test_shuffled_mode_mid_epoch_resume_charges_the_new_pass(tmp_path):
    """A resumed epoch draws a NEW permutation for its remaining batches: one more Gaussian mechanism."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(epochs, ckpt=None, callbacks=()):
        dp = DPSGD(noise_multiplier=4.0, max_grad_norm=1.0, poisson_sampling=False, seed=0)
        t = trainer(max_epochs=epochs, callbacks=[dp, *callbacks], enable_checkpointing=bool(callbacks),
                    default_root_dir=tmp_path)
        t.fit(Classifier(), BlobsData(n=200, batch_size=20), ckpt_path=ckpt)
        return t, dp

    _, full = fit(3, callbacks=[ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=15, save_top_k=-1,
                                                filename="{step}")])
    assert full.accountant.history == [(2.0, 1.0, 3)]
    t, resumed = fit(3, ckpt=str(tmp_path / "c" / "step=15.ckpt"))  # half-way through epoch 2
    assert t.global_step == 30
    assert resumed.accountant.history == [(2.0, 1.0, 4)]  # epochs 1, 2 (interrupted), the resumed pass, 3
    assert resumed.epsilon == pytest.approx(library_epsilon([(2.0, 1.0, 4)]), rel=1e-9)
    assert resumed.epsilon > full.epsilon


# ------------------------------------------------- A7: statistics that epsilon does not cover
def test_nonprivate_statistics_are_named_so_and_can_be_switched_off():
    def logged(**kwargs):
        names = set()

        class Capture(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                names.update(trainer.callback_metrics)

        # the module logs its loss under a plain name (no logger here: nothing reaches a record), so that every
        # nonprivate/ name below is DPSGD's own
        trainer(max_steps=3, log_every_n_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0, **kwargs),
                                                             Capture()]).fit(Classifier(loss_name="loss"), BlobsData())
        return names

    assert "nonprivate/clipped_fraction" in logged()
    names = logged(log_nonprivate_metrics=False)
    assert "privacy/epsilon" in names and not any(n.startswith("nonprivate/") or "clipped" in n for n in names)


# ------------------------------------------------------ B: the Lightning call users write first
def _poisson_fit(**fit_kwargs):
    sizes = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sizes.append(batch[0].shape[0])

    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp, Sizes()])
    t.fit(**fit_kwargs)
    return t, dp, sizes


class OwnLoader(Classifier):
    def train_dataloader(self):
        return DataLoader(blobs(200), batch_size=20, shuffle=True)


@pytest.mark.parametrize("how", ["train_dataloaders", "datamodule", "module_hook"])
def test_every_way_of_giving_training_data_is_poisson_sampled_and_accounted(how):
    fit = {"train_dataloaders": dict(model=Classifier(), train_dataloaders=DataLoader(blobs(200), batch_size=20,
                                                                                       shuffle=True)),
           "datamodule": dict(model=Classifier(), datamodule=BlobsData(n=200, batch_size=20)),
           "module_hook": dict(model=OwnLoader())}[how]
    t, dp, sizes = _poisson_fit(**fit)
    assert t.global_step == 20  # 2 epochs x ceil(200 / 20)
    assert len(set(sizes)) > 3 and 10 < sum(sizes) / len(sizes) < 30  # Poisson sizes around q N = 20
    assert dp.accountant.history == [(1.1, 0.1, 20)]
    assert dp.epsilon == pytest.approx(library_epsilon([(1.1, 0.1, 20)]), rel=1e-9)


def test_train_dataloaders_is_restored_after_fit():
    loader = DataLoader(blobs(200), batch_size=20)
    t, _, _ = _poisson_fit(model=Classifier(), train_dataloaders=loader)
    assert t.fit_loop._data_source.instance is loader and t.fit_loop._data_source.dataloader() is loader


def test_train_dataloaders_resume_exactly(tmp_path):
    """The loader is privatized after the checkpoint restored the seed: same batches, noise and epsilon."""
    def fit(epochs, ckpt=None):
        torch.manual_seed(0)
        model, dp = Classifier(), DPSGD(noise_multiplier=1.0, max_grad_norm=0.5, seed=None if ckpt else 11)
        t = trainer(max_epochs=epochs, callbacks=[dp])
        t.fit(model, train_dataloaders=DataLoader(blobs(150), batch_size=10, shuffle=True), ckpt_path=ckpt)
        return t, model, dp

    _, full, full_dp = fit(3)
    part, _, _ = fit(2)
    part.save_checkpoint(tmp_path / "mid.ckpt")
    _, resumed, resumed_dp = fit(3, str(tmp_path / "mid.ckpt"))
    assert resumed_dp.accountant.history == full_dp.accountant.history
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_collection_of_training_loaders_is_refused():
    loaders = {"a": DataLoader(blobs(200), batch_size=20), "b": DataLoader(blobs(100), batch_size=10)}
    with pytest.raises(MisconfigurationException, match="collection of loaders"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(
            Classifier(), train_dataloaders=loaders)


# ------------------------------------------------------------- A6: secrets never leave the machine
def test_dpsgd_keeps_its_seed_in_the_secret_part_of_its_state_and_resumes_from_a_public_checkpoint(tmp_path):
    from lightning_dp.tracking import public_checkpoint

    dp = DPSGD(noise_multiplier=1.0, seed=123)
    t = trainer(max_epochs=1, callbacks=[dp])
    t.fit(Classifier(), BlobsData())
    t.save_checkpoint(tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    (state,) = full["callbacks"].values()
    assert state["secret"] == {"seed": 123} and "seed" not in state
    public = public_checkpoint(full)
    assert "callbacks" not in public and "optimizer_states" not in public
    torch.save({**full, "callbacks": {k: {n: v for n, v in s.items() if n != "secret"}
                                      for k, s in full["callbacks"].items()}}, tmp_path / "no_secret.ckpt")
    resumed = DPSGD(noise_multiplier=1.0)
    t2 = trainer(max_epochs=2, callbacks=[resumed])
    t2.fit(Classifier(), BlobsData(), ckpt_path=str(tmp_path / "no_secret.ckpt"))
    assert resumed.accountant.history == [(1.0, 0.1, 20)]  # the spend continues ...
    assert resumed._seed not in (None, 123)  # ... from a fresh secret seed


def test_loggers_that_upload_resume_checkpoints_are_refused(tmp_path):
    from lightning_dp.tracking import MLFlowLogger

    logger = MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path / 'db.sqlite'}", log_model=True,
                          artifact_location=str(tmp_path / "art"), local_dir=str(tmp_path / "ckpt"))
    with pytest.raises(MisconfigurationException, match=r"log_model=True\) uploads every ModelCheckpoint file"):
        trainer(max_steps=1, logger=logger, callbacks=[DPSGD(noise_multiplier=1.0)]).fit(Classifier(), BlobsData())


# ------------------------------------------------------ second review: the paths beside these paths
def test_a_given_seed_wins_over_the_checkpoints_so_branches_draw_new_noise(tmp_path):
    """Runs branched from one checkpoint (a grid resuming every point from it) must not share noise."""
    t = trainer(max_epochs=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=11)])
    t.fit(Classifier(), BlobsData())
    t.save_checkpoint(tmp_path / "start.ckpt")
    branch = DPSGD(noise_multiplier=1.0)
    branch.set_secret_seed(5)  # what lightning-dp grid does before every fit
    trainer(max_epochs=2, callbacks=[branch]).fit(Classifier(), BlobsData(), ckpt_path=str(tmp_path / "start.ckpt"))
    assert branch._seed == 5 and branch.accountant.history == [(1.0, 0.1, 20)]
    plain = DPSGD(noise_multiplier=1.0)  # no seed given: the checkpoint's streams continue
    trainer(max_epochs=2, callbacks=[plain]).fit(Classifier(), BlobsData(), ckpt_path=str(tmp_path / "start.ckpt"))
    assert plain._seed == 11


@dataclasses.dataclass
class Pairs:
    x: torch.Tensor
    y: torch.Tensor


class ChunkedData(BlobsData):
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          collate_fn=lambda s: Pairs(torch.stack([a for a, _ in s]), torch.stack([b for _, b in s])))


class Chunked(Classifier):
    """Averages the batch pairwise above 8 examples (never in the probe's 3, 5 and 7): pairs of examples mix."""

    def training_step(self, batch, batch_idx):
        x, y = batch.x, batch.y
        if x.shape[0] > 8:
            half = x.shape[0] // 2
            x = (x[:half] + x[half:2 * half]) / 2
            y = y[:half]
        return F.cross_entropy(self(x), y)


def test_dataclass_batches_are_counted_and_mixing_examples_is_refused():
    with pytest.raises(MisconfigurationException, match=r"saw \d+ examples .* but the batch holds \d+ examples"):
        trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Chunked(), ChunkedData())


def test_a_batch_whose_size_cannot_be_read_is_refused():
    class Packed(Classifier):
        def training_step(self, batch, batch_idx):  # one flat tensor: the number of examples is in no dimension
            rows = batch.view(-1, 7)
            return F.cross_entropy(self(rows[:, :6]), rows[:, 6].long())

    data = [torch.cat([torch.randn(6), torch.tensor([float(i % 3)])]) for i in range(40)]
    loader = DataLoader(data, batch_size=10, collate_fn=lambda items: torch.cat(items))
    with pytest.raises(MisconfigurationException, match="cannot tell how many examples this training batch holds"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Packed(), train_dataloaders=loader)


def test_double_precision_runs_the_probe_through_lightnings_batch_path():
    model = Classifier().double()
    t = trainer(max_steps=2, precision="64-true", callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    t.fit(model, BlobsData())
    assert t.global_step == 2


def test_a_layer_frozen_in_the_modules_own_batch_hook_stays_frozen():
    class FreezeLate(Classifier):
        def on_train_batch_start(self, batch, batch_idx):  # runs after the callbacks' on_train_batch_start
            if self.global_step == 1:
                self.net[0].requires_grad_(False)

    model = FreezeLate()
    probe = StepProbe()
    trainer(max_steps=4, callbacks=[DPSGD(noise_multiplier=1.0, seed=0), probe]).fit(model, BlobsData())
    frozen = probe.models[2].net[0].weight
    assert not model.net[0].weight.requires_grad
    torch.testing.assert_close(model.net[0].weight, frozen, rtol=0, atol=0)
    assert "net.0.weight" not in probe.grads[1] and "net.2.weight" in probe.grads[1]


def test_online_sensitivity_follows_an_unfrozen_layer():
    """Its previous released vectors span the old trainable set: they are dropped when the engine is rebuilt
    (before, the sizes clashed: 'g_noisy and q_prev have different sizes')."""
    from lightning_dp.callbacks import OnlineSensitivity

    oso = OnlineSensitivity(noise_multiplier=1.0, seed=0)
    finetune = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)
    t = trainer(max_epochs=2, callbacks=[finetune, oso])
    t.fit(Finetuned(), BlobsData(n=100, batch_size=20))
    assert t.global_step == 10 and len(oso.clipping.trace) == 10


def test_a_second_fit_with_a_from_datasets_datamodule():
    dm = L.LightningDataModule.from_datasets(train_dataset=blobs(), batch_size=10)
    dp = DPSGD(noise_multiplier=1.0, seed=0)
    for _ in range(2):
        trainer(max_steps=2, callbacks=[dp]).fit(Classifier(), datamodule=dm)
    assert dp.accountant.history == [(1.0, 0.05, 4)]


def test_probe_leaves_python_numpy_and_transform_randomness_alone():
    import random

    import numpy as np

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):  # a random augmentation through every RNG a transform may use
            return torch.randn(6) + random.random() + float(np.random.rand()), torch.tensor(i % 3)

    states = {}

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            states.setdefault("before", (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1]))

    class After(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            states.setdefault("after", (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1]))

    trainer(max_steps=1, callbacks=[Before(), DPSGD(noise_multiplier=1.0, seed=0), After()]).fit(
        Classifier(), train_dataloaders=DataLoader(Noisy(), batch_size=10))
    (t0, p0, n0), (t1, p1, n1) = states["before"], states["after"]
    assert torch.equal(t0, t1) and p0 == p1 and (n0 == n1).all()


def test_training_step_returning_none_is_refused_with_the_fix():
    class Skips(Classifier):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(MisconfigurationException, match="returned None.*empty Poisson batch"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(Skips(), BlobsData())
