"""choose_pairing: by name within one framework and layout, by canonical boundary otherwise."""

import torch

import tdiff
from tdiff.align import CanonicalPairing, choose_pairing
from tdiff.compare import NamePairing
from tdiff.store import open_dump


def test_one_framework_pairs_by_name_and_two_by_canonical_boundary(dumps):
    hf, megatron = open_dump(dumps["hf:qwen2"]), open_dump(dumps["megatron:qwen2"])
    assert isinstance(choose_pairing(hf, hf), NamePairing)
    assert isinstance(choose_pairing(megatron, megatron), NamePairing)
    assert isinstance(choose_pairing(hf, megatron), CanonicalPairing)


def test_dumps_of_plain_torch_code_pair_by_name(tmp_path):
    with tdiff.capture(tmp_path / "a"):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    dump = open_dump(tmp_path / "a")
    assert isinstance(choose_pairing(dump, dump), NamePairing)


def test_a_mapping_makes_even_one_framework_align_by_boundary(dumps, tmp_path):
    (tmp_path / "map.yaml").write_text(
        "side: both\nrules:\n  - {module: '(?:.*\\.)?embed_tokens', boundary: embedding}\n")
    hf = open_dump(dumps["hf:qwen2"])
    pairing = choose_pairing(hf, hf, tmp_path / "map.yaml")
    assert [p.name for p in pairing.pair(hf, hf)] == ["embedding"]
    assert pairing.alignment.a.adapter == "mapping map.yaml"


def test_two_frameworks_adapters_know_pair_by_boundary_even_where_their_paths_line_up(dumps):
    """HF and SGLang share many module paths (model.embed_tokens, model.layers.N.input_layernorm):
    restricted to those, as captures with a --select would be, they are still two frameworks."""
    hf, sglang = open_dump(dumps["hf1:qwen2"]), open_dump(dumps["sglang:qwen2"])
    common = {r.module for r in hf.records} & {r.module for r in sglang.records}
    for dump in (hf, sglang):
        dump.records = [r for r in dump.records if r.module in common]
    assert isinstance(choose_pairing(hf, sglang), CanonicalPairing)
