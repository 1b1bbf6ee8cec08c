"""Whatever a module returns or receives, capture never breaks the program: nested, sparse,
wrapper-subclass and opaque tensors are recorded as the tensors they are made of, meta tensors
are skipped with a note, and capture's frames do not count against the recursion limit."""

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tdiff
from tdiff.store import open_dump


class Produces(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        return self.make(x)


class Consumes(torch.nn.Module):
    def forward(self, value):
        return value


class Model(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.produce, self.consume = Produces(make), Consumes()

    def forward(self, x):
        return self.consume(self.produce(x))


X = torch.arange(8.0).reshape(2, 4) - 3


def _captured(tmp_path, make, mode="full"):
    """Run ``make`` as a module's forward under capture, its output the input of the next module;
    returns (the program's output, the dump, the first module's output records by sub-name)."""
    with tdiff.capture(tmp_path / mode, mode=mode):
        out = Model(make)(X.clone())
    dump = open_dump(tmp_path / mode)
    assert not dump.problems
    outputs = {r.sub: r for r in dump.records if r.module == "produce" and r.role == "output"}
    # the same value as the next module's input, under the same sub-names
    assert {r.sub for r in dump.records if r.module == "consume" and r.role == "input"} == {
        f"0.{sub}" if sub else "0" for sub in outputs}
    return out, dump, outputs


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_nested_tensor_is_recorded_as_its_constituent_tensors(tmp_path, layout, mode):
    parts = [torch.arange(2.0), torch.arange(3.0) * 10]
    out, dump, outputs = _captured(tmp_path, lambda x: torch.nested.nested_tensor(parts, layout=layout), mode)
    assert out.is_nested   # the program got its value
    assert sorted(outputs) == ["nested.0", "nested.1"]
    if mode == "full":
        for i, part in enumerate(parts):
            assert torch.equal(dump.load(outputs[f"nested.{i}"]), part)


@pytest.mark.parametrize("mode", ["full", "stats"])
@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_a_sparse_tensor_is_recorded_as_its_indices_and_values(tmp_path, mode, layout):
    dense = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]])
    make = {"coo": lambda x: dense.to_sparse(), "csr": lambda x: dense.to_sparse_csr(),
            "csc": lambda x: dense.to_sparse_csc()}[layout]
    out, dump, outputs = _captured(tmp_path, make, mode)
    assert torch.equal(out.to_dense(), dense)
    parts = {"coo": ["indices", "values"], "csr": ["crow_indices", "col_indices", "values"],
             "csc": ["ccol_indices", "row_indices", "values"]}[layout]
    assert sorted(outputs) == sorted(f"sparse_{layout}.{p}" for p in parts)
    if mode == "full":
        recorded = {p: dump.load(outputs[f"sparse_{layout}.{p}"]) for p in parts}
        if layout == "coo":
            rebuilt = torch.sparse_coo_tensor(recorded["indices"], recorded["values"], dense.shape)
        else:
            build = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
            rebuilt = build(*recorded.values(), size=dense.shape)
        assert torch.equal(rebuilt.to_dense(), dense)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 5), seed=st.integers(0, 2**16), repeat=st.booleans())
def test_any_coo_tensor_is_recorded_in_one_order_that_rebuilds_it(tmp_path_factory, rows, cols, seed, repeat):
    """Uncoalesced indices (one entry given twice, in any order) are recorded coalesced: two runs
    that build one sparse tensor in different orders record the same components."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randint(-2, 3, (rows, cols), generator=generator).float()
    indices = dense.nonzero().t()
    values = dense[indices[0], indices[1]]
    order = torch.randperm(values.numel(), generator=generator)
    indices, values = indices[:, order], values[order]
    if repeat and values.numel():   # the first entry split into two halves
        indices = torch.cat([indices, indices[:, :1]], 1)
        values = torch.cat([values, values[:1] / 2])
        values[0] /= 2
    sparse = torch.sparse_coo_tensor(indices, values, (rows, cols))
    _, dump, outputs = _captured(tmp_path_factory.mktemp("coo"), lambda x: sparse)
    reference = dense.to_sparse()
    assert torch.equal(dump.load(outputs["sparse_coo.indices"]), reference.indices())
    assert torch.equal(dump.load(outputs["sparse_coo.values"]), reference.values())


def test_a_wrapper_subclass_is_recorded_as_its_inner_tensors(tmp_path):
    from torch.testing._internal.two_tensor import TwoTensor

    out, dump, outputs = _captured(tmp_path, lambda x: TwoTensor(x, x * 2))
    assert isinstance(out, TwoTensor)
    assert torch.equal(dump.load(outputs["TwoTensor.a"]), X)
    assert torch.equal(dump.load(outputs["TwoTensor.b"]), X * 2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no MKL-DNN in this torch")
def test_an_mkldnn_tensor_is_recorded_as_the_dense_tensor_it_holds(tmp_path):
    _, dump, outputs = _captured(tmp_path, lambda x: x.to_mkldnn())
    assert torch.equal(dump.load(outputs[""]), X)


def test_a_meta_tensor_is_skipped_with_a_note(tmp_path):
    _, dump, outputs = _captured(tmp_path, lambda x: (torch.empty(3, device="meta"), x * 2))
    assert sorted(outputs) == ["1"]
    [note] = [n for n in dump.notes if "meta" in n]
    assert "produce[0]" in note


def _strided_views(x):
    return {"zero": x[:0], "expanded": torch.ones(1).expand(4, 3), "transposed": x.t()[::2],
            "complex": torch.complex(x, -x), "conj": torch.complex(x, x).conj(),
            "int_repr": torch.quantize_per_tensor(x, 0.5, 2, torch.qint8),
            "subclass": x.as_subclass(_Marked), "bool": x > 0}


class _Marked(torch.Tensor):
    pass


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_odd_strided_values_are_recorded_as_the_values_they_hold(tmp_path, mode):
    _, dump, outputs = _captured(tmp_path, _strided_views, mode)
    expected = _strided_views(X)
    expected["int_repr"] = expected["int_repr"].int_repr()
    expected["conj"] = expected["conj"].resolve_conj()
    assert sorted(outputs) == sorted(expected)
    for key, value in expected.items():
        record = outputs[key]
        assert record.shape == tuple(value.shape)
        if mode == "full":
            assert torch.equal(dump.load(record), torch.Tensor(value) if key == "subclass" else value)


class Recursive(torch.nn.Module):
    """One module that calls itself ``n`` deep."""

    def forward(self, x, n):
        return x if n == 0 else self(x + 1, n - 1)


def _deepest(model, x) -> int:
    """The deepest recursion of ``model`` that runs from this caller's stack depth."""
    def runs(n):
        try:
            model(x, n)
            return True
        except RecursionError:
            return False

    low, high = 1, sys.getrecursionlimit()
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if runs(middle) else (low, middle - 1)
    return low


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_model_recursing_just_under_the_limit_runs_under_capture(tmp_path, mode):
    model, x = Recursive(), torch.zeros(2)
    limit = sys.getrecursionlimit()
    deepest = _deepest(model, x)
    with tdiff.capture(tmp_path / "d", mode=mode):
        out = model(x, deepest)
    assert torch.equal(out, x + deepest)
    dump = open_dump(tmp_path / "d")
    assert not dump.problems and max(r.depth for r in dump.records) == deepest
    assert sys.getrecursionlimit() == limit   # given back


def test_a_model_recursing_without_end_still_meets_recursion_error_under_capture(tmp_path):
    model, x = Recursive(), torch.zeros(2)
    deepest = _deepest(model, x)
    with tdiff.capture(tmp_path / "d", mode="stats"):
        # capture's own frames are given room, and no more: the model's frames reach the limit
        assert _deepest(model, x) < deepest + sys.getrecursionlimit() // 10
        with pytest.raises(RecursionError):
            model(x, 10**6)


@pytest.mark.parametrize("transform", ["vmap", "grad", "fake"])
def test_tensors_without_storage_of_their_own_are_skipped_with_a_note(tmp_path, transform):
    """Inside torch.func's vmap and grad and under FakeTensorMode a module's tensors hold no values
    capture can read: the program runs, those are noted, the rest is recorded."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import grad

    layer = torch.nn.Linear(4, 4)
    with tdiff.capture(tmp_path / "d"):
        if transform == "vmap":
            out = torch.vmap(layer)(torch.ones(3, 2, 4))
            assert torch.allclose(out[1], layer(torch.ones(2, 4)))
        elif transform == "grad":
            assert grad(lambda x: layer(x).sum())(torch.ones(4)).shape == (4,)
        else:
            with FakeTensorMode():
                assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).shape == (2, 4)
        tdiff.dump("after", torch.ones(2))
    dump = open_dump(tmp_path / "d")
    assert not dump.problems
    assert [r.name for r in dump.records if r.role == "explicit"] == ["after"]
    assert any("not recorded" in note for note in dump.notes), dump.notes
