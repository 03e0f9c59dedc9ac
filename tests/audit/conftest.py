"""Fixtures of the audit tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread (and do not fight other processes for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
