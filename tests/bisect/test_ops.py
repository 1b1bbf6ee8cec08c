"""Bisect descends into a module's own code: changes planted inside functions and forwards of real
models (tiny configs, random weights) are named down to the op, its function and source line."""

import inspect
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import tdiff
from tdiff.bisect import bisect_dumps
from tdiff.bisect.result import BisectResult
from tests.bisect import planted
from tests.bisect.programs import tiny_moe
from tests.helpers import REPO, installed_tdiff, tdiff_cli, tiny_qwen2, token_ids


def capture(path, model, ops, forward=None):
    with torch.no_grad(), tdiff.capture(path, ops=ops):
        (forward or (lambda: model(token_ids())))()
    return path


def op_of(result):
    d = result.first_divergence
    assert d is not None and d.op is not None, result.to_json()
    return d, result.to_json()["first_divergence"]["op"]


def assert_source_in(module, function, source):
    """``source`` (file:line) lies inside ``function`` of ``module``'s file."""
    code = inspect.unwrap(getattr(module, function))
    lines, start = inspect.getsourcelines(code)
    file, line = source.rsplit(":", 1)
    assert file == os.path.basename(inspect.getsourcefile(code)), source
    assert start <= int(line) < start + len(lines), (source, start)


def qwen2_pair(tmp_path, ops, *, plant_b=None, monkeypatch=None, replace=None):
    """Side A: a tiny Qwen2; side B: the same model with ``plant_b`` applied or a function of
    modeling_qwen2 replaced (``replace``: (name, function))."""
    from transformers.models.qwen2 import modeling_qwen2

    model = tiny_qwen2()
    model.config._attn_implementation = "eager"
    a = capture(tmp_path / "a", model, ops)
    if replace is not None:
        monkeypatch.setattr(modeling_qwen2, *replace)
    if plant_b is not None:
        plant_b(model)
    return bisect_dumps(a, capture(tmp_path / "b", model, ops))


def test_a_change_inside_apply_rotary_pos_emb_is_named_with_its_op_and_line(tmp_path, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    result = qwen2_pair(tmp_path, r"self_attn$", monkeypatch=monkeypatch,
                        replace=("apply_rotary_pos_emb", planted.bf16_apply_rotary_pos_emb))
    d, op = op_of(result)
    assert (d.module, d.kind, d.event) == ("model.layers.0.self_attn", "rope", "between")
    # side A rotates the keys as before; side B casts them to bf16 first: the sequences part there
    assert op["parted"] is True and op["name_b"] == "aten::_to_copy"
    assert op["function_b"] == "bf16_apply_rotary_pos_emb"
    assert_source_in(planted, "bf16_apply_rotary_pos_emb", op["source_b"])
    assert op["function"] in ("apply_rotary_pos_emb", "rotate_half") and op["name"].startswith("aten::")
    monkeypatch.undo()  # HF's own function again, to read its lines
    assert_source_in(modeling_qwen2, op["function"], op["source"])
    assert op["index"] == op["index_b"]  # every op before it matched, one for one
    assert BisectResult.from_json(result.to_json()) == result  # the op reads back from the JSON


def test_hf_moe_experts_combining_in_another_order_name_index_add(tmp_path):
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    model = tiny_moe()
    ops = r"\.experts$"
    a = capture(tmp_path / "a", model, ops)
    planted.reversed_index_add_combine(model.model.layers[1].mlp.experts)
    result = bisect_dumps(a, capture(tmp_path / "b", model, ops))
    d, op = op_of(result)
    assert (d.module, d.kind) == ("model.layers.1.mlp.experts", "moe_combine")
    # A adds the first expert's rows where B goes on to the next expert
    assert op["name"] == "aten::index_add_" and op["parted"] is True
    assert op["function"] == "forward"
    assert_source_in(modeling_qwen2_moe.Qwen2MoeExperts, "forward", op["source"])
    assert op["function_b"] == "forward" and op["name_b"] != "aten::index_add_"
    assert_source_in(planted, "reversed_index_add_combine", op["source_b"])


def test_a_bf16_residual_add_in_a_decoder_layers_forward_is_named_at_the_add(tmp_path):
    from transformers.models.qwen2 import modeling_qwen2

    result = qwen2_pair(tmp_path, r"^model\.layers\.1$",
                        plant_b=lambda m: planted.bf16_residual(m.model.layers[1]))
    d, op = op_of(result)
    assert (d.module, d.kind, d.event) == ("model.layers.1", "residual", "between")
    assert (op["name"], op["function"], op["name_b"]) == ("aten::add.Tensor", "forward", "aten::_to_copy")
    assert_source_in(modeling_qwen2.Qwen2DecoderLayer, "forward", op["source"])
    assert_source_in(planted, "bf16_residual", op["source_b"])


def test_softmax_in_bf16_inside_eager_attention_is_named_with_kind_attention(tmp_path, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    result = qwen2_pair(tmp_path, r"self_attn$", monkeypatch=monkeypatch,
                        replace=("eager_attention_forward", planted.bf16_softmax_eager_attention))
    d, op = op_of(result)
    assert (d.module, d.kind) == ("model.layers.0.self_attn", "attention")
    assert op["function"] == "eager_attention_forward" and op["function_b"] == "bf16_softmax_eager_attention"
    monkeypatch.undo()
    assert_source_in(modeling_qwen2, "eager_attention_forward", op["source"])
    assert_source_in(planted, "bf16_softmax_eager_attention", op["source_b"])
    # side A's softmax in fp32 where side B first casts to bf16
    assert op["parted"] is True and op["name"] == "aten::_softmax" and op["name_b"] == "aten::_to_copy"


def test_identical_runs_with_op_records_match_and_their_ops_are_equal(tmp_path):
    model = tiny_qwen2()
    a, b = (tdiff_open(capture(tmp_path / side, model, r".")) for side in "ab")
    assert bisect_dumps(a, b).status == "match"
    assert a.ops and [(r.name, r.fingerprint) for r in a.ops] == [(r.name, r.fingerprint) for r in b.ops]


def tdiff_open(path):
    from tdiff.store import open_dump

    return open_dump(path)


def test_without_op_records_bisect_gives_the_capture_command_that_zooms_in(tmp_path):
    result = qwen2_pair(tmp_path, (), plant_b=lambda m: planted.bf16_residual(m.model.layers[1]))
    d = result.first_divergence
    assert d.op is None and result.to_json()["first_divergence"]["op"] is None
    hint = next(note for note in result.notes if "--ops" in note)
    assert "--ops '^model\\.layers\\.1$'" in hint and f"--out {tmp_path / 'a'}-ops" in hint
    assert re.search(r"ops='\^model\\\\\.layers\\\\\.1\$'", hint)


# ---- megatron-core ----
def test_megatron_bias_dropout_add_in_bf16_is_named_in_its_function(tmp_path, megatron, monkeypatch):
    from megatron.core.fusions import fused_bias_dropout

    config = megatron.gpt_config(layers=2)
    ops = r"^decoder\.layers\.\d+$"

    def run(side):
        model = megatron.build_gpt(config)
        return capture(tmp_path / side, model, ops, lambda: megatron.gpt_forward(model, token_ids(tokens=8)))

    a = run("a")
    monkeypatch.setattr(fused_bias_dropout, "_bias_dropout_add_func", planted.bf16_bias_dropout_add)
    result = bisect_dumps(a, run("b"))
    d, op = op_of(result)
    assert (d.module, d.kind, d.event) == ("decoder.layers.0", "residual", "between")
    assert op["function"] == "_bias_dropout_add_func" and op["function_b"] == "bf16_bias_dropout_add"
    monkeypatch.undo()
    assert_source_in(fused_bias_dropout, "_bias_dropout_add_func", op["source"])
    assert_source_in(planted, "bf16_bias_dropout_add", op["source_b"])


@pytest.mark.slow
def test_the_printed_capture_commands_record_the_ops_that_name_the_culprit(tmp_path):
    """Offline dumps without op records: the note's commands, run as printed, give dumps whose
    bisection names the op."""
    amplify = f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m tests.bisect.programs amplify"
    for side, flag in (("a", ""), ("b", " --split-k")):
        tdiff_cli("capture", "--out", tmp_path / side, "--", "/bin/sh", "-c", amplify + flag, expect=0)
    result = tdiff_cli("bisect", tmp_path / "a", tmp_path / "b", expect=1)
    assert "introduced at proj" in result.stdout
    note = next(line for line in result.stdout.splitlines() if "bisect those dumps: " in line)
    commands = note.split("bisect those dumps: ")[1].split("; ")
    assert commands[0].startswith(f"tdiff capture --out {tmp_path / 'a'}-ops --ops '^proj$' -- /bin/sh -c ")
    for command in commands:
        ran = subprocess.run(installed_tdiff() + command.removeprefix("tdiff"), shell=True, capture_output=True)
        assert ran.returncode == 0, ran.stderr[-2000:]
    report = json.loads(tdiff_cli("bisect", f"{tmp_path / 'a'}-ops", f"{tmp_path / 'b'}-ops", "--json",
                                  expect=1).stdout)
    op = report["first_divergence"]["op"]
    assert report["first_divergence"]["module"] == "proj"
    # nn.Linear's own forward lies inside torch: it is still the function named
    assert (op["function"], op["source"].split(":")[0]) == ("forward", "linear.py")
    assert op["function_b"] == "forward" and op["source_b"].startswith("planted.py:")
    assert op["parted"] is True and op["index"] == op["index_b"] == 0


def test_bisect_says_when_a_traced_compiled_module_ran_eagerly(tmp_path):
    torch._dynamo.reset()
    try:
        model = tiny_qwen2()
        model.model.layers[1].compile(backend="aot_eager")
        a = capture(tmp_path / "a", model, r"^model\.layers\.1$")
        planted.bf16_residual(model.model.layers[1])
        result = bisect_dumps(a, capture(tmp_path / "b", model, r"^model\.layers\.1$"))
    finally:
        torch._dynamo.reset()
    d, op = op_of(result)
    assert (d.module, d.kind, op["name"], op["name_b"]) == ("model.layers.1", "residual", "aten::add.Tensor",
                                                           "aten::_to_copy")
    assert any(note.startswith("side B: --ops: model.layers.1 ran eagerly") for note in result.notes)
