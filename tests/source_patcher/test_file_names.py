"""FILE:NAME,... picks patches (patch apply, check) or candidates (patch try) of a patch file."""

import pytest

from tdiff.errors import TdiffError
from tdiff.source_patcher.catalogue import candidates_from, patches_from
from tests.helpers import REPO

CANDIDATES = str(REPO / "examples" / "demo" / "candidates.yaml")


def test_a_file_and_names_pick_those_patches_in_the_order_named():
    assert [p.name for p in patches_from(CANDIDATES)] == ["fp32-variance", "fp32-variance-rounded", "mlp-in-fp32"]
    assert [p.name for p in patches_from(f"{CANDIDATES}:mlp-in-fp32,fp32-variance")] == ["mlp-in-fp32",
                                                                                         "fp32-variance"]
    assert [c.name for c in candidates_from(f"{CANDIDATES}:fp32-variance")] == ["fp32-variance"]


def test_an_unknown_name_is_refused_with_the_names_the_file_has():
    with pytest.raises(TdiffError, match="no patch named 'nope' in the file; it has fp32-variance, "):
        patches_from(f"{CANDIDATES}:nope")
    with pytest.raises(TdiffError, match="name at least one patch"):
        patches_from(f"{CANDIDATES}:")
