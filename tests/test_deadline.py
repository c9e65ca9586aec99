"""trainmover_ext.deadline: the one clock of bounded waits and the TTL-derived recovery timeouts."""

from __future__ import annotations

import time

from trainmover_ext.deadline import Deadline, RecoveryTimeouts


def test_a_deadline_counts_down_and_expires():
    d = Deadline(0.2)
    assert not d.expired and 0.0 < d.remaining() <= 0.2
    time.sleep(0.25)
    assert d.expired and d.remaining() == 0.0
    assert Deadline(0.0).expired and not Deadline(float("inf")).expired


def test_recovery_timeouts_follow_the_lease_ttl_with_floors():
    short, long = RecoveryTimeouts(1.0), RecoveryTimeouts(6.0)
    assert (short.renew_every_s, short.decision_s, short.replacement_s) == (1 / 3, 30.0, 10.0)
    assert (long.renew_every_s, long.decision_s, long.replacement_s) == (2.0, 60.0, 30.0)
    # a rank waits for a decision longer than its agent waits for the replacement it reported
    for ttl in (0.5, 1.0, 2.0, 6.0, 30.0):
        t = RecoveryTimeouts(ttl)
        assert t.decision_s > t.replacement_s > ttl > t.renew_every_s
