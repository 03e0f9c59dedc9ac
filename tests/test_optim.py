"""AdamWOSM against a hand-written reference loop, its errors and resume; build_optimizer and ImageClassifier."""

from __future__ import annotations

import copy
import doctest
import io
import math

import pytest
import torch
from torch import nn

import lightning_dp.optim
from lightning_dp.callbacks import DPSGD
from lightning_dp.models import DigitsConvNet, ImageClassifier
from lightning_dp.optim import OPTIMIZERS, AdamWOSM, build_optimizer, check_optimizer_choice
from tests.helpers import BlobsData, Classifier, trainer


def _reference(theta0, grads, *, lr, beta, noise_std, eps, weight_decay):
    """The update of Mohapatra et al. (2022), written out step by step (float64)."""
    theta, m = theta0.clone(), torch.zeros_like(theta0)
    for t, g in enumerate(grads, start=1):
        m = beta * m + (1 - beta) * g
        m_hat = m / (1 - beta**t)
        theta = theta - lr * weight_decay * theta - lr * m_hat / (noise_std + eps)
    return theta


def _grads(steps, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("beta", [0.9, 0.5, 0.0])
def test_matches_reference_loop(beta, weight_decay) -> None:
    lr, noise_std, eps, steps = 0.01, 0.03, 1e-8, 6
    theta0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = nn.Parameter(theta0.clone())
    opt = AdamWOSM([p], lr=lr, beta=beta, noise_std=noise_std, eps=eps, weight_decay=weight_decay)
    grads = _grads(steps, theta0.shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _reference(theta0, grads, lr=lr, beta=beta, noise_std=noise_std, eps=eps, weight_decay=weight_decay)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-14)
    assert opt.state[p]["step"].item() == steps
    assert set(opt.state[p]) == {"step", "exp_avg"}  # no second moment


def test_param_groups_have_their_own_hyperparameters_and_step_counts() -> None:
    a0 = torch.randn(5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b0 = torch.randn(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
    opt = AdamWOSM([{"params": [a]}, {"params": [b], "lr": 0.2, "beta": 0.5, "weight_decay": 0.01}],
                   lr=0.05, noise_std=0.1)
    ga, gb = _grads(4, a0.shape, seed=4), _grads(4, b0.shape, seed=5)
    for t in range(4):
        a.grad = ga[t].clone()
        b.grad = gb[t].clone() if t % 2 == 0 else None  # b has no gradient at odd steps: skipped
        opt.step()
    torch.testing.assert_close(
        a.detach(), _reference(a0, ga, lr=0.05, beta=0.9, noise_std=0.1, eps=1e-8, weight_decay=0.0),
        rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        b.detach(), _reference(b0, gb[::2], lr=0.2, beta=0.5, noise_std=0.1, eps=1e-8, weight_decay=0.01),
        rtol=1e-12, atol=1e-14)
    assert opt.state[a]["step"].item() == 4 and opt.state[b]["step"].item() == 2


def test_first_step_is_lr_times_gradient_over_noise_std() -> None:
    """Bias correction undoes (1 - beta): the first step is lr * g / (noise_std + eps) for any beta."""
    sigma, clip, batch = 1.3, 0.7, 64.0
    noise_std, lr, eps = sigma * clip / batch, 1e-3, 1e-8
    g = torch.tensor([0.02, -0.005, 0.0, 1e-4], dtype=torch.float64)
    for beta in (0.9, 0.99, 0.0):
        p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        opt = AdamWOSM([p], lr=lr, beta=beta, noise_std=noise_std, eps=eps)
        p.grad = g.clone()
        opt.step()
        torch.testing.assert_close(p.detach(), -lr * g / (noise_std + eps), rtol=1e-14, atol=0.0)


def test_constant_gradient_gives_constant_steps() -> None:
    """With g_t = g the bias-corrected average is g at every step: t steps move by t * lr * g / noise_std."""
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt = AdamWOSM([p], lr=0.1, noise_std=0.5, eps=0.0)
    for _ in range(5):
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), -5 * 0.1 * g / 0.5, rtol=1e-13, atol=0.0)


def test_float32_parameters_and_closure() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = AdamWOSM([p], lr=0.01, noise_std=0.5)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(3.0)
    torch.testing.assert_close(p.detach(), torch.full((3,), 1.0 - 0.01 * 2.0 / 0.5))
    assert p.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32


def test_step_without_noise_std_raises_and_changes_nothing() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = AdamWOSM([p], lr=0.1)
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"noise_std'\] is None.*DPSGD callback.*noise_std=sigma\*C/B"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2)) and len(opt.state) == 0


def test_set_noise_std_sets_every_group() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = AdamWOSM([{"params": [a]}, {"params": [b], "noise_std": 0.5}], lr=0.1)
    assert [group["noise_std"] for group in opt.param_groups] == [None, 0.5]
    noise_std = 1.1 * 1.0 / 20  # what DPSGD passes: sigma * C / expected batch size
    opt.set_noise_std(noise_std)
    assert [group["noise_std"] for group in opt.param_groups] == [noise_std, noise_std]
    a.grad, b.grad = torch.ones(1), torch.ones(1)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.tensor([-0.1 / (noise_std + 1e-8)]))


def test_noise_std_may_be_set_inside_the_closure() -> None:
    """Lightning runs on_before_optimizer_step (where DPSGD calls set_noise_std) inside the step's closure."""
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = AdamWOSM([p], lr=0.1, eps=0.0)

    def closure():
        p.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
        opt.set_noise_std(0.25)
        return 0.0

    opt.step(closure)
    torch.testing.assert_close(p.detach(), torch.tensor([-0.4, 0.4], dtype=torch.float64), rtol=1e-12, atol=0.0)


def test_sparse_gradient_is_refused_before_any_update() -> None:
    dense, sparse = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = AdamWOSM([dense, sparse], lr=0.1, noise_std=1.0)
    dense.grad, sparse.grad = torch.ones(2), torch.ones(2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), torch.zeros(2)) and len(opt.state) == 0


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, None, True, "0.1"])
def test_set_noise_std_validates(value) -> None:
    opt = AdamWOSM([nn.Parameter(torch.zeros(1))], noise_std=0.5)
    with pytest.raises(ValueError, match=rf"noise_std={value!r} must be a finite number > 0; pass noise_std = "
                                         r"noise_multiplier \* max_grad_norm / expected_batch_size"):
        opt.set_noise_std(value)
    assert opt.param_groups[0]["noise_std"] == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -0.1}, r"lr=-0.1 must be a finite number >= 0; pass e.g. lr=1e-3"),
        ({"lr": math.nan}, r"lr=nan must be a finite number >= 0"),
        ({"lr": True}, r"lr=True must be a finite number >= 0"),
        ({"beta": 1.0}, r"beta=1.0 must be in \[0, 1\); pass e.g. beta=0.9"),
        ({"beta": -0.1}, r"beta=-0.1 must be in \[0, 1\)"),
        ({"noise_std": 0.0}, r"noise_std=0.0 must be a finite number > 0; pass noise_std = noise_multiplier"),
        ({"noise_std": math.inf}, r"noise_std=inf must be a finite number > 0.*DPSGD"),
        ({"eps": -1e-8}, r"eps=-1e-08 must be a finite number >= 0; pass e.g. eps=1e-8"),
        ({"weight_decay": -0.01}, r"weight_decay=-0.01 must be a finite number >= 0; pass 0.0 \(none\)"),
    ],
)
def test_constructor_errors_name_value_range_and_fix(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AdamWOSM([nn.Parameter(torch.zeros(1))], **kwargs)


def test_param_group_overrides_are_validated() -> None:
    with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\)"):
        AdamWOSM([{"params": [nn.Parameter(torch.zeros(1))], "beta": 1.5}], noise_std=0.1)
    opt = AdamWOSM([nn.Parameter(torch.zeros(1))], noise_std=0.1)
    with pytest.raises(ValueError, match=r"noise_std=-1 must be a finite number > 0"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "noise_std": -1})


def test_state_dict_round_trip_resumes_bit_identically() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = AdamWOSM(model.parameters(), lr=0.01, beta=0.8, weight_decay=0.05)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(6)]

    def step(m, o, x, y, noise_std):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.set_noise_std(noise_std)
        o.step()

    for i, (x, y) in enumerate(data[:3]):
        step(model, opt, x, y, 0.02 + 0.01 * i)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["opt"]["param_groups"][0]["noise_std"] == pytest.approx(0.04)
    assert saved["opt"]["param_groups"][0]["beta"] == 0.8

    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    opt2 = AdamWOSM(resumed.parameters(), lr=0.5)  # hyperparameters come from the state dict
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[0]["noise_std"] == opt.param_groups[0]["noise_std"]
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["weight_decay"] == 0.05
    for x, y in data[3:]:
        step(model, opt, x, y, 0.03)
        step(resumed, opt2, x, y, 0.03)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"])
        assert opt2.state[b]["step"].item() == 6


def test_build_optimizer_keeps_sgd_and_adam_and_adds_adamwosm() -> None:
    assert OPTIMIZERS == ("sgd", "adam", "adamwosm")
    params = [nn.Parameter(torch.zeros(2))]
    sgd = build_optimizer("sgd", params, lr=0.1, momentum=0.9)
    assert type(sgd) is torch.optim.SGD
    assert sgd.defaults == torch.optim.SGD(params, lr=0.1, momentum=0.9).defaults
    adam = build_optimizer("adam", params, lr=0.01)
    assert type(adam) is torch.optim.Adam and adam.defaults == torch.optim.Adam(params, lr=0.01).defaults
    wosm = build_optimizer("adamwosm", params, lr=0.002)
    assert type(wosm) is AdamWOSM
    assert wosm.defaults == {"lr": 0.002, "beta": 0.9, "noise_std": None, "eps": 1e-8, "weight_decay": 0.0}


@pytest.mark.parametrize(
    ("name", "momentum", "message"),
    [
        ("rmsprop", 0.0, r"optimizer='rmsprop' is not supported; choose one of \['sgd', 'adam', 'adamwosm'\]"),
        (["sgd"], 0.0, r"optimizer=\['sgd'\] is not supported"),
        ("sgd", 1.0, r"momentum=1.0 must be in \[0, 1\)"),
        ("adamwosm", 0.9, r"momentum=0.9 only applies to optimizer='sgd'; with optimizer='adamwosm' leave"),
        ("adam", 0.5, r"momentum=0.5 only applies to optimizer='sgd'; with optimizer='adam' leave"),
    ],
)
def test_optimizer_choice_errors(name, momentum, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_optimizer_choice(name, momentum)
    with pytest.raises(ValueError, match=message):
        build_optimizer(name, [nn.Parameter(torch.zeros(1))], lr=0.1, momentum=momentum)


def test_image_classifier_builds_adamwosm() -> None:
    model = ImageClassifier(DigitsConvNet(), lr=2e-3, optimizer="adamwosm")
    assert model.hparams.optimizer == "adamwosm" and model.hparams.momentum == 0.0
    opt = model.configure_optimizers()
    assert type(opt) is AdamWOSM
    assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[0]["beta"] == 0.9
    assert opt.param_groups[0]["noise_std"] is None  # the DPSGD callback sets it
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=r"momentum=0.9 only applies to optimizer='sgd'"):
        ImageClassifier(DigitsConvNet(), optimizer="adamwosm", momentum=0.9)


class _WOSMClassifier(Classifier):
    def configure_optimizers(self):
        return build_optimizer("adamwosm", self.parameters(), lr=self.lr)


def test_dpsgd_callback_sets_noise_std_sigma_c_over_expected_batch_size() -> None:
    model = _WOSMClassifier(lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=0.5, seed=0, accountant="rdp")
    trainer(max_steps=3, callbacks=[dp]).fit(model, BlobsData(n=200, batch_size=20))
    opt = model.trainer.optimizers[0]
    assert isinstance(opt, AdamWOSM)
    assert opt.param_groups[0]["noise_std"] == pytest.approx(1.1 * 0.5 / 20.0, rel=1e-12)  # q N = 0.1 * 200
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_training_without_dpsgd_fails_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"Use AdamWOSM with the lightning_dp.callbacks.DPSGD callback"):
        trainer(max_steps=1).fit(_WOSMClassifier(), BlobsData(n=40, batch_size=20))


def test_docstring_examples_run() -> None:
    result = doctest.testmod(lightning_dp.optim, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 2 and result.failed == 0
