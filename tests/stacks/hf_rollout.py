"""examples/rollout/run.py (the README's rollout walkthrough) as a module for tests: one
implementation of the Hugging Face engine, trainer and decode-only fault."""

import importlib.util
import sys

from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("tdiff_example_rollout", REPO / "examples" / "rollout" / "run.py")
rollout = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rollout   # dataclasses look their module up
_spec.loader.exec_module(rollout)
