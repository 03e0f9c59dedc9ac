"""Optional dependencies: which extra installs what, and one error that says so.

The plain install (``pip install lightning-dp``) trains DP-SGD and the federated rounds on the embedded and
official-file datasets. Four extras add what some configs need:

========  ==========================  ====================================================================
extra     packages                    needed by
========  ==========================  ====================================================================
``hf``    datasets                    ``source='huggingface'`` of the DataModules (the Hub copies)
``fl``    flwr-datasets (+ datasets)  the non-IID partitions of ``FederatedVisionDataModule`` (pathological, shards,
                                      dirichlet); IID needs neither
``lm``    transformers, peft          ``GPT2``, ``LoRA`` (examples/lm, examples/dpsgd_gpt2_wikitext2.yaml)
``bench`` opacus, flwr                the benchmark scripts' comparisons only
========  ==========================  ====================================================================

:func:`require` imports a package or raises :class:`MissingExtraError`, whose message is the one line a
user needs (what needs it, the command that installs it); ``lightning-dp`` prints it as a short error.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

#: Extra -> the distributions it installs (as in pyproject.toml's optional-dependencies).
EXTRAS: dict[str, tuple[str, ...]] = {"hf": ("datasets",), "fl": ("flwr-datasets", "datasets"),
                                      "lm": ("transformers", "peft"), "bench": ("opacus", "flwr")}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; ``str()`` says what needs it and how to install it.

    Attributes:
        extra: The extra that installs it (``"fl"``, ``"lm"``, ...).
    """

    def __init__(self, message: str, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


def require(module: str, extra: str, needed_by: str, alternative: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``extra``.

    Args:
        module: The import name, e.g. ``"flwr_datasets.partitioner"``.
        extra: The extra that installs it, a key of :data:`EXTRAS`.
        needed_by: What needs it, e.g. ``"FederatedVisionDataModule(partition='dirichlet')"``.
        alternative: What to use instead without the extra, e.g. ``"partition='iid'"`` ('' if nothing).

    >>> require("json", "hf", "a doctest").__name__
    'json'
    >>> try:
    ...     require("no_such_package_xyz", "lm", "GPT2")
    ... except MissingExtraError as err:
    ...     print(err)
    GPT2 needs no_such_package_xyz, which is not installed: pip install 'lightning-dp[lm]'
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra={extra!r} is not one of {sorted(EXTRAS)} (internal)")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        instead = f", or use {alternative}" if alternative else ""
        raise MissingExtraError(f"{needed_by} needs {module.split('.')[0]}, which is not installed: pip install "
                                f"'lightning-dp[{extra}]'{instead}", extra) from err
