"""tdiff: find the first op where two runs of the same model part numerically.

    with tdiff.capture("dumps/a", side="a"):
        model(input_ids)
        tdiff.dump("logprobs", logprobs)

``import tdiff`` stays light (no torch) so that the subprocess bootstrap and the CLI start fast;
the capture API is loaded on first use.
"""

from tdiff.errors import DumpError, TdiffError
from tdiff.version import __version__

_CAPTURE_API = ("capture", "dump", "tokens", "step", "warmup", "graph_rows", "graph_replayed")
__all__ = ["__version__", *_CAPTURE_API, "TdiffError", "DumpError"]  # noqa: PLE0604 - strings, listed once above


def __getattr__(name):
    if name in _CAPTURE_API:
        from tdiff import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module 'tdiff' has no attribute {name!r}")
