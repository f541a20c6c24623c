"""Whether every rank holds the same value, in one sum: the exact test behind ddpkit's mismatch checks.

Each rank maps its value (a checksum, a signature of dtype and shape) to an
integer ``s`` in ``[1, 2**bits]`` and contributes ``(s, s**2)`` to a float64
``all_reduce`` (sum). All ranks hold the same ``s`` exactly when
``W * sum(s**2) == sum(s)**2`` (equality in the Cauchy-Schwarz inequality), and
``bits`` is chosen so that both sums stay exact in float64 for ``W`` ranks.
Two different values can share ``s`` (probability ``2**-bits`` per pair); the
callers use two independent signatures where that matters.
"""

from __future__ import annotations

__all__ = ["all_equal", "signature_terms"]


def signature_terms(value: int, world_size: int) -> tuple[float, float]:
    """``(s, s**2)`` for ``value``, exact in float64 when summed over ``world_size`` ranks."""
    bits = max(8, (53 - world_size.bit_length()) // 2)
    s = float(value % (1 << bits) + 1)
    return s, s * s


def all_equal(total: float, squares: float, world_size: int) -> bool:
    """Whether the ranks' terms, summed to ``total`` and ``squares``, came from one value on every rank."""
    return world_size * int(squares) == int(total) ** 2
