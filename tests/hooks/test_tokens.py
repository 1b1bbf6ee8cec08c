"""Token metadata at capture: read from Hugging Face calls, given by tdiff.tokens, carried by
explicit dumps; stored per forward and rank, read back (and version 1 dumps still read)."""

import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tdiff
from tdiff.errors import DumpError, TdiffError
from tdiff.hooks.tokens import _count_positions
from tdiff.store import open_dump
from tdiff.store.tokens import PADDING
from tests.helpers import tiny_qwen2, token_ids


def test_hugging_face_prefill_and_decode_steps_describe_their_tokens_without_padding(tmp_path):
    from transformers import DynamicCache

    model = tiny_qwen2()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])   # left padding in row 0
    fed = []
    with torch.no_grad(), tdiff.capture(tmp_path / "a", model=model):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        for _ in range(2):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            fed.append(token.flatten().tolist())
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
    batches = open_dump(tmp_path / "a").token_batches()
    assert sorted(batches) == [(0, 0), (1, 0), (2, 0)]
    prefill = batches[(0, 0)]
    assert prefill.shape == (2, 5) and prefill.input_ids == ids.flatten().tolist()
    assert prefill.seqs == [PADDING, PADDING, 0, 0, 0, 1, 1, 1, 1, 1]
    real = [p for p, s in zip(prefill.positions, prefill.seqs) if s != PADDING]
    assert real == [0, 1, 2, 0, 1, 2, 3, 4]
    assert prefill.source == "transformers"
    for step, token in enumerate(fed, 1):
        decode = batches[(step, 0)]
        assert decode.shape == (2, 1) and decode.input_ids == token
        assert decode.positions == [2 + step, 4 + step] and decode.seqs == [0, 1]


def test_tokens_given_before_a_forward_describe_that_forward_and_replace_what_it_carries(tmp_path):
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "a", model=model):
        model(torch.tensor([[3, 4, 5]]))
        # a ragged batch of two sequences and one padding cell, flattened into one row
        tdiff.tokens(input_ids=torch.tensor([7, 8, 9, 10, 0]), positions=torch.tensor([4, 5, 0, 1, 0]),
                     seq_lens=torch.tensor([2, 2]), seq_ids=["req-b", "req-a"], prompt_lens=[3, 1])
        model(torch.tensor([[7, 8, 9, 10, 0]]))
        model(torch.tensor([[0, 4, 5]]), torch.tensor([[0, 1, 1]]))   # the mask passed by position
    batches = open_dump(tmp_path / "a").token_batches()
    first, second = batches[(0, 0)], batches[(1, 0)]
    assert first.source == "transformers" and first.positions == [0, 1, 2]
    assert second.source == "tokens" and second.shape == (5,)
    assert second.seqs == [0, 0, 1, 1, PADDING] and second.positions[:4] == [4, 5, 0, 1]
    assert second.seq_ids == ["req-b", "req-a"] and second.prompt_lens == [3, 1]
    third = batches[(2, 0)]
    assert third.seqs == [PADDING, 0, 0] and third.positions[1:] == [0, 1]


def test_explicit_dumps_carry_the_positions_of_their_rows(tmp_path):
    with tdiff.capture(tmp_path / "a"):
        tdiff.dump("logprobs", torch.zeros(2, 3), positions=torch.tensor([[1, 2, 3], [1, 2, 3]]))
        tdiff.dump("sampled", torch.zeros(3, 4), positions=torch.tensor([5, 6, 2]), seq_ids=torch.tensor([1, 1, 0]))
        with pytest.raises(TdiffError, match="leading dims"):
            tdiff.dump("bad", torch.zeros(2, 3), positions=torch.tensor([1, 2, 3]))
    records = {r.name: r for r in open_dump(tmp_path / "a").records}
    assert records["logprobs"].attrs["tokens"] == {"shape": [2, 3], "positions": [1, 2, 3, 1, 2, 3],
                                                  "seqs": [0, 0, 0, 1, 1, 1]}
    assert records["sampled"].attrs["tokens"]["seqs"] == [1, 1, 0]


def test_inconsistent_token_arguments_are_refused_in_one_line(tmp_path):
    with tdiff.capture(tmp_path / "a"):
        for given, message in (({"input_ids": torch.zeros(4, dtype=torch.long), "seq_lens": [3, 3]}, "add up to 6"),
                               ({"input_ids": torch.zeros(2, 2, dtype=torch.long), "positions": torch.zeros(3)},
                                "must hold integers"),
                               ({"input_ids": torch.zeros(3, dtype=torch.long), "seq_ids": [1, 2]}, "2 values for 1")):
            with pytest.raises(TdiffError, match=message):
                tdiff.tokens(**given)


def _rewrite_manifests(root, edit):
    for path in (root / "manifests").glob("*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps(line) + "\n" for line in edit(lines)))


def test_a_forwards_tokens_are_the_ids_it_was_given_though_it_changes_them_in_place(tmp_path, monkeypatch):
    """The writer describes a forward's tokens off the model's thread, from a copy taken when the
    forward began: a change the model (or the program, reusing its buffer) makes afterwards does
    not reach them."""
    import threading

    from tdiff.store.tokens import DeferredTokens

    changed = threading.Event()
    resolve = DeferredTokens.resolve

    def after_the_change(self):   # the writer describes them once the ids have changed
        changed.wait(timeout=30)
        return resolve(self)

    monkeypatch.setattr(DeferredTokens, "resolve", after_the_change)
    model = tiny_qwen2()
    ids = torch.tensor([[5, 6, 7, 8]])
    given = ids.flatten().tolist()
    model.model.embed_tokens.register_forward_pre_hook(lambda module, args: args[0].add_(1))
    with torch.no_grad(), tdiff.capture(tmp_path / "a"):
        model(ids)
        ids.add_(10)
        changed.set()
    assert open_dump(tmp_path / "a").token_batches()[(0, 0)].input_ids == given


class CountingQueue:
    """The writer's queue, counting what the model's thread hands over."""

    def __init__(self, queue):
        self.queue, self.puts = queue, 0

    def put(self, item):
        self.puts += 1
        self.queue.put(item)

    def get(self):
        return self.queue.get()


def test_forwards_that_record_nothing_wake_no_writer_thread_until_their_tokens_fill_a_handful(tmp_path, monkeypatch):
    """Each hand-over wakes the writer thread, which then takes the GIL from the model's: a
    forward that records nothing hands over nothing (its tokens wait in the handful, and the
    step's flush has no record to write), no shard writer is started for token metadata alone,
    yet every forward's tokens are written."""
    from tdiff.store import writer as writer_module

    monkeypatch.setattr(writer_module, "_HANDFUL_TOKENS", 8)   # a handful's tokens then go 8 at a time
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "a", select=["(?!)"]) as capture:
        model(token_ids())
        queue = capture.writer._queue = CountingQueue(capture.writer._queue)
        for _ in range(20):
            model(token_ids())
        handed = queue.puts
        capture.writer._hand_over(writer_module._FLUSH)   # a flush with only tokens to write...
        capture.writer.drain()                            # ...journaled by the writer itself
        shard_writers = [t.name for t in threading.enumerate() if t.name.startswith("tdiff-shards")]
        tdiff.dump("logprobs", torch.zeros(2))   # (explicit dumps ignore --select: the dump holds a tensor)
    assert handed == 21 // 8
    assert shard_writers == []
    assert sorted(open_dump(tmp_path / "a").token_batches()) == [(step, 0) for step in range(21)]


class Engine(torch.nn.Module):
    def forward(self, input_ids):
        return input_ids * 2


def test_tokens_a_framework_source_reads_that_cannot_be_described_end_the_dump_as_failed(tmp_path, monkeypatch):
    """Described by the writer, a source's bad reading cannot raise in the model's forward: the
    part ends as failed and says why (a dump whose tokens are missing cannot be lined up)."""
    import importlib

    tokens = importlib.import_module("tdiff.hooks.tokens")   # (tdiff.hooks.tokens is also a function's name)
    monkeypatch.setitem(tokens._SOURCES, Engine.__module__.partition(".")[0],
                        lambda module, args, kwargs: {"input_ids": args[0], "seq_lens": [5]})
    with torch.no_grad(), tdiff.capture(tmp_path / "a"):
        assert Engine()(torch.tensor([1, 2, 3])).tolist() == [2, 4, 6]
    with pytest.raises(DumpError, match="capture failed: the token metadata of step 0 cannot be described.*seq_lens add up to 5"):
        open_dump(tmp_path / "a", allow_incomplete=True)


def test_a_version_1_dump_reads_with_no_token_metadata(tmp_path):
    with torch.no_grad(), tdiff.capture(tmp_path / "a"):
        tiny_qwen2()(torch.tensor([[1, 2]]))

    def as_version_1(lines):
        lines = [line for line in lines if line["type"] != "tokens"]
        lines[0]["version"] = 1
        return lines

    _rewrite_manifests(tmp_path / "a", as_version_1)
    header = json.loads((tmp_path / "a" / "tdiff-dump.json").read_text())
    (tmp_path / "a" / "tdiff-dump.json").write_text(json.dumps({**header, "version": 1}))
    dump = open_dump(tmp_path / "a")
    assert dump.records and dump.token_batches() == {}


def test_a_tokens_line_that_disagrees_with_its_grid_is_refused_naming_the_line(tmp_path):
    with torch.no_grad(), tdiff.capture(tmp_path / "a"):
        tiny_qwen2()(torch.tensor([[1, 2]]))

    def cut(lines):
        for line in lines:
            if line["type"] == "tokens":
                line["positions"] = line["positions"][:1]
        return lines

    _rewrite_manifests(tmp_path / "a", cut)
    with pytest.raises(DumpError, match=r"line \d+: tokens field 'positions' has 1 entries"):
        open_dump(tmp_path / "a")


@given(st.lists(st.integers(PADDING, 4), max_size=96), st.sampled_from([None, 2, 3]))
def test_positions_count_from_zero_along_each_sequence_in_row_major_order(cells, width):
    # any assignment of cells to sequences (ragged, interleaved, padded anywhere), flat or in rows
    expected, seen = [], {}
    for seq in cells:
        expected.append(0 if seq == PADDING else seen.get(seq, 0))
        if seq != PADDING:
            seen[seq] = seen.get(seq, 0) + 1
    seqs = np.array(cells, dtype=np.int64)
    if width is not None:
        seqs = seqs[:len(cells) // width * width].reshape(-1, width)
        expected = expected[:seqs.size]
    assert _count_positions(seqs).ravel().tolist() == expected
