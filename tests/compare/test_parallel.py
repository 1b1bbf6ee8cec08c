"""Comparing on several threads (--jobs) gives the one-thread answer: rows, first divergence,
JSON byte for byte, and the same error at the same pair."""

import functools
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

import tdiff
from tdiff.cli import cli
from tdiff.compare import compare_dumps
from tdiff.compare.parallel import lending, map_in_order, spread
from tdiff.errors import DumpError
from tdiff.store import open_dump

RANKS = 8


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 8))


def ranked_dump(path: Path, planted: tuple[int, int, int] | None = None, ranks: int = RANKS) -> Path:
    """A dump of ``ranks`` processes, one forward each (module outputs are the next module's
    inputs: aliases); ``planted`` = (rank, linear layer, element) of a bias moved by 0.5."""
    saved = os.environ.get("RANK")
    os.environ["TDIFF_RUN"] = f"ranks-{path}"   # the ranks' captures are parts of one run
    try:
        for rank in range(ranks):
            os.environ["RANK"] = str(rank)
            net = model(rank)
            if planted is not None and planted[0] == rank:
                bias = net[2 * planted[1]].bias.detach()   # a bias moves its linear's output whatever the input
                bias[planted[2] % bias.numel()] += 0.5
            with torch.no_grad(), tdiff.capture(path, side=path.name):
                net(torch.linspace(-1, 1, 4 * 16).reshape(4, 16) * (rank + 1))
    finally:
        os.environ.pop("TDIFF_RUN")
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
    return path


def compare_json(a: Path, b: Path, jobs: int) -> str:
    return json.dumps(compare_dumps(open_dump(a), open_dump(b), jobs=jobs).to_json(), indent=1)


@settings(max_examples=5, deadline=None)
@given(rank=st.integers(0, 3), layer=st.integers(0, 2), element=st.integers(0, 1 << 10), jobs=st.integers(2, 8))
def test_any_planted_divergence_gives_the_one_thread_json(rank, layer, element, jobs):
    with tempfile.TemporaryDirectory() as tmp:
        a = ranked_dump(Path(tmp) / "a", ranks=4)
        b = ranked_dump(Path(tmp) / "b", planted=(rank, layer, element), ranks=4)
        one = compare_json(a, b, jobs=1)
        assert compare_json(a, b, jobs=jobs) == one
        first = json.loads(one)["tensors"]
        diverged = [t for t in first if t["status"] != "match"]
        assert diverged and {t["rank"] for t in diverged} == {rank}   # the planted rank, nothing else


def test_compare_jobs_flag_prints_the_same_json_byte_for_byte(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b", planted=(5, 1, 7))
    runner = CliRunner()
    outputs = [runner.invoke(cli, ["compare", str(a), str(b), "--json", "--jobs", str(jobs)]) for jobs in (1, 4)]
    assert [o.exit_code for o in outputs] == [1, 1], outputs[1].output
    assert outputs[0].stdout == outputs[1].stdout
    tables = [runner.invoke(cli, ["compare", str(a), str(b), "--jobs", str(jobs)]).stdout for jobs in (1, 4)]
    assert tables[0] == tables[1]


def test_a_corrupted_tensor_is_refused_with_the_one_thread_error(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b")
    dump = open_dump(b)
    victim = next(r for r in dump.records if r.rank == 6 and r.file is not None)
    shard = b / "data" / victim.file
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x40   # a bit of the shard's last tensor
    shard.write_bytes(bytes(raw))
    errors = []
    for jobs in (1, 4):
        with pytest.raises(DumpError, match="does not match its fingerprint") as caught:
            compare_dumps(open_dump(a), open_dump(b), jobs=jobs)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@given(failing=st.sets(st.integers(0, 39), max_size=4), groups=st.lists(st.integers(0, 5), min_size=40, max_size=40),
       jobs=st.integers(1, 6), weights=st.lists(st.integers(0, 10), min_size=40, max_size=40), memory=st.integers(0, 25))
def test_map_in_order_is_the_list_comprehension_and_raises_its_first_error(failing, groups, jobs, weights, memory):
    running, most = [], [0]
    lock = threading.Lock()

    def work(index):
        with lock:
            running.append(index)
            held = sum(min(weights[i], memory) for i in running)
            most[0] = max(most[0], held if len(running) > 1 else 0)
        try:
            return measured(index)
        finally:
            with lock:
                running.remove(index)

    def measured(index):
        if index in failing:
            raise ValueError(index)
        return index * index

    done = []
    try:
        expected = [measured(i) for i in range(40)]
    except ValueError as exc:
        expected = exc
    try:
        got = map_in_order(work, range(40), jobs=jobs, group_of=lambda i: groups[i] or None,
                           weight_of=weights.__getitem__, memory=memory, progress=lambda d, t: done.append(d))
    except ValueError as exc:
        got = exc
    if isinstance(expected, ValueError):
        assert isinstance(got, ValueError) and got.args == expected.args
        assert done == list(range(1, expected.args[0] + 1))
    else:
        assert got == expected and done == list(range(1, 41))
    assert most[0] <= memory   # pairs run together only within the memory they were given


def test_a_pairs_pieces_run_on_the_threads_the_pairs_leave_idle():
    """One pair among 3 threads: its two pieces run at once (the first waits for the second)."""
    second_ran = threading.Event()

    def first():
        assert second_ran.wait(timeout=30), "the pieces ran one after another"
        return "first"

    def second():
        second_ran.set()
        return "second"

    assert map_in_order(lambda _: spread([first, second]), [None], jobs=3) == [["first", "second"]]
    second_ran.clear()
    with lending(2):   # outside map_in_order (bisect's look around its culprit)
        assert spread([first, second]) == ["first", "second"]
    assert spread([second, lambda: "alone"]) == ["second", "alone"]   # outside both: one after another


@settings(deadline=None, max_examples=60)
@given(jobs=st.integers(1, 5), items=st.integers(1, 6), pieces=st.integers(0, 10),
       failing=st.sets(st.tuples(st.integers(0, 5), st.integers(0, 9)), max_size=3))
def test_spread_is_the_list_comprehension_on_at_most_jobs_threads(jobs, items, pieces, failing):
    computing, most = [0], [0]
    lock = threading.Lock()

    def piece(item, index):
        with lock:
            computing[0] += 1
            most[0] = max(most[0], computing[0])
        try:
            time.sleep(0.0005)
            if (item, index) in failing:
                raise ValueError(item, index)
            return item * 100 + index
        finally:
            with lock:
                computing[0] -= 1

    def work(item):
        with lock:   # the pair's own thread computes too
            computing[0] += 1
            most[0] = max(most[0], computing[0])
        try:
            time.sleep(0.0005)
        finally:
            with lock:
                computing[0] -= 1
        return spread([functools.partial(piece, item, index) for index in range(pieces)])

    def one_thread(item):
        return [piece(item, index) for index in range(pieces)]

    try:
        expected = [one_thread(item) for item in range(items)]
    except ValueError as exc:
        expected = exc
    try:
        got = map_in_order(work, range(items), jobs=jobs)
    except ValueError as exc:
        got = exc
    if isinstance(expected, ValueError):
        assert isinstance(got, ValueError) and got.args == expected.args   # the earliest failing piece
    else:
        assert got == expected
    assert most[0] <= jobs
