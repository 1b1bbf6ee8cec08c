"""capture --ops: every ATen op inside the forward of the selected modules, with its function,
source line and references to the records of its inputs."""

import inspect
import json
import sys

import pytest
import torch

import tdiff
from tdiff.errors import DumpError
from tdiff.store import FORMAT_VERSION, open_dump
from tdiff.store.record import Record
from tests.helpers import REPO, tdiff_cli, tiny_qwen2, token_ids


class Block(torch.nn.Module):
    """A child module, an in-place op on its output, and a softmax of the mutated value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        y.mul_(2)
        return torch.softmax(y, -1) + x


LINES, FIRST_LINE = inspect.getsourcelines(Block.forward)


def capture_block(path, *, mode="full", grad_mode=torch.no_grad, ops=r"^$", device="cpu"):
    model = Block().to(device)
    with grad_mode(), tdiff.capture(path, mode=mode, ops=ops):
        output = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(device))
    return open_dump(path), output


def by_op(dump):
    return {r.op["name"]: r for r in dump.ops}


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_op_records_name_op_function_line_and_refer_to_their_inputs_records(tmp_path, grad_mode):
    dump, output = capture_block(tmp_path / "d", grad_mode=grad_mode)
    records = {r.name: r for r in dump.records}
    ops = by_op(dump)
    # the Linear's own ops are left to it: only the root's own code is traced
    names = [r.op["name"] for r in dump.ops]
    assert len(names) == 3 and names[0] == "aten::mul_.Tensor" and "softmax" in names[1], names
    assert names[2] == "aten::add.Tensor"
    assert all(r.module == "" and r.role == "op" and r.op["function"] == "forward" for r in dump.ops)
    assert [r.op["index"] for r in dump.ops] == list(range(len(dump.ops)))
    mul = ops["aten::mul_.Tensor"]
    softmax = next(r for r in dump.ops if "softmax" in r.op["name"])
    add = ops["aten::add.Tensor"]
    for record, text in ((mul, "y.mul_(2)"), (softmax, "torch.softmax"), (add, "torch.softmax")):
        file, line = record.op["source"].split(":")
        assert file == "test_ops.py" and text in LINES[int(line) - FIRST_LINE]
    # inputs refer to records: the Linear's output, the in-place op's snapshot, the model's input
    assert mul.op["inputs"] == [records["proj"].seq]
    assert softmax.op["inputs"] == [mul.seq]
    assert add.op["inputs"][0] == softmax.seq
    held = {r.seq: r for r in dump.records}[add.op["inputs"][1]]  # the model's input, or the Linear's: one tensor
    assert torch.equal(dump.load(held), dump.load(records["(model)[0]"]))
    # the in-place op's input record holds the value before it, its own record the value after
    assert torch.equal(dump.load(mul), dump.load(records["proj"]) * 2)
    assert torch.equal(dump.load(add), output)


def test_stats_mode_records_ops_as_fingerprints(tmp_path):
    full, _ = capture_block(tmp_path / "full")
    stats, _ = capture_block(tmp_path / "stats", mode="stats")
    assert [r.op for r in stats.ops] == [r.op for r in full.ops]
    assert all(r.file is None and r.stats is not None for r in stats.ops)
    assert all(r.fingerprint == f.fingerprint for r, f in zip(stats.ops, full.ops))


def test_a_traced_parent_leaves_its_traced_childs_ops_to_the_child(tmp_path):
    dump, _ = capture_block(tmp_path / "d", ops=r"^(|proj)$")
    modules = {r.module for r in dump.ops}
    assert modules == {"", "proj"}
    child = [r for r in dump.ops if r.module == "proj"]
    assert child and all(r.parent == "proj" and r.op["index"] == i for i, r in enumerate(child))
    assert [r.op["name"] for r in dump.ops if r.module == ""] == [r.op["name"] for r in capture_block(
        tmp_path / "root", ops=r"^$")[0].ops]


def test_a_compiled_module_runs_eagerly_when_traced_and_the_dump_says_so(tmp_path, capfd):
    torch._dynamo.reset()
    model = tiny_qwen2()
    model.model.layers[0].compile(backend="aot_eager")
    with torch.no_grad(), tdiff.capture(tmp_path / "d", ops=r"^model\.layers\.0$"):
        model(token_ids())
    torch._dynamo.reset()
    dump = open_dump(tmp_path / "d")
    assert any("model.layers.0 ran eagerly" in note for note in dump.notes)
    assert "model.layers.0 ran eagerly" in capfd.readouterr().err
    assert {r.module for r in dump.ops} == {"model.layers.0"}
    assert [r.op["name"] for r in dump.ops].count("aten::add.Tensor") == 2  # the residual adds
    # it ran eagerly: the modules inside it are recorded as in an uncompiled run
    assert any(r.module == "model.layers.0.self_attn" for r in dump.records)


def test_capture_cli_ops_records_ops_of_the_selected_modules(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport torch\n"
                      "from tests.helpers import tiny_qwen2, token_ids\n"
                      "with torch.no_grad():\n    tiny_qwen2()(token_ids())\n")
    result = tdiff_cli("capture", "--out", tmp_path / "d", "--ops", r"mlp$", "--", sys.executable, script,
                       expect=0)
    dump = open_dump(tmp_path / "d")
    assert {r.module for r in dump.ops} == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert f"and {len(dump.ops)} op outputs" in result.stderr
    assert json.loads((tmp_path / "d" / "tdiff-dump.json").read_text())["version"] == FORMAT_VERSION


def test_an_op_record_without_its_op_fields_is_refused():
    base = {"seq": 0, "name": "m#0", "module": "m", "role": "op", "step": 0, "call": 0, "rank": 0,
            "dtype": "float32", "shape": [2]}
    with pytest.raises(DumpError, match="field 'op'"):
        Record.from_json(base)
    with pytest.raises(DumpError, match="op.inputs"):
        Record.from_json({**base, "op": {"name": "aten::neg", "index": 0, "function": "f", "source": "a.py:1",
                                         "inputs": ["x"]}})
    with pytest.raises(DumpError, match="field 'op'"):
        Record.from_json({**base, "role": "output", "op": {}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["full", "stats"])
def test_cuda_op_records_match_the_cpu_structure(tmp_path, mode):
    cpu, _ = capture_block(tmp_path / "cpu", mode=mode)
    cuda, output = capture_block(tmp_path / "cuda", mode=mode, device="cuda")
    assert [(r.op["name"], r.op["inputs"] is not None) for r in cuda.ops] == \
        [(r.op["name"], True) for r in cpu.ops]
    assert all(r.device.startswith("cuda") for r in cuda.ops)
    if mode == "full":
        assert torch.equal(cuda.load(by_op(cuda)["aten::add.Tensor"]), output.cpu())


def test_op_records_carry_no_layout_where_their_module_declares_one(tmp_path):
    # a seq-first module's inputs and outputs say so; the tensors of its ops are the ops' own
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).eval()   # batch_first=False
    with torch.no_grad(), tdiff.capture(tmp_path / "d", ops=r"^$"):
        layer(torch.randn(3, 2, 8))
    dump = open_dump(tmp_path / "d")
    outer = [r for r in dump.records if r.module == "" and r.role in ("input", "output")]
    assert outer and all(r.attrs.get("layout") == "seq-first" for r in outer)
    assert dump.ops and not any("layout" in r.attrs for r in dump.ops)
