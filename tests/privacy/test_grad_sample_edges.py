"""Paths around the per-sample gradient engine that a layer-by-layer matrix does not reach: shared
(broadcast) outputs used the wrong way, per-example loops, eval mode, in-place changes of inputs,
activation checkpointing, modules that never run, and rules that return nothing.

Every accepted case is compared with per-example autograd; every refused one must name the layer
and the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, LayerRule, PerSampleGradientError, register_rule
from tests.privacy.reference import per_example_gradients

T, B = 4, 5


def _check(model, x, y, *, train=True, c=0.5, reference=None):
    """Norms and clipped sum of the engine against per-example autograd (of ``reference``, default ``model``,
    sharing its parameters); nested probe batches from one batch."""
    model = model.double().train(train)
    x = x.double() if x.is_floating_point() else x  # token ids stay integers
    params, ref = per_example_gradients(model, F.cross_entropy((reference or model)(x[:B]), y[:B], reduction="none"))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=B):
        F.cross_entropy(model(x[:B]), y[:B]).backward()
    engine.check_parameter_gradients()
    norms = engine.per_sample_norms()
    factors = clip_factors(ref.norm(dim=1), c)
    summed = engine.clipped_sum(factors)
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    engine.remove()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)
    flat = torch.cat([summed[order[id(p)]].reshape(-1) for p in params])
    torch.testing.assert_close(flat, (factors[:, None] * ref).sum(0), rtol=1e-6, atol=1e-9)


def _data(*shape, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)


class _Shared(nn.Module):
    """A positional table looked up with arange(T)[None] (shape (1, T, d), shared by every example); ``use``
    says how the model combines it with the batch."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.wpe, self.inp, self.head = nn.Embedding(T, 6), nn.Linear(3, 6), nn.Linear(6, 3)

    def forward(self, x):
        pos = self.wpe(torch.arange(x.shape[1])[None])
        return self.head(torch.tanh(self.inp(x) + self.use(pos)).mean(1))


@pytest.mark.parametrize("use", [lambda p: p, lambda p: p.squeeze(0), lambda p: p[:, :T]],
                         ids=["broadcast", "squeeze", "slice_positions"])
def test_a_shared_output_broadcast_to_the_batch_is_exact(use):
    _check(_Shared(use), *_data(T, 3))


@pytest.mark.parametrize("use,why", [
    (lambda p: p[0], "examples beyond the first"),
    (lambda p: p.select(0, 0), "examples beyond the first"),
    (lambda p: p.mean(0), "changes when the batch grows from 3 to 5"),
    (lambda p: p.sum(0, keepdim=True) / p.shape[0], "changes when the batch grows from 3 to 5"),
], ids=["index", "select", "mean", "mean_keepdim"])
def test_a_shared_output_indexed_or_reduced_over_the_batch_is_refused(use, why):
    """The expanded output gives the same result, but slice b would not carry example b's gradient: an
    engine that accepted it would attribute every example's gradient to example 0 (or to all alike)."""
    with pytest.raises(PerSampleGradientError, match=rf"layer wpe \(Embedding\).*{why}.*index a shared table"):
        _check(_Shared(use), *_data(T, 3))


class _Loop(nn.Module):
    """Processes examples one at a time (variable-length inputs): each call sees a batch of one."""

    def __init__(self, gru=False):
        super().__init__()
        self.gru = gru
        self.fc = nn.GRU(4, 6, batch_first=True) if gru else nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if self.gru:
            h = torch.stack([self.fc(x[i:i + 1, None])[1][0, 0] for i in range(x.shape[0])])
        else:
            h = torch.stack([torch.tanh(self.fc(x[i:i + 1]))[0] for i in range(x.shape[0])])
        return self.head(h)


@pytest.mark.parametrize("gru", [False, True], ids=["linear", "gru"])
def test_a_per_example_loop_is_refused(gru):
    with pytest.raises(PerSampleGradientError, match=r"layer fc .*called \[3, 5, 7\] times for batches of \[3, 5, 7\]"):
        _check(_Loop(gru), *_data(4))


def test_the_broadcast_check_runs_in_eval_mode_and_restores_the_modes():
    """Dropout would change example 0's gradient between probe sizes: the check runs without it, and every
    module's training flag is as before the probe."""
    model = nn.Sequential(_Shared(lambda p: p), nn.Dropout(0.5)).double()
    model[0].head.train(False)  # a mixed state must come back as it was
    x, y = _data(T, 3)
    engine = GradSampleEngine(model)

    def run(n):  # deterministic, as probe() requires: the same dropout draws for the same n
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return F.cross_entropy(model(x[:n].double()), y[:n])

    engine.probe(run)
    assert [layer.name for layer in engine.layers if layer.broadcast] == ["0.wpe"]
    assert model.training and model[1].training and not model[0].head.training
    engine.remove()


def test_shared_inputs_of_embedding_bag_and_attention_are_refused():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.head = nn.EmbeddingBag(11, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.head(torch.tanh(x + self.bag(torch.arange(10)[None] % 11)))

    class Latents(nn.Module):
        def __init__(self):
            super().__init__()
            self.lat = nn.Parameter(torch.randn(1, 3, 8), requires_grad=False)
            self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(x + self.attn(self.lat, self.lat, self.lat)[0]).mean(1))

    with pytest.raises(PerSampleGradientError, match=r"layer bag \(EmbeddingBag\).*one bag per example"):
        _check(Bag(), *_data(3))
    with pytest.raises(PerSampleGradientError, match=r"layer attn \(MultiheadAttention\).*expand them to the batch"):
        _check(Latents(), *_data(3, 8))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_attention_in_eval_mode_does_not_take_the_fused_path(train):
    """With its weights frozen by the engine, an eval-mode nn.MultiheadAttention would run PyTorch's fused
    kernel, which calls no F.linear: the rule switches the fast path off while the module runs."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)
            self.head.requires_grad_(False)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    before = torch.backends.mha.get_fastpath_enabled()
    _check(M(), *_data(T, 8), train=train)
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_an_input_changed_in_place_after_the_layer_is_refused():
    model = nn.Sequential(nn.Embedding(9, 4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 9))
    ids = torch.randint(0, 9, (7, 4), generator=torch.Generator().manual_seed(0))
    engine = GradSampleEngine(model)
    engine.probe(lambda n: model(ids[:n].clone()).sum())
    with engine.record(batch_size=5):
        batch = ids[:5].clone()
        out = model(batch)
        batch.zero_()  # e.g. masking the ids in place once the forward is done
        out.sum().backward()
    with pytest.raises(PerSampleGradientError, match=r"input 0 of layer 0 \(Embedding\) was modified in place.*"
                                                     r"out-of-place form"):
        engine.per_sample_norms()


def test_a_trainable_module_that_never_runs_gets_zero_gradients():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.unused = nn.Linear(4, 3), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    _check(M(), *_data(4))


class _Checkpointed(nn.Module):
    def __init__(self, last, reentrant):
        super().__init__()
        self.last, self.reentrant = last, reentrant
        self.pre, self.a, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.attn, self.ln = nn.MultiheadAttention(6, 2, batch_first=True), nn.LayerNorm(6)
        self.lstm = nn.LSTM(6, 6, batch_first=True)

    def segment(self, z):
        z = torch.tanh(self.a(z))
        if self.last == "linear":
            return z
        if self.last == "lstm":  # recorded unrolled (rules/recurrent.py), recomputed unrolled again
            return self.lstm(z)[0]
        z = self.ln(z)
        return z if self.last == "ln" else self.attn(z, z, z)[0]

    def forward(self, x):
        z = torch.tanh(self.pre(x))
        h = self.segment(z) if self.reentrant is None else cp.checkpoint(self.segment, z, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("last", ["linear", "ln", "mha", "lstm"])
def test_activation_checkpointing(last, reentrant):
    """Non-reentrant checkpointing recomputes the segment during the backward pass and stops it early: the cut
    call must leave no record. Reentrant checkpointing records only in that recomputation."""
    model = _Checkpointed(last, reentrant)

    def plain(x):  # the reference runs without checkpointing: reentrant checkpointing forbids autograd.grad
        model.reentrant = None
        try:
            return model(x)
        finally:
            model.reentrant = reentrant

    _check(model, *_data(3, 4), reference=plain)


def test_a_rule_that_returns_nothing_is_an_error_not_a_zero_gradient():
    class Odd(nn.Linear):
        pass

    @register_rule(Odd)
    class Silent(LayerRule):
        def contributions(self, layer, records, batch_size):
            return {}

    with pytest.raises(PerSampleGradientError, match=r"layer 0 \(Odd\).*returned no per-sample gradient"):
        _check(nn.Sequential(Odd(4, 3)), *_data(4))


def test_a_layer_called_with_two_input_ranks_is_refused_by_name():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) + self.fc(x[:, None, :]).squeeze(1)

    with pytest.raises(PerSampleGradientError, match=r"layer fc \(Linear\).*inputs of different ranks \(\[\(2,\), \(3,\)\]\)"):
        _check(M(), *_data(4))


def test_embedding_max_norm_renormalizes_the_whole_table_whatever_the_batch_looks_up():
    """PyTorch renormalizes the looked-up rows during the forward: which rows change would depend on the private
    batch. Under the engine every row is renormalized before the probed and recorded forwards, so two batches that
    look up different rows leave the same table (issue 25, item 4)."""
    from lightning_dp.privacy.grad_sample import GradSampleEngine as Engine

    def table_after(ids):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 2))
        engine = Engine(model)
        probe_ids = torch.zeros(7, 2, dtype=torch.long)  # the probe looks up row 0 only
        engine.probe(lambda n: model(probe_ids[:n]).sum())
        with engine.record(batch_size=len(ids)):
            model(ids).sum().backward()
        engine.per_sample_norms()
        engine.remove()
        return model[0].weight.detach().clone()

    a = table_after(torch.tensor([[1, 2], [3, 3]]))
    b = table_after(torch.tensor([[7, 8], [9, 9]]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a.norm(dim=1) <= 1.0 + 1e-6).all()
    torch.manual_seed(0)
    plain = nn.Embedding(10, 4, max_norm=1.0)
    plain(torch.tensor([1, 2, 3]))  # without the engine only the looked-up rows are renormalized
    assert (plain.weight.norm(dim=1) > 1.0).any()


def test_every_refusal_names_the_submodule():
    """A rule's refusal at construction, at a call, or when computing names the layer's path in the model."""
    from lightning_dp.privacy.grad_sample import GradSampleEngine as Engine, PerSampleGradientError as Error

    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Embedding(5, 4, scale_grad_by_freq=True)))
    with pytest.raises(Error, match=r"^layer 1\.0 \(Embedding\): nn.Embedding\(scale_grad_by_freq=True\)"):
        Engine(model)
    lstm = nn.Sequential(nn.LSTM(3, 4, proj_size=2))
    with pytest.raises(Error, match=r"^layer 0 \(LSTM\): nn.LSTM\(proj_size > 0\)"):
        Engine(lstm)


def test_split_batch_keeps_dataclass_fields_that_are_not_init_arguments():
    import dataclasses

    from lightning_dp.privacy.batch_dims import batch_leaves, split_batch

    @dataclasses.dataclass(frozen=True)
    class Batch:
        x: torch.Tensor
        y: torch.Tensor = dataclasses.field(default=None, init=True)
        mask: torch.Tensor = dataclasses.field(default=None, init=False)

    b = Batch(torch.arange(10).view(5, 2), torch.arange(5))
    object.__setattr__(b, "mask", torch.ones(5, 3))
    assert len(batch_leaves(b)) == 3
    chunks = split_batch(b, [0, 0, 0], 2, 5)
    assert [c.x.shape[0] for c in chunks] == [2, 2, 1] and [c.mask.shape[0] for c in chunks] == [2, 2, 1]
    assert torch.equal(chunks[2].y, torch.tensor([4]))


class _Upstream(nn.Module):
    """A linear layer before a recurrent one: its per-sample gradients flow back through the recurrence."""

    def __init__(self, cell, batch_first, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.pre = nn.Linear(3, 4)
        self.rnn = cell(4, 5, batch_first=batch_first, **kwargs)
        self.head = nn.Linear(5 * (2 if kwargs.get("bidirectional") else 1), 3)

    def forward(self, x):  # x: (B, T, 3)
        z = torch.tanh(self.pre(x))
        out = self.rnn(z if self.batch_first else z.transpose(0, 1))[0]
        return self.head(out.mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("cell, batch_first, kwargs", [
    (nn.LSTM, True, dict(num_layers=2, bidirectional=True)), (nn.GRU, False, dict(num_layers=2)),
    (nn.RNN, True, dict(nonlinearity="relu", bias=False))], ids=["lstm", "gru", "rnn_relu"])
def test_a_recorded_recurrent_layer_runs_unrolled_and_needs_no_replay(cell, batch_first, kwargs, monkeypatch):
    """The recorded forward of nn.LSTM/GRU/RNN runs the recurrence unrolled instead of the fused kernel: the
    model's backward gives the gates' pre-activation gradients, so the rule replays nothing after it (one
    unrolling per recorded call, none after the backward); the result is exact against per-example autograd of
    the fused model (upstream layers included), and the recorded output equals the fused one to rounding."""
    import lightning_dp.privacy.grad_sample.rules.recurrent as recurrent

    unrolled = []
    original = recurrent._unroll
    monkeypatch.setattr(recurrent, "_unroll", lambda *a, **k: unrolled.append(1) or original(*a, **k))
    model = _Upstream(cell, batch_first, **kwargs)
    x, y = _data(T, 3)
    _check(model, x, y)
    assert len(unrolled) == 1  # the recorded forward; the probes ran the fused kernel, the norms replayed nothing

    model = _Upstream(cell, batch_first, **kwargs)  # float32: the unrolled forward against the fused kernel
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=B):
        recorded = model(x[:B])
        recorded.sum().backward()
    engine.remove()
    with torch.no_grad():
        fused = model(x[:B])
    torch.testing.assert_close(recorded.detach(), fused, rtol=1e-5, atol=1e-6)
    assert len(unrolled) == 2


def _scan_reference(mode, gi, probe, h, c, w, bias, reverse):
    """The recurrence in autograd's operators, for the scans' tests: (output, h_n[, c_n])."""
    seq = [None] * gi.shape[1]
    for t in (range(gi.shape[1] - 1, -1, -1) if reverse else range(gi.shape[1])):
        if mode == "LSTM":
            i, f, g, o = (gi[:, t] + h @ w.t()).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        else:
            ir, iz, in_ = gi[:, t].chunk(3, -1)
            hr, hz, hn = (h @ w.t() + (0 if bias is None else bias) + probe[:, t]).chunk(3, -1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(in_ + r * hn)
            h = (1 - z) * n + z * h
        seq[t] = h
    return (torch.stack(seq, 1), h) + ((c,) if mode == "LSTM" else ())


@pytest.mark.parametrize("mode, bias", [("LSTM", False), ("GRU", True), ("GRU", False)],
                         ids=["lstm", "gru", "gru_no_bias"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_recurrent_scans_equal_autograd_on_the_same_recurrence(mode, bias, reverse, dtype):
    """_LSTMScan and _GRUScan (one direction as one autograd node, its backward written out) against autograd's
    operators on the same recurrence: the outputs and final states, and the gradients of every input (the input
    pre-activations, whose gradient the per-sample gradients are made of; the GRU's probe, whose gradient is the
    recurrent pre-activations'; the initial states; the recurrent weight and bias) under cotangents on all
    outputs, and with only the sequence used (the final states' gradients materialized as zeros)."""
    from lightning_dp.privacy.grad_sample.rules.recurrent import _GRUScan, _LSTMScan

    gen = torch.Generator().manual_seed(11)
    b, steps, n = 5, 7, 4

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    if mode == "LSTM":
        leaves = [rand(b, steps, 4 * n), rand(b, n), rand(b, n), rand(4 * n, n, scale=0.5)]
    else:
        leaves = [rand(b, steps, 3 * n), torch.zeros(b, steps, 3 * n, dtype=dtype), rand(b, n),
                  rand(3 * n, n, scale=0.5)] + ([rand(3 * n)] if bias else [None])
    ours = [t if t is None else t.clone().requires_grad_() for t in leaves]
    ref = [t if t is None else t.clone().requires_grad_() for t in leaves]
    if mode == "LSTM":
        got_out = _LSTMScan.apply(*ours, reverse)
        expected = _scan_reference(mode, ref[0], None, ref[1], ref[2], ref[3], None, reverse)
    else:
        got_out = _GRUScan.apply(*ours, reverse)
        expected = _scan_reference(mode, ref[0], ref[1], ref[2], None, ref[3], ref[4], reverse)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    assert got_out[0].shape == (b, steps, n) and len(got_out) == len(expected)
    for a, e in zip(got_out, expected):
        torch.testing.assert_close(a, e, **tol)
    inputs = [t for t in ours if t is not None]
    ref_inputs = [t for t in ref if t is not None]
    for used in (len(expected), 1):
        cot = [rand(*t.shape) for t in expected[:used]]
        got = torch.autograd.grad(got_out[:used], inputs, cot, retain_graph=True)
        want = torch.autograd.grad(expected[:used], ref_inputs, cot, retain_graph=True)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, **tol)


def test_a_recurrent_layer_falls_back_to_the_replay_under_autocast(monkeypatch):
    """Autocast (and packed inputs, other dtypes, a compiled forward) keep the fused kernel: the rule replays it
    after the backward, as before."""
    import lightning_dp.privacy.grad_sample.rules.recurrent as recurrent

    unrolled = []
    original = recurrent._unroll
    monkeypatch.setattr(recurrent, "_unroll", lambda *a, **k: unrolled.append(1) or original(*a, **k))
    model = _Upstream(nn.LSTM, True)
    x, y = _data(T, 3)
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    with engine.record(batch_size=B), torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x[:B]), y[:B]).backward()
    assert not unrolled
    assert torch.isfinite(engine.per_sample_norms()).all()
    assert len(unrolled) == 1  # the replay after the backward
    engine.remove()


class _SharedSequence(nn.Module):
    """A recurrent layer run on a sequence shared by all examples (a buffer of shape (1, T, 3)), added to each
    example's own features: its per-example gradients come from the expanded output."""

    def __init__(self, cell, train_rest):
        super().__init__()
        self.register_buffer("seq", torch.randn(1, T, 3, generator=torch.Generator().manual_seed(3)))
        self.rnn, self.inp, self.head = cell(3, 5, batch_first=True), nn.Linear(3, 5), nn.Linear(5, 3)
        for p in (*self.inp.parameters(), *self.head.parameters()):
            p.requires_grad_(train_rest)

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x) + self.rnn(self.seq)[0]).mean(1))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("train_rest", [True, False], ids=["all_trainable", "only_the_recurrent_layer"])
def test_a_recurrent_layer_on_a_sequence_shared_by_all_examples_is_exact(cell, train_rest):
    """Its unrolled forward's hooks see the gradient summed over the batch (the engine expands the output after the
    layer); the rule replays it from the expanded records instead, per example (a regression: one norm for the whole
    batch, the batch clipped as one unit)."""
    _check(_SharedSequence(cell, train_rest), *_data(T, 3))


@pytest.mark.parametrize("kwargs", [dict(num_layers=2), dict(bidirectional=True)], ids=["two_layers", "bidirectional"])
def test_a_stacked_recurrent_layer_on_a_shared_sequence_is_refused(kwargs):
    """Several layers or directions on a shared sequence: their final states (L*D, 1, H) would be expanded with the
    batch at dimension 0, which the replay reads at dimension 1 (a shape error in the backward before); refused at the
    probe with the fix (expand the sequence to the batch), which is then exact."""
    model = _SharedSequence(nn.LSTM, True)
    model.rnn = nn.LSTM(3, 5, batch_first=True, **kwargs)
    width = 10 if kwargs.get("bidirectional") else 5
    model.inp, model.head = nn.Linear(3, width), nn.Linear(width, 3)
    x, y = _data(T, 3)
    engine = GradSampleEngine(model)
    with pytest.raises(PerSampleGradientError, match=r"sequence shared by all examples.*seq.expand\(B, -1, -1\)"):
        engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    engine.remove()

    class Expanded(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            m = self.inner
            seq = m.seq.expand(x.shape[0], -1, -1)
            return m.head(torch.tanh(m.inp(x) + m.rnn(seq)[0]).mean(1))

    _check(Expanded(model), x, y)


def test_a_recurrent_layer_that_sees_the_batch_on_its_time_axis_is_refused():
    """nn.LSTM(batch_first=False) fed (B, T, I) runs its recurrence across the examples: no clipping bounds that."""
    model = nn.Sequential(nn.LSTM(3, 5, batch_first=False))
    x = torch.randn(7, T, 3)
    engine = GradSampleEngine(model)
    with pytest.raises(PerSampleGradientError, match=r"LSTM\(batch_first=False\) sees the batch at dimension 0 of "
                                                     r"its input, not 1: its recurrence would run across examples"):
        engine.probe(lambda n: model(x[:n])[0].sum())
    engine.remove()


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("model_layout,input_layout", [(torch.channels_last, torch.channels_last),
                                                       (torch.channels_last, torch.contiguous_format),
                                                       (torch.contiguous_format, torch.channels_last)])
def test_a_channels_last_cnn_is_exact(model_layout, input_layout):
    """Weights and images in the channels-last layout (``model.to(memory_format=torch.channels_last)``, a common
    speed-up): the windows path (3 channels; 4 channels in 2 groups, strided), the grouped backward (8 channels at
    64 positions) and GroupNorm equal per-example autograd."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, stride=2, groups=2),
                          nn.Flatten(), nn.Linear(36, 3)).to(memory_format=model_layout)
    x, y = _data(3, 16, 16)
    _check(model, x.contiguous(memory_format=input_layout), y)
    assert model[4].weight.is_contiguous(memory_format=model_layout)


class _Sum(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, h):
        return h.sum(self.dims)


class _TwiceNorm(nn.Module):
    """One GroupNorm applied to two tensors (two records of the layer in one step)."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(4, 6, 3), nn.GroupNorm(2, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.head((self.norm(h) + self.norm(h.tanh() * 2 + 1)).mean(2))


class _Then(nn.Module):
    """``head(after(norm(before(conv(x)))))``: what surrounds a normalization decides the strides its records have."""

    def __init__(self, norm, before, after, features):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(4, 6, 3), norm, nn.Linear(features, 3)
        self.before, self.after = before, after

    def forward(self, x):
        return self.head(self.after(self.norm(self.before(self.conv(x)))))


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("case", ["group_1d", "group_no_positions", "instance_3d", "twice", "bias_frozen",
                                  "weight_frozen", "channels_last", "large_mean", "summed_after", "summed_after_2d",
                                  "chomped_input", "strided_input"])
def test_group_and_instance_norms_per_example(case):
    """GroupNorm and InstanceNorm take every example's weight and bias gradients from PyTorch's group-norm backward
    with the batch folded into the channels (rules/norms.py): 1-d and 3-d inputs, no positions at all, a layer used
    twice, one of its parameters frozen, a channels-last input, inputs far from zero mean, an output gradient
    expanded with stride 0 (a sum right after the layer: the aten kernels read it as contiguous memory, which gave
    wrong norms before the rule made it contiguous), inputs that are slices of a larger tensor (a causal
    convolution's chomp, a stride); against per-example autograd."""
    model, x, y = _norm_case(case)
    _random_affine(model)
    _check(model, x, y)


def _norm_case(case):
    """``(model, x, y)`` of a normalization case of the two tests around it."""
    if case == "group_1d":
        model, (x, y) = nn.Sequential(nn.Conv1d(4, 6, 3), nn.GroupNorm(3, 6), nn.Flatten(), nn.Linear(24, 3)), _data(4, 6)
    elif case == "group_no_positions":
        model, (x, y) = nn.Sequential(nn.Linear(5, 6), nn.GroupNorm(2, 6), nn.Tanh(), nn.Linear(6, 3)), _data(5)
    elif case == "instance_3d":
        model = nn.Sequential(nn.Conv3d(2, 4, 2), nn.InstanceNorm3d(4, affine=True), nn.Flatten(), nn.Linear(4 * 27, 3))
        x, y = _data(2, 4, 4, 4)
    elif case == "twice":
        model, (x, y) = _TwiceNorm(), _data(4, 8)
    elif case in ("bias_frozen", "weight_frozen"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 3))
        (model[1].bias if case == "bias_frozen" else model[1].weight).requires_grad_(False)
        x, y = _data(3, 5, 5)
    elif case == "channels_last":
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.Flatten(), nn.Linear(72, 3))
        model = model.to(memory_format=torch.channels_last)
        x, y = _data(3, 5, 5)
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "summed_after":
        model, (x, y) = _Then(nn.GroupNorm(3, 6), nn.Identity(), lambda h: h.sum(2), 6), _data(4, 8)
    elif case == "summed_after_2d":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True), _Sum((2, 3)), nn.Linear(4, 3))
        x, y = _data(3, 5, 5)
    elif case == "chomped_input":
        model, (x, y) = _Then(nn.GroupNorm(2, 6), lambda h: h[..., :-2], lambda h: h.flatten(1), 6 * 4), _data(4, 8)
    elif case == "strided_input":
        model, (x, y) = _Then(nn.GroupNorm(3, 6), lambda h: h[..., ::2], lambda h: h.flatten(1), 6 * 3), _data(4, 8)
    else:  # large_mean: a normalized input 100 standard deviations from zero
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 3))
        with torch.no_grad():
            model[0].bias.fill_(100.0)
        x, y = _data(3, 5, 5)
    return model, x, y


def _random_affine(model):
    """Random affine parameters for every group and instance normalization of ``model``: the defaults (1, 0) hide a
    swapped weight and bias."""
    for m in model.modules():
        if isinstance(m, (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)



class _NormalizesAnother(nn.GroupNorm):
    """Normalizes ``2 x + 1``, whose normalized values are x's (eps 0), so the rule's formula holds (its rule is
    registered for it below, as a user registers a rule for a subclass that computes what the parent does); but the
    autograd node of its output holds the moments of ``2 x + 1``, not of the recorded input ``x``."""

    def forward(self, x):
        return F.group_norm(2 * x + 1, self.num_groups, self.weight, self.bias, self.eps)


def _group_norm_rule_for_normalizes_another():
    from lightning_dp.privacy.grad_sample.rules.norms import GroupNormRule

    register_rule(_NormalizesAnother)(GroupNormRule)


_group_norm_rule_for_normalizes_another()


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("case,reused", [("after_conv", True), ("channels_last", True), ("twice", True),
                                         ("first_layer", False), ("strided_input", False),
                                         ("normalizes_another", False), ("checkpointed", False),
                                         ("checkpointed_module", False)])
def test_group_norm_reads_the_forward_moments_of_its_own_input_only(case, reused, monkeypatch):
    """GroupNorm's rule takes the means and inverse deviations its forward computed (from the output's autograd
    node, rules/norms.py: ``_forward_moments``) where that node normalized exactly the recorded input, and computes
    them again otherwise: no node (an input that does not require grad), a contiguous copy of a strided input, another
    tensor than the input (which would give wrong gradients with the node's moments), saved tensors packed by
    activation checkpointing (reading them would run the segment again inside the forward; with the composable
    ``checkpoint`` of the layer itself, whose hooks are gone when the engine's runs, a first version raised);
    per-example autograd agrees in every case."""
    from lightning_dp.privacy.grad_sample.rules import norms

    taken = []
    found = norms._forward_moments

    def spy(*args):
        moments = found(*args)
        taken.append(moments is not None)
        return moments

    monkeypatch.setattr(norms, "_forward_moments", spy)
    if case == "after_conv":
        model, (x, y) = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.Flatten(), nn.Linear(72, 3)), _data(3, 5, 5)
    elif case in ("channels_last", "twice", "strided_input"):
        model, x, y = _norm_case(case)
    elif case == "first_layer":
        model, (x, y) = nn.Sequential(nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(24, 3)), _data(4, 6)
    elif case == "checkpointed":
        norm = nn.GroupNorm(3, 6)
        model = _Then(nn.Identity(), lambda h: cp.checkpoint(lambda t: norm(t).tanh(), h, use_reentrant=False),
                      lambda h: h.flatten(1), 6 * 6)
        model.gn = norm
        x, y = _data(4, 8)
    elif case == "checkpointed_module":
        composable = pytest.importorskip("torch.distributed._composable")
        model, (x, y) = _Then(nn.GroupNorm(3, 6), nn.Identity(), lambda h: h.flatten(1), 6 * 6), _data(4, 8)
        # the reference: the same parameters without the checkpoint (which recomputes once, not per example)
        reference = _Then(nn.GroupNorm(3, 6), nn.Identity(), lambda h: h.flatten(1), 6 * 6)
        reference.conv, reference.head = model.conv, model.head
        reference.norm.weight, reference.norm.bias = model.norm.weight, model.norm.bias
        composable.checkpoint(model.norm)
    else:
        model, (x, y) = _Then(_NormalizesAnother(3, 6, eps=0.0), nn.Identity(), lambda h: h.flatten(1), 6 * 6), \
            _data(4, 8)
    _random_affine(model)
    _check(model, x, y, reference=reference if case == "checkpointed_module" else None)
    assert taken and all(t == reused for t in taken), taken


class _StandardizedConv(nn.Conv2d):
    """A weight-standardized convolution: its forward normalizes the weight first."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class _OtherEps(nn.GroupNorm):
    """A GroupNorm whose forward uses another eps than its attribute."""

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, 0.5)


class _DoubledLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, 2 * self.weight, self.bias)


class _PlainSubclass(nn.Linear):
    """A subclass that keeps nn.Linear's forward: it keeps nn.Linear's rule."""


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("case", ["standardized_conv", "other_eps", "doubled_linear", "plain_subclass"])
def test_a_subclass_that_overrides_forward_takes_the_exact_fallback(case):
    """A subclass of a layer with a rule that overrides its forward computes something else than the formulas of
    the parent's rule: it takes the torch.func fallback (``rule_for`` returns None), and its per-sample gradients
    are exact. Before, the parent's rule gave the gradients of the parent's computation (wrong norms: a weight-
    standardized convolution, a GroupNorm with another eps, a linear layer on twice its weight). The engine warns
    once per such layer, naming the rule to register where the forward computes the parent's. A subclass that keeps
    the forward keeps the rule."""
    from lightning_dp.privacy.grad_sample.registry import rule_for
    from lightning_dp.privacy.grad_sample.rules.linear import LinearRule

    if case == "standardized_conv":
        layer = _StandardizedConv(3, 4, 3)
        model, (x, y) = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(36, 3)), _data(3, 5, 5)
    elif case == "other_eps":
        layer = _OtherEps(2, 4)
        model, (x, y) = nn.Sequential(nn.Conv2d(3, 4, 3), layer, nn.Flatten(), nn.Linear(36, 3)), _data(3, 5, 5)
        _random_affine(model)
    elif case == "doubled_linear":
        layer = _DoubledLinear(5, 6)
        model, (x, y) = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3)), _data(5)
    else:
        layer = _PlainSubclass(5, 6)
        model, (x, y) = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3)), _data(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(model, x, y)
    assert type(rule_for(layer)) is (LinearRule if case == "plain_subclass" else type(None))
    said = [str(w.message) for w in caught if "torch.func fallback" in str(w.message)]
    if case == "plain_subclass":
        assert not said
    else:  # the engine says which layer, why, and how to opt back in
        assert len(said) == 1 and "another forward" in said[0] and f"register_rule({type(layer).__qualname__})" in said[0]


def _doubling_hook():
    """An accelerate ModelHook of a user's whose post_forward doubles the layer's output."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Doubling(hooks.ModelHook):
        def post_forward(self, module, output):
            return 2 * output

    return Doubling()


@pytest.mark.parametrize("case", ["replaced", "accelerate_hook", "accelerate_device_hook", "accelerate_user_hook",
                                  "accelerate_sequential_with_user_hook"])
def test_a_forward_set_on_the_instance_takes_the_exact_fallback(case):
    """An ``nn.Linear`` whose forward is replaced on the instance (here computing with twice its weight) takes the
    torch.func fallback, with a warning: its rule gave wrong norms before, and the engine's gradient check passed.
    Accelerate's device hooks (and its no-op base hook), which wrap the class's own forward (kept as
    ``_old_forward``), keep the rule; a user's accelerate hook that changes the output (alone or in a
    ``SequentialHook``) takes the fallback: the rule's formulas would describe the forward without the hook."""
    import types

    from lightning_dp.privacy.grad_sample.registry import rule_for
    from lightning_dp.privacy.grad_sample.rules.linear import LinearRule

    layer = nn.Linear(5, 6)
    if case == "replaced":
        layer.forward = types.MethodType(lambda self, x: F.linear(x, 2 * self.weight, self.bias), layer)
    else:
        hooks = pytest.importorskip("accelerate.hooks")
        hook = {"accelerate_hook": lambda: hooks.ModelHook(),
                "accelerate_device_hook": lambda: hooks.AlignDevicesHook(execution_device="cpu", io_same_device=True),
                "accelerate_user_hook": _doubling_hook,
                "accelerate_sequential_with_user_hook": lambda: hooks.SequentialHook(
                    hooks.AlignDevicesHook(execution_device="cpu"), _doubling_hook())}[case]()
        hooks.add_hook_to_module(layer, hook)
    model, (x, y) = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3)), _data(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(model, x, y)
    said = [str(w.message) for w in caught if "torch.func fallback" in str(w.message)]
    keeps = case in ("accelerate_hook", "accelerate_device_hook")
    assert type(rule_for(layer)) is (LinearRule if keeps else type(None))
    assert len(said) == (0 if keeps else 1)
    if case == "replaced":  # registering a rule for the type would not help here: the message says what would
        assert "set on the instance" in said[0] and "register_rule" not in said[0]
    elif not keeps:
        assert "Doubling" in said[0] or "SequentialHook" in said[0]
        assert "device hooks" in said[0] and "register_rule" not in said[0]


class _TwoSizes(nn.Module):
    """One stride-2 convolution on an image and on its crop (two records of different sizes in one step)."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, stride=2), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)) + self.conv(x[:, :, 1:, 2:]).tanh().mean((2, 3)))


class _TiedConvs(nn.Module):
    """Two convolutions sharing a weight: one on a channels-last input (windows copied channels innermost), one with
    stride 2 on a contiguous input (windows gathered): the cross term of the norm pairs the two layouts."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(16, 8, 3), nn.Conv2d(16, 8, 3, stride=2), nn.Linear(8, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        ya = self.a(x.contiguous(memory_format=torch.channels_last))
        return self.head(ya.tanh().mean((2, 3)) + self.b(x).sin().mean((2, 3)))


@pytest.mark.parametrize("case", ["two_sizes_gathered", "channels_last_channels_innermost", "tied_two_layouts"])
def test_convolution_windows_as_planned(case, monkeypatch):
    """The convolution's windows as :func:`conv._plan` lays them out by itself (no plan forced), on the paths the
    layer matrix does not take: a layer called on two sizes with its windows gathered (the index is per size), a
    channels-last input with 16 channels (copied channels innermost), a weight shared by two layers laid out
    differently; against per-example autograd."""
    from lightning_dp.privacy.grad_sample.rules import conv

    plans = []
    plan = conv._plan
    monkeypatch.setattr(conv, "_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    if case == "two_sizes_gathered":
        model, (x, y) = _TwoSizes(), _data(3, 9, 11)
        expected = {("t", True)}
    elif case == "channels_last_channels_innermost":
        model = nn.Sequential(nn.Conv2d(16, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 16, 3))
        model = model.to(memory_format=torch.channels_last)
        x, y = _data(16, 6, 6)
        x = x.contiguous(memory_format=torch.channels_last)
        expected = {("tc", False)}
    else:
        model, (x, y) = _TiedConvs(), _data(16, 9, 9)
        expected = {("tc", False), ("t", True)}
    _check(model, x, y)
    assert set(plans) == expected


class _Scale(nn.Module):
    """A layer without a rule (the torch.func fallback replays it)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x):
        return x * self.w


def _recorded(model, x, y):
    """An engine on ``model``, probed on nested batches of ``x``."""
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    return engine


def _refused_when_recorded(model, x, y, match, engine=None):
    """The recorded forward and backward of ``model`` on ``x`` raise a PerSampleGradientError matching ``match``
    (with ``engine``, or a new one, removed after)."""
    engine = engine or _recorded(model, x, y)
    with pytest.raises(PerSampleGradientError, match=match):
        with engine.record(batch_size=x.shape[0]):
            F.cross_entropy(model(x), y).backward()
    engine.remove()


@pytest.mark.parametrize("layer", [lambda: nn.Linear(6, 6), _Scale],
                         ids=["a rule", "the replay"])
@pytest.mark.parametrize("hook, refused", [
    (lambda m, args, out: out * 2, True),  # another output: the rule's formula would give half the gradient
    (lambda m, args, out: out.mul_(2), True),  # the output changed in place
    (lambda m, args, out: None, False),  # an observer: the output as the forward returned it
    (lambda m, args, out: out, False),  # the same tensor back
], ids=["scaled", "in place", "observer", "same"])
def test_a_forward_hook_that_changes_a_layers_output_is_refused(layer, hook, refused):
    """A user's forward hook registered before the engine runs before the engine's and while the layer's weights
    are frozen: a change of the output it makes is outside the rule's formula and outside the replay (which runs the
    forward alone): norms too low by the factor, silently, before this check."""
    torch.manual_seed(0)
    first = layer()
    model = nn.Sequential(nn.Linear(5, 6), first, nn.Tanh(), nn.Linear(6, 3))
    first.register_forward_hook(hook)
    x, y = _data(5)
    if not refused:
        _check(model, x, y)
        return
    _refused_when_recorded(model, x, y, "a forward hook on it changed its output")


@pytest.mark.parametrize("hook, refused", [(lambda m, args, out: out * 2, True), (lambda m, args, out: None, False)],
                         ids=["scaled", "observer"])
def test_a_global_forward_hook_is_watched(hook, refused):
    """Global forward hooks (register_module_forward_hook) run before every module's hooks: the engine keeps the
    forward's own output ahead of them."""
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = _data(5)
    handle = register_module_forward_hook(lambda m, args, out: hook(m, args, out) if m is model[0] else None)
    try:
        if not refused:
            _check(model, x, y)
            return
        _refused_when_recorded(model, x, y, "a forward hook on it changed its output")
    finally:
        handle.remove()




def test_hooks_put_ahead_of_the_engine_later_are_caught():
    """A prepend forward hook added after the engine's watch is armed runs before it: put back first. A forward
    pre-hook added after the engine would run with the weights frozen (a use of them would escape): refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = _data(5)
    model[0].register_forward_hook(lambda m, args, out: None)  # an observer arms the watch
    engine = _recorded(model, x, y)
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    engine.clear()
    model[0].register_forward_hook(lambda m, args, out: out * 2, prepend=True)
    _refused_when_recorded(model, x, y, "a forward hook on it changed its output", engine)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    engine = _recorded(model, x, y)
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * m.weight.sum(),))
    _refused_when_recorded(model, x, y, "a forward pre-hook was registered on it after the engine", engine)


def test_a_replayed_layer_sees_global_pre_hooks_once():
    """Global forward pre-hooks too: the replay runs the forward alone, no module call (306 % off before)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _Scale(), nn.Tanh(), nn.Linear(6, 3))
    handle = register_module_forward_pre_hook(lambda m, args: (args[0] + 1,) if m is model[1] else None)
    try:
        _check(model, *_data(5))
    finally:
        handle.remove()


def test_an_engine_dropped_without_remove_is_freed_under_global_hooks():
    """The engine's global capture hook holds it weakly: an engine and model dropped without remove() go (the model's
    hooks and the engine hold each other, a cycle the collector frees), the engine's global hook with them."""
    import gc
    import weakref

    from torch.nn.modules.module import _global_forward_hooks, register_module_forward_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = _data(5)
    handle = register_module_forward_hook(lambda m, args, out: None)
    try:
        engine = _recorded(model, x, y)
        with engine.record(batch_size=7):
            F.cross_entropy(model(x), y).backward()
        assert len(_global_forward_hooks) == 2  # the user's and the engine's
        alive = weakref.ref(engine)
        del engine, model
        gc.collect()
        assert alive() is None and len(_global_forward_hooks) == 1
    finally:
        handle.remove()


def test_a_replayed_layer_sees_its_pre_hooks_once():
    """The replay runs the layer's forward on the inputs the forward received (after its pre-hooks), not the module
    with its hooks (which applied a pre-hook twice: norms off by up to 30 %, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _Scale(), nn.Tanh(), nn.Linear(6, 3))
    model[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    _check(model, *_data(5))


@pytest.mark.parametrize("replayed", [False, True], ids=["a rule", "the replay"])
def test_a_forward_hook_added_after_the_engine_is_differentiated_through(replayed):
    """A hook registered after the engine's runs after it: the engine records the layer's own output, whose
    gradient autograd carries through the hook's change; exact (the replay runs the forward alone, not the hook)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _Scale() if replayed else nn.Identity(), nn.Tanh(),
                          nn.Linear(6, 3)).double()
    hooked = model[1] if replayed else model[0]
    x, y = _data(5)
    x = x.double()
    engine = GradSampleEngine(model)
    engine.probe(lambda n: F.cross_entropy(model(x[:n]), y[:n]))
    handle = hooked.register_forward_hook(lambda m, args, out: out * 2)
    params, ref = per_example_gradients(model, F.cross_entropy(model(x), y, reduction="none"))
    with engine.record(batch_size=7):
        F.cross_entropy(model(x), y).backward()
    norms = engine.per_sample_norms()
    engine.remove()
    handle.remove()
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("second", ["create_graph", "autograd_grad_first", "backward_twice"])
def test_a_recorded_forward_is_differentiated_once(second):
    """A gradient penalty (create_graph=True), torch.autograd.grad before loss.backward() and two backward passes
    through one forward are refused: the hooks cannot tell a diagnostic autograd.grad (which adds nothing to .grad)
    from a backward, and a double backward's dependence on the weights reaches no output gradient (norms 5x off,
    silently, before the refusal). One backward of the summed losses is what the step supports."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    engine = _recorded(model, x, y)
    xs = x.clone().requires_grad_()
    with pytest.raises(PerSampleGradientError, match="once per step"):
        with engine.record(batch_size=8):
            loss = F.cross_entropy(model(xs), y)
            if second == "create_graph":
                (g,) = torch.autograd.grad(loss, xs, create_graph=True)
                (loss + g.square().sum()).backward()
            elif second == "autograd_grad_first":
                torch.autograd.grad(loss, xs, retain_graph=True)
                loss.backward()
            else:
                loss.backward(retain_graph=True)
                loss.backward()
    engine.clear()
    with engine.record(batch_size=8):  # the engine still records a plain step afterwards
        (F.cross_entropy(model(x), y) + 0.5 * F.cross_entropy(model(x), y)).backward()
    assert engine.per_sample_norms().shape == (8,)
    engine.remove()


def test_a_backward_pass_that_skips_every_recorded_layer_is_refused():
    """loss.backward(inputs=params) prunes the recorded layers' outputs (the weights were frozen during the forward):
    no hook fires, and every per-sample gradient would be 0, the step releasing noise alone. Refused when the norms
    are asked for."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    engine = _recorded(model, x, y)
    with engine.record(batch_size=8):
        F.cross_entropy(model(x), y).backward(inputs=list(model.parameters()))
    with pytest.raises(PerSampleGradientError, match="no output gradient reached any recorded layer"):
        engine.per_sample_norms()
    engine.remove()


def _mixing_losses():
    def info_nce(model, x, y):  # each example's negatives are the batch's other examples
        z = F.normalize(model(x), dim=1)
        z2 = F.normalize(model(x + 0.1), dim=1)
        return F.cross_entropy(z @ z2.T / 0.1, torch.arange(x.shape[0]))

    def centred(model, x, y):  # logits centred on the batch mean
        logits = model(x)
        return F.cross_entropy(logits - logits.mean(0), y)

    def centred_between_layers(model, x, y):
        h = model[0](x)
        return F.cross_entropy(model[2](torch.tanh(h - h.mean(0))), y)

    return {"info_nce": info_nce, "centred_logits": centred, "centred_between_layers": centred_between_layers}


@pytest.mark.parametrize("loss", list(_mixing_losses()))
def test_a_loss_that_mixes_the_examples_is_refused(loss):
    """A loss (or an operation between layers) that mixes the batch's examples makes example b's row depend on the
    others: moving one example changed another's row (a review's test, InfoNCE: row 0 10.6 -> 7.2), each clipped
    to C, so one example's influence is about 2 B C. Refused by the probe: two batches of 7 examples with the same
    first three, run from the same random state, give those three other output gradients."""
    fn = _mixing_losses()[loss]
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 4, (12,))
    engine = GradSampleEngine(model)

    def examples(indices):
        with torch.random.fork_rng():
            return fn(model, x[indices], y[indices])

    try:
        with pytest.raises(PerSampleGradientError, match=r"the loss mixes the examples of the batch: what layer 0 "
                                                         r"\(Linear\)"):
            engine.probe(lambda n: examples(list(range(n))), examples=examples)
        engine.probe(lambda n: examples(list(range(n))))  # without examples(indices), the probe cannot check it
    finally:
        engine.remove()


def _independent_losses():
    """Steps whose examples' gradients are independent although the step draws random numbers, reduces twice, or
    scales the batch by one number: none may be refused (the first check, withdrawn, refused the first three)."""
    def noise_augmentation(model, x, y):
        return F.cross_entropy(model(x + 0.3 * torch.randn_like(x)), y)

    def vae(model, x, y):  # the reparametrization trick, and a per-example KL term
        h = model(x)
        mu, logvar = h[:, :2], h[:, 2:]
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return F.mse_loss(z, x[:, :2]) - 0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()

    def mean_plus_sum(model, x, y):
        out = model(x)
        return F.cross_entropy(out, y) + 0.1 * F.cross_entropy(out, y, reduction="sum")

    def dropout(model, x, y):
        return F.cross_entropy(F.dropout(model(x), 0.5), y)

    def weighted_mean(model, x, y):  # a batch-level scalar: a hole of its own, documented; not this check's
        w = x[:, 0].abs() + 0.1
        return (w * F.cross_entropy(model(x), y, reduction="none")).sum() / w.sum()

    def ignore_index(model, x, y):  # the mean over the batch's non-ignored targets: the same
        return F.cross_entropy(model(x), torch.where(x[:, 1] > 0.5, -100, y), ignore_index=-100)

    return {f.__name__: f for f in (noise_augmentation, vae, mean_plus_sum, dropout, weighted_mean, ignore_index)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss", list(_independent_losses()))
def test_a_loss_of_independent_examples_is_not_refused(loss, dtype):
    fn = _independent_losses()[loss]
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)
    x, y = torch.randn(12, 5, dtype=dtype), torch.randint(0, 4, (12,))
    engine = GradSampleEngine(model)

    def examples(indices):
        with torch.random.fork_rng():
            return fn(model, x[indices], y[indices])

    try:
        engine.probe(lambda n: examples(list(range(n))), examples=examples)
    finally:
        engine.remove()


def test_a_batch_split_across_forwards_in_one_recorded_step_is_refused():
    """record(batch_size=6) around two forwards of 3 examples: each layer's two calls are read as the same 3
    examples, so examples i and i + 3 shared one row, clipped together (a review's test: norms ||g_i + g_{i+3}||,
    silently). The layers' batch size is now compared with the one the step was recorded with."""
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    engine = _recorded(model, x, y)
    with engine.record(batch_size=6):
        (F.cross_entropy(model(x[:3]), y[:3], reduction="sum") + F.cross_entropy(model(x[3:6]), y[3:6],
                                                                               reduction="sum")).backward()
    with pytest.raises(PerSampleGradientError, match=r"recorded with batch_size=6, but its layers saw 3 examples"):
        engine.per_sample_norms()
    engine.remove()


@pytest.mark.parametrize("how", ["functional_call", "replaced"])
def test_a_parameter_swapped_out_of_its_layer_is_refused(how):
    """torch.func.functional_call with other tensors, or a new Parameter assigned after the engine was built: the
    rules would compute gradients for tensors that are not the ones released (a review's test: norms 1.2-2.9 for a
    gradient of 0; a replaced weight's plain .grad left unclipped). Refused at the recorded call."""
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    engine = _recorded(model, x, y)
    if how == "replaced":
        model[2].weight = nn.Parameter(torch.randn(3, 8))
    first = "0" if how == "functional_call" else "2"  # functional_call swaps every layer's; the first is refused
    with pytest.raises(PerSampleGradientError, match=rf"layer {first} \(Linear\): its parameter 'weight' is not the"):
        with engine.record(batch_size=8):
            if how == "functional_call":
                params = {k: v.detach() * 2 for k, v in model.named_parameters()}
                out = torch.func.functional_call(model, params, (x,))
            else:
                out = model(x)
            F.cross_entropy(out, y).backward()
    engine.remove()


def test_a_weight_used_in_a_forward_hook_is_refused():
    """A forward hook registered before the engine that uses the layer's weight (a regularizer kept for the loss)
    ran while the engine had frozen the weight: the term's gradient was silently dropped. The weights are now
    trainable again for the hooks that run after the layer's forward, so the term gives the weight an autograd
    gradient, which check_parameter_gradients refuses (DPSGD calls it every step)."""
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model[2].register_forward_hook(lambda mod, inp, out: setattr(mod, "reg", mod.weight.square().sum()))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    engine = _recorded(model, x, y)
    with engine.record(batch_size=8):
        (F.cross_entropy(model(x), y) + 0.5 * model[2].reg).backward()
    with pytest.raises(PerSampleGradientError, match=r"no use of module.weight in a forward hook"):
        engine.check_parameter_gradients()
    engine.remove()


@pytest.mark.parametrize("hook", [lambda g: -g, lambda g: 3 * g], ids=["reversal", "scale"])
def test_a_tensor_hook_on_a_layer_output_reaches_the_layer(hook):
    """A user's tensor hook on a layer's output that changes its gradient (a gradient reversal layer, a scale) runs
    after the engine's capture was registered; the capture took the gradient before it, so the layer's own
    per-sample gradients missed the change (a review's test: x2 on a linear layer, norms 24 % low), silently. The
    engine now takes it in a pre-hook of the output's autograd node, after every tensor hook: exact."""
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3)

        def forward(self, x):
            h = self.a(x)
            if h.requires_grad:
                h.register_hook(hook)
            return self.b(torch.tanh(h))

    _check(Hooked(), *_data(3))


def test_a_layer_output_view_changed_in_place_is_refused():
    """nn.Linear on (B, T, d) returns a view; nn.ReLU(inplace=True) after it rebases the view, and the layer's
    output gradient never reaches the engine: before, the layer got no per-sample gradient and silently never
    trained (a review's test; the bound held). Refused now, with the out-of-place form, which is exact."""
    x, y = torch.randn(8, 4, 6), torch.randint(0, 3, (8,))
    for inplace in (True, False):
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=inplace), nn.Linear(16, 3))

        def loss(n, model=model):
            return F.cross_entropy(model(x[:n]).mean(1), y[:n])

        engine = GradSampleEngine(model)
        engine.probe(loss)
        with engine.record(batch_size=8):
            loss(8).backward()
        if inplace:
            with pytest.raises(PerSampleGradientError, match=r"layer 0 \(Linear\): its output was changed in place"):
                engine.per_sample_norms()
        else:
            assert torch.isfinite(engine.per_sample_norms()).all()
        engine.remove()
