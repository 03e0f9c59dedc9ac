"""The thread policy of the training commands (issue 50, item 1): the free cores on a shared machine, the user's
choice first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightning_dp.config.threads import THREADS_ENV, apply_thread_policy, thread_policy


@pytest.mark.parametrize(("cpus", "load", "threads"), [
    (2, 5.6, 1),    # the machine: 2 cores, other jobs on more than both
    (2, 1.2, 1),
    (2, 0.9, None),  # less than one job's load: torch's default, one thread per core
    (2, 0.0, None),
    (8, 2.2, 6),
    (8, 7.6, 1),
    (16, 0.0, None),
    (1, 3.0, None),  # one core: nothing to cap
])
def test_the_cap_is_the_cores_other_jobs_leave_free_and_at_least_one(cpus, load, threads):
    assert thread_policy(cpus=cpus, load=load, env={}).threads == threads


def test_no_load_average_leaves_torch_alone():
    assert thread_policy(cpus=4, load=None, env={}).threads is None


def test_the_users_choice_wins():
    busy = {"cpus": 2, "load": 6.0}
    assert thread_policy(**busy, env={"OMP_NUM_THREADS": "2"}).threads is None  # torch reads it
    assert thread_policy(**busy, env={THREADS_ENV: "2"}).threads == 2
    assert thread_policy(**busy, env={THREADS_ENV: "2", "OMP_NUM_THREADS": "1"}).threads == 2
    assert thread_policy(**busy, env={THREADS_ENV: "auto"}).threads is None
    assert thread_policy(**busy, env={THREADS_ENV: "0"}).threads is None
    assert thread_policy(**busy, env={}, torch_threads=2).threads is None  # torch imported by a Python caller
    with pytest.raises(ValueError, match=f"{THREADS_ENV}='many' must be a number of threads"):
        thread_policy(**busy, env={THREADS_ENV: "many"})


def test_an_explicit_torch_set_num_threads_wins():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert apply_thread_policy(env={}).threads is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


_CHILD = ("from lightning_dp.config.threads import announce, apply_thread_policy\napply_thread_policy()\n"
          "import torch\nprint(torch.get_num_threads())\nannounce()\nannounce()")


def test_the_command_sets_torch_and_says_so_in_one_line():
    """In a fresh process (torch not yet imported, as in `lightning-dp fit`): the cap is set (as OMP_NUM_THREADS,
    which torch reads on import) and named once; the user's OMP_NUM_THREADS is left to torch, silently."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", THREADS_ENV)}
    done = subprocess.run([sys.executable, "-c", _CHILD], env={**env, THREADS_ENV: "1"}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "1"
    assert done.stderr.strip() == f"lightning-dp: torch uses 1 thread ({THREADS_ENV}=1)"
    done = subprocess.run([sys.executable, "-c", _CHILD], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "1" and done.stderr.strip() == ""
