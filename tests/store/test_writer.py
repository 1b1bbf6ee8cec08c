"""The background writer: what reaches the manifest, from how many threads, and what it keeps."""

import threading

import torch

import tdiff
from tdiff.store import open_dump
from tdiff.store.fingerprint import host_stats, xxh3_fingerprint
from tdiff.store.record import Record
from tdiff.store.writer import DumpWriter, Pending


class _Resolved:
    def __init__(self, tensor):
        self.stats, self.fingerprint = host_stats(tensor), xxh3_fingerprint(tensor)

    def resolve(self, record):
        from tdiff.store.fingerprint import stats_dict

        return stats_dict(self.stats), self.fingerprint


def _pending(seq: int, value: float) -> Pending:
    tensor = torch.full((4,), value)
    record = Record(seq=seq, name=f"t{seq}", module="", role="explicit", step=0, call=0, rank=0,
                    dtype="float32", shape=(4,))
    return Pending(record=record, summary=_Resolved(tensor))


def _new_writer(tmp_path) -> DumpWriter:
    from tdiff.store.manifest import create_dump

    create_dump(tmp_path / "d", {"side": "d", "mode": "stats", "storage": "safetensors", "tdiff": tdiff.__version__})
    return DumpWriter(tmp_path / "d", "p0", {"side": "d", "mode": "stats"})


def test_records_submitted_from_several_threads_each_reach_the_manifest_once(tmp_path):
    writer = _new_writer(tmp_path)
    threads, per_thread = 4, 700   # not a multiple of the handful: the last ones go at close

    def submit(first):
        for seq in range(first, first + per_thread):
            writer.submit(_pending(seq, float(seq)))

    workers = [threading.Thread(target=submit, args=(i * per_thread,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    writer.close()
    dump = open_dump(tmp_path / "d")
    assert dump.complete
    assert sorted(r.seq for r in dump.records) == list(range(threads * per_thread))
    for record in dump.records:
        assert record.stats["min"] == record.seq  # each record kept its own summary


def test_the_writer_thread_is_handed_records_in_handfuls_not_one_by_one(tmp_path):
    # waking the writer for every record made it take the GIL from the model's thread per record
    writer = _new_writer(tmp_path)
    handed = []
    queue = writer._queue

    class CountingQueue:
        def put(self, item):
            handed.append(item)
            queue.put(item)

        def get(self):
            return queue.get()

    writer._queue = CountingQueue()
    records = 1000
    for seq in range(records):
        writer.submit(_pending(seq, 1.0))
    writer.close()
    assert len(handed) <= records // 64
    assert len(open_dump(tmp_path / "d").records) == records


def test_the_writer_forgets_each_steps_records_once_the_step_ends(tmp_path):
    # aliases never cross a step: the records it keeps for them must not grow with the steps
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    steps = 6
    with tdiff.capture(tmp_path / "d", mode="stats") as cap:
        for step in range(steps):
            model(torch.full((2, 8), float(step)))
        writer = cap.writer
    dump = open_dump(tmp_path / "d")
    per_step = len(dump.records) // steps
    assert len(dump.records) == steps * per_step and per_step > 0
    assert len(writer._stored) <= per_step
    relu_in = [r for r in dump.records if r.name == "2[0]" and r.role == "input"]
    assert relu_in and all(r.alias_of is not None for r in relu_in)  # aliases within a step still found
