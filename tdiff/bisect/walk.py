"""The offline bisection: walk two dumps' events in execution order and name where the first
divergence is introduced.

Every event before the first differing one matched, so the first differing event says where the
divergence entered:

- a module's **output** differs and nothing recorded inside the call differs: the module itself
  (event "output") when no child was recorded, else its own code after its last recorded child
  (event "between", in that module's forward);
- a module's **input** differs: the code of the enclosing forward between the previous event at
  that level and this input (event "between"); when the enclosing call's start was not recorded,
  the producer is unknown (event "input", ``introduced`` false);
- an **explicit dump** differs: the code between the previous event at its level and the dump.

docs/BISECT.md explains the rules with examples.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from pathlib import Path

from tdiff.bisect.cause import cause_of
from tdiff.bisect.ops import STATE_NOT_RECORDED, descend
from tdiff.bisect.swap import swap_of
from tdiff.bisect.events import (Stream, enclosing_outputs, last_child_event, parent_of,
                                 previous_at_level, split_streams)
from tdiff.bisect.result import BisectResult, Divergence, TrailEntry, inputs_verdict
from tdiff.bisect.verdict import EventComparator
from tdiff.compare.engine import Comparison, unaligned_notes
from tdiff.compare.metrics import EXACT, Tolerance
from tdiff.compare.pairing import NamePairing, Pair, Pairing
from tdiff.compare.distributed import Counting, map_over_processes, torchrun_world
from tdiff.compare.parallel import lending, map_in_order, map_until_error
from tdiff.errors import TdiffError
from tdiff.store import Dump, open_dump
from tdiff.store.modules import read_module_descriptions
from tdiff.vocab.kinds import between_kind, explicit_kind, module_kind, record_kind
from tdiff.vocab.paths import ROOT_LABEL


def bisect_dumps(dump_a: Dump | str | Path, dump_b: Dump | str | Path, *,
                 tolerance: Tolerance = EXACT, pairing: Pairing | None = None,
                 allow_incomplete: bool = False, allow_unaligned: bool = False, jobs: int = 1,
                 echo: Callable[[str], None] | None = None) -> BisectResult:
    """Name the first op boundary where dump B departs from dump A.

    ``pairing`` decides which tensor of A is compared with which of B (default: by name, for two
    runs of the same program; cross-framework alignment supplies its own). A match of runs aligned
    by token that left rows of tokens both fed uncompared raises TdiffError, unless
    ``allow_unaligned`` (then a note says so). ``jobs`` streams (a rank's forward each) are walked
    at once; the answer does not depend on it. Under torchrun the streams are dealt over its
    processes, and the first ``echo``es what each process compared and read.
    """
    a, b = _opened(dump_a, allow_incomplete), _opened(dump_b, allow_incomplete)
    pairs = (pairing or NamePairing()).pair(a, b)
    missing = []
    if a.problems or b.problems:
        # an incomplete dump lacks records: those are missing, not where the runs part
        missing = [p for p in pairs if p.a is None or p.b is None]
        pairs = [p for p in pairs if p.a is not None and p.b is not None]
    if not any(p.a is not None and p.b is not None for p in pairs):
        raise TdiffError(f"{a.path} and {b.path} have no tensor in common to compare; "
                         "are they captures of the same program (or is a name mapping needed)?")
    comparator = EventComparator(a, b, tolerance)
    found = []
    streams = split_streams(pairs)
    firsts, checked = _walk_streams(streams, comparator, jobs, echo)
    for stream, first in zip(streams, firsts):
        if first is not None:
            found.append((first[1].record.step, stream.key[0], stream, *first))
    result = BisectResult(status="diverged" if found or missing else "match", first_divergence=None,
                          checked=checked,
                          tolerance=tolerance.describe(),
                          sides={"a": str(a.path), "b": str(b.path)},
                          notes=_notes(a, b) + _missing_notes(missing) + _left_out_notes(pairing)
                          + _not_aligned_notes(pairing) + _one_sided_input_notes(pairing))
    if found:
        _, _, stream, index, comparison = min(found, key=lambda f: f[:2])
        with lending(jobs):   # the modules around the culprit, the model's logits among them
            result.first_divergence, result.trail = _locate(stream, index, comparison, comparator,
                                                            _NotCompared(a, b, pairing))
        result.notes += descend(a, b, result.first_divergence, comparator)  # the op, from op records
        result.first_divergence.cause = cause_of(a, b, result.first_divergence, tolerance)  # which side is right
        result.first_divergence.swap = swap_of(a, b, result.first_divergence)  # each side's op on the other's inputs
    partings = list(getattr(getattr(pairing, "alignment", None), "partings", []))
    if partings:
        # the runs sampled different tokens: the op that made the difference, if a tensor shows it, is
        # the first divergence above (the logits of the position before)
        result.status = "diverged"
        result.notes.insert(0, partings[0].describe() + (f" (and {len(partings) - 1} more sequence pair(s))"
                                                         if len(partings) > 1 else ""))
    result.notes += unaligned_notes(getattr(pairing, "alignment", None), diverged=result.status != "match",
                                    allow_unaligned=allow_unaligned)
    return result


def _opened(dump: Dump | str | Path, allow_incomplete: bool) -> Dump:
    return dump if isinstance(dump, Dump) else open_dump(dump, allow_incomplete=allow_incomplete)


def _notes(a: Dump, b: Dump) -> list[str]:
    same = [(f"A and B are the same dump ({a.path}): it matches itself by construction; give two "
             "different runs to bisect")] if a.is_same_dump(b) else []
    return same + [f"side {label} is incomplete: {problem}"
                   for label, dump in (("A", a), ("B", b)) for problem in dump.problems]


def _missing_notes(missing: list[Pair]) -> list[str]:
    if not missing:
        return []
    first = missing[0]
    return [(f"{len(missing):,} tensor(s) captured on one side only were not compared (an incomplete dump "
             f"lacks them), first {first.name} (side {'A' if first.b is None else 'B'} only)")]


def _left_out_notes(pairing: Pairing | None) -> list[str]:
    left_out = getattr(pairing, "left_out", 0)  # a FilteredPairing's
    return [f"{left_out:,} tensor(s) left out by --select/--exclude were not compared"] if left_out else []


def _one_sided_input_notes(pairing: Pairing | None) -> list[str]:
    """Runs aligned by token: module inputs one run alone passes, listed, not divergences."""
    one_sided = getattr(getattr(pairing, "alignment", None), "one_sided_inputs", None)
    if not one_sided:
        return []
    name, side = one_sided[0]
    return [(f"aligned by token: {len(one_sided):,} input(s) one run alone passes were not compared (not a "
             f"divergence by itself), first {name} (side {side} only)")]


def _not_aligned_notes(pairing: Pairing | None) -> list[str]:
    """Runs aligned by token: the tensors without a row per token were not events (a decode step's
    mask over the cache, an op whose shape differs between decode and prefill)."""
    not_aligned = getattr(getattr(pairing, "alignment", None), "not_aligned", None)
    if not not_aligned:
        return []
    name, reason = not_aligned[0]
    return [(f"aligned by token: {len(not_aligned):,} tensor(s) without a row per token were not compared, "
            f"first {name} ({reason})")]


def _walk_streams(streams: list[Stream], comparator: EventComparator, jobs: int, echo: Callable[[str], None] | None
                  ) -> tuple[list[tuple[int, Comparison] | None], int]:
    """Each stream's first divergent event, ``jobs`` streams at a time, and how many events were
    compared; under torchrun the streams are dealt over its processes by rank
    (tdiff.compare.distributed) and every process gets them all."""
    def walk(stream: Stream) -> tuple[int, Comparison] | None:
        return _first_divergent(stream, comparator)

    world = torchrun_world()
    if world is None:
        return map_in_order(walk, streams, jobs=jobs), comparator.compared
    firsts = map_over_processes(lambda share: map_until_error(walk, [streams[i] for i in share], jobs=jobs),
                                streams, owner_key=lambda stream: stream.key[0], world=world, echo=echo,
                                counting=Counting("events", comparator.events, [dump.reads for dump in comparator.dumps]))
    # each process counted only its own share: the events every stream compared, as one process counts
    return firsts, sum(len(stream.pairs) if first is None else first[0] + 1 for stream, first in zip(streams, firsts))


def _first_divergent(stream: Stream, comparator: EventComparator) -> tuple[int, Comparison] | None:
    for index, pair in enumerate(stream.pairs):
        comparison = comparator.compare(pair)
        if comparison.diverged:
            return index, comparison
    return None


def _locate(stream: Stream, index: int, comparison: Comparison, comparator: EventComparator,
            not_compared: _NotCompared) -> tuple[Divergence, list[TrailEntry]]:
    pair = stream.pairs[index]
    event = pair.record
    event_b = pair.b.record if pair.b is not None else None
    # the calls enclosing the event, innermost first; their outputs make the trail
    calls = enclosing_outputs(stream, index, parent_of(event), event.depth - 1)
    if event.role == "output":
        divergence = _at_output(stream, index, comparison, not_compared)
    elif event.role == "input" and (event.depth == 0 or previous_at_level(stream, index) is None):
        divergence = Divergence.found(
            name=pair.name, module=event.module, module_b=event_b.module if event_b else None,
            kind=_pair_kind(pair), event="input", introduced=False, comparison=comparison,
            description=f"`{_path(event.module)}` input differs and the code that made it was not "
                        "recorded (the first recorded event at its level already differs)",
            module_call=event.call)
    else:
        # an input or an explicit dump: the code of the enclosing forward since the last event
        divergence = _between_events(stream, index, comparison, calls[0] if calls else None)
        calls = calls[1:]  # the first enclosing call is the forward the divergence names
    return divergence, _trail(stream, calls, comparator)


def _at_output(stream: Stream, index: int, comparison: Comparison, not_compared: _NotCompared) -> Divergence:
    """A module's output differs while its compared inputs and everything recorded inside it matched."""
    pair = stream.pairs[index]
    event = pair.record
    module, module_b = event.module, pair.b.record.module if pair.b is not None else None
    child = last_child_event(stream, index)
    if child is None:
        unchecked, differing = not_compared.of_module(stream, index)
        divergence = Divergence.found(name=pair.name, module=module, module_b=module_b, kind=_pair_kind(pair),
                                      event="output", introduced=True, comparison=comparison,
                                      description=f"`{_path(module)}`: {inputs_verdict(unchecked, differing)}",
                                      module_call=event.call)
        divergence.not_compared = unchecked
        return divergence
    kind = between_kind(parent=module, parent_kind=_pair_kind(pair),
                        before=_event_kind(stream, child, module), after=None)
    return Divergence.found(name=pair.name, module=module, module_b=module_b, kind=kind, event="between",
                            introduced=True, comparison=comparison,
                            description=f"in `{_path(module)}` forward, between "
                                        f"{_describe(stream, child, module)} and its output "
                                        "(everything recorded inside it matches)",
                            module_call=event.call, before=stream.record(child).module)


class _NotCompared:
    """The inputs of a culprit module's call that bisect did not compare: the parameters and
    buffers it reads (capture lists them on its output record, attrs "state"), the arguments it
    was passed that capture does not record as tensors (attrs "unrecorded"), inputs one side alone
    passed, and inputs that token alignment could not line up."""

    def __init__(self, a: Dump, b: Dump, pairing: Pairing | None):
        self.dumps = (a, b)
        self._descriptions: tuple[dict, dict] | None = None   # each side's modules/ (read when first needed)
        alignment = getattr(pairing, "alignment", None)
        self.not_aligned = dict(getattr(alignment, "not_aligned", None) or [])
        self.one_sided = dict(getattr(alignment, "one_sided_inputs", None) or [])

    def of_module(self, stream: Stream, index: int) -> tuple[str | None, str | None]:
        """For the call whose output is ``stream.pairs[index]``: what was not compared, "<names>
        (<why>); ...", and the parameters and buffers both sides stored (--params) that differ,
        "<names>"; each None when there is none."""
        pair = stream.pairs[index]
        event = pair.record
        groups: dict[str, list[str]] = {}

        def add(why: str, name: str) -> None:
            if name not in groups.setdefault(why, []):
                groups[why].append(name)

        stored = self._stored_state(pair)
        for side in (pair.a, pair.b):
            for name in (side.record.attrs.get("state") or []) if side is not None else []:
                if name not in stored:
                    add(STATE_NOT_RECORDED, name)
        for side in (pair.a, pair.b):   # arguments capture did not record as tensors (tdiff.hooks.opaque)
            for name, why in (side.record.attrs.get("unrecorded") or {}).items() if side is not None else ():
                add(why, name)
        differing = [name for name, equal in stored.items() if not equal]
        for earlier in stream.pairs[:index]:
            record = earlier.record
            if record.role == "input" and record.module == event.module and record.call == event.call \
                    and (earlier.a is None or earlier.b is None):
                add(f"passed by side {'A' if earlier.b is None else 'B'} only", record.sub)
        if self.not_aligned or self.one_sided:
            modules = {event.module, pair.b.record.module if pair.b is not None else None}
            for dump in self.dumps:
                for record in dump.records:
                    if record.role != "input" or record.module not in modules or record.call != event.call:
                        continue
                    if record.name in self.one_sided:
                        add(f"passed by side {self.one_sided[record.name]} only", record.sub)
                    elif record.name in self.not_aligned and record.step == event.step:
                        add("no row per token to align", record.sub)
        return ("; ".join(f"{', '.join(names)} ({why})" for why, names in groups.items()) or None,
                ", ".join(differing) or None)

    def _stored_state(self, pair: Pair) -> dict[str, bool]:
        """The parameters and buffers of the pair's module that both sides stored (capture
        --params), each with whether their fingerprints are equal."""
        if pair.a is None or pair.b is None:
            return {}
        if self._descriptions is None:
            self._descriptions = (read_module_descriptions(self.dumps[0].path),
                                  read_module_descriptions(self.dumps[1].path))
        described = [found.get((side.record.rank, side.record.module))
                     for found, side in zip(self._descriptions, (pair.a, pair.b))]
        if any(d is None or d.params is None for d in described):
            return {}
        params_a, params_b = (d.params for d in described)   # type: ignore[union-attr]
        return {name: params_a[name].fingerprint == params_b[name].fingerprint
                for name in params_a if name in params_b}


def _between_events(stream: Stream, index: int, comparison: Comparison,
                    forward_outputs: list[int] | None) -> Divergence:
    """An input or explicit dump differs: the code since the previous event at its level did it."""
    pair = stream.pairs[index]
    event = pair.record
    parent = parent_of(event)
    before = previous_at_level(stream, index)
    if event.role == "explicit":
        named = pair.kind or explicit_kind(event.name)
    else:
        # an aligned boundary names the op that made it (attn.q_rope is RoPE's output, mlp.act the
        # activation's), where the neighbours would only say whose forward the code runs in
        named = pair.kind if pair.kind != "other" else None
    kind = named or between_kind(
        parent=parent, parent_kind=_call_kind(stream, index, parent, event.depth - 1),
        before=_event_kind(stream, before, parent) if before is not None else None,
        after=_event_kind(stream, index, parent))
    where = f"in `{_path(parent)}` forward" if parent is not None else "outside any module"
    since = _describe(stream, before, parent) if before is not None else "the start of the capture"
    before_record = stream.record(before) if before is not None else None
    return Divergence.found(
        name=pair.name, module=parent,
        module_b=parent_of(pair.b.record) if pair.b is not None else None, kind=kind,
        event="between", introduced=before is not None, comparison=comparison,
        description=f"{where}, between {since} and {_describe(stream, index, parent)}",
        module_call=stream.record(forward_outputs[0]).call if forward_outputs else None,
        before=before_record.module if before_record and before_record.role != "explicit" else None)


def _trail(stream: Stream, calls: list[list[int]], comparator: EventComparator) -> list[TrailEntry]:
    trail = []
    for outputs in calls:
        for j in outputs:
            pair = stream.pairs[j]
            comparison = comparator.compare(pair)
            if comparison.diverged:
                trail.append(TrailEntry.found(module=pair.record.module,
                                              module_b=pair.b.record.module if pair.b else None,
                                              kind=_pair_kind(pair), comparison=comparison))
                break
    return trail


def _pair_kind(pair: Pair) -> str:
    return record_kind(pair.record, pair.kind)


def _event_kind(stream: Stream, index: int, forward: str | None) -> str | None:
    """The kind of the module an event at ``forward``'s level belongs to; None for the forward's
    own input or output."""
    record = stream.record(index)
    if record.role != "explicit" and record.module == forward:
        return None
    return _pair_kind(stream.pairs[index])


def _call_kind(stream: Stream, index: int, module: str | None, depth: int) -> str | None:
    """The kind of the enclosing call ``module`` (at ``depth``), from the nearest of its records."""
    if module is None:
        return None
    for j in chain(range(index, -1, -1), range(index + 1, len(stream.pairs))):
        record = stream.record(j)
        if record.module == module and record.depth == depth and record.role != "explicit":
            return _pair_kind(stream.pairs[j])
    return module_kind(module, None)


def _path(module: str | None) -> str:
    return module or ROOT_LABEL


def _describe(stream: Stream, index: int, forward: str | None) -> str:
    """An event, named relative to the forward it is described in."""
    record = stream.record(index)
    if record.role == "explicit":
        return f"the dump `{record.name}`"
    if record.module == forward:
        return f"its {record.role}"
    relative = record.module[len(forward) + 1:] if forward and record.module.startswith(forward + ".") \
        else _path(record.module)
    return f"`{relative}` {record.role}"
