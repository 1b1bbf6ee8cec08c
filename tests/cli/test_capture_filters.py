"""A capture filter that matches no module (--layers on a model without decoder layers, a --select
that names nothing) is said at capture's end; nothing recorded at all is exit 2, naming it."""

import sys

from tests.helpers import tdiff_cli

NO_LAYERS = ("import torch, tdiff; model = torch.nn.Sequential(torch.nn.Linear(2, 2)); x = model(torch.ones(1, 2))"
             "; tdiff.dump('logprobs', x)")
NOTHING = "import torch; model = torch.nn.Sequential(torch.nn.Linear(2, 2)); model(torch.ones(1, 2))"


def test_layers_that_match_no_module_are_said_with_what_was_recorded(tmp_path):
    result = tdiff_cli("capture", "--out", tmp_path / "d", "--layers", "0-1", "-q", "--", sys.executable, "-c",
                       NO_LAYERS, expect=0)
    assert "tdiff: warning: --layers 0-1 matched no module; recorded 1 explicit dump(s)" in result.stderr
    unfiltered = tdiff_cli("capture", "--out", tmp_path / "e", "-q", "--", sys.executable, "-c", NO_LAYERS, expect=0)
    assert "matched no module" not in unfiltered.stderr


def test_a_filter_that_leaves_nothing_recorded_is_exit_2_naming_it(tmp_path):
    result = tdiff_cli("capture", "--out", tmp_path / "d", "--select", "^nothing$", "--", sys.executable, "-c",
                       NOTHING)
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tdiff: error: --select ^nothing$ matched no module and nothing else was recorded")


def test_the_python_capture_says_a_filter_that_matched_no_module(tmp_path):
    import pytest
    import torch

    import tdiff
    from tdiff.store import open_dump

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with (pytest.warns(UserWarning, match=r"layers='0-1' matched no module; recorded 1 explicit dump\(s\)"),
          tdiff.capture(tmp_path / "d", layers="0-1")):
        tdiff.dump("logprobs", model(torch.ones(1, 2)))
    assert any("matched no module" in note for note in open_dump(tmp_path / "d").notes)
    with (pytest.warns(UserWarning, match=r"select=\['\^nothing\$'\] and layers='0-1' matched no module; recorded 0"),
          tdiff.capture(tmp_path / "e", layers="0-1", select=["^nothing$"])):
        model(torch.ones(1, 2))


def test_the_python_capture_says_nothing_when_its_filter_matched_a_module(tmp_path, recwarn):
    import torch

    import tdiff

    with tdiff.capture(tmp_path / "d", select=["^0$"]):
        torch.nn.Sequential(torch.nn.Linear(2, 2))(torch.ones(1, 2))
    assert not [w for w in recwarn if "matched no module" in str(w.message)]
