"""Manifests: records validated field by field, incomplete and newer dumps recognised."""

import dataclasses
import json
import re

import pytest
import torch

import tdiff
from tdiff.errors import DumpError
from tdiff.store import FORMAT_VERSION, Record, open_dump
from tdiff.store.manifest import DUMP_FILE, MANIFEST_DIR
from tests.helpers import REPO


def small_dump(path):
    with tdiff.capture(path):
        tdiff.dump("x", torch.arange(6.0))
        tdiff.dump("y", torch.ones(2, 2))
    return path


def only_manifest(path):
    (manifest,) = (path / MANIFEST_DIR).glob("*.jsonl")
    return manifest


def test_record_round_trips_through_json():
    record = Record(seq=3, name="m.layers.0[0]", module="m.layers.0", role="input", step=1, call=2,
                    rank=0, dtype="bfloat16", shape=(2, 3), sub="0", stats={"min": 0.0}, file="p.s00000.safetensors",
                    key="t3", attrs={"tp_rank": 1})
    assert Record.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_every_stored_field_round_trips_and_is_documented():
    """A record with no field at its default stores every field; docs/FORMAT.md lists exactly those."""
    record = Record(seq=3, name="m.layers.0.mlp[0]", module="m.layers.0.mlp", role="input", step=1, call=2,
                    rank=1, dtype="bfloat16", shape=(2, 3), sub="0", module_class="MLP", parent="m.layers.0",
                    depth=2, layer=4, device="cuda:0", stats={"min": 0.0}, fingerprint="xxh3:" + "0" * 32,
                    file="p.s00000.safetensors", key="t3", alias_of=1, attrs={"framework": "torch"})
    stored = record.to_json()
    assert Record.from_json(json.loads(json.dumps(stored))) == record
    # an op record (capture --ops) stores its op too
    op_record = dataclasses.replace(record, role="op", op={"name": "aten::neg", "index": 0, "function": "f",
                                                           "source": "a.py:1", "inputs": [1, None]})
    op_stored = op_record.to_json()
    assert Record.from_json(json.loads(json.dumps(op_stored))) == op_record
    table = (REPO / "docs" / "FORMAT.md").read_text().split("Record fields")[1].split(":\n\n", 1)[1].split("\n\n")[0]
    documented = {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == set(stored) | set(op_stored)


def test_a_records_copy_has_every_field_and_is_its_own():
    """Record.copy (a CUDA graph's replays copy each record) keeps every field, whatever its
    default, and setting the copy's fields leaves the original as it was."""
    values = {"seq": 3, "name": "m.mlp[0]", "module": "m.mlp", "role": "op", "step": 1, "call": 2, "rank": 1,
              "dtype": "bfloat16", "shape": (2, 3), "sub": "0", "module_class": "MLP", "parent": "m", "depth": 2,
              "layer": 4, "thread": "worker", "device": "cuda:0", "stats": {"min": 0.0},
              "fingerprint": "xxh3:" + "0" * 32, "file": "p.s00000.safetensors", "key": "t3", "alias_of": 1,
              "attrs": {"framework": "torch"}, "op": {"name": "aten::neg"}, "part": "p"}
    assert set(values) == {f.name for f in dataclasses.fields(Record)}
    record = Record(**values)
    copy = record.copy()
    assert copy == record and copy is not record
    for name in values:
        setattr(copy, name, None)
    assert record == Record(**values)


@pytest.mark.parametrize("field, value, message", [
    ("shape", "3x4", "field 'shape' has the wrong type"),
    ("shape", [3, -1], "non-negative integers"),
    ("role", "middle", "field 'role' must be one of"),
    ("step", True, "field 'step' has the wrong type"),
    ("file", "../../etc/passwd", "must name a file inside the dump"),
    ("seq", -1, "must not be negative"),
])
def test_bad_record_fields_are_named(field, value, message):
    data = {"seq": 0, "name": "x", "module": "", "role": "explicit", "step": 0, "call": 0, "rank": 0,
            "dtype": "float32", "shape": [1], "file": "a.safetensors", "key": "t0"}
    data[field] = value
    with pytest.raises(DumpError, match=message):
        Record.from_json(data, "line 2")


def test_missing_field_is_named():
    with pytest.raises(DumpError, match="field 'dtype' is missing"):
        Record.from_json({"seq": 0, "name": "x", "module": "", "role": "explicit", "step": 0, "call": 0,
                          "rank": 0, "shape": [1]})


def test_a_manifest_without_its_end_line_is_incomplete(tmp_path):
    dump = small_dump(tmp_path / "d")
    manifest = only_manifest(dump)
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:-1]))
    with pytest.raises(DumpError, match="incomplete: manifest .* has no end line"):
        open_dump(dump)
    partial = open_dump(dump, allow_incomplete=True)
    assert len(partial.records) == 2 and not partial.complete


def test_a_manifest_cut_mid_record_is_incomplete(tmp_path):
    dump = small_dump(tmp_path / "d")
    manifest = only_manifest(dump)
    text = manifest.read_text()
    second_record = text.index('"type":"record"', text.index('"type":"record"') + 1)
    manifest.write_text(text[: second_record + 20])
    with pytest.raises(DumpError, match="ends mid-record"):
        open_dump(dump)
    assert len(open_dump(dump, allow_incomplete=True).records) == 1


def test_newer_format_version_is_refused(tmp_path):
    dump = small_dump(tmp_path / "d")
    header = json.loads((dump / DUMP_FILE).read_text())
    header["version"] = FORMAT_VERSION + 1
    (dump / DUMP_FILE).write_text(json.dumps(header))
    with pytest.raises(DumpError, match="newer than this tdiff reads"):
        open_dump(dump)


def test_empty_dump_is_an_error(tmp_path):
    with tdiff.capture(tmp_path / "d"):
        pass
    with pytest.raises(DumpError, match="dump has no tensors"):
        open_dump(tmp_path / "d")


def test_missing_tensor_file_is_reported(tmp_path):
    dump = small_dump(tmp_path / "d")
    for shard in (dump / "data").iterdir():
        shard.unlink()
    with pytest.raises(DumpError, match="tensor file"):
        open_dump(dump)


def test_not_a_dump(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DumpError, match="not a tdiff dump"):
        open_dump(tmp_path / "plain")
    with pytest.raises(DumpError, match="no such dump directory"):
        open_dump(tmp_path / "missing")


def test_request_ids_past_64_bits_and_keys_that_are_not_strings_are_journaled_as_json_writes_them(tmp_path):
    # the journal's fast encoder (orjson) refuses both; they are written, and read back, exactly
    from tdiff.store.manifest import ManifestJournal, _encode, read_part
    from tdiff.store.tokens import TokenBatch

    (tmp_path / MANIFEST_DIR).mkdir()
    journal = ManifestJournal(tmp_path, "p0", {"side": "a"})
    big = 2**100 + 1   # uuid.uuid4().int as a request id, say
    batch = TokenBatch(step=0, rank=0, shape=(2,), input_ids=[5, 6], positions=[0, 0], seqs=[0, 1], sequences=2,
                       seq_ids=[big, big + 1])
    record = Record(seq=0, name="x", module="", role="explicit", step=0, call=0, rank=0, dtype="float32",
                    shape=(2,), attrs={"ids": [big], 3: "three"})
    journal.append([record], [batch])
    journal.end(1)
    part = read_part(tmp_path / MANIFEST_DIR / "p0.jsonl")
    assert part.problem is None
    assert part.tokens[0].seq_ids == [big, big + 1]   # integers, not floats rounded to 53 bits
    assert part.records[0].attrs == {"ids": [big], "3": "three"}
    plain = Record(seq=1, name="y", module="", role="explicit", step=0, call=0, rank=0, dtype="float32", shape=(2,))
    line = {"type": "record", **plain.to_json()}
    assert _encode(line) == (json.dumps(line, separators=(",", ":")) + "\n").encode()  # same bytes either way


@pytest.mark.parametrize("mode", ["stats", "full"])
def test_infinite_statistics_read_back_as_computed(tmp_path, mode):
    # orjson writes an infinite max as null, which reads back as "undefined": such lines go to json
    from tdiff.store.fingerprint import host_stats, stats_dict

    tensors = {"inf": torch.tensor([1.0, float("inf"), -2.0]), "both": torch.tensor([float("-inf"), float("inf")]),
               "nan": torch.tensor([float("nan"), float("nan")]), "finite": torch.tensor([0.5, -1.5])}
    with tdiff.capture(tmp_path / mode, mode=mode):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    stats = {r.name: r.stats for r in open_dump(tmp_path / mode).records}
    assert stats == {name: stats_dict(host_stats(tensor)) for name, tensor in tensors.items()}
    assert (stats["inf"]["min"], stats["inf"]["max"], stats["inf"]["inf"]) == (-2.0, float("inf"), 1)
