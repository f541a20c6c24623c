"""ddpkit doctor's checks on the test pool, and its report when messages go missing."""

from __future__ import annotations

import pytest

from ddpkit.doctor import DoctorReport, Measurement, check_ranks, format_bytes
from ddpkit.testing import run_parallel


def test_every_rank_hears_every_other_and_the_collectives_are_timed() -> None:
    first = run_parallel(check_ranks, 5.0, world_size=3, timeout=60)
    again = run_parallel(check_ranks, 5.0, world_size=3, timeout=60)  # the store's keys of a call stay apart
    for results in (first, again):
        report = results[0]
        assert results[1:] == [None, None]
        assert report is not None
        assert report.ok
        assert report.heard_from == {0: [1, 2], 1: [0, 2], 2: [0, 1]}
        requested = [(op, n) for op in ("all_reduce", "all_gather") for n in (8, 1024, 65536, 1 << 20, 16 << 20)]
        assert [m.operation for m in report.measurements] == [op for op, _ in requested]
        # all_gather's result is 3 equal parts of whole float32s: within 3 x 4 bytes of the size asked for.
        assert all(abs(m.nbytes - n) < 12 for m, (_, n) in zip(report.measurements, requested, strict=True))
        assert len(report.measurements) == 10
        assert all(m.seconds > 0 for m in report.measurements)
        assert "connectivity: ok" in report.format()


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
