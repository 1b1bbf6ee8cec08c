"""Sequences match globally and symmetrically (issue 27 §3): by request id where both runs give
one, else by token ids maximising the shared prefixes; a short sample never takes a longer one's
partner; swapping the runs never changes the pairs."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tdiff.align.tokens.sequences import Sequence, match_sequences
from tests.align.token_layouts import Forward, Run, capture_run, engine, trainer
from tests.helpers import tdiff_cli


def _sequences(contents: list[list[int]], ids=None, order=None) -> list[Sequence]:
    order = order if order is not None else list(range(len(contents)))
    return [Sequence(index=k, rank=0, seq_id=ids[i] if ids else None, tokens=dict(enumerate(contents[i])))
            for k, i in enumerate(order)]


def test_a_short_sample_never_takes_a_longer_samples_partner(tmp_path):
    """The engine never feeds its last sampled token: its short sample (prompt + EOS) holds only
    the prompt, which agrees with both of the trainer's samples (the trainer gives no ids)."""
    sequences = {"short": [1, 2, 3, 0], "long": [1, 2, 3, 7, 8, 9, 0]}
    capture_run(tmp_path / "engine", engine(sequences, {k: 3 for k in sequences}, ["short", "long"]))
    capture_run(tmp_path / "trainer", Run(sequences, [Forward([(k, list(range(len(sequences[k]))))
                                                               for k in ("long", "short")], ids=False)]))
    data = json.loads(tdiff_cli("compare", tmp_path / "engine", tmp_path / "trainer", "--json", expect=0).output)
    # the engine's order: short 0, long 1; the trainer's: long 0, short 1
    assert {(s["a"], s["b"]) for s in data["alignment"]["sequences"]} == {(0, 1), (1, 0)}
    assert data["alignment"]["unmatched"] == {"a": [], "b": []}


contents = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(contents, st.data())
def test_swapping_the_runs_never_changes_the_pairs(sequences, data):
    prompt = [9, 9]
    full = [prompt + s for s in sequences]
    n = len(full)
    with_ids = data.draw(st.booleans())
    ids = [f"r{data.draw(st.integers(0, 2))}" for _ in range(n)] if with_ids else None
    order_b = data.draw(st.permutations(range(n)))
    cut = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))   # an engine lacks its last sample
    a = _sequences(full, ids)
    b = _sequences([s[:-1] if c and len(s) > 1 else s for s, c in zip(full, cut)], ids, list(order_b))
    forward = match_sequences(a, b)
    backward = match_sequences(b, a)
    assert {y: x for x, y in backward.items()} == forward
    # the same sequences both sides: every one pairs with a sequence of its own tokens
    assert len(forward) == n
    for x, y in forward.items():
        tokens_a, tokens_b = a[x].tokens, b[y].tokens
        assert all(tokens_a[p] == tokens_b[p] for p in tokens_a.keys() & tokens_b.keys())


def test_request_ids_pair_first_and_n_samples_of_one_id_pair_by_their_tokens():
    a = _sequences([[1, 2, 3], [1, 2, 4], [5, 6]], ids=["q", "q", "p"])
    b = _sequences([[5, 6], [1, 2, 4], [1, 2, 3]], ids=["p", "q", "q"])
    assert match_sequences(a, b) == {0: 2, 1: 1, 2: 0}
    assert match_sequences(b, a) == {2: 0, 1: 1, 0: 2}


def test_swapped_runs_give_the_same_verdict_end_to_end(tmp_path):
    sequences = {"r1": [1, 2, 3, 4, 5], "r2": [1, 2, 3, 6], "r3": [1, 2, 3, 4, 7]}
    capture_run(tmp_path / "e", engine(sequences, {k: 3 for k in sequences}, ["r3", "r1", "r2"],
                                       planted={("r1", 3): 0.5}))
    capture_run(tmp_path / "t", trainer(sequences, ["r2", "r1", "r3"]))
    one = json.loads(tdiff_cli("compare", tmp_path / "e", tmp_path / "t", "--json", expect=1).output)
    two = json.loads(tdiff_cli("compare", tmp_path / "t", tmp_path / "e", "--json", expect=1).output)
    first_one, first_two = (d["first_divergence"]["tokens"]["first_differing"] for d in (one, two))
    assert (first_one["seq_a"], first_one["seq_b"], first_one["position"]) == \
        (first_two["seq_b"], first_two["seq_a"], first_two["position"])
    assert {(s["a"], s["b"]) for s in one["alignment"]["sequences"]} == \
        {(s["b"], s["a"]) for s in two["alignment"]["sequences"]}
