"""Module descriptions: what capture recorded of each module it recorded calls of.

``modules/<part>.jsonl`` holds one line per (rank, module path) a process recorded, written at
the module's first recorded call: its class, its scalar settings (``eps``, ``variance_epsilon``,
RoPE ``base``, and a few of its ``config``'s, as ``config.rope_theta``) and, when the capture ran
with ``--params``, its own parameters and buffers (``recurse=False``) by fingerprint. Each
parameter's bytes are stored once per dump, in ``modules/params/<hex>.bin``, named by its XXH3
fingerprint (dtype, shape and bytes): layers that share a tensor, and processes that hold the
same one, store it once. Bisect's exact-reference replay (tdiff.bisect.cause) reads them.

    {"module": "model.layers.1.post_attention_layernorm", "rank": 0, "class": "Qwen2RMSNorm",
     "class_path": "transformers.models.qwen2.modeling_qwen2:Qwen2RMSNorm",
     "settings": {"variance_epsilon": 1e-06},
     "params": {"weight": {"fingerprint": "xxh3:…", "dtype": "bfloat16", "shape": [64]}}}

``params`` is absent where parameters were not captured (no ``--params``); a buffer's entry
carries ``"buffer": true``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from tdiff.errors import DumpError
from tdiff.store.files import MAX_MANIFEST_LINE, read_regular

if TYPE_CHECKING:
    import torch

MODULES_DIR = "modules"
PARAMS_DIR = "params"   # inside MODULES_DIR


def param_file(fingerprint: str) -> str:
    """The file name (in ``modules/params/``) of the parameter with this XXH3 fingerprint."""
    algorithm, _, digest = fingerprint.partition(":")
    if algorithm != "xxh3" or not digest.isalnum():
        raise DumpError(f"parameter fingerprint {fingerprint!r} is not an XXH3 fingerprint")
    return f"{digest}.bin"


@dataclass(frozen=True)
class ParamEntry:
    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    buffer: bool = False      # a buffer (``register_buffer``), not a parameter


@dataclass(frozen=True)
class ModuleDescription:
    module: str
    rank: int
    module_class: str
    settings: dict
    params: dict[str, ParamEntry] | None   # None: the capture did not store parameters
    class_path: str | None = None           # "package.module:Class" (None in older dumps)

    @classmethod
    def from_json(cls, data: object, where: str) -> ModuleDescription:
        try:
            assert isinstance(data, dict)
            params = data.get("params")
            entries = None if params is None else {
                name: ParamEntry(str(p["fingerprint"]), str(p["dtype"]), tuple(int(n) for n in p["shape"]),
                                 bool(p.get("buffer", False)))
                for name, p in params.items()}
            settings = data.get("settings", {})
            assert isinstance(settings, dict)
            class_path = data.get("class_path")
            return cls(module=str(data["module"]), rank=int(data["rank"]), module_class=str(data["class"]),
                       settings=settings, params=entries, class_path=str(class_path) if class_path else None)
        except (AssertionError, KeyError, TypeError, ValueError, AttributeError):
            raise DumpError(f"{where}: not a module description") from None


def read_module_descriptions(dump_path: Path) -> dict[tuple[int, str], ModuleDescription]:
    """Every module description of the dump at ``dump_path``, by (rank, module path); empty for
    dumps captured before descriptions existed."""
    folder = Path(dump_path) / MODULES_DIR
    if not folder.is_dir():
        return {}
    found: dict[tuple[int, str], ModuleDescription] = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix == ".jsonl"):
        text = read_regular(path, "module descriptions", limit=MAX_MANIFEST_LINE).decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                if number == len(text.splitlines()):
                    continue  # a last line cut short by a process that was killed
                raise DumpError(f"{path}:{number}: not valid JSON") from None
            description = ModuleDescription.from_json(data, f"{path}:{number}")
            found.setdefault((description.rank, description.module), description)
    return found


def load_param(dump_path: Path, entry: ParamEntry) -> torch.Tensor:
    """A stored parameter, checked against its fingerprint."""
    import torch  # (here: `tdiff capture --help` reads this module's constants without torch)

    from tdiff.store.dtypes import from_bytes_view, stored_nbytes
    from tdiff.store.fingerprint import xxh3_fingerprint

    path = Path(dump_path) / MODULES_DIR / PARAMS_DIR / param_file(entry.fingerprint)
    if not path.is_file():
        raise DumpError(f"{path}: parameter file missing")
    expected = stored_nbytes(entry.dtype, entry.shape)
    raw = read_regular(path, "parameter file", limit=expected)
    if len(raw) != expected:
        raise DumpError(f"{path}: holds {len(raw)} bytes, not the {entry.dtype}{list(entry.shape)} it stands for")
    tensor = from_bytes_view(torch.frombuffer(bytearray(raw), dtype=torch.uint8), entry.dtype, entry.shape)
    if xxh3_fingerprint(tensor) != entry.fingerprint:
        raise DumpError(f"{path}: does not match its fingerprint: the file is corrupted")
    return tensor
