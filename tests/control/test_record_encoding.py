"""A record declared PLAIN is encoded from its fields as they are: only JSON types may be declared there,
and the bytes are those of the deep copy they replace (pure logic)."""

from __future__ import annotations

import dataclasses
import typing

from trainmover_ext.control import records
from trainmover_ext.kv.codec import encode

JSON_LEAVES = (bool, int, float, str, type(None), typing.Any)


def _json_only(hint) -> bool:
    args = typing.get_args(hint)
    if hint in JSON_LEAVES:
        return True
    return typing.get_origin(hint) in (list, dict, typing.Union, type(int | None)) and all(map(_json_only, args))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_plain_records_declare_only_json_types():
    plain = [c for c in _subclasses(records.Record) if c.PLAIN]
    assert records.ComputeReport in plain
    for cls in plain:
        hints = typing.get_type_hints(cls)
        bad = [f.name for f in dataclasses.fields(cls) if not _json_only(hints[f.name])]
        assert not bad, f"{cls.__name__} is PLAIN but declares non-JSON fields {bad}"


def test_a_plain_record_encodes_as_its_deep_copy_would():
    report = records.ComputeReport(
        host="n0", samples={"3": [[7, 0.25, 2, 0.01], [8, 0.26]], "4": [[7, 0.3]]}, published_at=12.5
    )
    raw = report.to_bytes()
    assert raw == encode("compute", dataclasses.asdict(report))
    assert records.ComputeReport.from_bytes(raw, key="compute/n0", strict=True) == report


def test_the_check_refuses_a_dataclass_at_any_depth():
    """The companion: a PLAIN record holding a nested record would be written unencodable; the check names it."""
    for hint in (records.ComputeReport, list[records.ComputeReport], dict[str, records.ComputeReport | None]):
        assert not _json_only(hint), hint
    assert _json_only(dict[str, list[list[float]]]) and _json_only(int | None)
