"""ddpkit doctor's checks on the test pool, and its report when messages go missing.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_doctor.py.
"""

from __future__ import annotations

from ddpkit.doctor import check_ranks
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
