"""The old path of :mod:`ddpkit._trust.sealed` (the same module: what is set or patched here is set there)."""

import sys

from ddpkit._trust import sealed

sys.modules[__name__] = sealed
