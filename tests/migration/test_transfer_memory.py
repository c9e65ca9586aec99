"""A state transfer takes no extra memory, measured on a state large enough for the check to mean something.

The model (2 layers of width 768, bf16 with fp32 master copies and Adam: about 14 bytes of transferred
state per parameter) gives each rank a state of over 20% of its resident size. After a SIGKILL, the
surviving replica sends its state to the standby that takes the dead rank:

- the sender's peak during the send stays within its resident size at the start + 2% of the state;
- the receiver's peak during the receive stays within what it keeps afterwards + 2% of the state.

The companion test runs the same job with the sender keeping one extra full copy of the state on
purpose (``TRAINMOVER_DRILL_EXTRA_STATE_COPY=1``) and shows that the same check fails.
"""

from __future__ import annotations

import pytest

from harness.jobs import model_args
from helpers import assert_transfer_memory, run_job, transfers
from trainmover_ext.runtime.faults import DRILL_EXTRA_COPY_ENV


def _args(corpus) -> list[str]:
    return model_args(layers=2, hidden=768, heads=8, seq=64, mbs=1, gbs=2, iters=6, lr=1e-4) + [
        "--data-path",
        corpus + "_text_document",
        "--bf16",
        "--trainmover",
        "--tm-standbys",
        "1",
        "--tm-standby-nice",
        "0",
        "--tm-inject-fault",
        "1:4:backward",
    ]


def _run(tmp_path, corpus, name: str, env=None):
    job = run_job(tmp_path, 2, _args(corpus), name=name, timeout=400, env=env)
    sent = [t for t in transfers(job) if t.side == "sent"]
    received = [t for t in transfers(job) if t.side == "received"]
    assert len(sent) == len(received) == 1, job.stdout()[-2000:]
    return job, sent[0], received[0]


def test_transfer_takes_no_extra_memory(tmp_path, corpus):
    job, sent, received = _run(tmp_path, corpus, "memory")
    assert (sent.rank, sent.peer) == (0, 1)
    assert sent.state_mib >= 0.2 * sent.start_mib, (
        f"the state ({sent.state_mib:.0f} MiB) is under 20% of the sender's RSS ({sent.start_mib:.0f} MiB): "
        "the check would prove little"
    )
    assert_transfer_memory(job, fraction=0.02, slack_mib=0.0)
    print(
        f"state {sent.state_mib:.1f} MiB = {sent.state_mib / sent.start_mib:.0%} of the sender's RSS; "
        f"sender +{sent.extra_mib:.2f} MiB, receiver +{received.extra_mib:.2f} MiB"
    )


def test_memory_check_fails_when_the_sender_copies_the_state(tmp_path, corpus):
    job, sent, _ = _run(tmp_path, corpus, "memory_copy", env={DRILL_EXTRA_COPY_ENV: "1"})
    assert sent.extra_mib >= 0.5 * sent.state_mib, sent  # the copy shows (untouched pages may not)
    with pytest.raises(AssertionError, match="over its resident size at the start"):
        assert_transfer_memory(job, fraction=0.02, slack_mib=0.0)
