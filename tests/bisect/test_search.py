"""The binary-search state machine: exact answers and the probe bound for every size and answer."""

import math

import pytest

from tdiff.bisect.search import BinarySearch


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 16, 17, 18, 33, 200])
def test_finds_the_first_diverging_boundary_within_the_bound(n):
    for answer in range(n + 1):  # n: nothing diverges
        search = BinarySearch(n)
        probed = []
        while (index := search.next_probe()) is not None:
            probed.append(index)
            search.record(index, diverged=index >= answer)
        assert search.result == answer
        assert search.probes == len(probed) <= math.ceil(math.log2(n + 1)) == BinarySearch.max_probes(n)
        assert len(set(probed)) == len(probed)


def test_a_probe_outside_the_candidates_is_refused():
    search = BinarySearch(4)
    search.record(1, diverged=True)
    with pytest.raises(ValueError):
        search.record(3, diverged=False)
    with pytest.raises(RuntimeError):
        _ = search.result
