"""The old path of :mod:`ddpkit._trust.secret` (the same module: what is set or patched here is set there)."""

import sys

from ddpkit._trust import secret

sys.modules[__name__] = secret
