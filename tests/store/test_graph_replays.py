"""A CUDA graph's replays journaled one line each (tdiff.store.graph_replays): read back, they are
the records the per-record path writes. The lines are written from host tables here; the GPU tests
(tests/hooks/test_cuda_graphs.py) make them from real graphs."""

import json
import math
import threading
import time
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tdiff
from tdiff.capture_options import DEFAULTS
from tdiff.errors import DumpError
from tdiff.hooks.running import RunningState
from tdiff.store import open_dump
from tdiff.store.fingerprint import digest_format, stats_dict
from tdiff.store.graph_replays import DIGEST, GraphReplay, GraphTemplate
from tdiff.store.manifest import MANIFEST_DIR, create_dump
from tdiff.store.record import Record
from tdiff.store.writer import DumpWriter

_CAPTURE_DEFAULTS = {name: getattr(DEFAULTS, name) for name in ("storage", "max_pending_bytes", "shard_bytes")}


def _writer(root) -> DumpWriter:
    create_dump(root, {"side": "d", "mode": "stats", "storage": "safetensors", "tdiff": tdiff.__version__})
    return DumpWriter(root, "p0", {"side": "d", "mode": "stats"}, **_CAPTURE_DEFAULTS)


def _record(index: int, module: str, role: str, call: int) -> Record:
    return Record(seq=index, name=f"{module}[{role}]", module=module, role=role, step=0, call=call, rank=0,
                  dtype="bfloat16", shape=(2, 3 + index), device="cuda:0")


def _template(modules: list[str], aliases: dict[int, int]) -> GraphTemplate:
    """One output record per module, in order; ``aliases``: record -> the earlier record it aliases.
    A module's records count its calls within the captured forward."""
    counters: dict[str, int] = {}
    calls: dict[str, int] = {}
    records, entries, row = [], [], 0
    for index, module in enumerate(modules):
        calls[module] = calls.get(module, -1) + 1
        records.append(_record(index, module, "output", calls[module]))
        counter = counters.setdefault(module, len(counters))
        if index in aliases:
            entries.append((counter, None, aliases[index]))
        else:
            entries.append((counter, row, None))
            row += 1
    return GraphTemplate(records, list(counters), entries)


def _table(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, 7, dtype=torch.float64, generator=generator)
    table[:, 4:6] = torch.randint(0, 5, (rows, 2), generator=generator).double()   # nan and inf counts
    table.view(torch.int64)[:, 6] = torch.randint(-2**63, 2**63 - 1, (rows,), generator=generator)
    return table


def _replay(template, seq, step, thread, calls, seed) -> GraphReplay:
    return GraphReplay(template, seq, step, thread, calls, _table(max(template.rows, 1) + 3, seed))


def _expected(replay: GraphReplay) -> list[dict]:
    """What the per-record path writes for the replay (tdiff.hooks.cuda_graphs' _emit before
    version 5): each record's seq, step, thread and call set, its statistics from its table row."""
    template, out = replay.template, []
    for index, (record, (counter, row, alias)) in enumerate(zip(template.records, template.entries)):
        record = record.copy()
        record.seq, record.step, record.thread = replay.seq + index, replay.step, replay.thread
        record.call += replay.calls[counter]
        if row is not None:
            values = replay.table[row]
            digest = int(replay.table.view(torch.int64)[row, 6])
            record.set_contents(stats_dict(values[:6].tolist()), digest_format(DIGEST, digest, record.dtype, record.shape))
        else:
            record.alias_of = replay.seq + alias
            original = out[alias]
            record.set_contents(original["stats"], original["fingerprint"])
        out.append(record.to_json())
    return out


def test_each_replay_reads_back_as_the_records_the_per_record_path_writes(tmp_path):
    template = _template(["0", "0.up", "0.down", "1", "1.up", "1.down", "0.up"], aliases={3: 2, 6: 1})
    replays = [_replay(template, seq=40, step=2, thread="MainThread", calls=[0, 0, 0, 0, 0, 0], seed=1),
               _replay(template, seq=47, step=2, thread="MainThread", calls=[1, 2, 1, 1, 1, 1], seed=2),
               _replay(template, seq=90, step=3, thread="decode", calls=[0, 0, 0, 0, 0, 0], seed=3)]
    writer = _writer(tmp_path / "d")
    for replay in replays:
        writer.submit(replay)
    writer.close()

    dump = open_dump(tmp_path / "d")
    assert dump.complete, dump.problems
    assert [r.to_json() for r in dump.records] == [line for replay in replays for line in _expected(replay)]
    lines = [json.loads(line) for line in next((tmp_path / "d" / MANIFEST_DIR).iterdir()).read_text().splitlines()]
    kinds = [line["type"] for line in lines]
    assert kinds == ["header", "graph", "replay", "replay", "replay", "end"]   # the graph once a part
    assert lines[-1]["records"] == 3 * len(template.records)


def test_a_replay_of_two_graphs_and_eager_records_interleave_in_seq_order(tmp_path):
    first, second = _template(["a", "a.b"], aliases={}), _template(["c"], aliases={})
    writer = _writer(tmp_path / "d")
    writer.submit(_replay(first, seq=0, step=0, thread="MainThread", calls=[0, 0], seed=1))
    writer.submit(_replay(second, seq=5, step=0, thread="MainThread", calls=[0], seed=2))
    writer.submit(_replay(first, seq=2, step=0, thread="MainThread", calls=[1, 1], seed=3))
    writer.close()
    records = open_dump(tmp_path / "d").records
    assert [(r.seq, r.name, r.call) for r in records] == [
        (0, "a[output]", 0), (1, "a.b[output]", 0), (2, "a[output]", 1), (3, "a.b[output]", 1), (5, "c[output]", 0)]


def test_statistics_that_are_not_finite_read_back_as_computed(tmp_path):
    template = _template(["a"], aliases={})
    replay = _replay(template, seq=0, step=0, thread="MainThread", calls=[0], seed=1)
    replay.table[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, math.nan], dtype=torch.float64)
    writer = _writer(tmp_path / "d")
    writer.submit(replay)
    writer.close()
    (record,) = open_dump(tmp_path / "d").records
    assert record.to_json() == _expected(replay)[0]
    assert record.stats["min"] is None and record.stats["max"] == math.inf and record.stats["mean"] == -math.inf


def _lines(tmp_path) -> tuple:
    template = _template(["a", "b", "a"], aliases={2: 0})
    writer = _writer(tmp_path / "d")
    writer.submit(_replay(template, seq=0, step=0, thread="MainThread", calls=[0, 0], seed=1))
    writer.close()
    path = next((tmp_path / "d" / MANIFEST_DIR).iterdir())
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def _rewrite(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("damage, message", [
    (lambda lines: lines.pop(1), "no graph line before it"),
    (lambda lines: lines[2]["stats"].pop(), "rows of 6 statistics"),
    (lambda lines: lines[2]["digests"].append(1), "rows of 6 statistics"),
    (lambda lines: lines[2]["stats"][0].__setitem__(0, "x"), "rows of 6 statistics"),
    (lambda lines: lines[2]["calls"].pop(), "call count per counter"),
    (lambda lines: lines[2].__setitem__("seq", -1), "non-negative 'seq'"),
    (lambda lines: lines[1]["entries"][2].__setitem__(2, 2), "entry 2"),
    (lambda lines: lines[1]["entries"][0].__setitem__(1, None), "entry 0"),
    (lambda lines: lines[1]["entries"][1].__setitem__(0, 9), "entry 1"),
    (lambda lines: lines[1]["records"].pop(), "as many 'entries' as 'records'"),
    (lambda lines: lines[1]["records"][0].pop("dtype"), "field 'dtype' is missing"),
])
def test_a_damaged_graph_or_replay_line_is_refused_with_its_line(tmp_path, damage, message):
    path, lines = _lines(tmp_path)
    damage(lines)
    _rewrite(path, lines)
    with pytest.raises(DumpError, match=message) as caught:
        open_dump(tmp_path / "d")
    assert "line" in str(caught.value)


def test_records_past_the_end_lines_count_make_the_part_incomplete(tmp_path):
    """A replay line adds its records: the end line's count checks them as it checks record lines."""
    path, lines = _lines(tmp_path)
    lines.insert(3, dict(lines[2], seq=10))
    _rewrite(path, lines)
    dump = open_dump(tmp_path / "d", allow_incomplete=True)
    assert "lists 6 records but its end line says 3" in dump.problems[0]


@st.composite
def _graphs(draw):
    modules = draw(st.lists(st.sampled_from(["a", "a.b", "c", "c.d"]), min_size=1, max_size=12))
    aliases = {}
    for index in range(1, len(modules)):
        if draw(st.booleans()):
            originals = [i for i in range(index) if i not in aliases]
            aliases[index] = draw(st.sampled_from(originals))
    return _template(modules, aliases)


@settings(max_examples=40, deadline=None)
@given(template=_graphs(), seq=st.integers(0, 10**6), step=st.integers(0, 50), base=st.integers(0, 5),
       seed=st.integers(0, 1000))
def test_any_graph_reads_back_as_the_per_record_path_writes(tmp_path_factory, template, seq, step, base, seed):
    root = tmp_path_factory.mktemp("g") / "d"
    replay = _replay(template, seq, step, "MainThread", [base] * len(template.counters), seed)
    writer = _writer(root)
    writer.submit(replay)
    writer.close()
    records = open_dump(root).records
    assert [r.to_json() for r in records] == _expected(replay)
    for record in records:
        if record.alias_of is not None:   # an alias carries its original's fingerprint, of this replay
            assert record.fingerprint == records[record.alias_of - seq].fingerprint


def test_consecutive_places_taken_for_a_replay_are_nobody_elses():
    running = RunningState()
    taken: list[list[int]] = [[] for _ in range(4)]

    def take(mine: list[int], block: int) -> None:
        for _ in range(2000):
            if block:
                first = running.next_seqs(block)
                mine.extend(range(first, first + block))
            else:
                mine.append(running.next_seq())

    threads = [threading.Thread(target=take, args=(taken[i], i * 3)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = sorted(seq for mine in taken for seq in mine)
    assert every == list(range(len(every)))


def test_a_replay_is_handed_to_the_writer_at_once_and_its_table_let_go(tmp_path):
    """Held back with later items, every replay's pinned table would stay held, and each replay
    take a new pinned block from the driver."""
    writer = _writer(tmp_path / "d")
    replay = _replay(_template(["a"], aliases={}), seq=0, step=0, thread="MainThread", calls=[0], seed=1)
    table = weakref.ref(replay.table)
    writer.submit(replay)
    del replay
    deadline = time.monotonic() + 10
    while table() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert table() is None
    writer.close()
    assert len(open_dump(tmp_path / "d").records) == 1
