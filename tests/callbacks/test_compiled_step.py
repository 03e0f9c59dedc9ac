"""DPSGD(compile_step=...): the private pass (norms, drop, clip factors, masks, clipped sums, counts) as one graph
of torch.compile, compiled once over a run of batches of one shape, with the eager pass' release (issue 53)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.callbacks import DPSGD, OnlineSensitivity, QuantileClipping
from tests.callbacks.test_batch_shape import fit
from tests.helpers import Classifier, blobs, trainer


def loader(batch_size=20, n=200):
    x, y = blobs(n).tensors
    return DataLoader(TensorDataset(x.double(), y), batch_size=batch_size)


def assert_same_run(a, b, atol):
    (_, probe_a, _, model_a), (_, probe_b, _, model_b) = a, b
    assert len(probe_a.grads) == len(probe_b.grads) > 0
    for ga, gb in zip(probe_a.grads, probe_b.grads):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=0, atol=atol)
    for x, y in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("split", [{}, {"max_physical_batch_size": 8}, {"accumulate_grad_batches": 2}],
                         ids=["whole", "chunks", "micro-batches"])
def test_compiled_once_and_equal_to_the_eager_pass(split):
    """Ten steps of batches of one shape: one graph, compiled at the first pass, never again (the rows of each pass,
    C and the loss scale enter as tensors); the released gradients are the eager pass' (float64, so to 1e-12)."""
    counter = CompileCounterWithBackend("eager")
    dp_kwargs = {k: v for k, v in split.items() if k == "max_physical_batch_size"}
    trainer_kwargs = {k: v for k, v in split.items() if k == "accumulate_grad_batches"}
    data = loader(10 if trainer_kwargs else 20)
    eager = fit(48, loader=data, dp_kwargs=dp_kwargs, **trainer_kwargs)
    compiled = fit(48, loader=data, dp_kwargs={**dp_kwargs, "compile_step": {"backend": counter}}, **trainer_kwargs)
    assert counter.frame_count == 1
    assert_same_run(eager, compiled, atol=1e-12)
    # the counts of the release (nonprivate/) are the eager pass' too
    assert torch.equal(eager[0].private_step.last_stats, compiled[0].private_step.last_stats)


@pytest.mark.parametrize("strategy", ["quantile", "oso"])
def test_an_adaptive_threshold_does_not_recompile(strategy):
    """QuantileClipping's and OSO's C change every step, and OSO's q weights are a second sum: still one graph,
    the same thresholds step for step and the same release."""
    runs = {}
    for compile_step in (False, {"backend": CompileCounterWithBackend("eager")}):
        torch.manual_seed(0)
        cb = (QuantileClipping(noise_multiplier=1.0, count_noise_std=2.0, seed=6, max_batch_size=48,
                               compile_step=compile_step) if strategy == "quantile" else
              OnlineSensitivity(noise_multiplier=1.0, clip_lr=0.2, lr_lr=0.1, seed=5, max_batch_size=48,
                                compile_step=compile_step))
        model = Classifier().double()
        trainer(max_epochs=2, callbacks=[cb]).fit(model, train_dataloaders=loader())
        runs[bool(compile_step)] = ([c for _, c, *_ in cb.clipping.trace], model)
    assert compile_step["backend"].frame_count == 1
    (eager_trace, eager_model), (trace, model) = runs[False], runs[True]
    assert len(trace) == 20 and len(set(trace)) > 5  # C moved
    assert trace == pytest.approx(eager_trace, rel=1e-12)
    for x, y in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_inductor_release_equals_the_eager_pass():
    """torch.compile's default backend (inductor: generated kernels, reordered float sums): the same release to
    float64 rounding."""
    eager = fit(48, loader=loader())
    compiled = fit(48, loader=loader(), dp_kwargs={"compile_step": True})
    assert_same_run(eager, compiled, atol=1e-10)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_example_is_dropped_as_the_eager_pass_drops_it(bad):
    """Every tenth example has a non-finite feature, so most steps sample some: the eager pass drops them after
    reading the norms, the compiled one by masking every row whose norm is not finite: the same release and the same
    counts of dropped examples at every step."""
    import lightning as L

    x, y = blobs(200).tensors
    x = x.double()
    x[::10, 0] = bad
    runs = []
    for compile_step in (False, {"backend": "eager"}):
        dropped: list[float] = []

        class Counts(L.Callback):
            def on_train_batch_end(self, trainer, *args):
                dropped.append(float(dp.private_step.last_stats[2]))

        torch.manual_seed(0)
        model = Classifier().double()
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=48, compile_step=compile_step)
        trainer(max_epochs=1, callbacks=[dp, Counts()]).fit(
            model, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=20))
        runs.append((model, dropped))
    (eager, eager_dropped), (compiled, compiled_dropped) = runs
    assert compiled_dropped == eager_dropped and sum(eager_dropped) >= 5
    for a, b in zip(compiled.parameters(), eager.parameters()):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_strategy_without_the_clip_argument_is_refused_before_any_data():
    """A user's strategy written for the eager pass (extra_weights(norms)) cannot take C as a tensor."""
    from lightning_dp.callbacks.clipping import FixedClip

    class Old(FixedClip):
        def extra_weights(self, per_sample_norms):
            return []

    dp = DPSGD(noise_multiplier=1.0, clipping=Old(1.0), max_batch_size=48, compile_step=True)
    with pytest.raises(MisconfigurationException, match="takes no clip argument"):
        trainer(max_epochs=1, callbacks=[dp]).fit(Classifier().double(), train_dataloaders=loader())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"compile_step": True}, "needs batches of one shape"),
    ({"compile_step": "yes", "max_batch_size": 48}, "compile_step='yes' is not allowed"),
    ({"compile_step": {"dynamic": True}, "max_batch_size": 48}, "is not allowed"),
])
def test_refused_before_any_data(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)


def test_the_whole_step_compiles_once_with_a_compiled_model():
    """The model's forward and backward compiled by the user (torch.compile(dynamic=False)) and the private pass by
    DPSGD: neither recompiles after the first step over two epochs; the release is the all-eager run's."""
    import lightning as L
    import torch.nn.functional as F

    def run(compiled):
        # a graph of nn.Sequential.forward compiled by an earlier test of this process would serve this model too
        # (same code, shapes and structure): start from empty caches, so that the counter sees the compilation
        torch._dynamo.reset()
        torch.manual_seed(0)
        model_counter, pass_counter, seen = (CompileCounterWithBackend("aot_eager"),
                                             CompileCounterWithBackend("eager"), [])

        class Model(Classifier):
            def __init__(self):
                super().__init__()
                self.forward_net = torch.compile(self.net, backend=model_counter, dynamic=False) if compiled \
                    else self.net

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.cross_entropy(self.forward_net(x), y)

        class Count(L.Callback):
            def on_train_batch_end(self, *args):
                seen.append((model_counter.frame_count, pass_counter.frame_count))

        model = Model().double()
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=48,
                   compile_step={"backend": pass_counter} if compiled else False)
        trainer(max_epochs=2, callbacks=[dp, Count()]).fit(model, train_dataloaders=loader())
        return model, seen

    eager, _ = run(False)
    model, seen = run(True)
    assert len(seen) == 20 and len(set(seen)) == 1 and seen[0][0] >= 1 and seen[0][1] == 1
    for x, y in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_bf16_mixed_and_a_layer_unfrozen_mid_run():
    """Under bf16-mixed the pass runs outside autocast (float32 norms and sums), as the eager one; a layer unfrozen
    after the first epoch rebuilds the engine, which compiles the pass once more (a new set of parameters), and the
    release stays the eager pass'."""
    import lightning as L

    class Unfreeze(L.Callback):
        def on_train_start(self, trainer, module):
            module.net[0].weight.requires_grad_(False)

        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                module.net[0].weight.requires_grad_(True)

    def run(compile_step):
        torch.manual_seed(0)
        model = Classifier()
        dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, seed=3, max_batch_size=48, compile_step=compile_step)
        x, y = blobs(200).tensors
        trainer(max_epochs=2, callbacks=[Unfreeze(), dp], precision="bf16-mixed").fit(
            model, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=20))
        return model

    counter = CompileCounterWithBackend("eager")
    eager, compiled = run(False), run({"backend": counter})
    assert counter.frame_count == 2
    for x, y in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
