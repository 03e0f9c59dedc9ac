"""The fused one-step round (lightning_dp/federated/clients.py, RoundClients.fused_block; dense.py, DenseSteps): one
SGD step of the dense engine from the round's one hypothesis, summed by DP-FedAvg's clipping without the (m, P) models,
against the path that makes the releases (train_clients, then the server's partial_sum)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_dp.federated.clients as clients_module
from lightning_dp.datamodules.population import SyntheticPopulationDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import CentralGaussian, ClipSanitizer, LocalSGD, PoissonSelection
from lightning_dp.federated.parts.sanitizers import NoSanitizer
from lightning_dp.models import LogisticRegression
from tests.federated.test_dp_fedavg import trainer
from tests.helpers import RecordingLogger

NAN, INF = float("nan"), float("inf")


def logreg() -> nn.Module:
    """Its step's norm through the Gram matrices (8 x 40 entries from 5 x (40 + 8) factors)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(40, 8))


def mlp() -> nn.Module:
    """A first layer through the Gram matrices, a last one written out (3 x 16 entries from 5 x (16 + 3))."""
    return nn.Sequential(nn.Flatten(), nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 3))


def tiny() -> nn.Module:
    """Its factors are not smaller than its 23 parameters: the releases' path is cheaper."""
    return nn.Sequential(nn.Flatten(), nn.Linear(40, 1, bias=False), nn.ReLU(), nn.Linear(1, 3))


def block_round(model: nn.Module, dtype: torch.dtype, clip: float, update: LocalSGD | None = None,
                sanitizer: object = "none") -> FederatedRound:
    """A DP-FedAvg round whose clients are called directly (no Trainer), its hypothesis in ``dtype``."""
    rnd = FederatedRound(model.to(dtype), selection=PoissonSelection(0.5),
                         update=update or LocalSGD(epochs=1, lr=0.5, batch_size=6), sanitizer=sanitizer,
                         server_privacy=CentralGaussian(noise_multiplier=1.0, clip=clip), loss="cross_entropy",
                         seed=0, noise_seed=1)
    rnd.hypotheses = rnd.hypotheses.to(dtype)
    rnd.previous_step = rnd.previous_step.to(dtype)
    return rnd


def block(dtype: torch.dtype, clients: int = 40, width: int = 5, seed: int = 0):
    """Padded data of ``clients`` clients of 1..``width`` examples (clients 0 and 1 of one), client 3 with a NaN
    input and client 5 with an infinite one."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, width + 1, (clients,), generator=g)
    counts[:2] = 1
    mask = torch.arange(width)[None] < counts[:, None]
    x = torch.randn(clients, width, 4, 10, generator=g, dtype=dtype) * mask[..., None, None]
    x[3, 0, 1, 2] = NAN
    x[5, 0, 0, 1] = INF
    y = torch.randint(0, 3, (clients, width), generator=g) * mask
    return x, y, mask


def both_paths(rnd: FederatedRound, x, y, mask):
    """``(fused, releases' path)``: each ``(stats, norms, sum)`` of one block of all the clients."""
    rnd.clients.splits = {"train": list(range(len(x)))}  # positions for the releases path's shuffle table
    rnd.clients.key_width = x.shape[1]
    mine, origin = list(range(len(x))), rnd.hypotheses[0]
    fused = rnd.clients.fused_block(mine, 0, x, y, mask, origin)
    released, stats, _ = rnd.train_clients(mine, 0, x, y, mask)
    norms, total = rnd.server_privacy.partial_sum(released, origin)
    return fused, (stats, norms, total)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float64, 1e-10)])
@pytest.mark.parametrize("clip", [0.05, 1e3], ids=["clipping", "no-clipping"])
@pytest.mark.parametrize("model", [logreg, mlp])
def test_fused_norms_and_clipped_sum_equal_the_releases_path(dtype, rtol, clip, model):
    """Every client's float64 update norm, the block's clipped sum and the statistics (loss, cost, count, unclipped
    bit, dropped bit) are the releases path's to float rounding; the two clients with a non-finite input are
    dropped by both (norm 0, nothing added, their bit set)."""
    rnd = block_round(model(), dtype, clip)
    x, y, mask = block(dtype)
    fused, (stats, norms, total) = both_paths(rnd, x, y, mask)
    assert fused is not None
    f_stats, f_norms, f_total = fused
    assert f_norms.dtype == torch.float64 and f_total.dtype == dtype
    torch.testing.assert_close(f_norms, norms, rtol=rtol, atol=0.0)
    torch.testing.assert_close(f_total, total, rtol=rtol, atol=rtol * float(total.abs().max()))
    torch.testing.assert_close(f_stats, stats, rtol=0.0, atol=0.0, equal_nan=True)
    assert f_stats[:, 4].nonzero().flatten().tolist() == [3, 5] and f_norms[[3, 5]].tolist() == [0.0, 0.0]
    assert f_stats[:2, 2].tolist() == [1.0, 1.0]  # clients of one example
    clipped = int((norms > clip).sum())
    assert (clipped > len(x) // 2) if clip < 1 else clipped == 0


@pytest.mark.parametrize("chunk", [2**18, 700], ids=["one-chunk", "chunks-of-two-clients"])
def test_fused_steps_are_the_dense_engines_steps_in_float64(monkeypatch, chunk):
    """The norms and the unit-weighted sum of the steps held as factors (DenseSteps) are those of the steps the
    dense engine adds to the start (DenseChain.step_from), here without rounding onto the models (float64); the
    norms in one chunk of clients or in chunks of two."""
    import lightning_dp.federated.dense as dense_module

    monkeypatch.setattr(dense_module, "_CHUNK_ENTRIES", chunk)
    rnd = block_round(mlp(), torch.float64, 1.0)
    x, y, mask = block(torch.float64, seed=1)
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[[3, 5]] = False
    x, y, mask = x[keep], y[keep], mask[keep]
    start = rnd.hypotheses[0].expand(len(x), -1)
    chain = rnd.update.dense_chain(rnd.template, rnd.spec, x, y, "cross_entropy", start)
    scale = torch.full((len(x), 1), -0.5, dtype=torch.float64)
    steps = chain.step_from(start, x, y, mask, "cross_entropy", scale) - start
    held = chain.steps_from(start, x, y, mask, "cross_entropy", scale)
    norms, bounds = held.norms()
    torch.testing.assert_close(norms, steps.norm(dim=1), rtol=1e-10, atol=0.0)
    assert bool((bounds >= steps.abs().amax(dim=1)).all())
    weights = torch.rand(len(x), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(held.weighted_sum(weights), weights @ steps, rtol=1e-10, atol=1e-12)
    c_norms, c_bounds, sizes, total = held.clipped(lambda n: 1 / (1 + n))  # weights from each client's norm
    assert torch.equal(c_norms, norms) and torch.equal(c_bounds, bounds)
    torch.testing.assert_close(total, (1 / (1 + norms)) @ steps, rtol=1e-10, atol=1e-12)
    assert bool((sizes >= norms * (1 - 1e-12)).all())  # the terms' magnitudes bound the steps' norms


@pytest.mark.parametrize("case", ["two local epochs", "two batches", "vmap engine", "clip sanitizer", "tiny model"])
def test_the_releases_path_is_taken_where_the_fused_one_does_not_apply(case):
    """More than one local step (epochs > 1, or a client with more examples than a batch), another engine than the
    dense one, a sanitizer that changes the releases, a model no larger than its steps' factors: no fused block, the
    releases path's results."""
    update = {"two local epochs": LocalSGD(epochs=2, lr=0.5, batch_size=6),
              "two batches": LocalSGD(epochs=1, lr=0.5, batch_size=4),
              "vmap engine": LocalSGD(epochs=1, lr=0.5, batch_size=6, engine="vmap")}.get(case)
    rnd = block_round(tiny() if case == "tiny model" else logreg(), torch.float32, 0.05, update=update,
                      sanitizer=ClipSanitizer(1.0) if case == "clip sanitizer" else "none")
    x, y, mask = block(torch.float32)
    fused, expected = both_paths(rnd, x, y, mask)
    assert fused is None
    rnd.clients.key_tables = None
    got = rnd.clients.summed_block(list(range(len(x))), 0, x, y, mask, rnd.hypotheses[0])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def test_a_block_whose_steps_could_overflow_the_models_takes_the_releases_path():
    """Finite factors whose step could reach the float range (a huge input): the releases path decides whether the
    update is finite, as it does today."""
    rnd = block_round(logreg(), torch.float32, 1.0)
    x, y, mask = block(torch.float32)
    x[7, 0, 0, 0] = 1e30
    fused, _ = both_paths(rnd, x, y, mask)
    assert fused is None


def summed(rnd: FederatedRound, x, y, mask):
    """The round's own entry point for one block of all the clients: ``(stats, norms, sum)``."""
    rnd.clients.splits = {"train": list(range(len(x)))}
    rnd.clients.key_width = x.shape[1]
    rnd.clients.key_tables = None
    return rnd.clients.summed_block(list(range(len(x))), 0, x, y, mask, rnd.hypotheses[0])


def regression_round(dtype: torch.dtype, **parts) -> FederatedRound:
    torch.manual_seed(0)
    rnd = FederatedRound(nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype),
                         selection=PoissonSelection(0.5), update=parts.pop("update", None) or LocalSGD(
                             epochs=1, lr=0.5, batch_size=6), server_privacy=parts.pop("server_privacy", None) or
                         CentralGaussian(noise_multiplier=1.0, clip=1.0), loss="rmse", seed=0, noise_seed=1, **parts)
    rnd.hypotheses = rnd.hypotheses.to(dtype)
    rnd.previous_step = rnd.previous_step.to(dtype)
    return rnd


@pytest.mark.parametrize("dtype, scale, label", [(torch.float32, 1e9, 2.0**63), (torch.float32, 3e10, 2.0**63),
                                                 (torch.float64, 8e17, 1e150)])
def test_a_client_whose_steps_cancel_moves_the_sum_by_at_most_its_clip(dtype, scale, label):
    """A review's attack on the fused round: a client's two examples with one huge input and labels +-L make
    opposite steps, so its update is 0 (its clip factor 1), but summed from the factors in the models' dtype
    their terms' rounding moved the block's clipped sum of its neighbour by up to 63 C (float32) and 4.6 C
    (float64). The block now takes the releases' path (DenseSteps.cancellation above CANCELLATION_LIMIT), which
    clips the update as written: the sums of the two neighbouring blocks differ by at most C."""
    rnd = regression_round(dtype)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 2, 40, generator=g, dtype=dtype), torch.randn(20, 2, generator=g, dtype=dtype)
    mask = torch.ones(20, 2, dtype=torch.bool)
    x[-1] = scale * torch.ones(40, dtype=dtype) / 40**0.5
    y[-1, 0], y[-1, 1] = label, -label
    rnd.clients.splits = {"train": list(range(20))}
    rnd.clients.key_width = 2
    assert rnd.clients.fused_block(list(range(20)), 0, x, y, mask, rnd.hypotheses[0]) is None
    assert rnd.clients.fused_block(list(range(19)), 0, x[:-1], y[:-1], mask[:-1], rnd.hypotheses[0]) is not None
    with_client, without = summed(rnd, x, y, mask), summed(rnd, x[:-1], y[:-1], mask[:-1])
    assert float((with_client[2] - without[2]).double().norm()) <= 1.0 + 1e-6


def test_nearly_cancelling_steps_are_summed_in_float64_within_their_clip():
    """Steps that nearly cancel (three examples of one input near 1e4, labels +-1e6, one of them off by 1e-7 to
    1e-1 relative), below the cancellation limit, stay fused: a lone client's clipped contribution is within 1e-7
    of C (the product in float32 reached 1.00004 C)."""
    rnd = regression_round(torch.float32)
    g = torch.Generator().manual_seed(1)
    fused = 0
    for _ in range(60):
        b = int(torch.randint(2, 5, (), generator=g))
        size = float(10 ** torch.empty(()).uniform_(2, 5, generator=g))
        off = float(10 ** torch.empty(()).uniform_(-7, -1, generator=g))
        x = (size * (1 + torch.rand(1, 1, 40, generator=g))).expand(1, b, 40).clone()
        y = torch.full((1, b), 1e6)
        y[0, b // 2:] = -1e6
        y[0, -1] *= 1 - off
        mask = torch.ones(1, b, dtype=torch.bool)
        rnd.clients.splits = {"train": [0]}
        rnd.clients.key_width = b
        out = rnd.clients.fused_block([0], 0, x, y, mask, rnd.hypotheses[0])
        if out is not None:
            fused += 1
            assert float(out[2].double().norm()) <= 1.0 + 1e-7
    assert fused > 20


def test_a_float64_norm_that_overflows_takes_the_releases_path():
    """From float64 factors a norm's squares overflow where the step is finite (an input of 1e160): the releases'
    path clips that step and keeps the client (a review found the fused path dropping it: another dropped count
    and norm in the record)."""
    rnd = block_round(logreg(), torch.float64, 1.0)
    x, y, mask = block(torch.float64)
    x[7, 0, 0, 0] = 1e160
    fused, expected = both_paths(rnd, x, y, mask)
    assert fused is None
    got = summed(rnd, x, y, mask)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    assert not bool(got[0][7, 4])  # not dropped


class _ClippedReleases(NoSanitizer):
    """Changes the releases (each update clipped to norm 0.01) but keeps NoSanitizer's gate."""

    def sanitize_rows(self, trained, start, **kwargs):
        released, costs, bits = super().sanitize_rows(trained, start, **kwargs)
        d = released - start
        return start + d * torch.clamp(0.01 / (d.norm(dim=1, keepdim=True) + 1e-12), max=1.0), costs, bits


class _DecayedSGD(LocalSGD):
    """Weight decay in train(), LocalSGD's one_step kept."""

    def train(self, template, spec, start, x, y, mask, **kwargs):
        return super().train(template, spec, start, x, y, mask, **kwargs) - 0.5 * self.lr * start


class _HalvedSum(CentralGaussian):
    """Another partial sum, CentralGaussian's sum_weights kept."""

    def partial_sum(self, releases, origin):
        norms, total = super().partial_sum(releases, origin)
        return norms, total / 2


@pytest.mark.parametrize("part", ["sanitizer", "update", "server_privacy"])
def test_a_subclass_that_overrides_what_the_fused_round_skips_is_not_fused(part):
    """A subclass that overrides the method the fused round skips (the sanitizer's releases, the clients' training,
    the server's partial sum) but inherits the gate written for its parent's method is not fused: the releases'
    path runs its code (a review found the fused path silently skipping it)."""
    parts = {"sanitizer": {"sanitizer": _ClippedReleases()},
             "update": {"update": _DecayedSGD(epochs=1, lr=0.5, batch_size=6)},
             "server_privacy": {"server_privacy": _HalvedSum(noise_multiplier=1.0, clip=100.0)}}[part]
    rnd = regression_round(torch.float32, **parts)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 40, generator=g), torch.randn(6, 3, generator=g)
    mask = torch.ones(6, 3, dtype=torch.bool)
    fused, expected = both_paths(rnd, x, y, mask)
    assert fused is None
    for a, b in zip(summed(rnd, x, y, mask), expected):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def population_fit(monkeypatch, *, fused: bool, epochs: int = 1):
    """Three DP-FedAvg rounds of a logistic regression on a generated population (about 100 clients of 1-4
    examples a round, blocks of 16 clients), with the fused path allowed or not: the final model, the record, the
    server and how many blocks were fused."""
    counted = {"fused": 0, "blocks": 0}
    original = clients_module.RoundClients.fused_block

    def counting(self, *args):
        counted["blocks"] += 1
        out = original(self, *args) if fused else None
        counted["fused"] += out is not None
        return out

    with monkeypatch.context() as patch:
        patch.setattr(clients_module.RoundClients, "fused_block", counting)
        patch.setattr(clients_module, "SUM_BLOCK_ENTRIES", 16 * 170)
        dm = SyntheticPopulationDataModule(2_000, 20, task="image", input_shape=[1, 4, 4], samples=(1, 4), seed=0)
        server = CentralGaussian(noise_multiplier=1.0, clip=2.0, target_delta=1e-4)
        module = FederatedRound(LogisticRegression(16, 10), selection=PoissonSelection(0.05),
                                update=LocalSGD(epochs=epochs, lr=0.5, batch_size=10), server_privacy=server,
                                loss="cross_entropy", seed=0, noise_seed=1, log_nonprivate_metrics=True)
        recorder = RecordingLogger()
        trainer(max_epochs=3, logger=recorder, log_every_n_steps=1).fit(module, dm)
    return module.hypotheses.detach().clone(), recorder, server, counted


def test_a_fused_round_releases_the_model_of_the_releases_path(monkeypatch):
    """The same seeds, with and without the fused path: the same clients drawn, the same model released to float
    rounding, the same record (norms, clipped fraction, loss, epsilon) and accounting."""
    got, rec, server, counted = population_fit(monkeypatch, fused=True)
    expected, rec_ref, server_ref, counted_ref = population_fit(monkeypatch, fused=False)
    assert counted["fused"] == counted["blocks"] == counted_ref["blocks"] > 3 and counted_ref["fused"] == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert rec.names() == rec_ref.names()
    for name in ("nonprivate/participants", "nonprivate/clipped_fraction", "nonprivate/train_loss",
                 "nonprivate/update_norm_mean", "nonprivate/update_norm_std", "privacy/epsilon"):
        assert rec.series(name) == pytest.approx(rec_ref.series(name), rel=1e-6), name
    assert 0 < rec.series("nonprivate/clipped_fraction")[0] < 1
    assert server.accountant.history == server_ref.accountant.history


def test_a_round_of_two_local_epochs_is_never_fused(monkeypatch):
    _, _, _, counted = population_fit(monkeypatch, fused=True, epochs=2)
    assert counted["blocks"] > 3 and counted["fused"] == 0
