"""Derived generators and their streams (lightning_dp/privacy/noise.py): the trailing-zero property of NumPy's
SeedSequence, one number per stream within each seed, one number of counters per stream at every call site."""

import ast
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dp"


def test_derived_streams_alias_on_trailing_zeros_and_each_seed_has_distinct_streams() -> None:
    """The property derive_generator's docstring warns of (SeedSequence ignores trailing zero words), and the
    stream tables that keep the draws of one seed apart: distinct numbers within each seed's table."""
    from lightning_dp.audit import _common, attacks, canaries, lira, neighbours
    from lightning_dp.commands import audit_dlg
    from lightning_dp.federated import round as rnd
    from lightning_dp.privacy import noise
    from lightning_dp.privacy.noise import derive_generator

    def draw(*counters):
        return torch.rand(4, generator=derive_generator(7, *counters))

    assert torch.equal(draw(31), draw(31, 0)) and torch.equal(draw(31), draw(31, 0, 0))
    assert not torch.equal(draw(31, 0), draw(31, 1)) and not torch.equal(draw(31), draw(32))
    tables = {
        "DPSGD's secret seed": [noise.SAMPLING, noise.NOISE, noise.CLIP_STATISTIC],
        "the round's seed and noise seed": [rnd._CLIENTS, rnd._LOCAL, rnd._NOISE, rnd._INIT, rnd._VAL,
                                            rnd._SERVER_NOISE, rnd._SERVER_COUNT, rnd._DIAGNOSTICS, rnd._LOCAL_NOISE],
        "OneRunAudit's seed": [canaries.CANARY_INCLUSION, canaries.CANARY_DATA, canaries.CANARY_SAMPLING],
        "the DLG audit's seed": [_common.NOISE_STREAM, _common.DUMMY_STREAM, audit_dlg.INIT_STREAM],
        "the MIA command's seed": [attacks.INIT_STREAM, attacks.DATA_STREAM, attacks.NOISE_STREAM,
                                   attacks.SUBSET_STREAM, attacks.SHUFFLE_STREAM],
        "a LiRA seed": [lira._INIT_STREAM, lira._DATA_STREAM],
        "a noisy-neighbour seed": [neighbours._MEMBER_STREAM, neighbours._NONMEMBER_STREAM],
    }
    for seed, streams in tables.items():
        assert len(streams) == len(set(streams)), (seed, streams)


def _stream_uses() -> dict[tuple[str, str], set[int]]:
    """``{(defining module, stream name): {counters after the stream}}`` over every call site in the package that
    derives a generator (or a seed, ``seeded``) from a named stream constant."""
    uses: dict[tuple[str, str], set[int]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        imported = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "id", getattr(call.func, "attr", None))
            if name in ("derive_generator", "derive_secret_generator", "StatisticStream") and len(call.args) >= 2:
                stream, counters = call.args[1], call.args[2:]
            elif name == "seeded" and call.args:  # seeded(stream, k=0) = derive_generator(seed, stream, k)
                stream, counters = call.args[0], [None]
            else:
                continue
            if not isinstance(stream, ast.Name) or any(isinstance(c, ast.Starred) for c in counters):
                continue
            uses.setdefault((imported.get(stream.id, module), stream.id), set()).add(len(counters))
    return uses


def test_every_named_stream_is_derived_with_one_number_of_counters() -> None:
    """(seed, s, 0) is (seed, s): a stream used with two arities could draw the same numbers twice."""
    uses = _stream_uses()
    assert len(uses) >= 20  # the scan sees the package's streams (round, DPSGD, audits)
    assert uses[("lightning_dp.privacy.noise", "NOISE")] == {1}
    mixed = {key: arities for key, arities in uses.items() if len(arities) > 1}
    assert not mixed, mixed
