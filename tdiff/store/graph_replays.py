"""A CUDA graph's replays in stats mode, journaled as one line each (format version 5).

A graph records the same tensors on every replay: only their statistics, fingerprints, and where
the replay falls (its first seq, its step, its thread, the call counts it continues from) change.
So the records its capture made are written once per part, in a "graph" line, and each replay in
a "replay" line that holds its statistics table; a reader expands each replay line back into the
records an eager forward would have written. Building and encoding a record per tensor per replay
took ~10 us of Python each, more than the GPU took for the whole decode step it recorded.

    {"type":"graph","graph":0,"counters":["0","0.up"],"records":[...],"entries":[[0,0,null],[1,null,0]]}
    {"type":"replay","graph":0,"seq":812,"step":3,"thread":"MainThread","calls":[2,2],
     "stats":[[min,max,mean,abs_mean,nan,inf],...],"digests":[...]}

``entries[i]`` = [index of record i's counter, its row in a replay's statistics (null for an
alias), the index of the earlier record of the same tensor (null unless an alias)]. Record ``i``
of a replay has seq ``seq + i``, call ``calls[counter] + `` its captured call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard

from tdiff.errors import DumpError
from tdiff.store.record import Record

if TYPE_CHECKING:   # the manifest reader imports this module: a command's --help must not import torch
    import torch

DIGEST = "mix64"   # the fused summary kernel's digest (tdiff.store.device_summary)


@dataclass(slots=True, eq=False)
class GraphTemplate:
    """What a graph's capture recorded. ``records``: seq and step are placeholders, ``call`` counts
    within the captured forward."""

    records: list[Record]
    counters: list[str]                       # distinct call counters, in first-use order
    entries: list[tuple[int, int | None, int | None]]   # (counter index, stats row, alias index)
    rows: int = field(init=False)             # of a replay's statistics table

    def __post_init__(self) -> None:
        self.rows = 1 + max((row for _, row, _ in self.entries if row is not None), default=-1)

    def line(self, number: int) -> dict:
        return {"type": "graph", "graph": number, "counters": self.counters,
                "records": [r.to_json() for r in self.records], "entries": [list(e) for e in self.entries]}


@dataclass(slots=True, eq=False)
class GraphReplay:
    """One replay on its way to the writer: its statistics table, in pinned host memory once
    ``ready`` completes (rows of 7 float64: six statistics and the digest's bits)."""

    template: GraphTemplate
    seq: int
    step: int
    thread: str
    calls: list[int]          # per counter of the template: its count before the replay
    table: torch.Tensor
    ready: torch.cuda.Event | None = None
    nbytes: int = 0            # held by the writer until written: none worth counting

    @property
    def records(self) -> int:
        return len(self.template.records)

    def line(self, number: int) -> dict:
        import torch   # only a capture writes lines

        if self.ready is not None:
            self.ready.synchronize()
        table = self.table[:self.template.rows]
        return {"type": "replay", "graph": number, "seq": self.seq, "step": self.step, "thread": self.thread,
                "calls": self.calls, "stats": table[:, :6].tolist(), "digests": table.view(torch.int64)[:, 6].tolist()}


class GraphLines:
    """A part's graph lines as it is read, turning each replay line into its records."""

    def __init__(self, where: str):
        self._where = where
        self._graphs: dict[int, GraphTemplate] = {}   # by number

    def graph(self, entry: dict, number: int) -> None:
        where = f"{self._where} line {number}"
        graph, counters, records, entries = (entry.get(k) for k in ("graph", "counters", "records", "entries"))
        if not _is_count(graph) or graph in self._graphs:
            raise DumpError(f"{where}: a graph line needs a new non-negative integer 'graph'")
        if not (isinstance(counters, list) and all(isinstance(c, str) for c in counters)
                and isinstance(records, list) and isinstance(entries, list) and len(entries) == len(records)):
            raise DumpError(f"{where}: a graph line needs 'counters' (strings) and as many 'entries' as 'records'")
        parsed = [Record.from_json(r, f"{where} record {i}") for i, r in enumerate(records)]
        checked = []
        for i, item in enumerate(entries):
            if not (isinstance(item, list) and len(item) == 3 and _is_count(item[0]) and item[0] < len(counters)
                    and (item[1] is None) != (item[2] is None)
                    and (item[1] is None or _is_count(item[1]))
                    and (item[2] is None or (_is_count(item[2]) and item[2] < i and entries[item[2]][2] is None))):
                raise DumpError(f"{where}: entry {i} must be [counter index, stats row or null, "
                                "index of an earlier non-alias record or null], one of the last two null")
            checked.append((item[0], item[1], item[2]))
        self._graphs[graph] = GraphTemplate(parsed, counters, checked)

    def replay(self, entry: dict, number: int) -> list[Record]:
        from tdiff.store.fingerprint import digest_format, stats_dict   # (imports torch)

        where = f"{self._where} line {number}"
        graph, seq, step, thread, calls, stats, digests = (
            entry.get(k) for k in ("graph", "seq", "step", "thread", "calls", "stats", "digests"))
        template = self._graphs.get(graph) if _is_count(graph) else None
        if template is None:
            raise DumpError(f"{where}: a replay of a graph with no graph line before it")
        if not (_is_count(seq) and _is_count(step)
                and isinstance(thread, str) and isinstance(calls, list) and len(calls) == len(template.counters)
                and all(map(_is_count, calls))):
            raise DumpError(f"{where}: a replay line needs non-negative 'seq' and 'step', a 'thread' and "
                            "a non-negative call count per counter of its graph")
        rows = template.rows
        if not (isinstance(stats, list) and isinstance(digests, list) and len(stats) == len(digests) == rows
                and all(isinstance(s, list) and len(s) == 6 and all(_is_number(v) for v in s) for s in stats)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in digests)):
            raise DumpError(f"{where}: a replay line needs {rows} rows of 6 statistics and as many digests")
        out: list[Record] = []
        for i, (record, (counter, row, alias)) in enumerate(zip(template.records, template.entries)):
            record = record.copy()
            record.attrs = dict(record.attrs)
            record.seq, record.step, record.thread = seq + i, step, thread
            record.call += calls[counter]
            if row is not None:
                record.set_contents(stats_dict(stats[row]), digest_format(DIGEST, digests[row], record.dtype, record.shape))
            else:
                original = out[alias]  # type: ignore[index]
                record.alias_of = original.seq
                record.set_contents(original.stats, original.fingerprint)
            out.append(record)
        return out


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
