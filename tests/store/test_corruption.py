"""Damaged dumps: every damage gives exit 2 with the file named, or a divergence — never a
traceback and never a false match."""

import json
import random

import pytest
import torch

import tdiff
from tdiff.store.manifest import MANIFEST_DIR
from tests.helpers import tdiff_cli


def make_dump(path, storage="safetensors", seed=0):
    generator = torch.Generator().manual_seed(seed)
    with tdiff.capture(path, storage=storage):
        for i in range(3):
            tdiff.dump(f"t{i}", torch.randn(32, 16, generator=generator).bfloat16())
        tdiff.dump("ids", torch.arange(10))
    return path


def shards(path):
    return sorted((path / "data").iterdir())


def compare_exit(a, b, *extra):
    """Run compare in-process; an unexpected exception (a traceback) fails the test."""
    result = tdiff_cli("compare", a, b, *extra)
    assert "Traceback" not in result.output
    return result


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_truncated_shard_is_named(tmp_path, storage):
    good = make_dump(tmp_path / "good", storage)
    bad = make_dump(tmp_path / "bad", storage)
    (shard,) = shards(bad)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = compare_exit(good, bad)
    assert result.exit_code == 2 and shard.name in result.output


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_every_command_refuses_a_truncated_shard_alike_before_a_verdict(tmp_path, storage):
    # the same capture twice: the fingerprints in both manifests agree, so a command judging by
    # fingerprints alone (bisect's stats pass) must still open the shards to see the damage
    good = make_dump(tmp_path / "good", storage)
    bad = make_dump(tmp_path / "bad", storage)
    (shard,) = shards(bad)
    shard.write_bytes(shard.read_bytes()[:-16])
    outputs = set()
    for command in ("compare", "bisect", "report"):
        for sides in ((good, bad), (bad, good)):
            result = tdiff_cli(command, *sides, expect=2)
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and shard.name in lines[0] and "truncated or corrupted" in lines[0]
            outputs.add(lines[0])
    assert len(outputs) == 1  # all agree, word for word


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_garbage_shard_is_named(tmp_path, storage):
    good = make_dump(tmp_path / "good", storage)
    bad = make_dump(tmp_path / "bad", storage)
    (shard,) = shards(bad)
    shard.write_bytes(b"\x00garbage" * 100)
    result = compare_exit(good, bad)
    assert result.exit_code == 2 and shard.name in result.output


def test_a_flipped_bit_in_tensor_data_is_caught_by_the_fingerprint(tmp_path):
    good = make_dump(tmp_path / "good")
    bad = make_dump(tmp_path / "bad")
    (shard,) = shards(bad)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes; the header is intact
    shard.write_bytes(bytes(data))
    result = compare_exit(good, bad)
    assert result.exit_code == 2 and "does not match its fingerprint" in result.output


def rewrite_safetensors_header(shard, change):
    """Apply ``change`` to a safetensors shard's JSON header, keeping its data as it is."""
    raw = shard.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    change({key: entry for key, entry in header.items() if key != "__metadata__"})
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def test_swapped_offsets_in_a_shard_header_are_caught_by_the_fingerprints(tmp_path):
    good = make_dump(tmp_path / "good")
    bad = make_dump(tmp_path / "bad")
    (shard,) = shards(bad)

    def swap_two_tensors(entries):  # the header stays well formed: the data read is another tensor's
        first, second = [entry for entry in entries.values() if entry["shape"] == [32, 16]][:2]
        first["data_offsets"], second["data_offsets"] = second["data_offsets"], first["data_offsets"]

    rewrite_safetensors_header(shard, swap_two_tensors)
    result = compare_exit(good, bad)
    assert result.exit_code == 2 and "does not match its fingerprint" in result.output


def test_a_shard_header_whose_entries_leave_a_gap_is_refused(tmp_path):
    good = make_dump(tmp_path / "good")
    bad = make_dump(tmp_path / "bad")
    (shard,) = shards(bad)

    def shift_the_last_tensor(entries):
        last = max(entries.values(), key=lambda entry: entry["data_offsets"][0])
        begin, end = last["data_offsets"]
        last["data_offsets"] = [begin + 2, end]
        last["shape"], last["dtype"] = [end - begin - 2], "U8"

    rewrite_safetensors_header(shard, shift_the_last_tensor)
    result = compare_exit(good, bad)
    assert result.exit_code == 2 and shard.name in result.output and "truncated or corrupted" in result.output


def test_random_truncation_of_every_shard_never_passes(tmp_path):
    rng = random.Random(7)
    reference = make_dump(tmp_path / "ref")
    for trial in range(12):
        damaged = make_dump(tmp_path / f"d{trial}")
        (shard,) = shards(damaged)
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[: rng.randrange(0, size)])
        assert compare_exit(reference, damaged).exit_code == 2


def mutations(value, rng):
    yield None
    yield "x" * rng.randrange(1, 5)
    yield -rng.randrange(1, 10**6)
    yield rng.random()
    yield [rng.randrange(-3, 1 << 40)]
    yield {"nested": value}
    yield True


def test_every_manifest_field_mutated_or_truncated_never_gives_a_traceback_or_false_match(tmp_path):
    from tdiff.store import open_dump

    rng = random.Random(3)
    reference = make_dump(tmp_path / "ref")
    (manifest,) = (reference / MANIFEST_DIR).glob("*.jsonl")
    lines = manifest.read_text().splitlines()
    damages = []  # (line index, field or None, new value or cut position)
    for index, line in enumerate(lines):
        entry = json.loads(line)
        for field in entry:
            damages += [(index, field, value) for value in mutations(entry[field], rng)]
        damages += [(index, None, rng.randrange(0, len(line))) for _ in range(3)]
    assert len(damages) > 150
    seen_exit_codes = set()
    for number, (index, field, value) in enumerate(damages):
        damaged = make_dump(tmp_path / f"m{number}")
        (target,) = (damaged / MANIFEST_DIR).glob("*.jsonl")
        own = target.read_text().splitlines()
        own[index] = json.dumps(dict(json.loads(own[index]), **{field: value})) if field else own[index][:value]
        target.write_text("\n".join(own) + "\n")
        result = compare_exit(reference, damaged)
        seen_exit_codes.add(result.exit_code)
        if result.exit_code == 0:
            # a match is allowed only when every tensor really is equal to the reference's
            ref, dmg = open_dump(reference), open_dump(damaged)
            assert [r.name for r in ref.records] == [r.name for r in dmg.records]
            for ra, rb in zip(ref.records, dmg.records):
                assert torch.equal(ref.load(ra).view(torch.uint8), dmg.load(rb).view(torch.uint8))
    assert seen_exit_codes == {0, 1, 2}, seen_exit_codes
