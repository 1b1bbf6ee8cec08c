"""Several processes (ranks) capturing into one dump directory at once."""

import multiprocessing as mp
import os

import torch

from tdiff.store import open_dump


def capture_rank(out, rank, barrier):
    import tdiff

    os.environ["RANK"] = str(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    barrier.wait()  # all ranks create the dump and write their parts at the same moment
    with tdiff.capture(out, side="ranks", shard_bytes=4096):
        for step in range(5):
            model(torch.full((8, 16), float(rank + step)))
            tdiff.dump("marker", torch.tensor([rank, step]))


def test_ranks_writing_into_one_directory_clobber_nothing(tmp_path):
    ranks = 4
    context = mp.get_context("spawn")
    barrier = context.Barrier(ranks)
    processes = [context.Process(target=capture_rank, args=(tmp_path / "d", r, barrier)) for r in range(ranks)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    dump = open_dump(tmp_path / "d")
    assert dump.complete and len(dump.parts) == ranks
    per_rank = {r: [rec for rec in dump.records if rec.rank == r] for r in range(ranks)}
    counts = {r: len(records) for r, records in per_rank.items()}
    assert len(set(counts.values())) == 1 and counts[0] == 5 * (2 * 4 + 1)  # 4 modules in/out + marker
    shard_files = {rec.file for rec in dump.records}
    assert len(shard_files) > ranks  # small shards: each rank wrote several
    for rank, records in per_rank.items():
        markers = [dump.load(r).tolist() for r in records if r.name == "marker"]
        assert markers == [[rank, step] for step in range(5)]
        first_input = next(r for r in records if r.role == "input")
        assert float(dump.load(first_input)[0, 0]) == float(rank)
