"""Reading stays inside the dump and bounded (issue 27 §10): a shard, data/ or a manifest that is a
symlink out of the dump is refused; a tokens line claiming 10^12 sequences is refused at once; the
HTML token grid takes memory per position a token has, not per position of the span."""

import json
import os
import shutil

import pytest
import torch

import tdiff
from tdiff.errors import DumpError
from tdiff.store import open_dump
from tdiff.store.manifest import DATA_DIR, MANIFEST_DIR
from tests.helpers import tdiff_bounded, tdiff_cli


def dump_of(path, **tensors):
    with tdiff.capture(path):
        for name, tensor in tensors.items():
            tdiff.dump(name, tensor)
    return path


def test_a_shard_linked_outside_the_dump_is_refused(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(4))
    b = dump_of(tmp_path / "b", x=torch.ones(4))
    elsewhere = dump_of(tmp_path / "elsewhere", x=torch.ones(4) * 2)
    (shard,) = (b / DATA_DIR).iterdir()
    (other,) = (elsewhere / DATA_DIR).iterdir()
    shard.unlink()
    shard.symlink_to(other)
    line = tdiff_cli("compare", a, b, expect=2).output
    assert "outside the dump" in line and shard.name in line


def test_data_and_manifests_linked_outside_the_dump_are_refused(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.ones(4))
    b = dump_of(tmp_path / "b", x=torch.ones(4))
    shutil.move(b / DATA_DIR, tmp_path / "moved-data")
    (b / DATA_DIR).symlink_to(tmp_path / "moved-data")
    assert "data directory is a link" in tdiff_cli("compare", a, b, expect=2).output
    c = dump_of(tmp_path / "c", x=torch.ones(4))
    (manifest,) = (c / MANIFEST_DIR).iterdir()
    shutil.move(manifest, tmp_path / manifest.name)
    manifest.symlink_to(tmp_path / manifest.name)
    assert "manifest is a link" in tdiff_cli("compare", a, c, expect=2).output


def test_a_link_inside_the_dump_and_a_dump_reached_through_a_link_still_read(tmp_path):
    a = dump_of(tmp_path / "a", x=torch.arange(4.0))
    (shard,) = (a / DATA_DIR).iterdir()
    kept = a / "kept" / shard.name
    kept.parent.mkdir()
    shutil.move(shard, kept)
    shard.symlink_to(os.path.relpath(kept, shard.parent))
    os.symlink(a, tmp_path / "link")
    linked = open_dump(tmp_path / "link")
    assert torch.equal(linked.load(linked.records[0]), torch.arange(4.0))


def claim_sequences(dump, sequences: int) -> None:
    """Rewrite the dump's tokens lines to claim ``sequences`` sequences for their few tokens."""
    (manifest,) = (dump / MANIFEST_DIR).iterdir()
    lines = []
    for raw in manifest.read_text().splitlines():
        entry = json.loads(raw)
        if entry.get("type") == "tokens":
            entry["sequences"] = sequences
        lines.append(json.dumps(entry))
    manifest.write_text("\n".join(lines) + "\n")


def test_a_tokens_line_claiming_10_12_sequences_is_refused_at_once(tmp_path):
    def run(path):
        with tdiff.capture(path):
            tdiff.tokens(input_ids=torch.tensor([5, 6, 7]))
            tdiff.dump("h", torch.ones(3, 2))
        return path

    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    claim_sequences(b, 10 ** 12)
    result = tdiff_bounded("compare", a, b, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "claims 1000000000000 sequences" in result.stderr
    with pytest.raises(DumpError):
        open_dump(b)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("per_channel", [False, True])
def test_a_quantized_tensor_keeps_its_scale_and_zero_point(tmp_path, per_channel):
    """The same integers under another scale are other values: a divergence, not a match."""
    integers = torch.tensor([[4, -2, 7], [1, 0, -5]], dtype=torch.int8)

    def quantized(scale):
        if per_channel:
            return torch._make_per_channel_quantized_tensor(integers, torch.tensor([0.5, scale], dtype=torch.float64),
                                                            torch.tensor([3, 3]), 0)
        return torch._make_per_tensor_quantized_tensor(integers, scale, 3)

    a, b = dump_of(tmp_path / "a", q=quantized(0.5)), dump_of(tmp_path / "b", q=quantized(0.5))
    rescaled = dump_of(tmp_path / "c", q=quantized(0.25))
    tdiff_cli("compare", a, b, expect=0)
    report = json.loads(tdiff_cli("compare", a, rescaled, "--json", expect=1).output)
    assert report["tensors"][0]["reason"].startswith("quantization differs: scale")
    assert "quantization differs" in tdiff_cli("bisect", a, rescaled, expect=1).output


def test_the_html_token_grid_over_a_position_span_of_10_9_takes_memory_per_token(tmp_path):
    far = 10 ** 9
    hidden = torch.arange(18.0).reshape(6, 3)

    def ragged(path, value):
        with tdiff.capture(path):
            tdiff.tokens(input_ids=torch.tensor([5, 6, 9, 7, 8, 10]), seq_lens=torch.tensor([3, 3]),
                         positions=torch.tensor([0, far, 2 * far, 0, far, 2 * far]))
            tdiff.dump("h", value)
        return path

    def padded(path, value):
        with tdiff.capture(path):
            tdiff.tokens(input_ids=torch.tensor([[5, 6, 9], [7, 8, 10]]),
                         positions=torch.tensor([[0, far, 2 * far], [0, far, 2 * far]]))
            tdiff.dump("h", value.reshape(2, 3, 3))
        return path

    spoiled = hidden.clone()
    spoiled[4, 1] += 1
    a, b = ragged(tmp_path / "a", hidden), padded(tmp_path / "b", spoiled)
    result = tdiff_bounded("report", a, b, "--format", "html", "--out", tmp_path / "r.html", timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "plot-token-grid" in (tmp_path / "r.html").read_text()
