"""GradSampleEngine.fused_pass: the norms and clipped sums of a pass as one function of tensors (what
DPSGD(compile_step=...) compiles), checked against the naive per-example loop for every layer family, compiled with
dynamo (its "eager" backend: the same graph capture and guards as inductor, no code generation) over several steps:
captured once, never recompiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from lightning_dp.callbacks.clipping import FixedClip
from lightning_dp.callbacks.private_step import compiled_pass, fused_pass
from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine
from tests.helpers import probe
from tests.privacy.test_grad_sample import CASES, prepared
from tests.privacy.test_grad_sample_edges import _Scale


class SequenceModel(nn.Module):
    """Embedding, then an LSTM or a Transformer encoder layer, then a head on the mean."""

    def __init__(self, kind):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = (nn.LSTM(6, 5, batch_first=True) if kind == "lstm" else
                     nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True))
        self.head = nn.Linear(5 if kind == "lstm" else 6, 3)

    def forward(self, x):
        h = self.body(self.emb(x))
        return self.head((h[0] if isinstance(h, tuple) else h).mean(1))


FAMILIES = dict(CASES)
# a layer without a rule: the torch.func fallback, in the compiled pass too
FAMILIES["fallback"] = (lambda: nn.Sequential(nn.Linear(4, 6), _Scale(), nn.Tanh(), nn.Linear(6, 3)),
                        lambda g: torch.randn(6, 4, generator=g), lambda g: torch.randint(0, 3, (6,), generator=g))
for _kind in ("lstm", "transformer"):
    FAMILIES[_kind] = (lambda kind=_kind: SequenceModel(kind), lambda g: torch.randint(0, 11, (6, 7), generator=g),
                       lambda g: torch.randint(0, 3, (6,), generator=g))


def run(engine, model, x, y, fn, clip):
    with engine.record():
        F.cross_entropy(model(x), y).backward()
    engine.check_inputs_unchanged()
    b = engine.batch_size()
    norms, (sums,), stats = fn(engine, FixedClip(clip), torch.tensor(float(b), dtype=torch.float64),
                               torch.tensor(clip, dtype=torch.float64), torch.tensor(b - 1))
    engine.clear()
    return norms, sums, stats


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_fused_pass_matches_the_naive_loop_and_compiles_once(case, monkeypatch):
    monkeypatch.setitem(CASES, case, FAMILIES[case])
    model, x, y, ref = prepared(case, 0)
    engine = GradSampleEngine(model)
    probe(engine, model, x)
    counter = CompileCounterWithBackend("eager")
    compiled = compiled_pass({"backend": counter})
    clip = 0.5
    for step in range(4):
        norms, sums, stats = run(engine, model, x, y, compiled if step else fused_pass, clip)
        if step == 1:
            frames = counter.frame_count
        # the last row is padding (real = B - 1): weighted 0, counted nowhere
        factors = clip_factors(ref.norm(dim=1), clip)
        factors[-1] = 0
        expected = (factors[:, None] * ref).sum(0)
        order = {id(p): i for i, p in enumerate(engine.parameters)}
        flat = torch.cat([sums[order[id(p)]].reshape(-1) for p in model.parameters() if p.requires_grad])
        torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(flat, expected, rtol=1e-9, atol=1e-12)
        assert stats.tolist() == [float((ref.norm(dim=1)[:-1] > clip).sum()), x.shape[0] - 1, 0]
    # captured at the first compiled pass, never again; one graph for every family but the LSTM, whose replay
    # runs nn.LSTM, which dynamo does not trace (graph breaks, each compiled once)
    assert counter.frame_count == frames
    assert frames == 1 or case == "lstm"


def test_a_gathered_convolution_compiles_once_from_a_cold_start(monkeypatch):
    """A strided convolution's windows are gathered through an index cached per geometry (rules/conv.py). Compiled
    from the first pass with that cache empty (DPSGD(compile_step=...)'s first step), the pass is captured once: the
    index is built inside the graph, not put in the cache during tracing (which failed the graph's guard on the next
    pass and compiled it again); the same norms and sums as the eager pass."""
    from lightning_dp.privacy.grad_sample.rules import conv

    monkeypatch.setattr(conv, "_GATHER_INDEX", {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 8, stride=2, padding=3), nn.Tanh(), nn.Flatten(),
                          nn.Linear(4 * 14 * 14, 3)).double()
    x, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert conv._plan(F.pad(x, (3, 3, 3, 3)), (8, 8), (2, 2), (1, 1), None, 1, 4) == ("t", True)
    engine = GradSampleEngine(model)
    probe(engine, model, x)
    counter = CompileCounterWithBackend("eager")
    compiled = compiled_pass({"backend": counter})
    passes = [run(engine, model, x, y, compiled, 0.5) for _ in range(3)]
    assert counter.frame_count == 1 and not conv._GATHER_INDEX
    norms, sums, _ = run(engine, model, x, y, fused_pass, 0.5)
    for n, s, _ in passes:
        torch.testing.assert_close(n, norms, rtol=1e-12, atol=0)
        for a, b in zip(s, sums):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
