"""tdiff's subprocess bootstrap.

`tdiff capture` and `tdiff patch apply` put this folder first on PYTHONPATH, so every Python
process the command starts (SGLang's scheduler processes, torchrun's ranks) imports this file at
start-up and activates what the environment asks for. Another sitecustomize further down the
path still runs afterwards.
"""

import os
import sys


def _activate():
    try:
        from tdiff.child_startup import activate_from_env

        activate_from_env()
    except Exception as exc:  # noqa: BLE001 - never break the user's process at start-up
        print(f"tdiff: bootstrap failed in {sys.argv[:1]}: {exc}", file=sys.stderr)


def _chain_next_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_activate()
_chain_next_sitecustomize()
