"""Clipping strategies as registered parts of DPSGD: by name, by instance, a new one in one class, the presets."""

from __future__ import annotations

import copy

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_dp.callbacks import DPSGD, OnlineSensitivity, QuantileClipping
from lightning_dp.callbacks.clipping import (
    ClipStrategy,
    FixedClip,
    OnlineSensitivityClip,
    QuantileClip,
    Release,
    register_clip_strategy,
    registered_clip_strategies,
)
from tests.helpers import BlobsData, Classifier, RecordingLogger, trainer


def _fit(callback, steps=6, **kwargs):
    torch.manual_seed(0)
    model = Classifier(lr=0.3)
    logger = RecordingLogger()
    trainer(max_steps=steps, callbacks=[callback], logger=logger, log_every_n_steps=1, **kwargs).fit(
        model, BlobsData(n=100, batch_size=10))
    return model, logger


def _same_parameters(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("preset, strategy", [
    (lambda: OnlineSensitivity(noise_multiplier=1.0, initial_clip=0.2, clip_lr=0.1, lr_lr=0.05, seed=4),
     lambda: OnlineSensitivityClip(initial_clip=0.2, clip_lr=0.1, lr_lr=0.05)),
    (lambda: QuantileClipping(noise_multiplier=1.0, initial_clip=0.2, target_quantile=0.7, count_noise_std=2.0,
                              seed=4),
     lambda: QuantileClip(initial_clip=0.2, target_quantile=0.7, count_noise_std=2.0)),
])
def test_a_preset_is_dpsgd_with_the_strategy_bit_for_bit(preset, strategy):
    a, b = preset(), DPSGD(noise_multiplier=1.0, clipping=strategy(), seed=4)
    model_a, log_a = _fit(a)
    model_b, log_b = _fit(b)
    _same_parameters(model_a, model_b)
    assert a.clipping.trace == b.clipping.trace and len(a.clipping.trace) == 6
    assert log_a.params == log_b.params and log_a.calls == log_b.calls  # the same record, metric for metric
    assert a.epsilon == b.epsilon


def test_strategies_are_chosen_by_name_with_their_defaults_and_unknown_names_say_what_exists():
    assert set(registered_clip_strategies()) >= {"fixed", "online_sensitivity", "quantile"}
    assert isinstance(DPSGD(noise_multiplier=1.0, clipping="quantile").clipping, QuantileClip)
    assert DPSGD(noise_multiplier=1.0, clipping="online_sensitivity").max_grad_norm == 0.1
    assert DPSGD(noise_multiplier=1.0, max_grad_norm=2.5).clipping.clip == 2.5
    with pytest.raises(ValueError, match="Did you mean 'quantile'"):
        DPSGD(noise_multiplier=1.0, clipping="quantil")
    with pytest.raises(ValueError, match="pass initial_clip=<C_0> instead of max_grad_norm=2.0"):
        DPSGD(noise_multiplier=1.0, clipping="quantile", max_grad_norm=2.0)
    with pytest.raises(ValueError, match="disagree"):
        DPSGD(noise_multiplier=1.0, clipping=FixedClip(1.0), max_grad_norm=2.0)
    with pytest.raises(ValueError, match="must be larger than noise_multiplier"):  # checked before any data
        DPSGD(noise_multiplier=1.0, clipping=OnlineSensitivityClip(q_noise_multiplier=0.5))


def test_a_new_strategy_is_one_registered_class_and_its_threshold_is_logged_and_used():
    @register_clip_strategy("halving_test")
    class Halving(ClipStrategy):
        """C halves after every released step: a public schedule, nothing more released."""
        adaptive = True
        title = "halving"

        def __init__(self, initial_clip: float = 1.0) -> None:
            super().__init__(initial_clip)

        def after_release(self, release: Release) -> None:
            self.record(release.step, release.optimizer)
            self.clip /= 2

    dp = DPSGD(noise_multiplier=1.0, clipping="halving_test", seed=0)
    _, log = _fit(dp, steps=4)
    assert [c for _, c, _ in dp.clipping.trace] == [1.0, 0.5, 0.25, 0.125] and dp.max_grad_norm == 0.0625
    assert log.series("privacy/max_grad_norm") == [1.0, 0.5, 0.25, 0.125]
    assert "privacy/max_grad_norm" not in log.params and log.params["privacy/noise_multiplier"] == 1.0


def test_the_strategys_statistic_noise_comes_from_the_secret_stream_it_never_holds_the_seed():
    seen = []

    class Spy(FixedClip):
        def after_release(self, release):
            seen.append(release)

    dp = DPSGD(noise_multiplier=1.0, clipping=Spy(), seed=123)
    _fit(dp, steps=2)
    assert [r.step for r in seen] == [0, 1]
    assert all(123 not in vars(r).values() for r in seen)
    from lightning_dp.privacy.noise import SecretGenerator

    assert isinstance(seen[0].statistic_generator(), SecretGenerator)
    assert not any(v == 123 for v in vars(dp.clipping).values())
    import pickle

    assert "123" not in repr(seen[0]) and "123" not in repr(seen[0].statistic_generator)
    with pytest.raises(TypeError, match="secret seed"):
        pickle.dumps(seen[0].statistic_generator)


def test_a_strategy_that_would_release_with_less_noise_or_a_bad_threshold_is_refused_at_its_first_step():
    class Cheating(FixedClip):
        def gradient_noise_multiplier(self, noise_multiplier, expected_batch_size):
            return 0.5 * noise_multiplier  # less than the accounted sigma: epsilon would be under-reported

    with pytest.raises(RuntimeError, match="below the accounted"):
        _fit(DPSGD(noise_multiplier=1.0, clipping=Cheating(), seed=0), steps=1)

    class Runaway(FixedClip):
        def after_release(self, release):
            self.clip = float("nan")

    with pytest.raises(ValueError, match="max_grad_norm=nan"):
        _fit(DPSGD(noise_multiplier=1.0, clipping=Runaway(), seed=0), steps=2)


def test_a_registered_name_cannot_be_taken_by_another_class():
    with pytest.raises(ValueError, match="'fixed' is already registered"):
        register_clip_strategy("fixed")(type("MyFixed", (FixedClip,), {}))


def test_osos_learning_rate_metric_is_admitted_by_the_gate_for_dpsgd_with_the_strategy():
    dp = DPSGD(noise_multiplier=1.0, clipping="online_sensitivity", seed=0)
    _, log = _fit(dp, steps=3)
    assert {"train/lr", "privacy/max_grad_norm", "privacy/epsilon"} <= log.names()
    assert log.params["privacy/method"] == "oso-dpsgd"


def test_a_strategy_is_configured_in_yaml_by_name_or_class_path():
    parser = ArgumentParser()
    parser.add_class_arguments(DPSGD, "dp")
    by_name = parser.instantiate_classes(parser.parse_object({"dp": {"noise_multiplier": 1.0,
                                                                     "clipping": "quantile"}})).dp
    assert isinstance(by_name.clipping, QuantileClip)
    config = {"dp": {"noise_multiplier": 1.0, "clipping": {
        "class_path": "lightning_dp.callbacks.clipping.QuantileClip", "init_args": {"target_quantile": 0.7}}}}
    by_class = parser.instantiate_classes(parser.parse_object(config)).dp
    assert by_class.clipping.target_quantile == 0.7


def test_a_resumed_strategy_continues_exactly(tmp_path):
    def fit(epochs, ckpt=None, name="run"):
        torch.manual_seed(0)
        model = Classifier()
        dp = DPSGD(noise_multiplier=1.0, clipping=OnlineSensitivityClip(clip_lr=0.1, lr_lr=0.05), seed=11)
        t = trainer(max_epochs=epochs, callbacks=[dp], default_root_dir=tmp_path / name)
        t.fit(model, BlobsData(n=100, batch_size=10), ckpt_path=ckpt)
        return t, model, dp

    _, full_model, full = fit(3, name="full")
    t1, _, _ = fit(2, name="part")
    t1.save_checkpoint(tmp_path / "mid.ckpt")
    _, resumed_model, resumed = fit(3, ckpt=str(tmp_path / "mid.ckpt"), name="resumed")
    assert resumed.clipping.trace == full.clipping.trace and resumed.clipping.lr_scale == full.clipping.lr_scale
    _same_parameters(full_model, resumed_model)


def test_copies_of_a_strategy_are_independent():
    dp = DPSGD(noise_multiplier=1.0, clipping="quantile")
    other = copy.deepcopy(dp)
    other.clipping.clip = 5.0
    assert dp.max_grad_norm == 0.1
