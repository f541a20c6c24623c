"""Shared fixtures: every test starts with the same environment and no process group."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import settings

from ddpkit.testing import close_pools

# The first example may import torch code paths; timing is not what these properties test.
settings.register_profile("ddpkit", deadline=None, print_blob=True)
settings.load_profile("ddpkit")


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _close_test_pools() -> Iterator[None]:
    yield
    close_pools()
