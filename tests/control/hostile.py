"""Hostile job namespaces for the property tests of the controller (``test_properties.py``).

:func:`jobs` draws a coherent job (ranks served by workers, standbys, an epoch; steady, recovering from
a failure, or in a planned move; failure reports, migration requests, stayers' recovery reports) and
puts a hostile layer on top: values replaced by garbage bytes, foreign JSON, another kind or schema
version, fields missing or of the wrong JSON type (``null`` lists, ``"3"`` ranks, ``Infinity``,
5,000-digit numbers, nesting json cannot parse), negative or out-of-range epochs, plans from a future the
epoch never reached, a planned move whose leaver is its joiner, records under another record's key, keys
TrainMover never writes. Every key is labelled with what it says (:class:`Stored`), so the tests can
check the controller against the keys rather than against its own reading of them.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass, field

from hypothesis import strategies as st

from trainmover_ext.control import records
from trainmover_ext.control.records import (
    MAX_EPOCH,
    ROLES,
    Alert,
    FailureReport,
    MemberRecord,
    MigrationPlan,
    MigrationRequest,
    RankRecord,
    Replacement,
    migration_key_suffix,
)
from trainmover_ext.kv import MemoryKV
from trainmover_ext.kv.codec import encode
from trainmover_ext.kv.job import JobSpace

VALID, INVALID, UNREAD = "valid", "invalid", "unread"
"""Labels: a sound record; a value the read must list as malformed; a key (or a marker's value) it does not read."""
WORKERS, STANDBYS = ["w0", "w1", "w2", "w3"], ["s0", "s1", "s2"]
POOL = WORKERS + STANDBYS + ["ghost"]  # "ghost" is named by records but never registered
INF, NAN = float("inf"), float("nan")
WRONG = {  # JSON values of the wrong type for each annotation the records use; the likeliest to break code first
    "str": [[], None, 3, 1.5, True, {}],
    "int": ["3", None, 1.5, 3.0, True, False, [], {}, INF, NAN],
    "float": ["1.5", None, True, [], {}, INF, NAN],
    "bool": ["true", None, 1, 0, [], {}],
    "int | None": ["3", 1.5, True, [], {}, INF],
    "str | None": [[], 3, True, {}],
    "float | None": ["x", True, [], INF, NAN],
    "list[str]": [None, 1, "first", [1], [None], {}],
    "list[int]": [None, "1", 1, [True], ["1"], [1.5], [None], {}],
    "dict[str, Any]": [None, [], "x", 3],
    "dict[str, float]": [None, [], "x", {"a": "x"}, {"a": None}, {"a": True}, {"a": INF}],
    "list[dict[str, Any]]": [
        None,
        {},
        "x",
        [1],
        [None],
        [{}],
        [{"rank": "1", "leaver": "w1", "joiner": "s0", "role": "last", "state_source": {}}],
    ],
}
PLAIN = {  # the values that are not records: field -> (annotation, required)
    "epoch": {"epoch": ("int", True)},
    "recovery": {"iteration": ("int | None", True)},
    "checkpoint": {"iteration": ("int", True)},
    "leader": {"id": ("str | None", False)},
}
FOREIGN_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
).filter(lambda doc: not (isinstance(doc, dict) and "tm" in doc))


class Stored:
    """One key's value and label (a plain class: a counterexample prints it short, not 100 kB of brackets)."""

    def __init__(
        self, value: bytes, label: str, record: object = None, kind: str = "", data: dict | None = None
    ) -> None:
        self.value, self.label, self.kind, self.data = value, label, kind, data or {}
        self.record = record
        """For VALID: what the key says (a record, or the epoch / iteration of a plain value)."""

    def __repr__(self) -> str:
        return f"Stored({self.label}, {self.value[:80]!r}{'...' if len(self.value) > 80 else ''})"


@dataclass
class Job:
    """The keys of one example, relative to the job root, with what each one says."""

    keys: dict[str, Stored] = field(default_factory=dict)

    def put(self, rel: str, kind: str, data: dict, record: object) -> None:
        self.keys[rel] = Stored(encode(kind, data), VALID, record, kind, data)

    def put_record(self, rel: str, rec: records.Record) -> None:
        self.put(rel, rec.KIND, dataclasses.asdict(rec), rec)

    def build(self) -> JobSpace:
        space = JobSpace.create(MemoryKV(), "j", "tok")
        for rel, stored in sorted(self.keys.items()):
            space.kv.put(space.root + rel, stored.value)
        return space

    def garbage(self, rel: str, value: bytes) -> Job:
        """Make ``rel`` hold ``value``, which the read must list as malformed."""
        self.keys[rel] = Stored(value, INVALID)
        return self

    def drop(self, rel: str) -> Job:
        del self.keys[rel]
        return self

    def plan(
        self, epoch: int, *, reason: str = "failure", rank: int = 0, leaver: str = "w0", joiner: str = "s0"
    ) -> Job:
        """Add the plan that opened ``epoch``, moving ``rank`` from ``leaver`` to ``joiner``."""
        self.put_record(
            f"migrations/{migration_key_suffix(epoch)}",
            MigrationPlan(
                epoch=epoch,
                reason=reason,
                resume_iteration=None,
                replacements=[
                    dict(rank=rank, leaver=leaver, joiner=joiner, role="first", state_source={"kind": "replica"})
                ],
            ),
        )
        return self

    def serve(self, rank: int, member_id: str) -> Job:
        """Make ``ranks/<rank>`` name ``member_id``."""
        self.put_record(f"ranks/{rank}", dataclasses.replace(self.keys[f"ranks/{rank}"].record, member_id=member_id))
        return self

    def report(self, rank: int, member_id: str, by: str = "a0") -> Job:
        self.put_record(
            f"reports/{rank}/{by}",
            FailureReport(rank=rank, member_id=member_id, reporter=by, reason="link broke", epoch=3, reported_at=1.0),
        )
        return self

    def valid(self, rel: str):
        stored = self.keys.get(rel)
        return stored.record if stored is not None and stored.label == VALID else None

    def committed_epoch(self) -> int | None:
        """The epoch key's value: 0 when absent, None when it holds garbage."""
        return self.valid("epoch") if "epoch" in self.keys else 0

    def planned_epochs(self) -> list[int]:
        """The epochs of every ``migrations/<10 digits>`` key, readable or not: the executor wrote each one
        in the transaction that moved the epoch there."""
        return [
            int(rel[11:])
            for rel in self.keys
            if rel.startswith("migrations/") and len(rel) == 21 and rel[11:].isascii() and rel[11:].isdigit()
        ]

    def serving(self, member_id: str) -> set[int]:
        return {
            s.record.rank
            for rel, s in self.keys.items()
            if rel.startswith("ranks/") and s.label == VALID and s.record.member_id == member_id
        }

    def kept_joiner(self, rep: Replacement, committed: int | None) -> bool:
        """``rep`` keeps the joiner of the planned move under way, which ``ranks/<r>`` names already."""
        plan, rank = self.valid(f"migrations/{migration_key_suffix(committed or 0)}"), self.valid(f"ranks/{rep.rank}")
        return (
            plan is not None
            and plan.reason == "planned"
            and rank is not None
            and rank.member_id == rep.joiner
            and any(r["rank"] == rep.rank and r["joiner"] == rep.joiner for r in plan.replacements[:1])
        )


# -- the generator ------------------------------------------------------------------------------


def _garbage(draw, stored: Stored) -> bytes:
    """A value of ``stored``'s kind that the read must reject."""
    if stored.kind in PLAIN:
        fields = PLAIN[stored.kind]
    else:
        cls = next(
            c
            for c in (MemberRecord, RankRecord, FailureReport, MigrationRequest, MigrationPlan, Alert)
            if c.KIND == stored.kind
        )
        fields = {
            f.name: (f.type, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        }
    data = dict(stored.data)
    how = draw(
        st.sampled_from(
            ["type", "bytes", "type", "json", "kind", "version", "missing", "type", "huge", "deep", "range"]
        )
    )
    if how == "missing" and any(req for _, req in fields.values()):
        del data[draw(st.sampled_from(sorted(name for name, (_, req) in fields.items() if req)))]
        return encode(stored.kind, data)
    if how == "type":
        name = draw(st.sampled_from(sorted(fields)))
        data[name] = draw(st.sampled_from(WRONG[fields[name][0]]))
        return encode(stored.kind, data)
    numeric = sorted(name for name, (hint, _) in fields.items() if hint.split(" ")[0] in ("int", "float"))
    if how == "huge" and numeric:  # json refuses integers of more than 4,300 digits
        data[draw(st.sampled_from(numeric))] = "HUGE"
        return encode(stored.kind, data).replace(b'"HUGE"', b"9" * 5000)
    if how == "range" and stored.kind in ("epoch", "recovery", "checkpoint"):
        name = next(iter(fields))
        data[name] = draw(
            st.sampled_from([-1, -7, MAX_EPOCH + 1, 10**30] if stored.kind == "epoch" else [-1, -(10**30)])
        )
        return encode(stored.kind, data)
    if how == "kind":
        return encode("leader" if stored.kind != "leader" else "member", data)
    if how == "version":
        return encode(stored.kind, data, version=draw(st.sampled_from([0, 2, 99, "1", None])))
    if how == "json":
        return json.dumps(draw(FOREIGN_JSON)).encode()
    if how == "deep":  # json gives up with a RecursionError
        return b'{"tm": "%s", "v": 1, "data": {"x": ' % stored.kind.encode() + b"[" * 50_000 + b"]" * 50_000 + b"}}"
    return draw(st.binary(max_size=24))


def chance(draw, percent: int) -> bool:
    """True ``percent`` % of the time; hypothesis leans to the simplest value (0 here: False), which is the
    common case."""
    return draw(st.integers(0, 99)) >= 100 - percent


@st.composite
def jobs(draw) -> Job:
    """A coherent job, steady, recovering from a failure or in a planned move, then the hostile layer."""
    job = Job()
    n = draw(st.integers(1, 4))
    epoch = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 0, 3, 1, 2, MAX_EPOCH - 1, MAX_EPOCH]))
    if epoch or draw(st.booleans()):
        job.put("epoch", "epoch", {"epoch": epoch}, epoch)
    roles = ["first", *["middle"] * (n - 2), "last"] if n > 1 else ["first"]
    calm = chance(draw, 35)  # nothing failed: requests and switch points get their turn
    serving = {r: f"w{r}" if calm else draw(st.sampled_from([f"w{r}"] * 10 + ["s0", "ghost"])) for r in range(n)}
    scenario = draw(st.sampled_from(["steady", "recovering", "moving"])) if epoch >= 1 else "steady"
    reps: list[dict] = []
    if scenario == "moving":  # the planned move that opened this epoch: ranks/<r> names its joiner already
        r = draw(st.integers(0, n - 1))
        joiner = draw(st.sampled_from(STANDBYS + [serving[r]]))
        leaver = draw(st.sampled_from([serving[r]] * 2 + [joiner, "ghost"] + POOL))
        reps, serving[r] = (
            [dict(rank=r, leaver=leaver, joiner=joiner, role=roles[r], state_source={"kind": "leaver"})],
            joiner,
        )
    elif scenario == "recovering":  # the failure plan that opened this epoch
        for r in draw(st.lists(st.integers(0, n), min_size=1, max_size=2, unique=True)):
            joiner = draw(st.sampled_from(STANDBYS + POOL))
            reps.append(
                dict(
                    rank=r,
                    leaver=serving.get(r, "ghost"),
                    joiner=joiner,
                    role=roles[min(r, n - 1)],
                    state_source={"kind": "replica"},
                )
            )
            if r < n:
                serving[r] = joiner
    for r in range(n):
        job.put_record(
            f"ranks/{r}",
            RankRecord(
                rank=r,
                member_id=serving[r],
                host=draw(st.sampled_from(["h0", "h1"])),
                role=draw(st.sampled_from([roles[r]] * 9 + ["odd"])),
                replicas=draw(st.lists(st.integers(0, n + 1), max_size=2)),
                since_epoch=draw(st.integers(0, 9)),
            ),
        )
    for mid in WORKERS[:n]:
        if calm or not chance(draw, 15):  # some workers are gone (lease expired)
            job.put_record(
                f"members/{mid}",
                MemberRecord(member_id=mid, kind="worker", host=draw(st.sampled_from(["h0", "h1"])), pid=1),
            )
    for mid in STANDBYS:
        if not chance(draw, 25):
            job.put_record(
                f"members/{mid}",
                MemberRecord(
                    member_id=mid,
                    kind=draw(st.sampled_from(["standby"] * 5 + ["worker"])),
                    host=draw(st.sampled_from(["h0", "h1"])),
                    pid=2,
                    warm_roles=draw(st.sampled_from([list(ROLES)] * 6 + [[], ["first"], ["last"], ["middle", "last"]])),
                    kept_rank=draw(st.none() | st.integers(0, n)),
                    warming=draw(st.booleans()),
                    health=draw(st.sampled_from(["ok"] * 5 + ["draining"])),
                    registered_at=draw(st.floats(0, 100)),
                ),
            )
    if reps:
        job.put_record(
            f"migrations/{migration_key_suffix(epoch)}",
            MigrationPlan(
                epoch=epoch,
                reason="planned" if scenario == "moving" else "failure",
                replacements=reps,
                resume_iteration=draw(st.none() | st.integers(0, 9)),
                steps={
                    s: 1.0
                    for s in draw(
                        st.lists(st.sampled_from(["ready", "ready", "handed_over", "transferred"]), max_size=2)
                    )
                },
                leaver_at=draw(st.none() | st.integers(0, 9)),
                last_boundary=draw(st.none() | st.integers(0, 9)),
            ),
        )
    if scenario == "recovering":  # the stayers' reports of what they hold, perhaps the convergence already decided
        for r in draw(st.lists(st.integers(0, n), max_size=n + 1, unique=True)):
            held = draw(st.none() | st.integers(0, 5))
            job.put(f"recovery/{migration_key_suffix(epoch)}/{r}", "recovery", {"iteration": held}, held)
        if chance(draw, 25):
            job.keys[f"convergence/{migration_key_suffix(epoch)}"] = Stored(
                b"{}", UNREAD
            )  # a marker: its value is not read
    if epoch >= 2 and chance(draw, 30):  # an older plan
        job.put_record(
            f"migrations/{migration_key_suffix(epoch - 1)}",
            MigrationPlan(epoch=epoch - 1, reason="failure", replacements=[], resume_iteration=None),
        )
    if chance(draw, 10):  # a plan from a future the epoch never reached (the epoch was rolled back)
        e = min(epoch + draw(st.integers(1, 3)), MAX_EPOCH)
        job.put_record(
            f"migrations/{migration_key_suffix(e)}",
            MigrationPlan(epoch=e, reason="failure", replacements=[], resume_iteration=None),
        )
    # Failure reports: on a rank's member, on a planned move's leaver, or on anyone about any rank.
    named = [(r, mid) for r, mid in serving.items()] + [(rep["rank"], rep["leaver"]) for rep in reps]
    reported = st.sampled_from(named) | st.tuples(st.integers(0, n + 1), st.sampled_from(POOL))
    for (r, mid), by in draw(st.lists(st.tuples(reported, st.sampled_from(["a0", "a1"])), max_size=0 if calm else 3)):
        job.put_record(
            f"reports/{r}/{by}",
            FailureReport(
                rank=r,
                member_id=mid,
                reporter=by,
                reason="link broke",
                epoch=epoch,
                reported_at=draw(st.floats(0, 999)),
            ),
        )
    for i, (r, to) in enumerate(
        draw(
            st.lists(
                st.tuples(st.sampled_from([*range(n), -1, n + 1]), st.none() | st.sampled_from(STANDBYS + POOL)),
                max_size=2,
            )
        )
    ):
        job.put_record(
            f"requests/q{i}", MigrationRequest(request_id=f"q{i}", rank=r, to=to, requested_at=draw(st.floats(0, 999)))
        )
    for r in draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True)):
        job.put_record(
            f"alerts/{r}",
            Alert(rank=r, member_id=draw(st.sampled_from(POOL)), epoch=epoch, reason="none left", raised_at=1.0),
        )
    for r in draw(st.lists(st.integers(0, n - 1), max_size=1)):
        job.keys[f"finished/{r}"] = Stored(
            encode("finished", {"iteration": 9}), UNREAD
        )  # a marker: its value is not read
    if draw(st.booleans()):
        job.put("checkpoint", "checkpoint", {"iteration": 4}, 4)
    if draw(st.booleans()):
        job.put("leader", "leader", {"id": "c0"}, "c0")
    # The hostile layer: garbage over sound values, records under another record's key, keys nobody writes.
    targets = sorted(
        (k for k, s in job.keys.items() if s.label == VALID and not (calm and k.startswith(("members/", "ranks/")))),
        key=lambda k: zlib.crc32(k.encode()),
    )  # not alphabetical: hypothesis leans to the first
    for rel in draw(st.lists(st.sampled_from(targets), max_size=3, unique=True) if targets else st.just([])):
        job.keys[rel] = Stored(_garbage(draw, job.keys[rel]), INVALID)
    if chance(draw, 25):  # an impostor: a warm standby's record kept under another key
        job.keys["members/impostor"] = Stored(
            MemberRecord(
                member_id=draw(st.sampled_from(POOL)), kind="standby", host="h1", pid=3, warm_roles=list(ROLES)
            ).to_bytes(),
            INVALID,
        )
    for rel in draw(
        st.lists(
            st.sampled_from(
                [
                    "ranks/-1",
                    "ranks/01",
                    "ranks/x",
                    "ranks/9",
                    "alerts/x",
                    "recovery/x/1",
                    "convergence/x",
                    "finished/ 1",
                    "migrations/12",
                    f"migrations/{migration_key_suffix(epoch)}x",
                ]
            ),
            max_size=2,
            unique=True,
        )
    ):
        value = draw(
            st.sampled_from([RankRecord(rank=0, member_id="s0").to_bytes(), b"\xff", encode("epoch", {"epoch": 1})])
        )
        job.keys[rel] = Stored(value, INVALID)
    for rel in draw(
        st.lists(
            st.sampled_from(["events/x", "zz/y", "members", "fingerprint", "links/1/2", "epochs"]),
            max_size=2,
            unique=True,
        )
    ):
        job.keys[rel] = Stored(draw(st.binary(max_size=8)), UNREAD)
    return job


def small_job() -> Job:
    """Two ranks (w0 the first stage, w1 the last) at epoch 3, warm standbys s0 (host h0) and s1 (host h1)."""
    job = Job()
    job.put("epoch", "epoch", {"epoch": 3}, 3)
    for r, role in enumerate(("first", "last")):
        job.put_record(f"ranks/{r}", RankRecord(rank=r, member_id=f"w{r}", host="h0", role=role))
        job.put_record(f"members/w{r}", MemberRecord(member_id=f"w{r}", kind="worker", host="h0", pid=1))
    for i, mid in enumerate(("s0", "s1")):
        job.put_record(
            f"members/{mid}", MemberRecord(member_id=mid, kind="standby", host=f"h{i}", pid=2, warm_roles=list(ROLES))
        )
    return job
