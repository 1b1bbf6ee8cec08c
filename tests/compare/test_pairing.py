from tdiff.compare.pairing import merge_in_order


def merge(a, b):
    return merge_in_order(a, b, key=lambda x: x.rstrip("'"), make=lambda x, y: (x, y))


def test_pairs_follow_side_a_and_b_only_items_follow_their_predecessor():
    assert merge(["x", "y", "z"], ["x'", "w'", "z'"]) == [("x", "x'"), (None, "w'"), ("y", None), ("z", "z'")]


def test_b_only_items_before_any_pair_lead():
    assert merge(["x"], ["v'", "x'"]) == [(None, "v'"), ("x", "x'")]


def test_repeated_keys_pair_in_order():
    assert merge(["x", "x"], ["x'", "x'"]) == [("x", "x'"), ("x", "x'")]
