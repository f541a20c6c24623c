"""The old path of :mod:`ddpkit._trust.channel` (the same module: what is set or patched here is set there)."""

import sys

from ddpkit._trust import channel

sys.modules[__name__] = channel
