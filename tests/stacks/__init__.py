"""Real frameworks on this CPU, for tests: megatron-core and SGLang's model classes.

Each module sets its framework up once per process (torch.distributed with gloo, world size 1
unless asked otherwise). See ../shared/notes/cpu-stacks.md for why each step is needed.
"""


def free_port() -> int:
    """A TCP port nobody listens on now, for a single process's torch.distributed rendezvous."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
