"""`torchrun ... -m tdiff bisect` over two torchrun groups standing for two nodes (gloo, CPU): the
ranks' event streams are dealt over the processes, and rank 0 prints the single-process answer
byte for byte (the culprit, the trail and how many events were compared), the others nothing."""

import pytest
from click.testing import CliRunner

from tdiff.cli import cli
from tests.compare.test_distributed import two_nodes
from tests.compare.test_parallel import ranked_dump


@pytest.mark.slow
def test_two_nodes_name_the_single_process_culprit_once(tmp_path):
    a = ranked_dump(tmp_path / "a")
    # rank 5 is dealt to the first node's second process, which prints nothing: its finding must reach rank 0
    b = ranked_dump(tmp_path / "b", planted=(5, 1, 7))
    single = CliRunner().invoke(cli, ["bisect", str(a), str(b), "--json", "--jobs", "1"])
    assert single.exit_code == 1 and '"rank": 5' in single.stdout
    outputs = two_nodes(["bisect", str(a), str(b), "--json"])
    assert outputs[0].stdout == single.stdout, outputs[0].stderr
    assert outputs[1].stdout == ""
    assert all(node.returncode != 0 for node in outputs)   # every process exits with the verdict's status


@pytest.mark.slow
def test_two_nodes_match_an_honest_pair_with_every_event_counted(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b")
    single = CliRunner().invoke(cli, ["bisect", str(a), str(b), "--json", "--jobs", "1"])
    assert single.exit_code == 0
    first, second = two_nodes(["bisect", str(a), str(b), "--json"])
    assert first.stdout == single.stdout and first.returncode == second.returncode == 0, first.stderr
