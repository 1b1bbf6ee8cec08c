"""Property tests for manifest parsing: valid records round-trip; anything else is a DumpError."""

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tdiff.errors import DumpError
from tdiff.store.manifest import read_part
from tdiff.store.record import Record

names = st.text(min_size=1, max_size=20)
counts = st.integers(min_value=0, max_value=10**6)
records = st.builds(
    Record, seq=counts, name=names, module=st.text(max_size=20), role=st.sampled_from(["input", "output", "explicit"]),
    step=counts, call=counts, rank=st.integers(0, 1024), dtype=st.sampled_from(["float32", "bfloat16", "int64"]),
    shape=st.lists(st.integers(0, 4096), max_size=4).map(tuple), sub=st.text(max_size=8),
    fingerprint=st.one_of(st.none(), st.text(max_size=40)),
    file=st.one_of(st.none(), st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.text(max_size=10)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=10)


@given(records)
def test_valid_records_round_trip(record):
    if record.file is not None:
        record = dataclasses.replace(record, key="t0")
    assert Record.from_json(json.loads(json.dumps(record.to_json()))) == record


@settings(max_examples=300)
@given(records, st.sampled_from(list(Record.__dataclass_fields__)), json_values)
def test_a_corrupted_field_is_accepted_as_a_valid_record_or_refused_with_dump_error(record, field, value):
    data = record.to_json()
    data[field] = value
    try:
        parsed = Record.from_json(data)
    except DumpError as exc:
        assert "line" in str(exc) or "record" in str(exc)
        return
    assert isinstance(parsed.shape, tuple) and parsed.role in ("input", "output", "explicit")


@settings(max_examples=200)
@given(st.lists(st.one_of(json_values.map(json.dumps), st.text(max_size=30)), max_size=6))
def test_random_manifest_lines_never_escape_as_other_errors(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("m") / "p.jsonl"
    header = json.dumps({"type": "header", "format": "tdiff-dump", "version": 1})
    path.write_text("\n".join([header, *lines]) + "\n")
    try:
        part = read_part(path)
    except DumpError:
        return
    assert part.problem is not None or all(isinstance(r, Record) for r in part.records)
