"""How many threads torch uses in a ``lightning-dp`` command: the cores that other jobs leave free.

torch starts one intra-op thread per core it may use. On a machine whose cores other jobs share, those threads
wait for each other: the README's first command took 97 s as written and 21 s with ``OMP_NUM_THREADS=1`` at a load
of 5-9 on 2 cores (issue 50). So the training commands (``fit``, ``validate``, ``test``, ``grid``, ``audit``) cap
torch's intra-op threads at the cores not busy when they start (:func:`thread_policy`: the cores of this process's
affinity minus the whole part of the 1-minute load average, at least 1; set as ``OMP_NUM_THREADS`` before torch is imported)
and say so in one line when the run starts (:func:`announce`).

The user's choice wins, in this order: ``LIGHTNING_DP_THREADS=N`` (``N`` threads; ``0`` or ``auto``: torch's own
default, no cap), ``OMP_NUM_THREADS`` (torch reads it), and a process that imported torch before calling
:func:`lightning_dp.cli.main` from Python keeps its threads (its ``torch.set_num_threads``, or torch's default).
The number of threads changes how fast a run is and the last bits of floating-point sums, never what the run
releases or how it is accounted; it is public configuration (the line printed names it; nothing is logged to the
record).

Standard library only (``lightning-dp --help`` and the argument errors answer without torch).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Optional

__all__ = ["THREADS_ENV", "ThreadChoice", "announce", "apply_thread_policy", "thread_policy"]

#: The environment variable that sets the number of torch threads of a ``lightning-dp`` command.
THREADS_ENV = "LIGHTNING_DP_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`thread_policy` decided: ``threads`` to set (None: leave torch's default) and why, in words."""

    threads: Optional[int]
    reason: str


def thread_policy(*, cpus: int, load: Optional[float], env: Mapping[str, str],
                  torch_threads: Optional[int] = None) -> ThreadChoice:
    """The number of torch intra-op threads for a command (a pure function: tested on made-up machines).

    Args:
        cpus: The cores this process may run on (``len(os.sched_getaffinity(0))``).
        load: The 1-minute load average (``os.getloadavg()[0]``), or None where the system has none.
        env: The environment (``LIGHTNING_DP_THREADS``, ``OMP_NUM_THREADS``).
        torch_threads: ``torch.get_num_threads()`` when torch was imported before the command ran (a Python caller
            of :func:`lightning_dp.cli.main`, which chooses its own threads: they stay), else None.

    Returns:
        ``threads=None`` leaves torch as it is; otherwise torch gets ``threads`` intra-op threads.

    Raises:
        ValueError: ``LIGHTNING_DP_THREADS`` is neither a non-negative integer nor ``auto``.

    >>> thread_policy(cpus=2, load=5.6, env={}).threads
    1
    >>> thread_policy(cpus=8, load=2.2, env={}).threads
    6
    >>> thread_policy(cpus=2, load=5.6, env={"OMP_NUM_THREADS": "2"}).threads is None
    True
    """
    given = env.get(THREADS_ENV, "").strip()
    if given:
        if given.lower() in ("0", "auto"):
            return ThreadChoice(None, f"{THREADS_ENV}={given}: torch's default")
        if not given.isdigit():
            raise ValueError(f"{THREADS_ENV}={given!r} must be a number of threads >= 1, or 0/auto for torch's "
                             "default (one per core)")
        return ThreadChoice(int(given), f"{THREADS_ENV}={given}")
    if env.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()}")
    if torch_threads is not None:
        return ThreadChoice(None, f"the caller's {torch_threads} torch threads")
    cpus = max(1, int(cpus))
    if load is None:
        return ThreadChoice(None, "no load average on this system: torch's default")
    free = max(1, min(cpus, cpus - int(load)))  # a core is busy when a whole job's worth of load is on it
    if free == cpus:
        return ThreadChoice(None, f"{cpus} cores, load {load:.1f}: torch's default")
    return ThreadChoice(free, f"{cpus} cores, load {load:.1f}")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _load() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        return None


_APPLIED: list[ThreadChoice] = []  # the cap this process set (announce() says it once)


def apply_thread_policy(env: Optional[MutableMapping[str, str]] = None) -> ThreadChoice:
    """Decide with :func:`thread_policy` on this machine; a cap is set as ``OMP_NUM_THREADS`` in ``env`` (this
    process's environment by default), which torch reads when it is imported: nothing heavy is imported here, so
    the argument errors of a command still answer before torch. The processes the command starts (DDP ranks,
    DataLoader workers) inherit the cap. Returns the choice; :func:`announce` prints it.
    """
    env = os.environ if env is None else env
    torch = sys.modules.get("torch")
    choice = thread_policy(cpus=_cpus(), load=_load(), env=env,
                           torch_threads=torch.get_num_threads() if torch is not None else None)
    if choice.threads is not None:
        env["OMP_NUM_THREADS"] = str(choice.threads)
        _APPLIED[:] = [choice]
    return choice


def announce(env: Optional[Mapping[str, str]] = None) -> None:
    """Say the cap :func:`apply_thread_policy` set, in one line on stderr, once per process, on global rank zero
    (called when a run starts: after its config is parsed, so an argument error stays three lines)."""
    env = os.environ if env is None else env
    if not _APPLIED or env.get("RANK", "0") != "0" or env.get("LOCAL_RANK", "0") != "0":
        return
    choice = _APPLIED.pop()
    threads = choice.threads or 0  # set: apply_thread_policy records only a cap
    override = "" if env.get(THREADS_ENV) else f"; {THREADS_ENV}=N to choose, {THREADS_ENV}=auto for one per core"
    sys.stderr.write(f"lightning-dp: torch uses {threads} thread{'s' * (threads > 1)} ({choice.reason}{override})\n")
