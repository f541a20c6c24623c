"""The old path of :mod:`ddpkit._trust.group_proof` (the same module: what is set or patched here is set there)."""

import sys

from ddpkit._trust import group_proof

sys.modules[__name__] = group_proof
