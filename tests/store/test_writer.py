"""The background writer: what reaches the manifest, from how many threads, and what it keeps."""

import threading
from pathlib import Path

import torch

import tdiff
from tdiff.capture_options import DEFAULTS
from tdiff.store import open_dump
from tdiff.store.fingerprint import host_stats, xxh3_fingerprint
from tdiff.store.record import Record
from tdiff.store.writer import DumpWriter, Pending

# a capture's defaults
_CAPTURE_DEFAULTS = {name: getattr(DEFAULTS, name) for name in ("storage", "max_pending_bytes", "shard_bytes")}


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
    return DumpWriter(tmp_path / "d", "p0", {"side": "d", "mode": "stats"}, **_CAPTURE_DEFAULTS)


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


def test_the_records_kept_for_aliases_do_not_grow_with_the_steps(tmp_path, monkeypatch):
    # an alias takes its contents from the item it aliases: no table of every record is kept;
    # and an idle shard writer keeps no records of the last shard it wrote (4 of them, as on a
    # machine of 16 cores)
    import gc

    from tdiff.store import writer

    monkeypatch.setattr(writer, "DEFAULT_SHARD_WRITERS", 4)

    def live_records() -> int:
        gc.collect()
        return sum(isinstance(o, Record) for o in gc.get_objects())

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    steps = 12
    before = live_records()  # of earlier tests in this process
    with tdiff.capture(tmp_path / "d", mode="stats") as cap:
        for step in range(steps):
            model(torch.full((2, 8), float(step)))
        cap.writer.drain()
        live = live_records() - before
    dump = open_dump(tmp_path / "d")
    per_step = len(dump.records) // steps
    assert len(dump.records) == steps * per_step and per_step > 0
    assert live <= 3 * per_step
    relu_in = [r for r in dump.records if r.name == "2[0]" and r.role == "input"]
    assert relu_in and all(r.alias_of is not None for r in relu_in)  # aliases within a step still found


def test_an_alias_another_thread_found_across_a_steps_end_resolves(tmp_path, monkeypatch):
    # thread B stores x, then (before B notes it for aliases) thread A ends its step, which flushes
    # the writer; B's next record of the unchanged x (in B's own step: threads count steps apart)
    # is an alias of the record written before the flush
    from tdiff.hooks.recorders import Recorder

    x = torch.randn(16)
    step_now, stepped = threading.Event(), threading.Event()
    remember = Recorder._remember

    def remember_after_a_step(self, *args, **kwargs):
        if threading.current_thread().name == "B" and not step_now.is_set():
            step_now.set()
            stepped.wait(10)
        return remember(self, *args, **kwargs)

    monkeypatch.setattr(Recorder, "_remember", remember_after_a_step)

    def a():
        step_now.wait(10)
        tdiff.step()
        stepped.set()

    def b():
        tdiff.dump("x", x)
        tdiff.dump("x", x)

    for mode in ("full", "stats"):
        step_now.clear()
        stepped.clear()
        with tdiff.capture(tmp_path / mode, mode=mode):
            threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        dump = open_dump(tmp_path / mode)
        assert dump.complete, mode
        first, second = dump.records
        assert (first.step, second.step, second.call, second.alias_of) == (0, 0, 1, first.seq)
        assert second.fingerprint == first.fingerprint and second.stats == first.stats
        if mode == "full":
            assert torch.equal(dump.load(second), x)


def _copy(seq: int, nbytes: int) -> Pending:
    tensor = torch.full((nbytes // 4,), float(seq))
    record = Record(seq=seq, name=f"t{seq}", module="", role="explicit", step=0, call=0, rank=0,
                    dtype="float32", shape=tuple(tensor.shape))
    return Pending(record=record, data=tensor, nbytes=nbytes)


def _gated_writer(tmp_path, max_pending_bytes: int) -> tuple[DumpWriter, threading.Event]:
    """A full-mode writer whose shards wait for the returned gate before they are written."""
    from tdiff.store.manifest import create_dump

    create_dump(tmp_path / "d", {"side": "d", "mode": "full", "storage": "safetensors", "tdiff": tdiff.__version__})
    writer = DumpWriter(tmp_path / "d", "p0", {"side": "d", "mode": "full"},
                        **{**_CAPTURE_DEFAULTS, "max_pending_bytes": max_pending_bytes})
    gate = threading.Event()
    write = writer.storage.write

    def gated_write(path, tensors):
        gate.wait(10)
        return write(path, tensors)

    writer.storage = type("Gated", (), {"write": staticmethod(gated_write), "suffix": writer.storage.suffix})()
    return writer, gate


def test_a_thread_at_the_memory_cap_is_not_kept_waiting_by_what_another_thread_holds(tmp_path):
    # A waits at the cap; B then submits a copy that fits. Once the writer frees the first copy,
    # B's copy alone still leaves no room for A's: A may go on only once B's copy is written too,
    # so B's copy must not sit in B's handful (until the step's end) while A waits
    cap = 1000
    writer, gate = _gated_writer(tmp_path, cap)
    writer.submit(_copy(0, 500))
    a = threading.Thread(target=writer.submit, args=(_copy(1, 900),), name="A")
    a.start()
    for _ in range(1000):
        if writer.waits:
            break
        threading.Event().wait(0.01)
    assert writer.waits == 1
    writer.submit(_copy(2, 300))   # fits beside the first: no wait for this thread
    gate.set()
    a.join(10)
    assert not a.is_alive(), "A still waits at the memory cap"
    writer.close()
    dump = open_dump(tmp_path / "d")
    assert dump.complete and sorted(r.seq for r in dump.records) == [0, 1, 2]
    assert writer.peak_pending_bytes <= cap


def test_after_a_write_failure_no_copy_stays_held(tmp_path):
    # copies still in a thread's handful when the writer fails are never handed over (submit
    # returns at once from then on): they are freed then, not at the step's end
    import pytest

    from tdiff.errors import DumpError

    writer, gate = _gated_writer(tmp_path, 1 << 20)   # shards of 512 KiB
    write = writer.storage.write

    def failing_write(path, tensors):
        write(path, tensors)   # waits for the gate
        raise OSError(28, "No space left on device")

    writer.storage.write = failing_write
    writer.submit(_copy(0, 600_000))
    writer.flush()                      # its shard is on its way to disk, held at the gate
    held = [_copy(seq, 1000) for seq in (1, 2, 3)]
    for item in held:
        writer.submit(item)  # held in this thread's handful
    gate.set()
    for _ in range(1000):
        if writer.failed and writer._pending_bytes == 0:
            break
        threading.Event().wait(0.01)
    assert writer.failed and writer._pending_bytes == 0
    # nor do the items: capture keeps an item while its tensor may be recorded again
    assert all(item.data is None for item in held)
    writer.close()
    with pytest.raises(DumpError, match="capture failed"):
        open_dump(tmp_path / "d")


def _full_writer(tmp_path) -> DumpWriter:
    from tdiff.store.manifest import create_dump

    create_dump(tmp_path / "d", {"side": "d", "mode": "full", "storage": "safetensors", "tdiff": tdiff.__version__})
    return DumpWriter(tmp_path / "d", "p0", {"side": "d", "mode": "full"}, **_CAPTURE_DEFAULTS)


def _record_of(seq: int, tensor: torch.Tensor) -> Record:
    from tdiff.store.dtypes import dtype_name

    return Record(seq=seq, name=f"t{seq}", module="", role="explicit", step=0, call=0, rank=0,
                  dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def _journaled_seqs(tmp_path) -> list[int]:
    import json

    from tdiff.store.manifest import MANIFEST_DIR

    lines = (tmp_path / "d" / MANIFEST_DIR / "p0.jsonl").read_text().splitlines()
    return [json.loads(line)["seq"] for line in lines if '"seq"' in line]


def test_a_streamed_shards_records_reach_the_manifest_only_once_it_is_in_place(tmp_path):
    from tdiff.store.manifest import DATA_DIR

    writer = _full_writer(tmp_path)
    data = tmp_path / "d" / DATA_DIR
    x = torch.arange(10.0)
    writer.stream(_record_of(0, x), x)
    writer.drain()
    assert not list(data.glob("*.safetensors")) and len(list(data.glob(".*.tmp"))) == 1  # still open
    assert _journaled_seqs(tmp_path) == []
    writer.flush()   # the end of a step
    writer.drain()
    [shard] = data.glob("*.safetensors")
    assert _journaled_seqs(tmp_path) == [0] and not list(data.glob(".*.tmp"))
    y = torch.ones(3, dtype=torch.bfloat16)
    writer.stream(_record_of(1, y), y)
    writer.close()
    dump = open_dump(tmp_path / "d")
    assert dump.complete and [r.seq for r in dump.records] == [0, 1]
    assert dump.records[0].file == shard.name and dump.records[1].file != shard.name
    assert torch.equal(dump.load(dump.records[0]), x) and torch.equal(dump.load(dump.records[1]), y)
    assert not list(data.glob(".*.tmp"))


def test_a_streamed_shards_header_room_follows_what_the_last_header_needed(tmp_path, monkeypatch):
    # a shard that fills its header room ends, and the next gets twice the room; a shard of few
    # tensors after it does not carry that room on
    import json
    import struct

    from safetensors.torch import load_file

    from tdiff.store import storage
    from tdiff.store.manifest import DATA_DIR

    monkeypatch.setattr(storage, "STREAM_HEADER_ROOM", 512)
    writer = _full_writer(tmp_path)
    # 6 bytes each: every other tensor would start off an 8-byte boundary without padding
    tensors = [torch.full((3,), float(i), dtype=torch.bfloat16) for i in range(42)]
    for seq, tensor in enumerate(tensors[:40]):
        assert writer.stream(_record_of(seq, tensor), tensor) is not None
    for seq in (40, 41):   # a step of one tensor each
        writer.flush()
        writer.drain()   # the writer thread has sealed the shard open so far
        writer.stream(_record_of(seq, tensors[seq]), tensors[seq])
    writer.close()
    dump = open_dump(tmp_path / "d")
    assert dump.complete and len(dump.records) == len(tensors)
    for record in dump.records:
        assert torch.equal(dump.load(record), tensors[record.seq])
    shards = sorted({r.file for r in dump.records})
    rooms, used = [], []
    for name in shards:
        raw = (tmp_path / "d" / DATA_DIR / name).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        rooms.append(8 + length)
        used.append(8 + len(raw[8:8 + length].rstrip(b" ")))
        stored = load_file(str(tmp_path / "d" / DATA_DIR / name))   # safetensors' own reader
        header = json.loads(raw[8:8 + length])
        for record in dump.records:
            if record.file == name:
                assert torch.equal(stored[record.key], tensors[record.seq])
                assert header[record.key]["data_offsets"][0] % 8 == 0   # aligned for any dtype
    filled = len(shards) - 3   # those the first 40 tensors filled
    assert filled >= 2 and rooms[0] == 512
    assert all(rooms[i + 1] >= 2 * used[i] for i in range(filled))
    assert rooms[-1] == 512   # after a shard of one tensor


def test_a_signal_handler_that_ends_the_capture_mid_tensor_does_not_hang(tmp_path, monkeypatch):
    # SIGTERM's handler (tdiff.child_startup) closes the writer on the thread it interrupts, which
    # may be inside stream(), holding the streamed shard's lock
    import pytest

    from tdiff.errors import DumpError
    from tdiff.store import writer as writer_module
    from tdiff.store.manifest import DATA_DIR

    writer = _full_writer(tmp_path)
    writer.streamed_shard_limit = 50   # 40 bytes a tensor: each in a shard of its own
    x = torch.arange(10.0)
    for seq in range(3):   # two shards ended, one open: the handler leaves none behind
        writer.stream(_record_of(seq, x), x)
    summarise = writer_module.host_summary

    def interrupted(tensor, sink=None):
        writer.close("the process was ended by SIGTERM")   # as the handler would, mid-tensor
        return summarise(tensor, sink=sink)

    monkeypatch.setattr(writer_module, "host_summary", interrupted)
    ended = threading.Thread(target=writer.stream, args=(_record_of(3, x), x), daemon=True)
    ended.start()
    ended.join(30)
    assert not ended.is_alive(), "closing the writer mid-tensor hung"
    assert writer.failed
    with pytest.raises(DumpError, match="capture failed"):
        open_dump(tmp_path / "d")
    assert not list((tmp_path / "d" / DATA_DIR).glob(".*.tmp"))



def test_a_signal_handler_that_ends_the_capture_as_a_hook_takes_the_shards_lock_does_not_hang(tmp_path):
    # the handler may run at any bytecode of stream(), not only while a tensor's bytes are written:
    # here, at its first check inside the lock
    from tdiff.store.manifest import create_dump

    class HandlerInside(DumpWriter):
        hook_thread: int | None = None

        @property
        def failed(self) -> bool:
            if threading.get_ident() == self.hook_thread and self._stream_lock.locked():
                self.hook_thread = None
                self.close("the process was ended by SIGTERM")
            return self.error is not None

    create_dump(tmp_path / "d", {"side": "d", "mode": "full", "storage": "safetensors", "tdiff": tdiff.__version__})
    writer = HandlerInside(tmp_path / "d", "p0", {"side": "d", "mode": "full"}, **_CAPTURE_DEFAULTS)
    x = torch.arange(10.0)

    def hook():
        writer.hook_thread = threading.get_ident()
        writer.stream(_record_of(0, x), x)

    ended = threading.Thread(target=hook, daemon=True)
    ended.start()
    ended.join(30)
    assert not ended.is_alive(), "closing the writer inside stream() hung"
    assert writer.failed


def test_a_signal_handler_that_ends_the_capture_inside_submit_queues_no_record_twice(tmp_path):
    # submit holds the handful's lock (re-entrant, so that the handler's close does not wait on
    # it); a handful queued and then closed over must not be queued again by close
    writer = _new_writer(tmp_path)
    closed = []

    class HandlerAfterPut:
        def __init__(self, queue):
            self.get, self._put = queue.get, queue.put

        def put(self, message):
            self._put(message)
            if isinstance(message, list) and not closed:
                closed.append(True)
                writer.close()   # as SIGTERM's handler, on this thread, right after the put

    writer._queue = HandlerAfterPut(writer._queue)
    for seq in range(300):   # more than a handful: the first full one is queued by submit
        writer.submit(_pending(seq, float(seq)))
    assert closed
    seqs = _journaled_seqs(tmp_path)
    assert len(seqs) == len(set(seqs)) > 0


def test_a_streamed_shard_that_cannot_be_sealed_fails_the_part_and_none_of_its_records_is_journaled(
        tmp_path, monkeypatch):
    # a full shard is sealed by the writer thread at its next flush, after its records were submitted
    import pytest

    from tdiff.errors import DumpError
    from tdiff.store.manifest import DATA_DIR
    from tdiff.store.storage import SafetensorsStream

    writer = _full_writer(tmp_path)
    writer.streamed_shard_limit = 100
    x = torch.arange(20.0)   # 80 bytes: each tensor starts another shard
    seal = SafetensorsStream.seal

    def disk_full_for_the_first(self):
        if self.path.name.endswith("s00000.safetensors"):
            raise OSError(28, "No space left on device")
        seal(self)

    monkeypatch.setattr(SafetensorsStream, "seal", disk_full_for_the_first)
    for seq in range(3):
        assert writer.stream(_record_of(seq, x), x) is not None   # the hook goes on: nothing is sealed there
    writer.close()
    assert writer.failed and _journaled_seqs(tmp_path) == []
    assert not list((tmp_path / "d" / DATA_DIR).glob(".*.tmp"))
    with pytest.raises(DumpError, match="No space left on device"):
        open_dump(tmp_path / "d")


def test_ended_streamed_shards_are_flushed_before_their_open_files_pile_up(tmp_path):
    from tdiff.store import writer as writer_module
    from tdiff.store.manifest import DATA_DIR

    writer = _full_writer(tmp_path)
    writer.streamed_shard_limit = 50   # 40 bytes a tensor: each in a shard of its own
    x = torch.arange(10.0)
    count = writer_module._ENDED_STREAMS_BEFORE_FLUSH + 1   # the last one ends as many as that
    for seq in range(count):
        writer.stream(_record_of(seq, x), x)
    writer.drain()   # no step ended, nothing flushed by the capture
    data = tmp_path / "d" / DATA_DIR
    assert not list(data.glob(".*.tmp")) and len(list(data.glob("*.safetensors"))) == count
    assert _journaled_seqs(tmp_path) == list(range(count - 1))   # the last one's record comes later
    writer.close()
    assert [r.seq for r in open_dump(tmp_path / "d").records] == list(range(count))


def test_the_writers_threads_leave_sigterm_to_the_programs_threads(tmp_path):
    """A SIGTERM the kernel gave a writer thread left a pool worker, idle in its queue's lock, alive
    with tdiff capture's handler never run (its flag set, the main thread never woken)."""
    import signal

    writer = _new_writer(tmp_path)
    try:
        threads = [t for t in threading.enumerate() if t.name.startswith(("tdiff-writer-p0", "tdiff-shards-p0"))]
        assert threads
        for thread in threads:
            status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
            blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
            assert blocked & (1 << (signal.SIGTERM - 1)), thread.name
    finally:
        writer.close()
