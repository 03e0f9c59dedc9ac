"""Parts of a federated round, registered by kind and name so that a YAML config can name them.

A round is assembled from one part of each kind (``selection``, ``update``, ``sanitizer``, ``aggregator``,
``server_privacy``); a part may keep state (``state_dict``) and parameters to log (``hparams``). Adding one is a
subclass registered with :func:`register_part`: docs/federated.md, "Adding a part" (run by
tests/federated/test_parts_docs.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_dp.privacy.registry import Registry

__all__ = ["KINDS", "Combination", "Part", "register_part", "registered_parts", "resolve_part"]

KINDS = ("selection", "update", "sanitizer", "aggregator", "server_privacy")
_BASES = {"selection": "ClientSelection", "update": "ClientUpdate", "sanitizer": "ClientSanitizer",
          "aggregator": "Aggregator", "server_privacy": "ServerPrivacy"}


@dataclass(frozen=True)
class Combination:
    """The parts of one round and its number of hypotheses, as a part sees them when it checks the combination."""

    selection: Any
    update: Any
    sanitizer: Any
    aggregator: Any
    server_privacy: Any
    num_hypotheses: int


class Part(abc.ABC):
    """What every part shares: a kind, a name, optional state, parameters to log, and a check of the combination it
    is in. Each kind's base class (``ClientSanitizer``, ...) declares ``kind`` and its abstract methods.

    Capabilities, one vocabulary: ``accountable`` (the part spends privacy and keeps its own accounting: an update's
    record-level ledgers, a sanitizer's per-client ledger, the server's client-level accountant).
    """

    #: which of :data:`KINDS` the part is (set by the kind's base class)
    kind: ClassVar[str] = ""
    name = "part"
    #: whether the part spends privacy and accounts it
    accountable = False

    def problems(self, parts: Combination) -> list[str]:
        """Why this part's privacy claims would not hold among ``parts`` (empty: they hold). The round collects
        every part's problems into one error before any client trains."""
        return []

    def hparams(self) -> dict[str, Any]:
        """Parameters logged with the run (never secrets)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def _of_kind(kind: str) -> Any:
    return lambda obj: isinstance(obj, type) and issubclass(obj, Part) and obj.kind == kind


_PARTS: dict[str, Registry[type]] = {kind: Registry(f"{kind} part", base=Part, accepts=_of_kind(kind), argument=kind)
                                     for kind in KINDS}


def register_part(kind: str, name: str):
    """Class decorator: make the part available as ``name`` for its ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")

    def decorate(cls: type) -> type:
        if getattr(cls, "kind", None) != kind:
            raise TypeError(f"register_part({kind!r}, {name!r}): {cls.__name__} is not a {kind} part (subclass "
                            f"lightning_dp.federated.parts.{_BASES[kind]})")
        _PARTS[kind].register(name, cls)
        cls.name = name  # type: ignore[attr-defined]  # parts are Part subclasses, which declare it
        return cls
    return decorate


def registered_parts(kind: str) -> dict[str, type]:
    """``{name: class}`` of the parts of one kind."""
    return dict(_PARTS[kind])


def resolve_part(kind: str, value: Any) -> Any:
    """A part instance from an instance, or from a registered name or a class path (``my_module.CoordinateMedian``),
    built with its defaults.

    Raises:
        ValueError: If the name is not registered (the message lists the names that are and the closest one), or the
            class path does not name a part of this kind.
    """
    if isinstance(value, str):
        return _PARTS[kind].resolve(value)()
    if not (isinstance(value, Part) and type(value).kind == kind):
        base = _BASES[kind]
        raise ValueError(f"{kind}={value!r} is not a {base} (lightning_dp.federated.parts); pass a registered name "
                         f"({sorted(_PARTS[kind])}), a class path or an instance of a {base} subclass")
    return value
