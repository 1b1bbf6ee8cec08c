"""How stats mode queues small GPU tensors for the fused group kernel (tdiff.hooks.device.SummaryGroup),
the one set of rules for eager forwards and CUDA-graph captures. The kernel launch is replaced by a
list of what each launch was given: the rules need no GPU; the GPU tests (test_cuda_capture.py,
test_cuda_graphs.py) check the kernel's values."""

import pytest
import torch

from tdiff.hooks.device import SummaryGroup
from tdiff.store import device_summary


@pytest.fixture
def launches(monkeypatch):
    made = []

    def launch(tensors, table, counters, slot, partials=None):
        made.append(([t.dtype for t in tensors], table, slot, partials))

    monkeypatch.setattr(device_summary, "group_summary_into", launch)
    return made


def test_a_group_is_launched_when_full_when_the_dtype_or_table_changes_and_when_asked(launches):
    table, other, counters = torch.empty(64, 7), torch.empty(64, 7), torch.empty(64, 1)
    group = SummaryGroup()
    f32, bf16 = torch.zeros(2), torch.zeros(4, dtype=torch.bfloat16)
    slots = iter(range(64))
    for _ in range(device_summary.GROUP + 1):   # one more than a launch holds
        group.add(f32, table, counters, next(slots))
    group.add(bf16, table, counters, next(slots))      # another dtype
    group.add(bf16, other, counters, 0)                # another table
    group.launch()                                     # a module call's tensors are all queued
    group.launch()                                     # nothing left: no launch
    assert [(dtypes, t is table, slot) for dtypes, t, slot, _ in launches] == [
        ([torch.float32] * device_summary.GROUP, True, 0),
        ([torch.float32], True, device_summary.GROUP),
        ([torch.bfloat16], True, device_summary.GROUP + 1),
        ([torch.bfloat16], False, 0),
    ]


def test_a_group_takes_its_partials_from_its_first_tensor_at_its_launch(launches):
    given = []

    def partials_of(tensor):
        given.append(tensor)
        return ("partials", tensor.dtype)

    group = SummaryGroup(partials_of=partials_of)
    first, second = torch.zeros(2), torch.ones(2)
    table, counters = torch.empty(4, 7), torch.empty(4, 1)
    group.add(first, table, counters, 2)
    group.add(second, table, counters, 3)
    assert given == []   # nothing asked before the launch (the stream is the launch's)
    group.launch()
    assert given == [first] and launches[0][2:] == (2, ("partials", torch.float32))


def test_a_slot_that_does_not_follow_the_groups_last_starts_a_new_group(launches):
    """The kernel writes tensor i of a launch into slot first + i: inside a graph, copies summarised
    off the model's path may skip the slots of tensors summarised in place between them."""
    table, counters = torch.empty(16, 7), torch.empty(16, 1)
    group = SummaryGroup()
    for slot in (0, 1, 3, 4, 9):
        group.add(torch.zeros(2), table, counters, slot)
    group.launch()
    assert [(len(dtypes), slot) for dtypes, _, slot, _ in launches] == [(2, 0), (2, 3), (1, 9)]
