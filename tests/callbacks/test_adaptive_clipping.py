"""OnlineSensitivity (OSO-DPSGD) and QuantileClipping: every step replayed by hand, accounting, resume, errors."""

from __future__ import annotations

import copy
import math

import dp_accounting as dpa
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.callbacks import DPSGD, OnlineSensitivity, QuantileClipping
from lightning_dp.privacy.noise import CLIP_STATISTIC, NOISE, derive_generator
from tests.helpers import ACCELERATORS, DEVICE, BlobsData, Classifier, trainer


class StepProbe(L.Callback):
    """Records, at every optimizer step, the batch, the parameters, the released gradient and the lr."""

    def __init__(self):
        self.batches, self.params, self.grads, self.lrs = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.clone() for t in batch])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.params.append([p.detach().clone() for p in pl_module.parameters()])
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]))
        self.lrs.append(optimizer.param_groups[0]["lr"])


def per_example_grads(model: Classifier, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """(B, P) per-example gradients by a loop of single-example backward passes (the naive reference)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p, v in zip(m.parameters(), params):
            p.copy_(v)
    rows = []
    for i in range(x.shape[0]):
        g = torch.autograd.grad(F.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), list(m.parameters()))
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    return torch.stack(rows) if rows else torch.zeros(0, sum(p.numel() for p in params))


def sign(v: float) -> float:
    return float((v > 0) - (v < 0))


def library_epsilon(sigma, q, steps, delta=1e-5):
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


# ----------------------------------------------------------------------------------------------- OSO


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_oso_steps_equal_algorithm_3_replayed_by_hand(accelerator):
    """Every released gradient, learning rate and threshold of 8 steps equals a naive replay of Algorithm 3 (on a
    GPU too: the noise there comes from the GPU's generator of the same secret streams)."""
    device = DEVICE[accelerator]
    nu, c0, rho_c, rho_r, lr0, seed, batch = 1.0, 0.05, 0.3, 0.2, 0.5, 4, 10
    torch.manual_seed(0)
    model = Classifier(lr=lr0)
    init = copy.deepcopy(model)
    oso = OnlineSensitivity(noise_multiplier=nu, initial_clip=c0, clip_lr=rho_c, lr_lr=rho_r, seed=seed)
    probe = StepProbe()
    trainer(max_steps=8, callbacks=[oso, probe], accelerator=accelerator).fit(model, BlobsData(n=100, batch_size=batch))

    nu_q = 7.124 * nu
    nu_g = (nu ** -2 - nu_q ** -2) ** -0.5
    clip, scale, g_prev, q_prev = c0, 1.0, None, None
    clips_used = []
    for t, ((x, y), params, got) in enumerate(zip(probe.batches, probe.params, probe.grads)):
        per = per_example_grads(init, params, x.cpu(), y.cpu()).double()
        got = got.cpu()
        norms = per.norm(dim=1)
        factors = (clip / (norms + 1e-6)).clamp(max=1)
        q_weights = torch.where(norms > clip, 1 / (norms + 1e-6), torch.zeros_like(norms))
        size = per.shape[1]
        g_noise = _draw(size, seed, NOISE, t, device) * (nu_g * clip)
        q_noise = _draw(size, seed, CLIP_STATISTIC, t, device) * nu_q
        g_tilde = ((factors[:, None] * per).sum(0) + g_noise) / batch  # expected batch size q N = 10
        q_tilde = (q_weights[:, None] * per).sum(0) + q_noise
        torch.testing.assert_close(got.double(), g_tilde, rtol=1e-5, atol=1e-6)
        assert probe.lrs[t] == pytest.approx(lr0 * scale, rel=1e-12)  # theta_{t+1} = theta_t - rho_t g~_t
        clips_used.append(clip)
        if q_prev is not None:
            clip *= math.exp(rho_c * sign(float(g_tilde @ q_prev)))
        if g_prev is not None:
            scale *= math.exp(rho_r * sign(float(g_tilde @ g_prev)))
        g_prev, q_prev = g_tilde, q_tilde
    assert len(clips_used) == 8
    assert [c for _, c, _ in oso.clipping.trace] == pytest.approx(clips_used, rel=1e-12)
    assert oso.max_grad_norm == pytest.approx(clip, rel=1e-12) and oso.lr_scale == pytest.approx(scale, rel=1e-12)
    assert len(set(clips_used)) >= 2 and scale != 1.0  # C and the lr moved: the test exercised both updates
    # the parameters follow SGD with the adapted learning rate
    for t in range(7):
        for before, after, g in zip(probe.params[t], probe.params[t + 1],
                                    torch.split(probe.grads[t], [p.numel() for p in probe.params[t]])):
            torch.testing.assert_close(after, before - probe.lrs[t] * g.view_as(before), rtol=0, atol=1e-6)


def _draw(size, seed, stream, t, device):
    """The float32 standard normals of ``stream`` at step ``t`` as the callbacks draw them on ``device``, in float64
    on the CPU (on a GPU the generator is the GPU's, seeded from the same secret stream)."""
    g = derive_generator(seed, stream, t, device=device)
    return torch.randn(size, generator=g, device=device).double().cpu()


def test_oso_is_accounted_as_one_gaussian_with_the_overall_multiplier():
    oso = OnlineSensitivity(noise_multiplier=1.1, seed=0)
    t = trainer(max_epochs=2, callbacks=[oso])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 20
    assert oso.accountant.history == [(1.1, 0.1, 20)]
    assert oso.epsilon == pytest.approx(library_epsilon(1.1, 0.1, 20), rel=1e-9)
    # the same spend as DP-SGD with the same multiplier: adaptivity is free
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=0)
    trainer(max_epochs=2, callbacks=[dp]).fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert oso.epsilon == dp.epsilon


def test_oso_target_epsilon_calibrates_nu_and_stops_within_budget():
    oso = OnlineSensitivity(target_epsilon=2.0, target_delta=1e-3, epochs=3, seed=0)
    t = trainer(max_epochs=3, callbacks=[oso])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert t.global_step == 30
    assert 1.9 < oso.epsilon <= 2.0
    assert oso.gradient_noise_multiplier == pytest.approx(1.01 * oso.noise_multiplier, rel=1e-3)


def test_oso_logs_threshold_learning_rate_and_clipped_fraction():
    logged: dict[str, list[float]] = {}

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            for k in ("privacy/max_grad_norm", "train/lr", "nonprivate/clipped_fraction", "privacy/epsilon"):
                logged.setdefault(k, []).append(float(trainer.callback_metrics[k]))

    oso = OnlineSensitivity(noise_multiplier=1.0, initial_clip=0.1, clip_lr=0.1, lr_lr=0.1, seed=1)
    trainer(max_steps=6, callbacks=[oso, Capture()], log_every_n_steps=1).fit(Classifier(lr=0.2),
                                                                              BlobsData(n=100, batch_size=10))
    assert logged["privacy/max_grad_norm"] == pytest.approx([c for _, c, _ in oso.clipping.trace], rel=1e-6)
    assert logged["train/lr"] == pytest.approx([lr for _, _, lr in oso.clipping.trace], rel=1e-6)
    assert logged["train/lr"][0] == pytest.approx(0.2)
    assert all(0 <= f <= 1 for f in logged["nonprivate/clipped_fraction"])


def _oso_fit(tmp_path, epochs, ckpt=None, name="run"):
    torch.manual_seed(0)
    model = Classifier()
    oso = OnlineSensitivity(noise_multiplier=1.0, initial_clip=0.1, clip_lr=0.1, lr_lr=0.05, seed=11)
    t = trainer(max_epochs=epochs, callbacks=[oso], default_root_dir=tmp_path / name)
    t.fit(model, BlobsData(n=150, batch_size=10), ckpt_path=ckpt)
    return t, model, oso


def test_oso_resumes_exactly(tmp_path):
    _, full_model, full = _oso_fit(tmp_path, 3, name="full")
    t1, _, part = _oso_fit(tmp_path, 2, name="part")
    assert part.max_grad_norm != full.max_grad_norm  # the state to restore differs from the initial one
    path = tmp_path / "mid.ckpt"
    t1.save_checkpoint(path)
    t2, resumed_model, resumed = _oso_fit(tmp_path, 3, ckpt=str(path), name="resumed")
    assert t2.global_step == 45
    assert resumed.accountant.history == full.accountant.history and resumed.epsilon == full.epsilon
    assert resumed.max_grad_norm == full.max_grad_norm and resumed.lr_scale == full.lr_scale
    assert resumed.clipping.trace == full.clipping.trace
    for a, b in zip(full.clipping.q_prev, resumed.clipping.q_prev):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=1.0, q_noise_multiplier=1.0), "must be larger than noise_multiplier"),
    (dict(noise_multiplier=1.0, q_noise_multiplier=-2.0), "q_noise_multiplier=-2.0"),
    (dict(noise_multiplier=1.0, max_grad_norm=1.0), "initial_clip"),
    (dict(noise_multiplier=1.0, initial_clip=0.0), "initial_clip=0.0"),
    (dict(noise_multiplier=1.0, clip_lr=-0.1), "clip_lr=-0.1"),
    (dict(noise_multiplier=1.0, lr_lr=float("nan")), "lr_lr=nan"),
    (dict(), "noise_multiplier=<sigma> or target_epsilon"),
])
def test_oso_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OnlineSensitivity(**kwargs)


def test_oso_refuses_a_learning_rate_scheduler_unless_lr_lr_is_zero():
    class Scheduled(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]

    with pytest.raises(MisconfigurationException, match="lr_lr=0"):
        trainer(max_steps=1, callbacks=[OnlineSensitivity(noise_multiplier=1.0, seed=0)]).fit(Scheduled(), BlobsData())
    oso = OnlineSensitivity(noise_multiplier=1.0, lr_lr=0.0, seed=0)
    trainer(max_steps=3, callbacks=[oso]).fit(Scheduled(), BlobsData())
    assert oso.lr_scale == 1.0


# ------------------------------------------------------------------------------------------ quantile


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_quantile_steps_equal_andrew_et_al_replayed_by_hand(accelerator):
    device = DEVICE[accelerator]
    z, c0, gamma, eta, sigma_b, seed, batch = 1.0, 0.05, 0.3, 0.2, 2.0, 9, 10
    torch.manual_seed(0)
    model = Classifier(lr=0.5)
    init = copy.deepcopy(model)
    qc = QuantileClipping(noise_multiplier=z, initial_clip=c0, target_quantile=gamma, clip_lr=eta,
                          count_noise_std=sigma_b, seed=seed)
    probe = StepProbe()
    trainer(max_steps=8, callbacks=[qc, probe], accelerator=accelerator).fit(model, BlobsData(n=100, batch_size=batch))

    z_delta = (z ** -2 - (2 * sigma_b) ** -2) ** -0.5
    clip = c0
    for t, ((x, y), params, got) in enumerate(zip(probe.batches, probe.params, probe.grads)):
        per = per_example_grads(init, params, x.cpu(), y.cpu()).double()
        got = got.cpu()
        norms = per.norm(dim=1)
        factors = (clip / (norms + 1e-6)).clamp(max=1)
        g_noise = _draw(per.shape[1], seed, NOISE, t, device) * (z_delta * clip)
        torch.testing.assert_close(got.double(), ((factors[:, None] * per).sum(0) + g_noise) / batch,
                                   rtol=1e-5, atol=1e-6)
        assert qc.clipping.trace[t][1] == pytest.approx(clip, rel=1e-12)
        count_noise = torch.randn((), generator=derive_generator(seed, CLIP_STATISTIC, t), dtype=torch.float64)
        centered = float((norms <= clip).sum()) - len(norms) / 2
        b = min(1.0, max(0.0, (centered + sigma_b * count_noise.item()) / batch + 0.5))
        clip *= math.exp(-eta * (b - gamma))
    assert qc.max_grad_norm == pytest.approx(clip, rel=1e-12)
    assert len({c for _, c, _ in qc.clipping.trace}) > 2


def test_quantile_clipping_accounting_uses_z_and_default_count_noise():
    qc = QuantileClipping(noise_multiplier=1.1, seed=0)
    t = trainer(max_epochs=2, callbacks=[qc])
    t.fit(Classifier(), BlobsData(n=200, batch_size=20))
    assert qc.accountant.history == [(1.1, 0.1, 20)]  # z, not z_Delta
    assert qc.epsilon == pytest.approx(library_epsilon(1.1, 0.1, 20), rel=1e-9)
    assert qc.count_noise_std == 1.0  # m / 20 with m = q N = 20
    assert qc.gradient_noise_multiplier == pytest.approx((1.1 ** -2 - 2.0 ** -2) ** -0.5)


def test_quantile_threshold_converges_to_the_target_quantile_of_the_norms():
    """With little count noise, C settles where about gamma of the examples are unclipped."""
    qc = QuantileClipping(noise_multiplier=0.5, initial_clip=0.1, target_quantile=0.5, count_noise_std=0.5,
                          seed=2)
    torch.manual_seed(0)
    model = Classifier(lr=1e-4)  # nearly frozen model: a stationary norm distribution
    init = copy.deepcopy(model)
    trainer(max_epochs=20, callbacks=[qc]).fit(model, BlobsData(n=200, batch_size=40))
    norms = per_example_grads(init, [p.detach() for p in model.parameters()], *_all(BlobsData(n=200))).norm(dim=1)
    assert qc.clipping.trace[0][1] == 0.1 and qc.max_grad_norm > 10 * 0.1  # it moved 30x from C_0 ...
    unclipped = float((norms <= qc.max_grad_norm).float().mean())
    assert 0.35 < unclipped < 0.65, unclipped  # ... to about the median norm


def _all(dm):
    dm.setup("fit")
    return dm.train_set.tensors


def test_quantile_count_noise_too_small_for_z_is_refused():
    with pytest.raises(ValueError, match="must be smaller than 2 \\* count_noise_std"):
        QuantileClipping(noise_multiplier=3.0, count_noise_std=1.0)
    # the default m / 20 = 0.5 for m = 10 is only known at the start of training
    qc = QuantileClipping(noise_multiplier=3.0, seed=0)
    with pytest.raises(MisconfigurationException, match="expected batch size m = 10"):
        trainer(max_steps=1, callbacks=[qc]).fit(Classifier(), BlobsData(n=100, batch_size=10))


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=1.0, target_quantile=1.5), "target_quantile=1.5"),
    (dict(noise_multiplier=1.0, clip_lr=-1), "clip_lr=-1"),
    (dict(noise_multiplier=1.0, count_noise_std=0), "count_noise_std=0"),
    (dict(noise_multiplier=1.0, max_grad_norm=2.0), "initial_clip"),
])
def test_quantile_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantileClipping(**kwargs)


def test_quantile_resumes_exactly(tmp_path):
    def fit(epochs, ckpt=None, name="run"):
        torch.manual_seed(0)
        model = Classifier()
        qc = QuantileClipping(noise_multiplier=1.0, target_quantile=0.7, count_noise_std=2.0, seed=3)
        t = trainer(max_epochs=epochs, callbacks=[qc], default_root_dir=tmp_path / name)
        t.fit(model, BlobsData(n=150, batch_size=10), ckpt_path=ckpt)
        return t, model, qc

    _, full_model, full = fit(3, name="full")
    t1, _, _ = fit(2, name="part")
    t1.save_checkpoint(tmp_path / "mid.ckpt")
    _, resumed_model, resumed = fit(3, ckpt=str(tmp_path / "mid.ckpt"), name="resumed")
    assert resumed.max_grad_norm == full.max_grad_norm and resumed.epsilon == full.epsilon
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_adaptive_threshold_is_a_metric_not_a_param_and_ends_the_summary(capsys):
    """C moves: privacy/max_grad_norm is a metric (no param that would claim one C); C_0 is privacy/initial_clip."""
    from lightning.pytorch.loggers import Logger

    class Record(Logger):
        name, version = "record", 0

        def __init__(self):
            super().__init__()
            self.params, self.metric_names = {}, set()

        def log_hyperparams(self, params, *args, **kwargs):
            self.params.update(params)

        def log_metrics(self, metrics, step=None):
            self.metric_names.update(metrics)

    logger = Record()
    qc = QuantileClipping(noise_multiplier=1.0, initial_clip=0.1, seed=0)
    trainer(max_steps=4, callbacks=[qc], logger=logger, log_every_n_steps=1).fit(Classifier(), BlobsData())
    assert "privacy/max_grad_norm" not in logger.params and logger.params["privacy/initial_clip"] == 0.1
    assert logger.params["privacy/noise_multiplier"] == 1.0 and "privacy/noise_multiplier" not in logger.metric_names
    assert {"privacy/max_grad_norm", "privacy/epsilon"} <= logger.metric_names
    assert f"  clipping norm C   {qc.max_grad_norm:.4g} at the end (adaptive, initial 0.1)" in capsys.readouterr().out
