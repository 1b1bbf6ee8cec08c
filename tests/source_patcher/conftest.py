import sys
import textwrap
import uuid

import pytest


@pytest.fixture
def make_module(tmp_path, monkeypatch):
    """Write a real module file and put it on sys.path; returns its (unique) name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def make(source: str, name: str | None = None) -> str:
        name = name or f"tdiff_target_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)
