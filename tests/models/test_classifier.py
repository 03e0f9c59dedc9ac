"""ImageClassifier: training on random data, the empty-batch contract, validation of arguments."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.models import MLP, DigitsConvNet, ImageClassifier


def _loader(n: int = 48, batch_size: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    options = dict(
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    options.update(kwargs)
    return L.Trainer(**options)


def test_trains_and_logs_namespaced_metrics(tmp_path) -> None:
    torch.manual_seed(0)
    model = ImageClassifier(DigitsConvNet(), lr=0.05, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=1)
    trainer.fit(model, _loader(), _loader(seed=1))
    assert trainer.global_step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    metrics = trainer.callback_metrics
    assert {"nonprivate/train_loss", "nonprivate/train_acc", "val/loss", "val/acc"} <= set(metrics)
    assert torch.isfinite(metrics["nonprivate/train_loss"])
    assert 0.0 <= metrics["val/acc"] <= 1.0
    results = trainer.test(model, _loader(seed=2), verbose=False)
    assert set(results[0]) == {"test/loss", "test/acc"}


def test_training_step_returns_batch_mean_cross_entropy(tmp_path) -> None:
    """The DP callback's contract: the returned loss is the mean over the batch of per-example losses."""

    class CheckLoss(L.Callback):
        def __init__(self) -> None:
            self.checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            x, y = batch
            with torch.no_grad():
                self.expected = F.cross_entropy(pl_module(x), y, reduction="none").sum() / y.numel()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            torch.testing.assert_close(outputs["loss"], self.expected)
            self.checked += 1

    check = CheckLoss()
    trainer = _trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[check])
    trainer.fit(ImageClassifier(MLP(64, hidden=(8,))), _loader(n=24, batch_size=10))
    assert check.checked == 2


def test_empty_batch_gives_zero_loss_and_zero_gradients() -> None:
    model = ImageClassifier(DigitsConvNet())
    x, y = torch.empty(0, 1, 8, 8), torch.empty(0, dtype=torch.long)
    loss = model.training_step((x, y), 0)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_empty_batches_inside_fit_do_not_crash(tmp_path) -> None:
    """Poisson sampling can draw an empty batch: fit, validate and test must go through it."""

    class WithEmptyBatches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int):
            n = 0 if i == 1 else 4
            return torch.randn(n, 1, 8, 8), torch.randint(0, 10, (n,))

    def loader() -> DataLoader:
        return DataLoader(WithEmptyBatches(), batch_size=None)

    model = ImageClassifier(DigitsConvNet())
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(model, loader(), loader())
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["nonprivate/train_loss"])
    trainer.test(model, loader(), verbose=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_hyperparameters_and_checkpoint_round_trip(tmp_path) -> None:
    model = ImageClassifier(DigitsConvNet(num_classes=10), lr=0.01, optimizer="adam")
    assert dict(model.hparams) == {
        "num_classes": 10,
        "lr": 0.01,
        "log_nonprivate_metrics": True,
        "optimizer": "adam",
        "momentum": 0.0,
        "network_class": "lightning_dp.models.networks.DigitsConvNet",
    }
    assert model.hparams_initial["network_class"] == "lightning_dp.models.networks.DigitsConvNet"
    assert isinstance(model.configure_optimizers(), torch.optim.Adam)
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(model, _loader())
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    restored = ImageClassifier.load_from_checkpoint(path, network=DigitsConvNet())
    assert restored.hparams.lr == 0.01 and restored.hparams.optimizer == "adam"
    for a, b in zip(model.state_dict().values(), restored.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"network": "MNISTConvNet"}, TypeError, r"network='MNISTConvNet' must be a torch.nn.Module"),
        ({"num_classes": 1}, ValueError, r"num_classes=1 must be an integer >= 2"),
        ({"num_classes": 3}, ValueError, r"num_classes=3 but the network DigitsConvNet outputs 10"),
        ({"lr": 0.0}, ValueError, r"lr=0.0 must be a finite number > 0"),
        ({"optimizer": "rmsprop"}, ValueError, r"optimizer='rmsprop'.*\['sgd', 'adam', 'adamwosm'\]"),
        ({"momentum": 1.0}, ValueError, r"momentum=1.0 must be in \[0, 1\)"),
        ({"optimizer": "adam", "momentum": 0.9}, ValueError, r"momentum=0.9 only applies to optimizer='sgd'"),
    ],
)
def test_invalid_arguments_are_named(kwargs, error, message) -> None:
    kwargs = {"network": DigitsConvNet(), **kwargs}
    with pytest.raises(error, match=message):
        ImageClassifier(**kwargs)
