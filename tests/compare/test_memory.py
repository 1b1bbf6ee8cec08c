"""compare's peak memory on several cores (issue 32): at most the largest tensor pair + 512 MB
whatever --jobs, the process's own size (the interpreter, torch) and its threads' scratch counted
in, measured as the peak resident memory of a `tdiff compare` process."""

import subprocess
import sys
import threading
from unittest import mock

import torch

import tdiff
from tdiff.compare import metrics
from tdiff.compare.metrics import EXACT, WORKSPACE_BYTES, Tolerance, measure
from tdiff.compare.parallel import map_in_order
from tdiff.store import open_dump
from tdiff.store.dtypes import stored_nbytes
from tests.helpers import REPO

PEAK = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)
"""
HEADROOM = 512 << 20   # the 0.5 GB
TENSORS, ELEMENTS = 24, 4 << 20   # 16 MB a tensor: 16 pairs at once are the whole 512 MB, the process aside


def dump_of(path, moved: float):
    with tdiff.capture(path, side=path.name):
        for index in range(TENSORS):
            values = torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(index))
            tdiff.dump(f"tensor{index}", values + moved)   # B: every element differs, every metric is computed
    return path


def test_compare_on_sixteen_threads_peaks_within_the_largest_pair_and_512_mb(tmp_path):
    a, b = dump_of(tmp_path / "a", 0.0), dump_of(tmp_path / "b", 1e-3)
    largest = max(sum(stored_nbytes(r.dtype, r.shape) for r in pair)
                  for pair in zip(open_dump(a).records, open_dump(b).records))
    out = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "tdiff", "compare", str(a), str(b),
                          "--json", "--jobs", "16"], capture_output=True, text=True, cwd=REPO, check=True)
    peak, code = map(int, out.stdout.split())
    assert code == 1   # every pair differs
    assert peak <= largest + HEADROOM, f"peak {peak / 2**20:.0f} MB, largest pair {largest / 2**20:.0f} MB"


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8, torch.int32,
          torch.int64, torch.uint8, torch.bool]


def test_a_threads_scratch_stays_within_what_compare_counts_per_thread(monkeypatch):
    """The workspace of a thread that measured differing pairs of every dtype, each against its own
    dtype and against float32, under every rule and with rows, the tensors larger than a chunk."""
    sizes = []

    def measure_everything():
        for dtype in DTYPES:
            a = (torch.randn(3 * metrics.CHUNK_ELEMENTS // 8 + 5, 8) * 4).to(dtype)
            b = a.clone()
            b.view(-1)[::3] = (torch.randn(b.numel() // 3 + 1 - (b.numel() % 3 == 0)) * 4).to(dtype)
            if dtype.is_floating_point and dtype.itemsize > 1:
                b.view(-1)[5] = float("nan")
            for rule in (EXACT, Tolerance(atol=1e-3, rtol=1e-2), Tolerance(ulp=2)):
                for other in (b, b.to(torch.float32 if dtype != torch.float32 else torch.float64)):
                    for by_rows in (False, True):
                        measure(a, other, rule, by_rows=by_rows)
        sizes.append(metrics._workspace.nbytes())

    monkeypatch.setattr(metrics._Workspaces, "_idle", [])   # no workspace of earlier tests: one of its own
    thread = threading.Thread(target=measure_everything)
    thread.start()
    thread.join()
    assert sizes and 0 < sizes[0] <= WORKSPACE_BYTES, sizes


def test_a_run_of_many_threads_leaves_one_workspace_behind(monkeypatch):
    """Each thread measuring at once has a workspace of its own; once they are done, one is kept."""
    monkeypatch.setattr(metrics._Workspaces, "_idle", [])
    a = torch.randn(8, 3 * metrics.CHUNK_ELEMENTS).to(torch.float16)   # numpy's path: float16
    b = a.clone()
    b.view(-1)[::7] += 1
    with mock.patch.object(metrics, "PIECE_ELEMENTS", metrics.CHUNK_ELEMENTS):
        results = map_in_order(lambda pair: measure(*pair), [(a, b)] * 6, jobs=4)
    assert all(r.metrics.mismatched == results[0].metrics.mismatched > 0 for r in results)
    assert len(metrics._Workspaces._idle) == 1
