"""`torchrun ... -m tdiff bisect` over two torchrun groups standing for two nodes (gloo, CPU): the
ranks' event streams are dealt over the processes, and rank 0 prints the single-process answer
byte for byte (the culprit, the trail and how many events were compared), the others nothing;
rank 0's stderr says what each process compared, which shows each walked its own ranks' streams."""

import json

import pytest
from click.testing import CliRunner

from tdiff.cli import cli
from tests.compare.test_distributed import shares, two_nodes
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
    processes = shares(outputs[0].stderr)
    assert sorted(processes) == [0, 1, 2, 3], outputs[0].stderr
    dealt = [p["dealt"] for p in processes.values()]
    assert set().union(*dealt) == set(range(8)) and sum(map(len, dealt)) == 8   # each rank to one process
    # the split is real: each process walked its own ranks' streams only, and all of them together
    # compared the events one process compares
    assert all(p["dealt"] and p["compared_ranks"] == p["dealt"] for p in processes.values())
    assert sum(p["compared"] for p in processes.values()) == json.loads(single.stdout)["checked"]
    # equal fingerprints settle matches unread: the planted rank's process alone read tensors, of rank 5
    assert {n: p["read_ranks"] for n, p in processes.items() if p["read"]} == \
        {n: {5} for n, p in processes.items() if 5 in p["dealt"]}


@pytest.mark.slow
def test_two_nodes_match_an_honest_pair_with_every_event_counted(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b")
    single = CliRunner().invoke(cli, ["bisect", str(a), str(b), "--json", "--jobs", "1"])
    assert single.exit_code == 0
    first, second = two_nodes(["bisect", str(a), str(b), "--json"])
    assert first.stdout == single.stdout and first.returncode == second.returncode == 0, first.stderr
