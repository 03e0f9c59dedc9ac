"""Neighbouring records (issue 24, item 3): train on D and on D' with the same seeds, read both MLflow records, diff.

D' is D with ONE training example (centralized DataModules) or ONE training client (federated ones) changed
drastically (:func:`change_data`): inputs multiplied by :data:`FACTOR`, labels moved to another class. Sizes,
client counts and the configuration stay identical, so every difference between the two records is an effect of
that one example or client: DESIGN.md ("Secrets and the record") allows it only for declared releases
(:class:`lightning_dp.privacy.record.Kind.RELEASE`) and ``nonprivate/`` statistics.

A record is what an attacker reads of a run: its metrics with their full histories, params, tags, artifacts
(file contents; checkpoints loaded), and what the command printed. :func:`read_record` reads it, normalized only
for what differs between ANY two runs whatever their data: run ids (:func:`canonical`), metric timestamps, and
wall-clock durations (:data:`WALL_CLOCK_METRICS`).
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import mlflow
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_dp.privacy.record import Kind, classify, undeclared

__all__ = ["FACTOR", "Record", "change_data", "check_neighbours", "check_record", "differences", "neighbouring",
           "read_record", "run_ids_since"]

#: How much the changed example's (or client's) inputs are scaled.
FACTOR = 1000.0

#: MLflow run ids (uuid4 hex): random per run whatever its data, so they are replaced by a placeholder in every
#: text of the record (a child's mlflow.parentRunId, the grid's table of its runs, printed run locations).
_RUN_ID = re.compile(r"\b[0-9a-f]{32}\b")
#: Artifacts read as text (and compared after :func:`canonical`).
_TEXT_SUFFIXES = (".yaml", ".yml", ".md", ".tsv", ".txt", ".json", ".csv")


def canonical(text: str) -> str:
    """``text`` with every MLflow run id replaced by ``<run-id>``."""
    return _RUN_ID.sub("<run-id>", text)


#: Wall-clock durations differ between any two runs whatever their data, like timestamps: metrics of these names
#: are read as 0, and table columns of these headers (TSV, Markdown) as ``<seconds>`` (the audits' costs).
WALL_CLOCK_METRICS = ("*/seconds/*", "*/ratio_seconds")
WALL_CLOCK_COLUMNS = ("seconds",)


def _without_wall_clock(text: str, path: str) -> str:
    """The cells of :data:`WALL_CLOCK_COLUMNS` of every table in ``text`` (a ``.tsv``, or Markdown tables)."""
    out, columns = [], set()
    for line in text.splitlines():
        markdown = line.lstrip().startswith("|")
        if not (path.endswith(".tsv") or markdown):
            columns = set()
            out.append(line)
            continue
        cells = line.split("\t") if not markdown else line.split("|")
        stripped = [c.strip() for c in cells]
        if any(c in WALL_CLOCK_COLUMNS for c in stripped):
            columns = {i for i, c in enumerate(stripped) if c in WALL_CLOCK_COLUMNS}
        elif columns and not set("".join(stripped)) <= set("-: "):  # not a Markdown separator row
            cells = ["<seconds>" if i in columns else c for i, c in enumerate(cells)]
        out.append(("|" if markdown else "\t").join(cells))
    return "\n".join(out)


# --------------------------------------------------------------------------- the neighbour


def _next_label(y: torch.Tensor) -> torch.Tensor:
    """Class labels (integers) each moved to another class within the labels' range; regression targets (floats)
    scaled like the inputs."""
    if y.dtype.is_floating_point:
        return y * FACTOR
    return (y + 1) % max(int(y.max()) + 1, 2)


def _change_dataset(dataset: Any, what: str) -> str:
    """Example 0 of a map-style dataset changed in place: a ``TensorDataset`` (input x FACTOR, label moved) or
    token blocks (``TokenBlocks``: every token id of block 0 moved to another id)."""
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors[:2]
        x[0] *= FACTOR
        y[:1] = _next_label(y[:1])
        return f"{what} example 0 of {len(dataset)}: input x{FACTOR:g}, label changed"
    blocks = getattr(dataset, "blocks", None)
    if isinstance(blocks, torch.Tensor) and not blocks.dtype.is_floating_point:
        blocks[0] = (blocks[0] + 1) % (int(blocks.max()) + 1)
        return f"{what} token block 0 of {len(dataset)}: every token changed"
    raise TypeError(f"{type(dataset).__name__}: teach tests/neighbours._change_dataset this dataset")


#: Non-finite neighbours (issue 49): one input feature of one example set to this (``how`` of :func:`change_data`).
NON_FINITE = {"nan": math.nan, "inf": math.inf}


def change_data(datamodule: Any, unit: str = "client", split: str = "train", how: str = "scale") -> str:
    """Change example 0 (or client 0) of ``split`` of a set-up DataModule in place; return what changed.

    Federated DataModules (``<split>_clients``): with ``unit="client"`` (client-level DP: the client is the unit of
    privacy) client 0's inputs times :data:`FACTOR` and its labels changed; with ``unit="example"`` (record-level DP
    inside the clients: local DP-SGD, PFA) the same for client 0's example 0 only. Centralized DataModules
    (``<split>_dataset``): example 0 (:func:`_change_dataset`). A ``CentralizedView`` (a federated DataModule's
    clients pooled for centralized training; with ``DPSGD(privacy_unit="user")`` a client is a user): its federated
    DataModule's client 0 (or that client's example 0), as above. Sizes and client counts stay.

    ``split`` is ``"train"`` except for commands whose private data is elsewhere (``audit dlg`` attacks releases of
    the first validation examples).

    ``how="nan"`` or ``"inf"`` (:data:`NON_FINITE`): instead, the first input feature of the first example of client
    0 (federated, any ``unit``) is set to NaN or +inf, nothing else: a neighbour whose data is broken.
    """
    if unit not in ("client", "example"):
        raise ValueError(f"unit={unit!r}: 'client' or 'example'")
    if how != "scale" and how not in NON_FINITE:
        raise ValueError(f"how={how!r}: 'scale', 'nan' or 'inf'")
    from lightning_dp.datamodules import CentralizedView

    if isinstance(datamodule, CentralizedView):  # pools a federated DataModule's clients: change one of those
        datamodule = datamodule.federated
    clients = getattr(datamodule, f"{split}_clients", None)
    if clients and how in NON_FINITE:
        client = clients[0]
        client.x[(0,) * client.x.ndim] = NON_FINITE[how]
        return f"{split} client {client.client_id!r}: example 0's first feature set to {how}"
    if clients:
        client = clients[0]
        rows = slice(None) if unit == "client" else slice(0, 1)
        client.x[rows] *= FACTOR
        client.y[rows] = _next_label(client.y[rows])
        what = f"all {len(client)} examples" if unit == "client" else f"example 0 of {len(client)}"
        return f"{split} client {client.client_id!r}: {what}, inputs x{FACTOR:g}, labels changed"
    dataset = getattr(datamodule, f"{split}_dataset", None)
    if dataset is None:
        raise TypeError(f"{type(datamodule).__name__} has neither {split}_clients nor {split}_dataset after setup")
    return _change_dataset(dataset, split)


def _datamodule_classes() -> list[type]:
    """Every imported LightningDataModule class that defines its own ``setup``."""
    import lightning_dp.datamodules  # noqa: F401  (every DataModule of the package is imported, so a subclass)
    from lightning.pytorch import LightningDataModule

    found, stack = [], [LightningDataModule]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return [cls for cls in found if "setup" in vars(cls)]


@contextmanager
def neighbouring(monkeypatch: pytest.MonkeyPatch, unit: str = "client", split: str = "train",
                 how: str = "scale") -> Iterator[list[str]]:
    """Within the block every DataModule changes its data (:func:`change_data`) when its first ``setup`` returns,
    whoever builds it (``lightning-dp fit``, ``grid``, the audit commands); yields the list of what changed (one
    entry per DataModule). A DataModule set up inside another's ``setup`` (FederatedVisionDataModule reads the files through
    MNISTDataModule) is left alone: the outer one changes its own example or client."""
    changed: list[str] = []
    depth = [0]

    def wrap(setup: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(setup)
        def setup_then_change(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                out = setup(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and not self.__dict__.get("_neighbour_changed", False):
                changed.append(change_data(self, unit, split, how))
                self._neighbour_changed = True
            return out

        return setup_then_change

    with monkeypatch.context() as patch:
        for cls in _datamodule_classes():
            patch.setattr(cls, "setup", wrap(vars(cls)["setup"]))
        yield changed


# --------------------------------------------------------------------------- the record


@dataclass
class Record:
    """One MLflow run as an attacker reads it (module docstring)."""

    run_id: str
    name: str
    status: str
    metrics: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)
    printed: str = ""

    def names(self) -> Iterator[tuple[str, str]]:
        """``(where, name)`` of every item."""
        for where, items in (("metric", self.metrics), ("param", self.params), ("tag", self.tags),
                             ("artifact", self.artifacts)):
            yield from ((where, name) for name in items)


def _artifact_paths(client: mlflow.MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    found: list[str] = []
    for info in client.list_artifacts(run_id, path):
        found += _artifact_paths(client, run_id, info.path) if info.is_dir else [info.path]
    return sorted(found)


def _content(path: str, data: bytes) -> Any:
    """An artifact's content to compare: a checkpoint loaded (torch.save's bytes hold pickling details that are
    not the model: compare what it contains), text with run ids and wall-clock columns replaced, anything else
    (images) as bytes."""
    if path.endswith((".ckpt", ".pt", ".pth")):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)  # our own test's artifact
    if path.endswith(_TEXT_SUFFIXES):
        return _without_wall_clock(canonical(data.decode("utf-8")), path)
    return data


def read_record(uri: str, run_id: str, printed: str = "") -> Record:
    """The record of one run: metrics with full histories (steps and values; timestamps are wall clock), params and
    tags (run ids replaced: a local checkpoint's path holds one), every artifact's content (:func:`_content`), and
    ``printed`` (run ids replaced)."""
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    record = Record(run_id=run_id, name=run.info.run_name, status=run.info.status, printed=canonical(printed))
    for name in run.data.metrics:
        history = client.get_metric_history(run_id, name)
        clock = any(fnmatchcase(name, pattern) for pattern in WALL_CLOCK_METRICS)
        record.metrics[name] = tuple(sorted((int(m.step), 0.0 if clock else float(m.value)) for m in history))
    record.params = {k: canonical(v) for k, v in run.data.params.items()}
    record.tags = {k: canonical(v) for k, v in run.data.tags.items()}
    for path in _artifact_paths(client, run_id):
        local = client.download_artifacts(run_id, path)
        with open(local, "rb") as handle:
            record.artifacts[path] = _content(path, handle.read())
    return record


def run_ids_since(uri: str, known: set[str]) -> list[str]:
    """Ids of the runs of the store at ``uri`` not in ``known``, oldest first (``known`` is updated)."""
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time ASC"])
    new = [r.info.run_id for r in runs if r.info.run_id not in known]
    known.update(new)
    return new


# --------------------------------------------------------------------------- comparing


def same(a: Any, b: Any) -> bool:
    """Equality of record contents: tensors exactly (NaN equal to NaN), containers item by item, modules by their
    structure and state, other objects by ``==`` or, without one, by their attributes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0,
                                                                                      equal_nan=True)))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.nn.Module):
        return repr(a) == repr(b) and same(a.state_dict(), b.state_dict())
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # identity: compare the contents
        return same(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: compare what it prints
        return repr(a) == repr(b)


def differing_keys(a: Any, b: Any, prefix: str = "", depth: int = 3) -> list[str]:
    """The key paths (``federated.previous_step``) of two loaded checkpoints whose contents differ (for messages)."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or depth == 0:
        return [prefix.rstrip(".")] if prefix else []
    out = []
    for k in sorted(a.keys() | b.keys(), key=str):
        if k not in a or k not in b:
            out.append(f"{prefix}{k}")
        elif not same(a[k], b[k]):
            out += differing_keys(a[k], b[k], f"{prefix}{k}.", depth - 1)
    return out


def differences(a: Record, b: Record) -> list[tuple[str, str]]:
    """``(where, name)`` of every item present in one record only or different in the two."""
    out = []
    for where, x, y in (("metric", a.metrics, b.metrics), ("param", a.params, b.params), ("tag", a.tags, b.tags),
                        ("artifact", a.artifacts, b.artifacts)):
        for name in sorted(x.keys() | y.keys()):
            if name not in x or name not in y or not same(x[name], y[name]):
                out.append((where, name))
    return out


def describe(a: Record, b: Record, items: Sequence[tuple[str, str]]) -> str:
    """A readable account of differing items (for assertion messages)."""
    lines = []
    for where, name in items:
        kind = classify(name, where)
        store = {"metric": "metrics", "param": "params", "tag": "tags", "artifact": "artifacts"}[where]
        x, y = getattr(a, store).get(name, "<absent>"), getattr(b, store).get(name, "<absent>")
        if where == "artifact" and isinstance(x, str) and isinstance(y, str):
            first = next(((p, q) for p, q in zip(x.splitlines() + [""], y.splitlines() + [""]) if p != q), ("", ""))
            detail = f"text, first differing lines {first[0][:100]!r} != {first[1][:100]!r}"
        elif where == "artifact":
            keys = differing_keys(x, y)
            detail = f"checkpoint keys differing: {keys}" if keys else "bytes"
        else:
            detail = f"{str(x)[:120]} != {str(y)[:120]}"
        lines.append(f"  {where} {name!r} ({kind.value if kind else 'UNDECLARED'}): {detail}")
    return "\n".join(lines)


#: ``name=value`` or ``name: value`` in a printed line (``RestoreBestWeights: restored ... (val/loss=5.59)``).
_NAMED_VALUE = re.compile(r"(?P<name>[A-Za-z_][\w./-]*)(?P<sep>\s*[=:]\s*)"
                          r"(?P<value>[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))", re.IGNORECASE)


def released_out(line: str) -> str:
    """A printed line with the values of declared releases replaced by ``<release>``.

    Two forms name a value: an end-of-run summary row (lightning_dp.callbacks.summary: ``  <label>  <value>``, the
    label of a metric row is the metric's name, ``val/loss``) and ``name=value`` / ``name: value`` in a message.
    Everything else of the line stays, and must be the same in D and D'."""
    fields = line.split(maxsplit=1)
    if line.startswith("  ") and fields and classify(fields[0], "metric") is Kind.RELEASE:
        return f"  {fields[0]}  <release>"

    def replace(match: re.Match) -> str:
        if classify(match["name"], "metric") is Kind.RELEASE:
            return f"{match['name']}{match['sep']}<release>"
        return match[0]

    return _NAMED_VALUE.sub(replace, line)


def printed_differences(a: Record, b: Record) -> list[str]:
    """Lines printed in one run and not in the other once the values of declared releases are replaced
    (:func:`released_out`)."""
    x = [released_out(line.rstrip()) for line in a.printed.splitlines() if line.strip()]
    y = [released_out(line.rstrip()) for line in b.printed.splitlines() if line.strip()]
    return [*(line for line in x if line not in y), *(line for line in y if line not in x)]


def check_record(record: Record, *, nonprivate: bool = False) -> None:
    """Items of one record: every metric, tag and artifact declared; nothing under ``nonprivate/`` unless the run
    logged nonprivate metrics (``nonprivate``); the run finished.

    Params are configuration (the logged hyperparameters of the model, the data and the DP components) and need
    no row in the table: :func:`check_neighbours` requires them identical across D and D' instead.
    """
    assert record.status == "FINISHED", f"run {record.name} ended {record.status}"
    for where, items in (("metric", record.metrics), ("tag", record.tags), ("artifact", record.artifacts)):
        assert undeclared(items, where) == [], (f"run {record.name!r}: undeclared {where}s "
                                                "(lightning_dp/privacy/record.py)")
    if not nonprivate:
        found = [(where, name) for where, name in record.names()
                 if "nonprivate/" in name or classify(name, where) is Kind.NONPRIVATE]
        assert found == [], f"run {record.name!r}: nonprivate items with log_nonprivate_metrics=False: {found}"


def check_neighbours(d: Record, twin: Record, neighbour: Record, *, nonprivate: bool = False,
                     expect_effect: bool = True) -> list[tuple[str, str]]:
    """The neighbouring-record test of one run kind (issue 24, item 3); returns the differing release items.

    - determinism: the twin (same data, same seeds) has the same record item by item, so that a difference
      between D and D' is an effect of the changed example;
    - every item of both records is declared, none is ``nonprivate/`` (:func:`check_record`; ``nonprivate``: the
      runs logged nonprivate metrics, which may then differ too);
    - params are configuration and identical, except those the table declares releases (``best_checkpoint/*``:
      the best validation score, a param because it is written once);
    - every item that differs between D and D' is a declared release (Kind.RELEASE), and so is every printed
      line that differs (:func:`printed_differences`);
    - at least one release differs (the neighbour had an effect: the test can see one), unless ``expect_effect`` is
      False: a command that writes several runs may show the effect in another of its runs (the caller checks).
    """
    twin_diff = differences(d, twin)
    assert twin_diff == [], f"two runs on the same data differ (not deterministic):\n{describe(d, twin, twin_diff)}"
    printed = printed_differences(d, twin)
    assert printed == [], f"two runs on the same data printed differently: {printed}"
    for record in (d, neighbour):
        check_record(record, nonprivate=nonprivate)
    diff = differences(d, neighbour)
    allowed = {Kind.RELEASE, Kind.NONPRIVATE} if nonprivate else {Kind.RELEASE}
    leaks = [item for item in diff if classify(item[1], item[0]) not in allowed]
    params = [item for item in leaks if item[0] == "param"]
    assert params == [], f"params (configuration) differ between D and D':\n{describe(d, neighbour, params)}"
    assert leaks == [], ("items that are not declared releases differ between D and D' (a leak of the changed "
                         f"example):\n{describe(d, neighbour, leaks)}")
    printed = printed_differences(d, neighbour)
    assert printed == [], f"printed lines that are not release rows differ between D and D': {printed}"
    assert diff or not expect_effect, ("D and D' gave identical records: the changed example had no visible effect "
                                       "(is the test blind?)")
    return diff
