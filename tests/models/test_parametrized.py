"""lightning_dp.models.Parametrized: torch's parametrizations on a network's linear layers and convolutions, from a
config (examples/dpsgd_digits_weight_norm.yaml), trained by DPSGD."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_dp.models import DigitsConvNet, Parametrized

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dpsgd_digits_weight_norm.yaml"


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_every_linear_layer_and_convolution_is_parametrized(kind):
    torch.manual_seed(0)
    plain = DigitsConvNet()
    torch.manual_seed(0)
    net = Parametrized(DigitsConvNet(), kind)
    assert net.parametrized == ["features.0", "features.3", "classifier.1", "classifier.3"]
    assert all(parametrize.is_parametrized(net.network.get_submodule(n), "weight") for n in net.parametrized)
    x = torch.randn(5, 1, 8, 8)
    assert net(x).shape == (5, 10)
    if kind == "weight_norm":  # starts from the network's weights: the same function
        torch.testing.assert_close(net(x), plain(x))
    if kind == "orthogonal":  # by the matrix exponential, which private training's noise leaves orthogonal
        from lightning_dp.privacy.validators import find_noise_broken_parametrizations

        assert find_noise_broken_parametrizations(net) == []
        assert all(net.network.get_submodule(n).parametrizations.weight[0].orthogonal_map.name == "matrix_exp"
                   for n in net.parametrized)


def test_target_modules_pick_layers_and_the_network_itself_can_be_one():
    net = Parametrized(DigitsConvNet(), "spectral_norm", target_modules=["classifier.1"])
    assert net.parametrized == ["classifier.1"]
    assert not parametrize.is_parametrized(net.network.features[0])
    assert Parametrized(nn.Linear(3, 4)).parametrized == [""]


def test_a_frozen_weight_is_left_alone():
    net = DigitsConvNet()
    net.features[0].weight.requires_grad_(False)
    assert "features.0" not in Parametrized(net).parametrized


@pytest.mark.parametrize("kwargs, match", [
    ({"parametrization": "weight_standardization"}, "is not one of"),
    ({"target_modules": ["nope"]}, "matches no module"),
    ({"target_modules": ["features"]}, "not a linear layer or convolution"),
    ({"target_modules": []}, "names no layer"),
    ({"target_modules": "classifier.1"}, "a list of names"),
])
def test_bad_arguments_say_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Parametrized(DigitsConvNet(), **kwargs)
    with pytest.raises(ValueError, match="no nn.Linear or convolution"):
        Parametrized(nn.Sequential(nn.ReLU()))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Parametrized("DigitsConvNet")  # type: ignore[arg-type]


@pytest.mark.parametrize("override", [[], ["--model.init_args.network.init_args.parametrization=spectral_norm"]],
                         ids=["weight_norm", "spectral_norm"])
def test_the_example_and_its_documented_override_train_privately(override, tmp_path, monkeypatch):
    """The commands of the example's header, as written, for two epochs: DPSGD trains the originals, accounted."""
    from lightning_dp.callbacks import DPSGD
    from lightning_dp.cli import LightningDPCLI

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    header = EXAMPLE.read_text().splitlines()[:4]
    assert any(line.strip() == "#   lightning-dp fit --config examples/dpsgd_digits_weight_norm.yaml " + " ".join(
        override) if override else line.strip() == "#   lightning-dp fit --config examples/dpsgd_digits_weight_norm.yaml"
        for line in header)
    cli = LightningDPCLI(args=["fit", "--config", str(EXAMPLE), *override, "--trainer.max_epochs=2",
                               "--trainer.callbacks.init_args.epochs=2", "--trainer.logger=false",
                               "--trainer.enable_progress_bar=false"])
    (dp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, DPSGD)]
    assert cli.trainer.global_step > 0 and 0 < dp.epsilon <= 3.0
    names = {n for n, p in cli.model.named_parameters() if p.requires_grad}
    assert "network.network.features.0.parametrizations.weight.original" + ("1" if not override else "") in names
