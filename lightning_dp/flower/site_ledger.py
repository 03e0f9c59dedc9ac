"""A site's own privacy ledger on a Flower deployment: no server to trust (issue 52, item 3).

Under local DP (a local sanitizer: ``gaussian_ldp``, ``laplace_ldp``, the d-privacy ``euclidean_laplace``) and
under record-level DP-SGD inside the clients (``local_dp_sgd``), what a client releases is private by itself, so
its guarantee must not rest on the server's bookkeeping. The server keeps the run's ledgers as in simulation (for
its record); each site keeps its own, on its own disk, and is the one that enforces it:

- **charged before release**: a TRAIN reply leaves the site only after the costs of its clients' releases (and
  the record-level DP-SGD steps) are written to the site's ledger file;
- **budgets enforced by the site**: a client whose release would take it past ``client_privacy_cap``, or past its
  record-level budget under ``local_dp_sgd``, is not trained and the message is refused, whatever the server asks;
- **no noise reused**: a site's noise is a function of its secret seed, the round and the client, so a server
  that sends the same round again with other hypotheses would learn the difference of two releases exactly. The
  ledger keeps a digest of the public input of every (round, client) it released from each noise stream; the same
  input again is the same release (no new cost), another input is refused. A stream is named without the seed: a
  pinned ``noise-seed`` by the operator's public ``noise-seed-label`` (default empty: a new pinned seed needs a new
  label, else the rounds it answered before are refused), a fresh seed (none given: drawn by the process that
  builds the site, as Flower 1.42 does for every message) by a random id of that process, whose repeats are then
  charged as the new releases they are.

The file (``--node-config ledger="PATH"``, default ``lightning-dp-ledger-<site or partition-P>.json`` in the
SuperNode's working directory) accumulates over runs: a client's spend composes across them. It holds the clients'
ids, their costs and participations (what the server's ledger holds), never a seed or data. Flower starts a
process per message, so the file is read and written under an exclusive lock each time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["SiteLedger", "default_path", "input_digest"]

_FORMAT = 1


def default_path(node_config: Any) -> Path:
    """The ledger file of a node that names none: per site (or partition) in the working directory."""
    site = str(node_config.get("site", "")).strip() if "site" in node_config else ""
    name = site if site else f"partition-{int(node_config.get('partition-id', 0))}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return Path(f"lightning-dp-ledger-{safe}.json")


def input_digest(*, hypotheses: torch.Tensor, previous_step: torch.Tensor, seed: int, clip: float, round: int,
                 num_clients: int | None = None) -> str:
    """SHA-256 of everything public that a TRAIN message gives a client's computation: the state, the public seed,
    the clipping threshold, the round and the deployment's client count (local_dp_sgd's noise scale follows it: two
    answers with the same noise draws at two scales would show the update)."""
    h = hashlib.sha256()
    for t in (hypotheses, previous_step):
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.numpy().tobytes())
    h.update(json.dumps([int(seed), float(clip), int(round), -1 if num_clients is None else int(num_clients)]).encode())
    return h.hexdigest()


class SiteLedger:
    """The site's ledger file, opened for one message: ``with SiteLedger(path, module, stream).open() as ledger:``;
    ``stream`` names the noise the site's releases come from (``pinned:<label>`` or ``fresh:<process id>``)."""

    def __init__(self, path: str | Path, module: Any, stream: str) -> None:
        self.path, self.module, self.stream = Path(path), module, str(stream)
        self.released: dict[str, str] = {}

    def _kinds(self) -> dict[str, Any]:
        m = self.module
        return {"sanitizer": m.sanitizer.name if m.sanitizer.accountable else None,
                "update": m.update.name if m.update.accountable else None}

    @contextlib.contextmanager
    def open(self) -> Iterator[SiteLedger]:
        """Lock the file, load it into the module's ledgers, and write it back when the block ends without error."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._load()
            yield self
            self._save()

    def _load(self) -> None:
        m = self.module
        if not self.path.exists():
            self.released = {}
            return
        try:
            state = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"the site's ledger {self.path} cannot be read ({err}): it is what protects this site's "
                             "clients; restore it from a backup rather than deleting it") from None
        if state.get("format") != _FORMAT or state.get("kinds") != self._kinds():
            raise ValueError(f"the site's ledger {self.path} was written for {state.get('kinds')!r}, this run "
                             f"releases {self._kinds()!r}: a ledger adds up one kind of cost. Give this node another "
                             "--node-config ledger=\"PATH\"")
        if state.get("client_ledger") is not None:
            m.ledger.load_state_dict(state["client_ledger"])
        if state.get("record_ledger") is not None:
            m.update.ledger.load_state_dict(state["record_ledger"])
        self.released = dict(state.get("released", {}))

    def _save(self) -> None:
        m = self.module
        # a fresh stream's entries matter only while its process lives (its noise is gone with it): keep pinned
        # streams' and this process's own
        released = {k: v for k, v in self.released.items()
                    if k.startswith("pinned:") or k.startswith(f"{self.stream}/")}
        state = {"format": _FORMAT, "kinds": self._kinds(),
                 "client_ledger": m.ledger.state_dict() if m.sanitizer.accountable else None,
                 "record_ledger": m.update.ledger.state_dict() if m.update.accountable else None,
                 "released": released}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(state), "utf-8")
        os.replace(tmp, self.path)  # atomic: a crash leaves the old or the new ledger, never half of one

    # ------------------------------------------------------------------ one message
    def repeats(self, client_ids: list[Any], r: int, digest: str) -> bool:
        """Whether this message repeats one already answered from the same noise stream (the site's pinned seed, by
        its label, or this process's fresh one): True if every client's (round, client) was released from it for
        the same input (the same release again: nothing new to charge). Refuses a repeat with another input, and a
        message that mixes repeated and new clients."""
        keys = [f"{self.stream}/{int(r)}/{cid}" for cid in client_ids]
        seen = [self.released.get(k) for k in keys]
        if any(s is not None and s != digest for s in seen):
            raise ValueError(f"round {r}: the server sent clients this site already released in round {r} with "
                             "other inputs; with the site's fixed noise seed the two releases would share their noise "
                             "and show the difference of the updates. Refused (a server that restarts from its "
                             "checkpoint sends the same inputs; a new run needs a new --node-config noise-seed)")
        if all(s is not None for s in seen):
            return True
        if any(s is not None for s in seen):
            raise ValueError(f"round {r}: some of the requested clients were released in this round before and some "
                             "were not: refused (an honest server sends a round's clients of a node once)")
        return False

    def note(self, client_ids: list[Any], r: int, digest: str) -> None:
        """Record that the clients' releases of round ``r`` from this noise stream answered inputs ``digest``."""
        for cid in client_ids:
            self.released[f"{self.stream}/{int(r)}/{cid}"] = digest

    def summary(self, name: str) -> str:
        m = self.module
        parts = [f"site {name or '(partition)'}: ledger {self.path}"]
        if m.sanitizer.accountable and len(m.ledger):
            parts.append(f"{len(m.ledger)} clients, {m.sanitizer.ledger_label} max {m.ledger.max():.4g}, "
                         f"median {m.ledger.median():.4g}")
        if m.update.accountable and len(m.update.ledger):
            parts.append(f"record-level epsilon max {m.update.ledger.max():.4g} at delta {m.update.delta:g}")
        return "; ".join(parts)
