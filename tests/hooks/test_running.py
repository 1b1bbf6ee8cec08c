"""The running state's counting of a CUDA graph's replay (the GPU tests replay real graphs)."""

from tdiff.hooks.running import ThreadState


def test_a_graph_replay_counts_its_calls_on_from_those_made_in_the_step():
    thread = ThreadState("MainThread")
    thread.calls.update({"model": 1, "dumped": 2})
    thread.top_level_done.add(1)
    bases = thread.count_replay({"model": 1, "model.layers.0": 3}, {7})
    assert bases == {"model": 1, "model.layers.0": 0}
    assert thread.calls == {"model": 2, "dumped": 2, "model.layers.0": 3}
    assert thread.top_level_done == {1, 7}
