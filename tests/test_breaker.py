"""The router's circuit breaker (cluster/policies.py Breaker): pure state-machine checks. The cluster
test that drives a really broken (prefill, decode) link is in tests/test_recovery.py."""

from pdcluster.cluster.policies import Breaker


def test_opens_after_threshold_consecutive_failures_only():
    b = Breaker(threshold=3, cooldown_s=5.0)
    assert not b.record_failure(0.0) and not b.record_failure(0.1) and b.allows(0.2)
    b.record_success()  # a success in between: the count starts over
    assert not b.record_failure(1.0) and not b.record_failure(1.1)
    assert b.record_failure(1.2), "the third failure in a row opens it"
    assert not b.allows(1.3) and not b.allows(6.1) and b.allows(6.2)


def test_half_open_failure_retrips_with_doubled_cooldown_and_success_closes():
    b = Breaker(threshold=3, cooldown_s=5.0, max_cooldown_s=12.0)
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    assert b.allows(5.2)  # half-open: one placement may go through
    assert b.record_failure(5.3), "one failure while half-open re-opens at once"
    assert not b.allows(15.2) and b.allows(15.3)  # 10 s: doubled
    assert b.record_failure(15.4)
    assert not b.allows(27.3) and b.allows(27.4)  # 20 s capped at 12 s
    b.record_success()
    assert b.allows(27.4) and b.consecutive_failures == 0 and b.trips == 0
    assert not b.record_failure(28.0), "closed again: back to needing `threshold` failures"
