"""Capture in programs with several threads: counters per thread, records paired by thread."""

import threading

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.report.console import summary_line
from tdiff.store import open_dump
from tests.helpers import python_script, tiny_qwen2, token_ids

FORWARDS = 3


def _two_threads_run(out, model, *, planted_in: str | None = None, **options):
    """Two threads (the main one and "worker") each run the model FORWARDS times, released
    together at every forward so that their module calls interleave; ``planted_in`` names the
    thread whose layer 0 MLP output is nudged."""
    barrier = threading.Barrier(2)

    def nudge(module, args, output):
        if threading.current_thread().name == planted_in:
            return output + 1e-3
        return output

    handle = model.model.layers[0].mlp.register_forward_hook(nudge)

    def forwards(seed):
        ids = token_ids(12, seed=seed)
        for _ in range(FORWARDS):
            barrier.wait()
            with torch.no_grad():
                model(ids)

    try:
        with tdiff.capture(out, **options):
            worker = threading.Thread(target=forwards, args=(2,), name="worker")
            worker.start()
            forwards(1)
            worker.join()
    finally:
        handle.remove()
    return open_dump(out)


def test_two_threads_running_one_model_keep_their_own_steps_and_calls(tmp_path):
    model = tiny_qwen2()
    dump = _two_threads_run(tmp_path / "a", model)
    by_thread = {"MainThread": [], "worker": []}
    for record in dump.records:
        by_thread[record.thread].append(record)
    main, worker = by_thread["MainThread"], by_thread["worker"]
    # each thread's records are those of FORWARDS forwards alone: steps 0.. and call 0 per module
    assert len(main) == len(worker) > 0
    for records in (main, worker):
        assert sorted({r.step for r in records}) == list(range(FORWARDS))
        assert {r.call for r in records if r.module == "model.layers.0.mlp"} == {0}
    assert [(r.name, r.step, r.call, r.role) for r in main] == [(r.name, r.step, r.call, r.role) for r in worker]


def test_records_carry_their_thread_in_the_manifest(tmp_path):
    _two_threads_run(tmp_path / "a", tiny_qwen2())
    lines = [line for path in (tmp_path / "a" / "manifests").iterdir() for line in path.read_text().splitlines()]
    records = [line for line in lines if '"type":"record"' in line]
    assert records and all('"thread":' in line for line in records)
    assert any('"thread":"worker"' in line for line in records)
    assert any('"thread":"MainThread"' in line for line in records)


def test_honest_runs_of_two_threads_match(tmp_path):
    model = tiny_qwen2()
    a = _two_threads_run(tmp_path / "a", model)
    b = _two_threads_run(tmp_path / "b", model)
    report = compare_dumps(a, b)
    assert report.status == "match", summary_line(report)
    assert report.counts()["compared"] == len(a.records) == len(b.records)


@pytest.mark.parametrize("planted_in", ["MainThread", "worker"])
def test_a_fault_on_either_thread_is_found_and_its_thread_named(tmp_path, planted_in):
    model = tiny_qwen2()
    a = _two_threads_run(tmp_path / "a", model)
    b = _two_threads_run(tmp_path / "b", model, planted_in=planted_in)
    report = compare_dumps(a, b)
    first = report.first_divergence
    assert report.status == "diverged" and first is not None
    assert first.name == "model.layers.0.mlp" and first.record.step == 0
    assert first.record.thread == planted_in
    assert first.verdict().to_json()["thread"] == planted_in
    # every divergence is on the planted thread: the other thread's records pair with their own
    assert {c.record.thread for c in report.comparisons if c.diverged} == {planted_in}
    if planted_in != "MainThread":
        assert f"thread {planted_in}" in summary_line(report)


def _helper_dumps_while_the_model_runs(out, model):
    """The main thread runs two forwards while a helper thread dumps values of its own."""
    started = threading.Event()

    def helper():
        started.wait()
        for i in range(6):
            tdiff.dump("helper.value", torch.full((4,), float(i)))

    with torch.no_grad(), tdiff.capture(out):
        thread = threading.Thread(target=helper, name="logger")
        thread.start()
        for seed in (1, 2):
            started.set()
            model(token_ids(12, seed=seed))
            tdiff.step()
        thread.join()
    return open_dump(out)


def test_a_dump_from_a_helper_thread_while_the_model_runs_matches_honestly(tmp_path):
    model = tiny_qwen2()
    a = _helper_dumps_while_the_model_runs(tmp_path / "a", model)
    b = _helper_dumps_while_the_model_runs(tmp_path / "b", model)
    helper = [r for r in a.records if r.name == "helper.value"]
    # the helper's dumps count in its own steps, whatever steps the main thread is in meanwhile
    assert [(r.thread, r.step, r.call) for r in helper] == [("logger", 0, i) for i in range(6)]
    report = compare_dumps(a, b)
    assert report.status == "match", summary_line(report)


THREADS_SCRIPT = """
import sys, threading
import torch, tdiff

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
barrier = threading.Barrier(3)

def forwards(seed):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    for _ in range(4):
        barrier.wait()
        with torch.no_grad():
            model(x)

with tdiff.capture(sys.argv[1]):
    threads = [threading.Thread(target=forwards, args=(seed,)) for seed in (1, 2)]  # default names
    for thread in threads:
        thread.start()
    forwards(3)
    for thread in threads:
        thread.join()
"""


def test_threads_with_default_names_pair_across_two_processes(tmp_path):
    # "Thread-1 (forwards)", "Thread-2 (forwards)": numbered by the program in the same order in
    # every run, whichever thread records first
    for side in ("a", "b"):
        result = python_script(THREADS_SCRIPT, tmp_path, tmp_path / side)
        assert result.returncode == 0, result.stderr
    a, b = open_dump(tmp_path / "a"), open_dump(tmp_path / "b")
    assert {r.thread for r in a.records} == {"MainThread", "Thread-1 (forwards)", "Thread-2 (forwards)"}
    report = compare_dumps(a, b)
    assert report.status == "match", summary_line(report)
