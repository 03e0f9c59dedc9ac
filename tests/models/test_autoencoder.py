"""Autoencoder: the batch-mean MSE contract, empty batches, DP-SGD training, arguments and checkpoints."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD
from lightning_dp.models import Autoencoder, ConvAutoencoder, MNISTConvNet
from lightning_dp.models.autoencoder import per_example_mse
from tests.helpers import trainer


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _datamodule(n: int = 48, batch_size: int = 16) -> L.LightningDataModule:
    return L.LightningDataModule.from_datasets(
        train_dataset=_images(n, seed=0), val_dataset=_images(16, seed=1), test_dataset=_images(16, seed=2),
        batch_size=batch_size)


def test_training_step_returns_batch_mean_of_per_example_mse(tmp_path) -> None:
    """The DP callback's contract: the loss is the mean over examples of each example's pixel-mean MSE."""

    class CheckLoss(L.Callback):
        checked = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            x, _ = batch
            with torch.no_grad():
                reconstruction = pl_module(x)
            manual = [((reconstruction[i] - x[i]) ** 2).sum() / x[i].numel() for i in range(x.shape[0])]
            self.expected = torch.stack(manual).mean()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            torch.testing.assert_close(outputs["loss"], self.expected)
            self.checked += 1

    check = CheckLoss()
    t = trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, callbacks=[check])
    t.fit(Autoencoder(ConvAutoencoder(), lr=0.1), _datamodule(n=24, batch_size=10))
    assert check.checked == 2


def test_per_example_mse() -> None:
    x = torch.zeros(2, 1, 2, 2)
    reconstruction = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 0.0]).reshape(2, 1, 2, 2)
    assert per_example_mse(reconstruction, x).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"reconstruction has shape \(2, 4\) but its input has shape \(2, 1, 2, 2\)"):
        per_example_mse(torch.zeros(2, 4), x)


def test_empty_batch_gives_zero_loss_and_zero_gradients() -> None:
    model = Autoencoder(ConvAutoencoder())
    loss = model.training_step((torch.empty(0, 1, 28, 28), torch.empty(0, dtype=torch.long)), 0)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    model._evaluate(torch.empty(0, 1, 28, 28), "val")  # logs nothing, no nan


def test_trains_with_dp_sgd_and_logs_namespaced_losses(tmp_path) -> None:
    torch.manual_seed(0)
    model = Autoencoder(ConvAutoencoder(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    datamodule = _datamodule()
    t = trainer(default_root_dir=tmp_path, max_epochs=1, callbacks=[dp], log_every_n_steps=1)
    t.fit(model, datamodule)
    assert t.global_step == 3  # ceil(48 / 16) Poisson batches
    assert dp.epsilon > 0 and dp.noise_multiplier == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {"nonprivate/train_loss", "val/loss"} <= set(t.callback_metrics)
    assert all(torch.isfinite(t.callback_metrics[key]) for key in ("nonprivate/train_loss", "val/loss"))
    results = t.test(model, datamodule, verbose=False)
    assert set(results[0]) == {"test/loss"} and results[0]["test/loss"] > 0


def test_bare_tensor_batches() -> None:
    model = Autoencoder(ConvAutoencoder())
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        expected = ((model(x) - x) ** 2).mean()
    with pytest.warns(Warning, match="self.trainer"):  # no trainer: self.log only warns
        loss = model.training_step(x, 0)
    torch.testing.assert_close(loss, expected)


def test_hyperparameters_and_checkpoint_round_trip(tmp_path) -> None:
    model = Autoencoder(ConvAutoencoder(), lr=0.01, optimizer="adam")
    assert dict(model.hparams) == {
        "lr": 0.01,
        "log_nonprivate_metrics": True,
        "optimizer": "adam",
        "momentum": 0.0,
        "network_class": "lightning_dp.models.networks.ConvAutoencoder",
    }
    assert isinstance(model.configure_optimizers(), torch.optim.Adam)
    sgd = Autoencoder(ConvAutoencoder(), lr=0.2, momentum=0.9).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.2
    t = trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0)
    t.fit(model, DataLoader(_images(8, seed=0), batch_size=4))
    path = tmp_path / "model.ckpt"
    t.save_checkpoint(path)
    restored = Autoencoder.load_from_checkpoint(path, network=ConvAutoencoder())
    assert restored.hparams.lr == 0.01 and restored.hparams.optimizer == "adam"
    for a, b in zip(model.state_dict().values(), restored.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"network": "ConvAutoencoder"}, TypeError, r"network='ConvAutoencoder' must be a torch.nn.Module"),
        ({"lr": -1.0}, ValueError, r"lr=-1.0 must be a finite number > 0"),
        ({"lr": float("nan")}, ValueError, r"lr=nan must be a finite number > 0"),
        ({"optimizer": "rmsprop"}, ValueError, r"optimizer='rmsprop'.*\['sgd', 'adam', 'adamwosm'\]"),
        ({"momentum": 1.0}, ValueError, r"momentum=1.0 must be in \[0, 1\)"),
        ({"optimizer": "adam", "momentum": 0.9}, ValueError, r"momentum=0.9 only applies to optimizer='sgd'"),
    ],
)
def test_invalid_arguments_are_named(kwargs, error, message) -> None:
    kwargs = {"network": ConvAutoencoder(), **kwargs}
    with pytest.raises(error, match=message):
        Autoencoder(**kwargs)


def test_shape_mismatch_is_explained() -> None:
    model = Autoencoder(MNISTConvNet())  # a classifier, not an autoencoder
    with pytest.raises(ValueError, match="must map x to a tensor of x's shape"):
        model.training_step((torch.randn(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)), 0)


def test_adamwosm_optimizer_is_built():
    from lightning_dp.optim import AdamWOSM

    assert isinstance(Autoencoder(ConvAutoencoder(), optimizer="adamwosm", lr=0.01).configure_optimizers(), AdamWOSM)
