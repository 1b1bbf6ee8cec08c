"""The recorders hand the part's sink typed messages (tdiff.hooks.part.Sink): a fake sink in place
of the DumpWriter sees each recording strategy's item, and a sink that fails stops the recording
while the model runs on."""

import torch
from torch import nn

import tdiff
from tdiff.hooks.part import ProcessPart
from tdiff.store.fingerprint import xxh3_fingerprint
from tdiff.store.writer import Pending


class FakeSink:
    """Keeps what it is handed; ``fail_after`` items, it fails as a full disk does (drops the rest)."""

    part = "fake"

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after
        self.items: list[Pending] = []      # submitted (a streamed tensor's item too)
        self.streamed: list[Pending] = []
        self.tokens: list = []
        self.closed: list[tuple] = []

    @property
    def failed(self) -> bool:
        return self.fail_after is not None and len(self.items) >= self.fail_after

    def submit(self, item):
        if not self.failed:
            self.items.append(item)

    def stream(self, record, tensor):
        if self.failed:
            return None
        record.set_contents(None, xxh3_fingerprint(tensor))
        item = Pending(record=record)
        self.streamed.append(item)
        self.submit(item)
        return item

    def submit_tokens(self, batch):
        self.tokens.append(batch)

    def flush(self):
        pass

    def drain(self):
        pass

    def settle(self, notes=()):
        pass

    def resume(self):
        pass

    def close(self, error=None, notes=()):
        self.closed.append((error, list(notes)))


def run_into(sink: FakeSink, out, mode: str, model: nn.Module, forwards: int = 1) -> list[torch.Tensor]:
    capture = tdiff.capture(out, mode=mode)
    capture.part = ProcessPart(lambda: sink)
    outputs = []
    with capture, torch.no_grad():
        tdiff.tokens(input_ids=torch.tensor([[1, 2]]))
        for _ in range(forwards):
            outputs.append(model(torch.ones(2, 4)))
    return outputs


def model_of_one_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())


def test_each_recorder_hands_the_sink_its_typed_message(tmp_path):
    model = model_of_one_layer()
    for mode in ("full", "stats"):
        sink = FakeSink()
        run_into(sink, tmp_path / mode, mode, model)
        names = [(i.record.name, i.record.role) for i in sink.items]
        # the sequential's input is the linear's, the linear's output the relu's input...: each
        # tensor is handed over once, its later records are aliases of that item
        stored = [i for i in sink.items if i.original is None]
        aliases = [i for i in sink.items if i.original is not None]
        assert len(names) == 6 and len(stored) == 3 and len(aliases) == 3
        assert all(a.original in stored and a.record.alias_of == a.original.record.seq for a in aliases)
        if mode == "full":   # CPU tensors are streamed to their shards as they are recorded
            assert sink.streamed == stored
        else:                # summaries, computed on the tensor's device
            assert not sink.streamed and all(i.summary is not None for i in stored)
        assert [batch.input_ids for batch in sink.tokens] == [[1, 2]]
        assert sink.closed == [(None, [])]


def test_once_the_sink_fails_nothing_more_is_recorded_and_the_model_runs_on(tmp_path):
    model = model_of_one_layer()
    with torch.no_grad():
        expected = model(torch.ones(2, 4))
    sink = FakeSink(fail_after=2)
    outputs = run_into(sink, tmp_path / "d", "full", model, forwards=3)
    assert all(torch.equal(out, expected) for out in outputs)
    # the input and its alias (the linear's input), then nothing more, in this forward or the next
    assert [(i.record.step, i.original is not None) for i in sink.items] == [(0, False), (0, True)]
    assert sink.closed == [(None, [])]
