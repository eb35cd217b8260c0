"""The soak script's arithmetic and report (benchmarks/hostile_soak.py), without a server."""

from __future__ import annotations

import math

import pytest

from benchmarks.hostile_requests import HostileRequest, hostile_requests
from benchmarks.hostile_soak import (
    HostileOutcome,
    PhaseStats,
    Soak,
    hostile_table,
    percentile,
    phase_table,
    run,
    summary_table,
)


def test_percentile_interpolates_between_closest_ranks():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_phase_table_reports_percentiles_mismatches_and_failures():
    quiet = PhaseStats("ordinary alone", latencies=[1.0, 2.0, 3.0])
    mixed = PhaseStats("ordinary + hostile", latencies=[2.0], mismatches=1)
    mixed.fail("503")
    mixed.fail("503")
    mixed.fail("timeout")
    rows = phase_table([quiet, mixed]).splitlines()
    assert rows[2] == "| ordinary alone | 3 | 2.00 | 2.98 | 3.00 | 0 | 0 |"
    assert rows[3] == "| ordinary + hostile | 1 | 2.00 | 2.00 | 2.00 | 1 | 503: 2, timeout: 1 |"


def test_hostile_and_summary_tables():
    slow = HostileOutcome(HostileRequest("chat <|im_end|>", "/v1/chat/completions"),
                          answers=["200", "timeout", "timeout"], max_s=30.5)
    unsent = HostileOutcome(HostileRequest("HEAD /health", "/health", method="HEAD"))
    table = hostile_table([slow, unsent]).splitlines()
    assert table[2] == "| chat <\\|im_end\\|> | 200 x1, timeout x2 | 30.50 | 2 |"  # pipes escaped
    assert table[3] == "| HEAD /health | not sent | 0.00 | 0 |"
    soak = Soak("http://127.0.0.1:1", status_5xx=3)
    state = {"admitted_requests": 5, "running": 0, "waiting": 0, "kv_used": 12}
    summary = summary_table(soak, [slow, unsent], state, [100.0, 110.0, 150.0])
    assert "| 5xx answers (any request) | 3 |" in summary
    assert "past their 30 s timeout | 2 |" in summary
    assert "admitted_requests 5, running 0, waiting 0, kv_used 12" in summary
    assert "100 / 110 / 150 (growth +50)" in summary
    assert "ConnectError" in summary_table(soak, [], {"error": "ConnectError()"}, [0.0] * 3)


def test_hostile_requests_are_bounded_and_distinct():
    requests = hostile_requests()
    assert len({r.name for r in requests}) == len(requests)
    for r in requests:
        assert r.path.startswith("/") and 1 <= r.times <= 100, r
        assert (r.body is None) or (r.raw is None), r
    assert sum(r.times for r in requests) < 200  # one round


def test_run_refuses_a_host_off_loopback():
    with pytest.raises(AssertionError, match="loopback only"):
        run("http://example.com:30000", None, 1.0, 1, 1)
