"""Capture of torch.compile'd models: the compiled program stays the one an uncaptured run
compiles (bitwise equal outputs), capture records the compiled module's inputs and outputs, and
says on stderr and in the dump that the modules inside are not recorded.

CPU tests use the aot_eager backend (no C++ build per test); the GPU test uses inductor."""

import pytest
import torch

import tdiff
from tdiff.store import open_dump
from tests.helpers import tdiff_cli, tiny_qwen2, token_ids

NOTE = "torch.compile: (model) ran compiled"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def uncaptured(model, ids, backend, **options):
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, **options)(ids).logits
    torch._dynamo.reset()
    return logits


def captured(model, ids, path, backend, **options):
    """Compile under capture (the first call traces while tdiff's hook is installed)."""
    compiled = torch.compile(model, backend=backend, **options)
    with torch.no_grad(), tdiff.capture(path, model=compiled):
        logits = compiled(ids).logits
    return logits, open_dump(path)


@pytest.mark.slow
def test_compiled_under_capture_the_outputs_are_those_of_the_uncaptured_compiled_run(tmp_path):
    """Old code: torch.compile traced into tdiff's hook and failed."""
    model, ids = tiny_qwen2(), token_ids()
    expected = uncaptured(model, ids, "aot_eager")
    logits, _ = captured(model, ids, tmp_path / "d", "aot_eager")
    assert torch.equal(logits, expected)


def test_a_compiled_model_records_its_inputs_and_outputs_and_says_so(tmp_path, capfd):
    model, ids = tiny_qwen2(), token_ids()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(ids)  # compiled before capture: the backend's graph module runs at every call
        with tdiff.capture(tmp_path / "d", model=compiled):
            logits = compiled(ids).logits
    dump = open_dump(tmp_path / "d")
    assert [(r.name, r.role) for r in dump.records] == [("(model)[0]", "input"), ("(model)[logits]", "output")]
    assert torch.equal(dump.load(dump.records[1]), logits)
    assert any(note.startswith(NOTE) for note in dump.notes)
    assert NOTE in capfd.readouterr().err


def test_module_compile_in_place_is_recorded_the_same_way(tmp_path):
    model, ids = tiny_qwen2(), token_ids()
    expected = uncaptured(model, ids, "aot_eager")
    model.compile(backend="aot_eager")
    with torch.no_grad(), tdiff.capture(tmp_path / "d", model=model):
        logits = model(ids).logits
    dump = open_dump(tmp_path / "d")
    assert torch.equal(logits, expected)
    assert {r.module for r in dump.records} == {""}
    assert any(note.startswith(NOTE) for note in dump.notes)


def test_compare_with_an_eager_run_prints_why_inner_modules_are_on_one_side(tmp_path):
    model, ids = tiny_qwen2(), token_ids()
    with torch.no_grad(), tdiff.capture(tmp_path / "a", model=model):
        model(ids)
    captured(model, ids, tmp_path / "b", "aot_eager")
    output = tdiff_cli("compare", tmp_path / "a", tmp_path / "b", "--top", "0").output
    assert f"note: side B: {NOTE}" in output


def test_tdiff_dump_inside_compiled_code_is_left_out_of_the_compiled_program(tmp_path):
    def scaled(x):
        return tdiff.dump("scaled", x * 3) + 1

    x = torch.randn(4, 8)
    expected = torch.compile(scaled, backend="aot_eager")(x)
    torch._dynamo.reset()
    with tdiff.capture(tmp_path / "d"):
        tdiff.dump("input", x)
        assert torch.equal(torch.compile(scaled, backend="aot_eager")(x), expected)
    dump = open_dump(tmp_path / "d")
    # nor is the backend's graph module recorded as if it were a module of the program
    assert [r.name for r in dump.records] == ["input"]
    assert any(note.startswith("torch.compile: compiled code ran") for note in dump.notes)


def test_a_graph_module_the_program_itself_calls_is_recorded(tmp_path):
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    with tdiff.capture(tmp_path / "d"):
        traced(torch.randn(2, 8))
    dump = open_dump(tmp_path / "d")
    assert {r.module for r in dump.records} == {"", "0", "1"} and not dump.notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_inductor_on_the_gpu_outputs_are_bitwise_those_of_the_uncaptured_run(tmp_path, mode, compile_mode):
    model, ids = tiny_qwen2(torch.bfloat16).cuda(), token_ids(64).cuda()
    expected = uncaptured(model, ids, "inductor", mode=compile_mode)
    compiled = torch.compile(model, backend="inductor", mode=compile_mode)
    with torch.no_grad(), tdiff.capture(tmp_path / "d", model=compiled, mode=mode):
        outputs = [compiled(ids).logits.clone() for _ in range(3)]  # reduce-overhead: warm-up, record, replay
    dump = open_dump(tmp_path / "d")
    assert all(torch.equal(logits, expected) for logits in outputs)
    assert [(r.name, r.step) for r in dump.records if r.role == "output"] == [("(model)[logits]", s) for s in range(3)]
    assert any(note.startswith(NOTE) for note in dump.notes)
