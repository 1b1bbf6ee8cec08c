"""SGLang's dumper output read as a tdiff dump: written by the real dumper, its older raw-tensor
format, and files that must never be unpickled."""

import pytest
import torch

from tdiff.errors import DumpError
from tdiff.store import open_dump


@pytest.fixture(scope="module")
def dumper():
    from tests.stacks.sglang import install_import_shims

    install_import_shims()
    dumper = pytest.importorskip("sglang.srt.debug_utils.dumper",
                                 reason="SGLang is not installed (scripts/setup.sh installs it)").dumper

    yield dumper
    dumper.reset()
    dumper.configure(enable=False)


def run_dumper(dumper, directory, model, x):
    dumper.reset()
    dumper.configure(enable=True, dir=str(directory), exp_name="exp", non_intrusive_mode="all",
                     enable_output_console=False)
    dumper.register_non_intrusive_dumper(model)
    with torch.no_grad():
        y = model(x)
    dumper.dump("logprobs", torch.log_softmax(y, -1))
    dumper.dump("pair", [y, y * 2])
    dumper.dump("note", 3)
    dumper.step()
    dumper.reset()
    dumper.configure(enable=False)
    return y


def test_files_of_the_real_dumper_become_module_inputs_outputs_and_explicit_dumps(dumper, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 4)
    y = run_dumper(dumper, tmp_path, model, x)

    dump = open_dump(tmp_path)              # the experiment directory is found inside
    assert dump.path == tmp_path / "exp" and dump.info["format"] == "sglang-dumper"
    records = {(r.name, r.role): r for r in dump.records}
    assert dump.load(records[("(model)[0]", "input")]).equal(x)
    assert dump.load(records[("2", "output")]).equal(y)
    assert records[("0[0]", "input")].module == "0" and records[("0[0]", "input")].sub == "0"
    assert torch.allclose(dump.load(records[("logprobs", "explicit")]), torch.log_softmax(y, -1))
    assert dump.load(records[("pair[1]", "explicit")]).equal(y * 2)
    assert dump.info["skipped_values"] == 1   # the int: not a tensor
    assert [r.seq for r in dump.records] == sorted(r.seq for r in dump.records)


def test_older_raw_tensor_files_take_their_metadata_from_the_name(tmp_path):
    value = torch.arange(6.0).reshape(2, 3)
    torch.save(value, tmp_path / "step=1___rank=0___dump_index=4___name=hidden___layer_id=3.pt")
    torch.save(value * 2, tmp_path / "step=1___rank=0___dump_index=5___name=hidden___layer_id=4.pt")
    dump = open_dump(tmp_path)
    first, second = dump.records
    assert (first.name, first.role, first.step, first.call, first.attrs["tags"]) == ("hidden", "explicit", 1, 0,
                                                                                     {"layer_id": "3"})
    assert second.call == 1
    assert dump.load(second).equal(value * 2)


def test_nested_values_are_named_as_capture_names_them_and_load_back(tmp_path):
    a, b, c = torch.arange(3.0), torch.ones(2), torch.zeros(4)
    value = {"h": [a, (b, {"cos": c, "n": 3})]}
    torch.save({"value": value, "meta": {}},
               tmp_path / "step=0___rank=0___dump_index=1___name=non_intrusive__model.layers.0.output.pt")
    dump = open_dump(tmp_path)
    base = "model.layers.0"
    assert [(r.name, r.sub) for r in dump.records] == [
        (f"{base}[h][0]", "h.0"), (f"{base}[h][1][0]", "h.1.0"), (f"{base}[h][1][1][cos]", "h.1.1.cos")]
    assert all(dump.load(r).equal(t) for r, t in zip(dump.records, (a, b, c), strict=True))


class Payload:
    """What a malicious or foreign pickle may hold: loading it would run code."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (open, (str(self.sentinel), "w"))


def test_pickled_objects_are_refused_never_executed(tmp_path):
    sentinel = tmp_path / "executed"
    torch.save({"value": Payload(sentinel), "meta": {"name": "evil"}},
               tmp_path / "step=0___rank=0___dump_index=1___name=evil.pt")
    torch.save({"value": torch.ones(2), "meta": {"name": "fine"}},
               tmp_path / "step=0___rank=0___dump_index=2___name=fine.pt")
    with pytest.raises(DumpError, match="dump is incomplete: .*evil.pt: not readable as tensors"):
        open_dump(tmp_path)
    dump = open_dump(tmp_path, allow_incomplete=True)
    assert [r.name for r in dump.records] == ["fine"]
    assert not sentinel.exists()


def test_several_experiments_must_be_told_apart(tmp_path):
    for name in ("run1", "run2"):
        (tmp_path / name).mkdir()
        torch.save(torch.ones(1), tmp_path / name / "step=0___rank=0___dump_index=1___name=x.pt")
    with pytest.raises(DumpError, match="holds 2 SGLang dumper experiments \\(run1, run2\\); pass one of them"):
        open_dump(tmp_path)
    assert open_dump(tmp_path / "run2").records[0].name == "x"
