"""ddpkit doctor's checks on the test pool, and its report when messages go missing.

Here, the tests that need no process; the others are in tests/ranks/test_doctor.py.
"""

from __future__ import annotations

import pytest

from ddpkit.doctor import DoctorReport, Measurement, format_bytes


def test_bus_bandwidth_follows_the_nccl_tests_convention() -> None:
    reduce = Measurement("all_reduce", 4_000_000, 0.002, world_size=4)
    gather = Measurement("all_gather", 4_000_000, 0.002, world_size=4)
    assert reduce.algbw == pytest.approx(2e9)
    assert reduce.busbw == pytest.approx(2e9 * 2 * 3 / 4)
    assert gather.busbw == pytest.approx(2e9 * 3 / 4)
    assert (format_bytes(8), format_bytes(65536), format_bytes(16 << 20), format_bytes(1500)) == (
        "8 B",
        "64 KiB",
        "16 MiB",
        "1500 B",
    )


def test_a_missing_message_and_a_silent_rank_are_named() -> None:
    report = DoctorReport(4, "gloo", "10.0.0.1:29500", {0: [1, 3], 1: [0, 2, 3], 3: [0, 1, 2]}, 0.01)
    assert not report.ok
    assert report.silent_ranks == [2]
    assert report.unreachable == [(2, 0)]
    text = report.format()
    assert "connectivity: FAILED" in text
    assert "rank 2 reported nothing: it hung or cannot reach the store at 10.0.0.1:29500" in text
    assert "rank 2 -> rank 0: no message arrived" in text
    assert "GLOO_SOCKET_IFNAME" in text
