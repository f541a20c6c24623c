"""The old path of :mod:`ddpkit._trust.group_store` (the same module: what is set or patched here is set there)."""

import sys

from ddpkit._trust import group_store

sys.modules[__name__] = group_store
