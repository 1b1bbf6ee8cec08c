"""Capture of CUDA graphs: recording during graph capture must not break it, and each replay is
recorded like the eager forward it stands for. The GPU tests are skipped without CUDA; run them
on the GPU machine with `python -m pytest tests/hooks/test_cuda_graphs.py`."""

import json
import time

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.errors import TdiffError
from tdiff.store import open_dump
from tdiff.store.writer import DumpWriter
from tests.helpers import tdiff_cli

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WIDTH = 64


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Linear(torch.nn.Linear):
    """A Linear that can be planted to compute in bf16 (a fault inside the graph)."""

    low_precision = False

    def forward(self, x):
        if self.low_precision:
            return torch.nn.functional.linear(x.bfloat16(), self.weight.bfloat16(), self.bias.bfloat16()).float()
        return super().forward(x)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = RMSNorm(), Linear(WIDTH, 2 * WIDTH), Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block() for _ in range(3))
        self.norm, self.head = RMSNorm(), Linear(WIDTH, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batches(count=3, rows=8):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(rows, WIDTH, generator=generator).cuda() for _ in range(count)]


def eager(model, inputs, path, **options):
    with torch.no_grad(), tdiff.capture(path, **options):
        for x in inputs:
            model(x)
    return open_dump(path)


def graphed(model, inputs, path, *, rows=None, **options):
    """Warm up, capture one graph for inputs[0]'s shape, replay it once per input; returns the
    dump and the graph's outputs of each replay."""
    with torch.no_grad(), tdiff.capture(path, **options):
        outputs = replayed(model, inputs, rows=rows)
    return open_dump(path), outputs


def replayed(model, inputs, *, rows=None):
    """:func:`graphed` inside the capture running: the graph's outputs of each replay."""
    static_x = torch.zeros_like(inputs[0])
    outputs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), tdiff.warmup():
        model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    for x in inputs:
        static_x.zero_()
        static_x[:len(x)].copy_(x)
        if rows is not None:
            tdiff.graph_rows(rows)
        graph.replay()
        outputs.append(static_y.clone())
    torch.cuda.synchronize()
    return outputs


def identity(dump):
    return [(r.name, r.role, r.step, r.call, r.dtype, r.shape) for r in dump.records]


@cuda
def test_full_mode_capture_does_not_break_graph_capture(tmp_path):
    """Old code: tdiff's host copy inside the capture raised cudaErrorStreamCaptureInvalidated."""
    model, x = Tiny().cuda(), batches(1)[0]
    with torch.no_grad():
        expected = model(x)
        with tdiff.capture(tmp_path / "d"):
            graph = torch.cuda.CUDAGraph()
            static_x = x.clone()
            with torch.cuda.graph(graph):
                static_y = model(static_x)
            graph.replay()
            torch.cuda.synchronize()
    assert torch.equal(static_y, expected)


def slow_writer(monkeypatch, seconds=0.02):
    """A writer that takes ``seconds`` per tensor (a slow disk): it lags behind the model."""
    store = DumpWriter._store
    handled = []

    def slow_store(self, item):
        time.sleep(seconds)
        store(self, item)
        handled.append(item.record.seq)

    monkeypatch.setattr(DumpWriter, "_store", slow_store)
    return handled


@cuda
def test_a_graph_captured_while_the_writer_is_busy_is_not_invalidated(tmp_path, monkeypatch):
    """The writer thread waits on the CUDA events of earlier eager copies; in the default global
    capture mode an event wait in any thread during a capture invalidates it."""
    slow_writer(monkeypatch)
    model, inputs = Tiny().cuda(), batches()
    with torch.no_grad(), tdiff.capture(tmp_path / "d"):
        for x in inputs:
            expected = model(x)   # about 90 tensors: some 2 s of writing still to do
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(inputs[-1])
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(static_y, expected)
    dump = open_dump(tmp_path / "d")
    assert {r.step for r in dump.records} == {0, 1, 2, 3}


@cuda
def test_replays_record_what_the_eager_forwards_record_bitwise(tmp_path):
    model, inputs = Tiny().cuda(), batches()
    a = eager(model, inputs, tmp_path / "a")
    b, outputs = graphed(model, inputs, tmp_path / "b")
    assert identity(b) == identity(a)           # names, steps, calls, shapes: warm-up and capture are no steps
    assert {r.step for r in b.records} == {0, 1, 2}
    assert all(r.has_data for r in b.records)
    with torch.no_grad():
        assert all(torch.equal(y, model(x)) for x, y in zip(inputs, outputs))
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--json", expect=0)
    assert json.loads(result.stdout)["status"] == "match"


@cuda
def test_a_fault_inside_the_graph_is_named_by_bisect(tmp_path):
    model, inputs = Tiny().cuda(), batches()
    eager(model, inputs, tmp_path / "a")
    model.layers[1].up.low_precision = True
    graphed(model, inputs, tmp_path / "b")
    report = json.loads(tdiff_cli("bisect", tmp_path / "a", tmp_path / "b", "--json", expect=1).stdout)
    assert report["first_divergence"]["module"] == "layers.1.up"
    assert report["first_divergence"]["step"] == 0


@cuda
def test_a_padded_batch_is_trimmed_to_the_rows_graph_rows_gives(tmp_path):
    model, inputs = Tiny().cuda(), batches(2, rows=3)
    padded = [torch.cat([x, torch.zeros(5, WIDTH, device="cuda")]) for x in inputs]
    full = eager(model, padded, tmp_path / "padded")
    b, _ = graphed(model, padded, tmp_path / "b", rows=3)
    assert [i[:3] for i in identity(b)] == [i[:3] for i in identity(full)]
    by_key = {r.pair_key: r for r in full.records}
    for record in b.records:
        reference = by_key[record.pair_key]
        assert record.shape == (3, *reference.shape[1:])
        assert torch.equal(b.load(record), full.load(reference)[:3]), record.name


@cuda
def test_past_the_budget_the_rest_of_the_graph_is_recorded_as_statistics(tmp_path):
    model, inputs = Tiny().cuda(), batches()
    a = eager(model, inputs, tmp_path / "a")
    budget = 6 * 8 * WIDTH * 4   # room for the first few [8, 64] float32 tensors only
    b, _ = graphed(model, inputs, tmp_path / "b", graph_budget_bytes=budget)
    stored = [r for r in b.records if r.has_data]
    kept_as_stats = [r for r in b.records if not r.has_data]
    assert stored and kept_as_stats
    assert all(r.fingerprint.startswith("mix64:") and r.stats is not None for r in kept_as_stats)
    # the rest of the graph: once one tensor went to statistics, every later one of its replay did
    for step in range(3):
        seqs = [r.has_data for r in b.records if r.step == step and r.alias_of is None]
        assert seqs == sorted(seqs, reverse=True)
    assert any("--graph-budget" in note for note in b.notes)
    assert compare_dumps(a, b).status == "match"   # statistics fingerprints checked against A's data
    assert "--graph-budget" in tdiff_cli("compare", tmp_path / "a", tmp_path / "b", expect=0).output


@cuda
def test_stats_mode_inside_a_graph_matches_eager(tmp_path):
    model, inputs = Tiny().cuda(), batches()
    a = eager(model, inputs, tmp_path / "a", mode="stats")
    b, _ = graphed(model, inputs, tmp_path / "b", mode="stats")
    assert identity(b) == identity(a)
    assert compare_dumps(a, b).status == "match"
    assert compare_dumps(eager(model, inputs, tmp_path / "full"), b).status == "match"
    # each replay journaled as one line (format version 5), the graph's records once
    kinds = [json.loads(line)["type"] for path in (tmp_path / "b" / "manifests").iterdir()
             for line in path.read_text().splitlines()]
    assert kinds.count("graph") == 1 and kinds.count("replay") == len(inputs) and "record" not in kinds


@cuda
def test_stats_mode_inside_a_graph_launches_the_fused_kernels_in_groups(tmp_path, monkeypatch):
    """Issue 30: summaries inside a graph are the fused group kernel's, launched per module call's
    inputs or outputs (not a dozen torch-op kernels a tensor, each a node of the graph), and give
    eager's statistics and fingerprints, in bf16 too."""
    from tdiff.hooks import cuda_graphs
    from tdiff.store import device_summary

    launched = []   # tensors per launch made while a graph is captured
    original = device_summary.group_summary_into

    def counted(tensors, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            launched.append(len(tensors))
        return original(tensors, *args, **kwargs)

    def no_torch_ops(tensor):
        raise AssertionError("a summary inside the graph was computed with torch ops")

    class Split(torch.nn.Module):
        def forward(self, y):
            return y * 2, y + 1

    class TwoHeads(Tiny):   # a call with two outputs: one launch of two
        def __init__(self):
            super().__init__()
            self.split = Split()

        def forward(self, x):
            a, b = self.split(super().forward(x))
            return a + b

    monkeypatch.setattr(device_summary, "group_summary_into", counted)
    monkeypatch.setattr(cuda_graphs, "_packed_summary", no_torch_ops)
    model = TwoHeads().cuda().bfloat16()
    inputs = [x.bfloat16() for x in batches()]
    a = eager(model, inputs, tmp_path / "a", mode="stats")
    # as in a process whose first stats-mode forward is captured: the kernel the graph launches is
    # the one compiled before its capture began, not one an eager forward left
    monkeypatch.setattr(device_summary, "_compiled_group_kernels", {})
    monkeypatch.setattr(device_summary, "_launches", {})
    b, _ = graphed(model, inputs, tmp_path / "b", mode="stats")
    assert identity(b) == identity(a)
    assert compare_dumps(a, b).status == "match"
    first_replay = [r for r in b.records if r.step == b.records[0].step]
    assert sum(launched) == len([r for r in first_replay if r.alias_of is None])
    assert len(launched) < sum(launched)


class AddsInPlace(torch.nn.Module):
    """Adds its input to a Linear's output in place right after the Linear returns (as Megatron's
    bias-dropout-add does): the Linear's recorded output is the one it returned."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.trunk, self.lin = Tiny(), Linear(16, 16)

    def forward(self, x):
        y = self.trunk(x)
        out = self.lin(y)
        out.add_(y)
        return out


def staged_counts(monkeypatch) -> list[int]:
    """The copies each stats-mode graph captured from here on summarises off the model's path."""
    from tdiff.hooks.cuda_graphs import GraphRecording

    counts = []
    close = GraphRecording.close

    def counted(self):
        close(self)
        counts.append(len(self._staged))

    monkeypatch.setattr(GraphRecording, "close", counted)
    return counts


@cuda
def test_stats_mode_copies_inside_a_graph_are_taken_before_a_later_in_place_change(tmp_path, monkeypatch):
    """Issue 30: inside a graph, stats mode copies a call's tensors where eager forwards summarise
    them and summarises the copies later, on a side stream: a change in place after the call
    returned must not reach what was recorded."""
    from tdiff.store.fingerprint import mix64_fingerprint

    counts = staged_counts(monkeypatch)
    model, inputs = AddsInPlace().cuda(), batches()
    a = eager(model, inputs, tmp_path / "a", mode="stats")
    b, outputs = graphed(model, inputs, tmp_path / "b", mode="stats")
    assert counts and counts[0] == len([r for r in b.records if r.step == b.records[0].step and r.alias_of is None])
    assert identity(b) == identity(a)
    assert compare_dumps(a, b).status == "match"
    with torch.no_grad():
        returned = [model.lin(model.trunk(x)) for x in inputs]
    recorded = [r.fingerprint for r in b.records if r.name == "lin" and r.role == "output"]
    assert recorded == [mix64_fingerprint(y) for y in returned]
    with torch.no_grad():
        assert all(torch.equal(y, model(x)) for x, y in zip(inputs, outputs))


@cuda
def test_past_the_graph_budget_stats_mode_summarises_in_place(tmp_path, monkeypatch):
    """Stats mode's copies are the graph's static buffers, bounded by --graph-budget: with none
    left, the graph summarises each tensor where it is, with the same records."""
    counts = staged_counts(monkeypatch)
    model, inputs = AddsInPlace().cuda(), batches()
    staged, _ = graphed(model, inputs, tmp_path / "staged", mode="stats")
    in_place, _ = graphed(model, inputs, tmp_path / "in_place", mode="stats", graph_budget_bytes=0)
    assert counts[0] > 0 and counts[1] == 0
    assert [(r.name, r.role, r.step, r.fingerprint, r.stats) for r in in_place.records] == \
        [(r.name, r.role, r.step, r.fingerprint, r.stats) for r in staged.records]
    assert compare_dumps(staged, in_place).status == "match"


@cuda
def test_a_summary_kernel_that_cannot_be_compiled_leaves_the_graph_to_torch_ops(tmp_path, monkeypatch):
    from tdiff.store import device_summary

    def fails(device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(device_summary, "compile_group_kernels", fails)
    monkeypatch.setattr(device_summary, "group_kernel_compiled", lambda device, dtype: False)
    model, inputs = Tiny().cuda(), batches()
    a = eager(model, inputs, tmp_path / "a", mode="stats")
    b, _ = graphed(model, inputs, tmp_path / "b", mode="stats")
    assert any("could not be compiled" in note for note in b.notes)
    assert compare_dumps(a, b).status == "match"


class Forked(torch.nn.Module):
    """A long chain run on a stream forked inside the forward (SGLang's shared-experts overlap):
    inside a capture its summaries' table rolls over on the side stream."""

    def __init__(self, length=300):
        super().__init__()
        torch.manual_seed(2)
        self.trunk = Tiny()
        self.chain = torch.nn.ModuleList(Linear(16, 16) for _ in range(length))
        self.side = None

    def forward(self, x):
        self.side = self.side or torch.cuda.Stream()
        y = self.trunk(x)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            z = y
            for link in self.chain:
                z = link(z)
        torch.cuda.current_stream().wait_stream(self.side)
        return y + z


@cuda
def test_a_graph_forked_onto_a_side_stream_records_each_replays_own_statistics(tmp_path):
    """Review of issue 30: the fused kernels' counters were zeroed by a node of the graph, which
    kernels of a stream forked inside the capture were not ordered after: a slot could keep the last
    replay's statistics and stats-mode compare say "match" on a diverging replay."""
    model, inputs = Forked().cuda(), batches(4)
    a = eager(model, inputs, tmp_path / "a", mode="stats")
    b, outputs = graphed(model, inputs, tmp_path / "b", mode="stats")
    assert identity(b) == identity(a)
    assert len([r for r in b.records if r.step == 0 and r.alias_of is None]) > 256   # the table rolled over
    assert compare_dumps(a, b).status == "match"
    last = [r.fingerprint for r in b.records if r.name == "chain.299" and r.role == "output"]
    assert len(set(last)) == len(inputs)   # every replay its own (different inputs, different outputs)
    with torch.no_grad():
        assert all(torch.equal(y, model(x)) for x, y in zip(inputs, outputs))


@cuda
def test_graphs_captured_by_two_threads_each_stage_on_their_own_side_stream(tmp_path, monkeypatch):
    """Stats mode's side stream is made per capturing thread: two threads that each capture and
    replay a graph under one capture record what each of their eager forwards records."""
    import threading

    from tdiff.hooks.cuda_graphs import GraphRecording

    sides = []
    begin = GraphRecording.__init__

    def remembered(self, recorder, side):
        begin(self, recorder, side)
        sides.append(side)

    monkeypatch.setattr(GraphRecording, "__init__", remembered)
    model, inputs = AddsInPlace().cuda(), batches()

    def in_threads(path, run):
        with torch.no_grad(), tdiff.capture(path, mode="stats"):
            workers = [threading.Thread(target=run, name=f"worker-{index}") for index in range(2)]
            for worker in workers:
                worker.start()
                worker.join()   # one after the other: their step counts do not race
        return open_dump(path)

    def eager_forwards():
        for x in inputs:
            model(x)

    a = in_threads(tmp_path / "a", eager_forwards)
    b = in_threads(tmp_path / "b", lambda: replayed(model, inputs))
    assert len(sides) == 2 and None not in sides   # each thread found the side stream made for it
    assert {r.thread for r in b.records} == {"worker-0", "worker-1"}
    assert identity(b) == identity(a)
    assert compare_dumps(a, b).status == "match"


# ---- without a GPU ----
class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_graphs_counters_are_zeroed_once_its_capture_completes(monkeypatch):
    # the fused kernels count blocks from zero; the zeroing runs after the capture, not in the
    # graph, and a CPU table's counters (a CPU tensor recorded inside a capture) need no device
    from tdiff.hooks.cuda_graphs import GraphRecording

    recording = GraphRecording(type("Recorder", (), {"mode": "stats"})())
    recording._counters.append(torch.full((4, 1), 7, dtype=torch.int32))
    recording.finish(completed=False)   # a failed capture: nothing to replay, nothing to zero
    assert int(recording._counters[0].sum()) == 28
    monkeypatch.setattr(torch.cuda, "current_stream", None)   # no CUDA call for CPU counters
    recording.finish(completed=True)
    assert int(recording._counters[0].abs().sum()) == 0


def test_warmup_forwards_are_not_recorded_and_are_not_steps(tmp_path):
    model = Doubler()
    with tdiff.capture(tmp_path / "d"):
        model(torch.ones(2))
        with tdiff.warmup():
            model(torch.ones(2))
            tdiff.dump("inside", torch.ones(1))
        model(torch.ones(2))
    dump = open_dump(tmp_path / "d")
    assert [(r.role, r.step) for r in dump.records] == [("input", 0), ("output", 0), ("input", 1), ("output", 1)]


def test_a_replay_tdiff_cannot_record_is_said_in_the_dump(tmp_path):
    """A graph captured before capture started has no buffers: its replays are said, not hidden."""
    with tdiff.capture(tmp_path / "d"):
        Doubler()(torch.ones(2))
        tdiff.graph_replayed(object())
    dump = open_dump(tmp_path / "d")
    assert any("not recorded" in note for note in dump.notes)
    assert json.loads(tdiff_cli("compare", tmp_path / "d", tmp_path / "d", "--json").stdout)["b"]["notes"] == dump.notes


def test_before_a_graph_capture_the_writer_finishes_what_it_holds(tmp_path, monkeypatch):
    handled = slow_writer(monkeypatch)
    with tdiff.capture(tmp_path / "d") as capture:
        for _ in range(5):
            Doubler()(torch.ones(2))
        capture.graphs.prepare()  # what CUDAGraph.capture_begin runs first
        assert len(handled) == 10


def test_graph_rows_takes_a_positive_count():
    with pytest.raises(TdiffError, match="positive"):
        tdiff.graph_rows(0)


def test_graph_budget_must_be_a_size(tmp_path):
    result = tdiff_cli("capture", "--out", tmp_path / "d", "--graph-budget", "lots", "--", "true", expect=2)
    assert "--graph-budget 'lots' is not a size" in result.output


@cuda
def test_tokens_given_before_each_replay_describe_that_replay(tmp_path):
    """A decode step replayed from a CUDA graph: no model call reads its batch, the engine's
    token source gives it with tdiff.tokens before the replay."""
    model, inputs = Tiny().cuda(), batches()
    static_x = torch.zeros_like(inputs[0])
    with torch.no_grad(), tdiff.capture(tmp_path / "g"):
        with tdiff.warmup():
            model(static_x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static_x)
        for step, x in enumerate(inputs):
            static_x.copy_(x)
            tdiff.tokens(input_ids=torch.arange(len(x)).cuda() + step, positions=torch.full((len(x),), 4 + step),
                         seq_lens=torch.ones(len(x), dtype=torch.long))
            graph.replay()
        torch.cuda.synchronize()
    dump = open_dump(tmp_path / "g")
    steps = sorted({r.step for r in dump.records})
    batches_by_step = dump.token_batches()
    assert sorted(step for step, _ in batches_by_step) == steps
    for index, step in enumerate(steps):
        batch = batches_by_step[(step, 0)]
        assert batch.positions == [4 + index] * len(inputs[index]) and batch.input_ids[0] == index
