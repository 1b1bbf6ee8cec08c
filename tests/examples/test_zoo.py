"""The divergence zoo (examples/zoo, docs/ZOO.md): its registry fits its model, a few classes run
end to end (tdiff capture per side, tdiff bisect --json) and are named at the module where they
were planted with the cause expected, and the table's verdict is judged from the bisect JSON."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from examples.zoo.classes import CLASSES, by_key
from examples.zoo.model import build
from examples.zoo.runner import judge, markdown, run_class
from examples.zoo.side import plant


@pytest.mark.parametrize("zoo_class", CLASSES, ids=lambda c: c.key)
def test_each_class_plants_an_existing_variant_and_names_a_module_of_the_model(zoo_class):
    model = build()
    paths = [path for path, _ in model.named_modules()]
    for p in zoo_class.engine + zoo_class.both:
        assert any(re.fullmatch(p.module, path) for path in paths), p
    assert any(re.fullmatch(zoo_class.named, path) for path in paths)
    plant(model, zoo_class.both + zoo_class.engine)   # refuses a variant the module does not have


@pytest.mark.parametrize("key", ["qk-norm", "rope-generation", "logsoftmax-precision"])
def test_a_precision_variant_moves_the_engine_away_from_the_trainer(key):
    """The planted variants are real: the engine's output differs from the trainer's."""
    from examples.zoo.side import sequences

    zoo_class = by_key(key)
    trainer, engine = build(), build()
    plant(engine, zoo_class.engine)
    ids = sequences(1)
    with torch.no_grad():
        assert not torch.equal(trainer(ids), engine(ids))


@pytest.mark.slow
@pytest.mark.parametrize("key", ["norm-tree", "rope-application", "logsoftmax-precision", "batch-invariance"])
def test_zoo_class_is_named_where_planted_with_its_cause(key, tmp_path):
    zoo_class = by_key(key)
    row = run_class(zoo_class, tmp_path)
    assert re.fullmatch(zoo_class.named, row.named), row
    expected = f"{zoo_class.cause} ({zoo_class.side})" if zoo_class.side else zoo_class.cause
    assert row.cause == expected, row.cause_description
    assert row.right and row.why is None
    # two captures and one bisect, each a real command line
    assert [c.split()[:2] for c in row.commands] == [["tdiff", "capture"]] * 2 + [["tdiff", "bisect"]]
    assert f"| {zoo_class.title} |" in markdown([row])


@pytest.mark.slow
def test_moe_combine_class_is_named_at_the_op_its_plant_adds(tmp_path):
    """The routing weights cast to bf16 inside the MoE's own forward: bisect names the MoE module,
    and the op records where the two sides' op sequences part: the engine's cast."""
    row = run_class(by_key("routing-weight-cast"), tmp_path)
    assert row.named == "model.layers.1.mlp" and row.kind == "moe_combine"
    assert row.op is not None and "vs aten::_to_copy" in row.op
    # the cause says why it cannot replay the combine, and does not ask for the op records it has
    assert row.cause == "unknown" and "its op records name the op" in row.cause_description


def test_the_verdict_is_judged_from_the_bisect_result():
    norm = by_key("norm-tree")
    result = {"status": "diverged", "first_divergence": {
        "module": "model.layers.1.post_attention_layernorm", "kind": "norm", "op": None, "token": None,
        "cause": {"class": "rounding", "side": None, "description": "both within rounding"}}}
    assert judge(norm, result, []).right
    wrong_expectation = dataclasses.replace(norm, cause="precision", side="engine")
    row = judge(wrong_expectation, result, [])
    assert not row.right and "cause rounding, expected precision (engine)" in row.why
    elsewhere = dict(result, first_divergence=dict(result["first_divergence"], module="model.layers.0.mlp"))
    assert "named `model.layers.0.mlp`, not the planted" in judge(norm, elsewhere, []).why
    assert "no divergence" in judge(norm, {"status": "match", "first_divergence": None}, []).why


def test_docs_table_has_a_row_for_every_class():
    """docs/ZOO.md shows the table of a real run: one row per registered class, none stale."""
    from tests.helpers import REPO

    text = (REPO / "docs" / "ZOO.md").read_text()
    table = text[text.index("<!-- zoo-table:begin -->"):text.index("<!-- zoo-table:end -->")]
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[3:] if line.startswith("| ")]
    assert rows == [zoo_class.title for zoo_class in CLASSES]
