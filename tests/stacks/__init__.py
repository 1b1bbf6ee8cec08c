"""Real frameworks on this CPU, for tests: megatron-core and SGLang's model classes.

Each module sets its framework up once per process (torch.distributed with gloo, world size 1
unless asked otherwise). See ../shared/notes/cpu-stacks.md for why each step is needed.
"""
