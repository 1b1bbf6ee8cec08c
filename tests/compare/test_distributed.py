"""`torchrun ... -m tdiff compare` over two torchrun groups standing for two nodes (gloo, CPU):
rank 0 prints the single-process JSON byte for byte, every other process prints nothing; rank 0's
stderr says what each process compared and read, which shows the work split: each process read
only the tensors of the ranks dealt to it, every rank's once."""

import os
import re
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tdiff.cli import cli
from tdiff.compare import compare_dumps
from tdiff.compare.distributed import torchrun_world
from tdiff.store import open_dump
from tests.compare.test_parallel import ranked_dump
from tests.helpers import REPO


def test_only_torchrun_makes_a_compare_distributed(monkeypatch):
    for name, value in {"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_world() is None   # a launcher's variables alone: compare alone, not waiting for peers
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert torchrun_world() == (1, 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_world() is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args: list[str], nproc_per_node: int = 2) -> list[subprocess.CompletedProcess]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "-m", "tdiff", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for node in (0, 1)]
    outputs = []
    for node in nodes:
        stdout, stderr = node.communicate(timeout=300)
        outputs.append(subprocess.CompletedProcess(node.args, node.returncode, stdout, stderr))
    return outputs


SHARE = re.compile(r"^tdiff: process (\d+) of (\d+) \(.+\) was dealt rank\(s\) (.+?): compared ([\d,]+) (?:pairs|events) "
                   r"of rank\(s\) (.+?); (?:read ([\d,]+) tensor\(s\) of rank\(s\) (.+?) \(.+ MB\)|read no tensor); "
                   r"[\d.]+ s$", re.MULTILINE)


def shares(stderr: str) -> dict[int, dict]:
    """Each process's line on rank 0's stderr: the ranks dealt to it, how many pairs (events) it
    compared and of which ranks, how many tensors it read and of which ranks."""
    def ranks(text):
        return set() if text in (None, "none") else {int(rank) for rank in text.split(", ")}

    found = {}
    for match in SHARE.finditer(stderr):
        process, processes, dealt, compared, compared_ranks, read, read_ranks = match.groups()
        found[int(process)] = {"processes": int(processes), "dealt": ranks(dealt), "compared": int(compared.replace(",", "")),
                               "compared_ranks": ranks(compared_ranks), "read": int((read or "0").replace(",", "")),
                               "read_ranks": ranks(read_ranks)}
    return found


def per_rank(values) -> dict[int, int]:
    counts: dict[int, int] = {}
    for rank, count in values:
        counts[rank] = counts.get(rank, 0) + count
    return counts


@pytest.mark.slow
def test_two_nodes_print_the_single_process_verdict_once(tmp_path):
    a = ranked_dump(tmp_path / "a")
    b = ranked_dump(tmp_path / "b", planted=(6, 1, 3))   # rank 6's pairs go to the second node
    single = CliRunner().invoke(cli, ["compare", str(a), str(b), "--json", "--jobs", "1"])
    assert single.exit_code == 1
    first, second = two_nodes(["compare", str(a), str(b), "--json"])
    assert first.stdout == single.stdout, first.stderr
    # what one process compares and reads of each rank, counted as the dumps count their loads
    dump_a, dump_b = open_dump(a), open_dump(b)
    report = compare_dumps(dump_a, dump_b, jobs=1)
    pairs = per_rank((c.record.rank, 1) for c in report.comparisons)
    reads = per_rank((rank, count) for dump in (dump_a, dump_b) for rank, (count, _) in dump.reads.snapshot().items())
    processes = shares(first.stderr)
    assert sorted(processes) == [0, 1, 2, 3] and {p["processes"] for p in processes.values()} == {4}, first.stderr
    dealt = [p["dealt"] for p in processes.values()]
    assert set().union(*dealt) == set(pairs) and sum(map(len, dealt)) == len(pairs)   # each rank to one process
    for process in processes.values():
        # the split is real: a process compared and read its own ranks' pairs and tensors, nothing else
        assert process["dealt"] and process["compared_ranks"] == process["read_ranks"] == process["dealt"]
        assert process["compared"] == sum(pairs[rank] for rank in process["dealt"])
        assert process["read"] == sum(reads[rank] for rank in process["dealt"])
    assert second.stdout == ""
    assert "tdiff: " not in second.stderr and '"tensors"' not in second.stderr   # torchrun's own lines only
    table = CliRunner().invoke(cli, ["compare", str(a), str(b), "--jobs", "1"])
    first, second = two_nodes(["compare", str(a), str(b)])
    assert first.stdout == table.stdout and second.stdout == ""


@pytest.mark.slow
def test_two_nodes_refuse_a_corrupted_dump_with_the_single_process_error(tmp_path):
    a, b = ranked_dump(tmp_path / "a"), ranked_dump(tmp_path / "b")
    shard = next((b / "data").iterdir())
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x40
    shard.write_bytes(bytes(raw))
    single = CliRunner().invoke(cli, ["compare", str(a), str(b), "--json"])
    assert single.exit_code == 2 and "does not match its fingerprint" in single.stderr
    first, second = two_nodes(["compare", str(a), str(b), "--json"])
    assert first.stderr.count("tdiff: error:") == 1 and single.stderr.strip() in first.stderr
    assert first.stdout == second.stdout == ""
