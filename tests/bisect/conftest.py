import pytest


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's process groups for one rank (gloo, CPU), torn down after the module."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.stacks import megatron

    megatron.init_megatron()
    yield megatron
    # later tests in this process expect no process group (ranks then come from $RANK)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
