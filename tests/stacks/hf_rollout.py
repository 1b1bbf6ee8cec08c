"""examples/rollout/run.py (the README's rollout walkthrough) as a module for tests: one
implementation of the Hugging Face engine, trainer and decode-only fault, and the three dumps
the token tests share."""

import importlib.util
import sys

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("tdiff_example_rollout", REPO / "examples" / "rollout" / "run.py")
rollout = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rollout   # dataclasses look their module up
_spec.loader.exec_module(rollout)


def capture_runs(root):
    """root/engine, root/trainer (the finished sequences in the other order) and root/faulty (the
    engine with the decode-only fault) of one tiny Qwen2; returns the clean rollout."""
    from tests.helpers import tiny_qwen2

    model = tiny_qwen2()
    clean = rollout.engine(model, rollout.PROMPTS, rollout.DECODE_STEPS, root / "engine")
    rollout.trainer(model, clean.sequences[::-1], root / "trainer")
    handle = rollout.decode_only_fault(model, rollout.FAULTY)
    faulty = rollout.engine(model, rollout.PROMPTS, rollout.DECODE_STEPS, root / "faulty")
    handle.remove()
    assert faulty.sequences == clean.sequences   # the fault is small: the same tokens are sampled
    return clean
