"""Properties of token alignment over random honest layouts of the same sequences (issue 27):
batching, ragged, padded, packed THD, reordered, chunked prefill, changing decode batches,
recompute. Honest runs always match, every token both fed compared; any single perturbed row
element of a token both fed is found at that token; swapping the runs never changes the verdict."""

import shutil
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tdiff.align import choose_pairing
from tdiff.compare import compare_dumps
from tdiff.compare.engine import unaligned_notes
from tdiff.store import open_dump
from tests.align.token_layouts import Forward, Run, capture_run


@st.composite
def sequence_sets(draw):
    count = draw(st.integers(1, 3))
    sequences, prompts = {}, {}
    for k in range(count):
        prompt = draw(st.integers(1, 4))
        tokens = draw(st.lists(st.integers(1, 4), min_size=prompt + 1, max_size=prompt + 4))
        sequences[f"r{k}"], prompts[f"r{k}"] = tokens, prompt
    return sequences, prompts


@st.composite
def layouts(draw, sequences, prompts) -> Run:
    keys = list(sequences)
    if draw(st.booleans()):   # a trainer: one forward over the finished sequences, packed or padded
        order = draw(st.permutations(keys))
        return Run(sequences, [Forward([(k, list(range(len(sequences[k])))) for k in order],
                                       padded=draw(st.booleans()), padding=draw(st.integers(0, 2)))])
    forwards = []
    chunk = draw(st.integers(1, 4))
    fed = dict.fromkeys(keys, 0)
    # the prefill, in chunks, then decode steps advancing a changing subset; never the last sample
    while any(fed[k] < len(sequences[k]) - 1 for k in keys):
        ready = [k for k in keys if fed[k] < len(sequences[k]) - 1]
        chosen = draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        feeds = []
        for key in draw(st.permutations(chosen)):
            end = min(fed[key] + chunk, prompts[key]) if fed[key] < prompts[key] else fed[key] + 1
            feeds.append((key, list(range(fed[key], end))))
            fed[key] = end
        forwards.append(Forward(feeds, padded=draw(st.booleans()), padding=draw(st.integers(0, 2))))
        if draw(st.integers(0, 5)) == 0:   # a recompute of a sequence's positions so far
            key = draw(st.sampled_from(keys))
            if fed[key]:
                forwards.append(Forward([(key, list(range(fed[key])))]))
    return Run(sequences, forwards)


def _claims(run: Run) -> Counter:
    return Counter((key, p) for forward in run.forwards for key, positions in forward.feeds for p in positions)


def _first_seen(run: Run) -> dict[str, int]:
    order: dict[str, int] = {}
    for forward in run.forwards:
        for key, _ in forward.feeds:
            order.setdefault(key, len(order))
    return order


def _verdict(path_a: Path, path_b: Path):
    a, b = open_dump(path_a), open_dump(path_b)
    report = compare_dumps(a, b, pairing=choose_pairing(a, b, align="tokens"))
    unaligned_notes(report.alignment, diverged=report.status != "match", allow_unaligned=False)  # raises if any
    return report


def _hidden(report):
    return next(c for c in report.comparisons if c.name == "hidden")


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_honest_layouts_match_comparing_every_token_both_fed_and_a_perturbed_one_is_found(data):
    sequences, prompts = data.draw(sequence_sets())
    run_a, run_b = data.draw(layouts(sequences, prompts)), data.draw(layouts(sequences, prompts))
    claims_a, claims_b = _claims(run_a), _claims(run_b)
    both = sorted(claims_a.keys() & claims_b.keys(), key=lambda t: (t[1], t[0]))
    root = Path(tempfile.mkdtemp())
    try:
        capture_run(root / "a", run_a)
        capture_run(root / "b", run_b)
        report = _verdict(root / "a", root / "b")
        assert report.status == "match"
        assert _hidden(report).tokens.compared == sum(max(claims_a[t], claims_b[t]) for t in both)
        swapped = _verdict(root / "b", root / "a")
        assert swapped.status == "match"
        assert {(s.a, s.b) for s in report.alignment.sequences} == \
            {(s.b, s.a) for s in swapped.alignment.sequences}
        # one element of one token both fed, perturbed in every claim of it on side B
        key, position = data.draw(st.sampled_from(both))
        run_b.planted[(key, position)] = data.draw(st.sampled_from([1e-3, 0.5, -2.0]))
        capture_run(root / "planted", run_b)
        for first, second in (("a", "planted"), ("planted", "a")):
            report = _verdict(root / first, root / second)
            assert report.status == "diverged"
            found = _hidden(report).tokens
            assert found.compared - found.equal == max(claims_a[(key, position)], claims_b[(key, position)])
            token = found.first_differing
            seq_a = _first_seen(run_a)[key] if first == "a" else _first_seen(run_b)[key]
            assert (token.position, token.seq_a) == (position, seq_a)
    finally:
        shutil.rmtree(root)
