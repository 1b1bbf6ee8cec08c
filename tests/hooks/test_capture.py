"""Capture on real transformers models: names, order, steps, aliases, filters and modes."""

import gc
import json
import weakref

import pytest
import torch

import tdiff
from tdiff.compare import compare_dumps
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tiny_qwen2, token_ids


def capture_qwen2(path, *, model=None, ids=None, **options):
    model = model or tiny_qwen2()
    with torch.no_grad(), tdiff.capture(path, **options):
        logits = model(ids if ids is not None else token_ids()).logits
        tdiff.dump("logprobs", torch.log_softmax(logits.float(), -1))
    return open_dump(path)


def test_inputs_and_outputs_in_execution_order_with_paths_from_the_outermost_model(tmp_path):
    dump = capture_qwen2(tmp_path / "a")
    events = [(r.role, r.module) for r in dump.records]
    mlp_in = events.index(("input", "model.layers.1.mlp"))
    up_out = events.index(("output", "model.layers.1.mlp.up_proj"))
    mlp_out = events.index(("output", "model.layers.1.mlp"))
    layer_out = events.index(("output", "model.layers.1"))
    assert mlp_in < up_out < mlp_out < layer_out
    assert events[-1] == ("explicit", "")
    record = next(r for r in dump.records if r.module == "model.layers.1.mlp.up_proj" and r.role == "output")
    assert (record.module_class, record.parent, record.step, record.call, record.rank) == (
        "Linear", "model.layers.1.mlp", 0, 0, 0)
    assert record.dtype == "float32" and record.shape == (1, 12, 128)
    assert record.stats["nan"] == 0 and record.fingerprint.startswith("xxh3:")
    assert any(r.name == "model.layers.0[position_embeddings][0]" for r in dump.records)


def test_two_identical_runs_match_bitwise(tmp_path):
    a, b = capture_qwen2(tmp_path / "a"), capture_qwen2(tmp_path / "b")
    report = compare_dumps(a, b)
    assert report.status == "match"
    assert report.counts()["compared"] == len(a.records) > 50


def test_a_planted_one_ulp_change_is_found_at_its_module(tmp_path):
    model = tiny_qwen2(torch.bfloat16)
    a = capture_qwen2(tmp_path / "a", model=model)

    def plant(module, args, output):
        output = output.clone()
        output.view(torch.int16).view(-1)[5] += 1  # one ULP in one bf16 element
        return output

    handle = model.get_submodule("model.layers.1.mlp.up_proj").register_forward_hook(plant)
    b = capture_qwen2(tmp_path / "b", model=model)
    handle.remove()
    first = compare_dumps(a, b).first_divergence
    assert (first.name, first.record.module, first.record.role) == (
        "model.layers.1.mlp.up_proj", "model.layers.1.mlp.up_proj", "output")
    assert first.metrics.mismatched == 1 and first.metrics.max_ulp == 1


def test_a_shared_module_gets_one_call_index_per_invocation(tmp_path):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(self.proj(x))

    with tdiff.capture(tmp_path / "d"):
        Twice()(torch.ones(2, 4))
    outputs = [(r.name, r.call) for r in open_dump(tmp_path / "d").records if r.role == "output"]
    assert outputs == [("proj", 0), ("proj", 1), ("(model)", 0)]


def test_steps_advance_per_forward_and_explicit_dumps_join_their_forward(tmp_path):
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", select=["^lm_head$"]):
        for _ in range(3):
            logits = model(token_ids()).logits
            tdiff.dump("logits_after", logits)
    records = open_dump(tmp_path / "d").records
    assert [(r.name, r.role, r.step) for r in records if r.role != "input"] == [
        ("lm_head", "output", 0), ("logits_after", "explicit", 0),
        ("lm_head", "output", 1), ("logits_after", "explicit", 1),
        ("lm_head", "output", 2), ("logits_after", "explicit", 2)]


def test_explicit_steps_take_over(tmp_path):
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", select=["^lm_head$"]):
        for _ in range(2):
            model(token_ids())  # two micro-batches of one step
            model(token_ids())
            tdiff.step()
    steps = [(r.step, r.call) for r in open_dump(tmp_path / "d").records if r.role == "output"]
    # the second forward of the first iteration still advanced the step on its own; from the
    # first tdiff.step() on, only tdiff.step() advances it
    assert steps == [(0, 0), (1, 0), (2, 0), (2, 1)]


def test_dump_and_step_are_no_ops_without_a_capture():
    x = torch.ones(2)
    assert tdiff.dump("x", x) is x
    tdiff.step()


def test_model_argument_captures_an_engine_that_calls_forward_directly(tmp_path):
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", model=model):
        model.forward(token_ids())   # SGLang-style: no __call__ on the root
        model(token_ids())           # and the usual way: recorded once, not twice
    records = open_dump(tmp_path / "d").records
    roots = [(r.step, r.role) for r in records if r.module == "" and r.role == "output"]
    assert roots == [(0, "output"), (1, "output")]
    assert any(r.module == "model.layers.0.mlp" for r in records)
    assert "forward" not in vars(model)  # the wrapper is gone after the capture


def test_an_input_that_is_the_previous_output_is_stored_once_by_reference(tmp_path):
    dump = capture_qwen2(tmp_path / "a")
    norm_out = next(r for r in dump.records if r.name == "model.layers.0.input_layernorm")
    q_in = next(r for r in dump.records if r.name == "model.layers.0.self_attn.q_proj[0]")
    assert q_in.alias_of == norm_out.seq and (q_in.file, q_in.key) == (norm_out.file, norm_out.key)
    assert torch.equal(dump.load(q_in), dump.load(norm_out))


def test_a_tensor_changed_in_place_is_stored_again(tmp_path):
    class InPlace(torch.nn.Module):
        def forward(self, x):
            return x.mul_(2)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Identity(), InPlace()

        def forward(self, x):
            return self.second(self.first(x))

    with tdiff.capture(tmp_path / "d"):
        Outer()(torch.ones(3))
    dump = open_dump(tmp_path / "d")
    by_name = {(r.name, r.role): r for r in dump.records}
    before = dump.load(by_name[("second[0]", "input")])
    after = dump.load(by_name[("second", "output")])
    assert torch.equal(before, torch.ones(3)) and torch.equal(after, torch.full((3,), 2.0))


def add_one_through_data(t):
    t.data[0, 0, 0] += 1


def add_one_through_numpy(t):
    t.numpy()[0, 0, 0] += 1


def add_one_through_dlpack(t):
    torch.from_dlpack(t)[0, 0, 0] += 1  # a view with its own version counter


@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("write", [add_one_through_data, add_one_through_numpy, add_one_through_dlpack])
def test_a_write_that_autograd_does_not_see_is_recorded_and_compares_as_diverged(tmp_path, write, mode):
    # the logits are the lm_head's output, recorded as such; changed in place by a path that
    # leaves autograd's version counter as it was, then dumped: its record must hold the new bytes
    model = tiny_qwen2()
    for side in ("a", "b"):
        with torch.no_grad(), tdiff.capture(tmp_path / side, mode=mode):
            logits = model(token_ids()).logits
            version = logits._version
            if side == "b":
                write(logits)
            assert logits._version == version
            tdiff.dump("logits", logits)
    dump = open_dump(tmp_path / "b")
    record = next(r for r in dump.records if r.name == "logits")
    head = next(r for r in dump.records if r.name == "lm_head")
    assert record.alias_of is None and record.fingerprint != head.fingerprint
    if mode == "full":
        assert torch.equal(dump.load(record), logits)
    result = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--json", expect=1)
    assert json.loads(result.stdout)["first_divergence"]["name"] == "logits"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_recorded_again_is_stored_again_never_aliased(tmp_path):
    # no device hash is strong enough yet to check a CUDA alias's bytes: each record is a copy
    x = torch.ones(8, device="cuda")
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("before", x)
        x.data.add_(1)
        tdiff.dump("after", x)
    dump = open_dump(tmp_path / "d")
    assert [r.alias_of for r in dump.records] == [None, None]
    assert [float(dump.load(r)[0]) for r in dump.records] == [1.0, 2.0]


def test_modules_made_during_a_forward_are_recorded_and_not_kept_alive(tmp_path):
    """What capture learns of each module it sees (its path, layer, selection) must not outlive
    the module: a module made in every forward is recorded each time and then freed."""
    made = []

    class MakesOneEachCall(torch.nn.Module):
        def forward(self, x):
            scale = torch.nn.Identity()
            made.append(weakref.ref(scale))
            return scale(x) * 2

    model = MakesOneEachCall()
    with torch.no_grad(), tdiff.capture(tmp_path / "a", mode="stats"):
        for _ in range(20):
            model(torch.ones(3))
        gc.collect()
        alive = sum(ref() is not None for ref in made)
    assert alive == 0
    records = open_dump(tmp_path / "a").records
    assert sum(r.module_class == "Identity" and r.role == "output" for r in records) == len(made) == 20


def test_select_exclude_layers_and_steps_filter_what_is_recorded(tmp_path):
    model = tiny_qwen2()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", select=["mlp"], exclude=["act_fn"], layers="1",
                                        steps="1"):
        model(token_ids())
        model(token_ids())
        tdiff.dump("logprobs", torch.zeros(2))
    records = open_dump(tmp_path / "d").records
    modules = {r.module for r in records if r.role != "explicit"}
    assert modules == {"model.layers.1.mlp", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                       "model.layers.1.mlp.down_proj"}
    assert {r.step for r in records} == {1}
    assert any(r.name == "logprobs" for r in records)


def test_stats_mode_keeps_fingerprints_that_catch_one_ulp(tmp_path):
    model = tiny_qwen2(torch.bfloat16)
    a = capture_qwen2(tmp_path / "a", model=model, mode="stats")
    assert all(r.file is None and r.fingerprint for r in a.records)
    handle = model.get_submodule("model.layers.0.self_attn.o_proj").register_forward_hook(
        lambda m, i, o: o.view(torch.int16).view(-1).__setitem__(0, o.view(torch.int16).view(-1)[0] + 1))
    b = capture_qwen2(tmp_path / "b", model=model, mode="stats")
    handle.remove()
    report = compare_dumps(a, b)
    assert report.first_divergence.name == "model.layers.0.self_attn.o_proj"
    assert "fingerprints differ" in report.first_divergence.reason


def test_host_tensors_are_written_at_the_hook_with_no_copy_held(tmp_path):
    # full mode streams a CPU tensor into its shard as it is recorded: the page cache holds the
    # bytes of the moment, so a later in-place write cannot reach them and no host copy waits
    tensors = [torch.full((256, 256), float(i)) for i in range(40)]  # 256 KiB each, 10 MiB in all
    with tdiff.capture(tmp_path / "d", max_pending_bytes=1 << 20, shard_bytes=3 << 20) as cap:
        for i, t in enumerate(tensors):
            tdiff.dump(f"t{i}", t)
            t.add_(1000)   # after the hook
        writer = cap.writer
        assert writer.peak_pending_bytes == 0 and writer.waits == 0
    dump = open_dump(tmp_path / "d")
    assert len(dump.records) == 40
    assert len({r.file for r in dump.records}) == -(-40 * (256 << 10) // (3 << 20))  # shards of 3 MiB
    for record in dump.records:
        assert torch.equal(dump.load(record), torch.full((256, 256), float(record.name[1:])))


def test_rank_comes_from_the_environment_before_torch_distributed_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("x", torch.ones(1))
    assert open_dump(tmp_path / "d").records[0].rank == 3


FORKING = """
import os, sys
import torch, tdiff

with tdiff.capture(sys.argv[1], storage=sys.argv[2]):
    tdiff.dump("before", torch.arange(1000.0))
    pid = os.fork()
    if pid == 0:   # the child goes on in a part of its own, and ends it as it exits
        tdiff.dump("child", torch.ones(5))
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    tdiff.dump("after", torch.arange(7.0))
"""


@pytest.mark.parametrize("storage", ["safetensors", "h5"])
def test_a_forked_child_leaves_the_shard_its_parent_is_writing_whole(tmp_path, storage):
    # the parent's open shard is inherited by the child: closing or flushing it there (HDF5 does,
    # for a file it holds open) would change the parent's file under it
    from tests.helpers import python_script

    result = python_script(FORKING, tmp_path, tmp_path / "d", storage)
    assert result.returncode == 0, result.stderr
    dump = open_dump(tmp_path / "d")
    assert dump.complete
    expected = {"before": torch.arange(1000.0), "child": torch.ones(5), "after": torch.arange(7.0)}
    assert sorted(r.name for r in dump.records) == sorted(expected)
    for record in dump.records:
        assert torch.equal(dump.load(record), expected[record.name])


def test_h5_storage_captures_and_compares(tmp_path):
    a = capture_qwen2(tmp_path / "a", storage="h5")
    b = capture_qwen2(tmp_path / "b", storage="h5")
    assert all(r.file.endswith(".h5") for r in a.records)
    assert compare_dumps(a, b).status == "match"


def test_batch_row_records_one_sequence_of_a_batch_as_if_scored_alone(tmp_path):
    model = tiny_qwen2()
    batch = torch.cat([token_ids(12, seed=s) for s in (5, 1, 7)])  # row 1 is the lone sequence
    alone = capture_qwen2(tmp_path / "alone", model=model, ids=token_ids(12, seed=1))
    row = capture_qwen2(tmp_path / "row", model=model, ids=batch, batch_row=1)
    whole = capture_qwen2(tmp_path / "whole", model=model, ids=batch)
    assert [(r.name, r.shape) for r in row.records] == [(r.name, r.shape) for r in alone.records]
    for r_row, r_whole in zip(row.records, whole.records):
        expected = whole.load(r_whole)
        if r_whole.shape and r_whole.shape[0] == 3:
            expected = expected[1:2]
        assert torch.equal(row.load(r_row), expected), r_row.name
    # on this CPU a row scored in a batch of 3 equals the row scored alone, except where kernels
    # split work by batch size; either way the comparison is element-wise on equal shapes
    report = compare_dumps(alone, row)
    assert all(c.status in ("match", "mismatch") for c in report.comparisons)


def test_batch_row_outside_the_batch_is_an_error(tmp_path):
    import pytest

    from tdiff.errors import TdiffError

    with pytest.raises(TdiffError, match="outside the batch of 3"):
        capture_qwen2(tmp_path / "d", ids=torch.cat([token_ids(4)] * 3), batch_row=5)
