"""The C allocator policy of the training commands (issue 53): freed memory kept for the next step with glibc, the
user's choice first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_dp.config.allocator import MALLOC_ENV, allocator_policy, apply_allocator_policy


def test_glibc_keeps_freed_memory_unless_the_user_chose():
    assert allocator_policy({}, glibc=True).keep
    assert allocator_policy({MALLOC_ENV: "keep"}, glibc=True).keep
    assert allocator_policy({MALLOC_ENV: " KEEP "}, glibc=True).keep
    for env in ({MALLOC_ENV: "system"}, {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"},
                {"LD_PRELOAD": "libjemalloc.so.2"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                {"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}):
        choice = allocator_policy(env, glibc=True)
        assert not choice.keep and choice.reason
    assert not allocator_policy({}, glibc=False).keep  # macOS, Windows, musl: nothing to set
    with pytest.raises(ValueError, match=f"{MALLOC_ENV}='fast' must be 'keep' .* or 'system'"):
        allocator_policy({MALLOC_ENV: "fast"}, glibc=True)


_CHILD = ("from lightning_dp.config.allocator import apply_allocator_policy\n"
          "print(apply_allocator_policy().keep)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_the_settings_are_taken_by_glibc_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in (MALLOC_ENV, "LD_PRELOAD")}
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        pytest.skip("not glibc")
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.strip() == "True"
    done = subprocess.run([sys.executable, "-c", _CHILD], env={**env, MALLOC_ENV: "system"}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


def test_a_command_applies_it_and_refuses_a_bad_value_before_anything_runs(monkeypatch, capsys):
    import lightning_dp.config.allocator as allocator
    from lightning_dp.cli import main

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(allocator, "_libc", lambda: object())
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv(MALLOC_ENV, raising=False)
    monkeypatch.setenv("LIGHTNING_DP_THREADS", "auto")  # the thread policy then leaves OMP_NUM_THREADS unset
    assert apply_allocator_policy().keep and calls == [1]
    assert main(["fit", "--config", "nowhere.yaml"]) == 2  # applied first; then the missing config is refused
    assert calls == [1, 1]
    assert "nowhere.yaml" in capsys.readouterr().err
    monkeypatch.setenv(MALLOC_ENV, "fast")
    assert main(["fit", "--config", "nowhere.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"{MALLOC_ENV}='fast' must be 'keep'" in err
    assert calls == [1, 1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_children_true_passes_the_settings_to_the_processes_started_afterwards():
    """What the benchmarks' ``--malloc keep`` calls: set here, and glibc's variables for the processes it starts."""
    from lightning_dp.config.allocator import GLIBC_ENV

    env = {k: v for k, v in os.environ.items() if k not in (*GLIBC_ENV, "LD_PRELOAD")}
    child = ("import os\nfrom lightning_dp.config.allocator import GLIBC_ENV, keep_freed_memory\n"
             "kept = keep_freed_memory(children=True)\n"
             "print(kept, all(os.environ.get(k) == v for k, v in GLIBC_ENV.items()))\n")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    if done.stdout.split()[0] == "False":
        pytest.skip("not glibc")
    assert done.stdout.split() == ["True", "True"]
