"""Freed memory kept by the C allocator in a ``lightning-dp`` command, so that a training step does not fault its
large temporaries in from the system again every step.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at start, raised as such blocks are freed, up to
32 MiB) with a fresh mapping, and gives the free memory above the top of its heap back to the system beyond its trim
threshold. A training step that allocates and frees the same large tensors every step then pays for page faults
every step: the kernel zeroes and maps each 4 KiB page again when it is first touched. A private step allocates more
large temporaries than a plain one (per-sample gradients, their norms, the clipped sums, a grouped convolution's
results), so it pays more: ResNet-8's private step at one thread, 1.52x its plain step with glibc's defaults and
1.26-1.28x with freed memory kept, the Transformer 1.26-1.35x and 1.20-1.25x (docs/benchmarks.md, "... and the C
allocator").

The training commands (``fit``, ``validate``, ``test``, ``grid``, ``audit``) therefore set glibc's trim threshold
to 2 GiB and its mmap threshold to 32 MiB (``mallopt``; the ceiling of glibc's own dynamic threshold) when they
start: memory a step frees stays in the process for the next step. The price: the process' resident memory stays
near its peak instead of shrinking between steps (DataLoader workers forked from it inherit the settings: each keeps
what it frees). It changes how fast a run is, never what it computes, releases or records.

The user's choice wins: ``LIGHTNING_DP_MALLOC=system`` leaves the allocator as it is, and so do glibc's own
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES`` naming ``glibc.malloc`` settings, and
an allocator preloaded with ``LD_PRELOAD`` (jemalloc, tcmalloc, mimalloc). Without glibc (macOS, Windows, musl)
there is nothing to set. In your own process (a Lightning script with :class:`~lightning_dp.callbacks.DPSGD`), call
:func:`keep_freed_memory` once before training: a library callback does not change the allocator of the process it
runs in.

Standard library only (the command line's argument errors answer without torch).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

__all__ = ["GLIBC_ENV", "MALLOC_ENV", "AllocatorChoice", "allocator_policy", "apply_allocator_policy",
           "keep_freed_memory"]

#: The environment variable that chooses the allocator policy of a ``lightning-dp`` command: ``keep`` (the
#: default) or ``system``.
MALLOC_ENV = "LIGHTNING_DP_MALLOC"

#: glibc's mallopt parameters (malloc.h) and the values set
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: 2 GiB of free memory at the heap's top before any goes back
_MMAP_BYTES = 32 * 2**20  # the ceiling of glibc's own dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)

#: The same settings as glibc's environment variables, which it reads when a process starts (for the processes a
#: caller starts itself, e.g. a benchmark's one fresh process per measurement).
GLIBC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(_TRIM_BYTES), "MALLOC_MMAP_THRESHOLD_": str(_MMAP_BYTES)}


@dataclass(frozen=True)
class AllocatorChoice:
    """What :func:`allocator_policy` decided: whether to keep freed memory, and why, in words."""

    keep: bool
    reason: str


def allocator_policy(env: Mapping[str, str], *, glibc: bool) -> AllocatorChoice:
    """Whether a command keeps freed memory in the process (a pure function: tested on made-up environments).

    Args:
        env: The environment (``LIGHTNING_DP_MALLOC``, glibc's ``MALLOC_*`` variables, ``LD_PRELOAD``).
        glibc: Whether this process' C library is glibc.

    Raises:
        ValueError: ``LIGHTNING_DP_MALLOC`` is neither ``keep`` nor ``system``.

    >>> allocator_policy({}, glibc=True).keep
    True
    >>> allocator_policy({"LIGHTNING_DP_MALLOC": "system"}, glibc=True).keep
    False
    >>> allocator_policy({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, glibc=True).reason
    'LD_PRELOAD=/usr/lib/libjemalloc.so.2: the preloaded allocator'
    """
    given = env.get(MALLOC_ENV, "").strip().lower()
    if given and given not in ("keep", "system"):
        raise ValueError(f"{MALLOC_ENV}={env[MALLOC_ENV]!r} must be 'keep' (freed memory stays in the process for "
                         "the next step: faster, resident memory stays near its peak) or 'system' (the C "
                         "allocator as it is)")
    if given == "system":
        return AllocatorChoice(False, f"{MALLOC_ENV}=system")
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return AllocatorChoice(False, f"LD_PRELOAD={preload}: the preloaded allocator")
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        if env.get(name, "").strip():
            return AllocatorChoice(False, f"{name}={env[name].strip()}: glibc's settings as given")
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return AllocatorChoice(False, "GLIBC_TUNABLES sets glibc.malloc: glibc's settings as given")
    if not glibc:
        return AllocatorChoice(False, "not glibc: nothing to set")
    return AllocatorChoice(True, "glibc: freed memory kept for the next step")


def _libc() -> Optional[ctypes.CDLL]:
    """This process' C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(*, children: bool = False) -> bool:
    """Keep memory freed by the C allocator in this process for later allocations (glibc; see the module
    docstring): the trim threshold at 2 GiB, the mmap threshold at 32 MiB. Returns whether it was set (False
    without glibc). Call it once, before training; it affects the whole process, and stays. ``children=True``:
    where it was set, also write :data:`GLIBC_ENV` into ``os.environ``, so that the processes this one starts
    afterwards (a benchmark's fresh process per measurement) start with the same settings."""
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES)) and bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES))
    if kept and children:
        os.environ.update(GLIBC_ENV)
    return kept


def apply_allocator_policy(env: Optional[Mapping[str, str]] = None) -> AllocatorChoice:
    """Decide with :func:`allocator_policy` for this process and apply it (:func:`keep_freed_memory`)."""
    choice = allocator_policy(os.environ if env is None else env, glibc=_libc() is not None)
    if choice.keep and not keep_freed_memory():
        return AllocatorChoice(False, "glibc refused the settings: the allocator as it is")
    return choice
