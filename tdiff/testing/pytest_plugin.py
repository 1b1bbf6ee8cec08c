"""pytest plugin (registered through the ``pytest11`` entry point): the fixture ``tdiff_capture``.

    def test_rollout_matches_training(tdiff_capture):
        with tdiff_capture("engine", model=engine) as engine_dump:
            rollout(engine)
        with tdiff_capture("trainer") as trainer_dump:
            train_forward(trainer)
        assert_match(engine_dump, trainer_dump, select="logprobs", atol=1e-6)

Loaded by every pytest run where tdiff is installed, so importing it costs nothing: capture and
torch load when the fixture is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@pytest.fixture
def tdiff_capture(tmp_path_factory: pytest.TempPathFactory):
    """Capture a ``with`` block into a temporary dump: ``with tdiff_capture(name, **options) as
    path`` runs the block under ``tdiff.capture(path, side=name, **options)`` and gives the dump's
    directory (kept with pytest's temporary directories). Blocks run one at a time."""
    root = tmp_path_factory.mktemp("tdiff-dumps")

    @contextmanager
    def capture_block(name: str = "dump", **options) -> Iterator[Path]:
        import tdiff

        path = root / name
        if path.exists():
            raise ValueError(f"tdiff_capture: this test already captured a dump named {name!r}")
        options.setdefault("side", name)
        with tdiff.capture(path, **options):
            yield path

    return capture_block
