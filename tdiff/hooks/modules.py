"""Describe each recorded module once: its class, its scalar settings and (``--params``) its
parameters, for bisect's exact-reference replay (tdiff.store.modules says the format).

Settings are the module's own public scalar and enum attributes (``variance_epsilon``, ``eps``,
``base``, ``rotary_dim``, ``is_neox_style``, ``approximate``, ``attn_mask_type``...: whatever names
its framework gives them)
and the few of its ``config`` that a canonical op reads (RoPE theta and type, norm epsilons).
"""

from __future__ import annotations

import enum
import errno
import io
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from tdiff.store.dtypes import dtype_name, to_bytes_view
from tdiff.store.fingerprint import xxh3_fingerprint
from tdiff.store.modules import MODULES_DIR, PARAMS_DIR, param_file

# What a module's ``config`` (transformers' PretrainedConfig, megatron's TransformerConfig) says
# that its canonical op needs: RoPE's theta, type and scaling, the norm's epsilon.
_CONFIG_SETTINGS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_base", "rotary_percent",
                    "rms_norm_eps", "layer_norm_eps", "layernorm_epsilon", "normalization", "head_dim",
                    "hidden_act")
_SCALARS = (bool, int, float, str)


def module_settings(module: torch.nn.Module) -> dict:
    """The scalar settings of ``module`` (see the module docstring)."""
    settings = {name: _json_scalar(value) for name, value in vars(module).items()
                if not name.startswith("_") and name != "training" and _is_setting(value)}
    config = getattr(module, "config", None)
    if config is not None:
        for name in _CONFIG_SETTINGS:
            value = getattr(config, name, None)
            if isinstance(value, _SCALARS):
                settings[f"config.{name}"] = _json_scalar(value)
            elif isinstance(value, dict):
                settings.update({f"config.{name}.{key}": _json_scalar(item) for key, item in value.items()
                                 if isinstance(item, _SCALARS)})
    return settings


def _is_setting(value) -> bool:
    """A scalar or None, an enum member, or a short tuple of scalars (torch's ``normalized_shape``)."""
    if value is None or isinstance(value, (*_SCALARS, enum.Enum)):
        return True   # (None too: torch's RMSNorm eps=None means the dtype's epsilon)
    return isinstance(value, tuple) and len(value) <= 8 and all(isinstance(item, _SCALARS) for item in value)


def _json_scalar(value):
    """JSON holds no NaN or infinity: those are written as their names; an enum member
    (Megatron's ``AttnMaskType.causal``) as its name."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple):
        return [_json_scalar(item) for item in value]
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


class ModuleDescriber:
    """Writes ``modules/<part>.jsonl`` for one process (a forked child's part gets its own file)
    and, with ``params``, each parameter's bytes once per dump.

    The file stays open for its part, unbuffered (nothing buffered that a fork could write twice),
    so a capture's first forward does not pay an open, a mkdir and a close for each of its hundreds
    of modules. Threads running models describe one at a time."""

    def __init__(self, root: Path, params: bool, note: Callable[[str], None]):
        self.root = Path(root)
        self.params = params
        self._note = note            # says in the dump what could not be written
        self._failed = False
        self._finished = False       # the capture ended: nothing more is described
        self._part: str | None = None
        self._file: io.FileIO | None = None   # the part's file, once a module of it is described
        self._lock = threading.RLock()
        self._described: set[tuple[int, str]] = set()

    def describe(self, module: torch.nn.Module, path: str, rank: int, part: str) -> None:
        """Describe ``module`` (called at each recorded call; writes at its first)."""
        with self._lock:
            if self._finished:
                return
            if part != self._part:   # the capture's first record, or a forked child's
                self._close_file()
                self._part, self._described = part, set()
            key = (rank, path)
            if key in self._described or self._failed:
                return
            self._described.add(key)
            try:
                self._write(module, path, rank, part)
            except OSError as exc:   # the captured program must not fail for it: the dump says so
                self._failed = True
                self._note(f"module descriptions (and --params) stop at `{path or '(model)'}`: cannot write "
                           f"them ({exc.strerror or exc}); bisect cannot replay the culprit's op")

    def finish(self) -> None:
        """The capture's end: close the part's file; nothing more is described."""
        with self._lock:
            self._finished = True
            self._close_file()

    def after_fork_in_child(self) -> None:
        """A fork may have copied the lock while another thread held it: the child's is its own.
        (Its first description opens the child part's file and drops the inherited one.)"""
        self._lock = threading.RLock()

    def _close_file(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass   # unbuffered: every line written was written (or failed, and said so) already

    def _write(self, module: torch.nn.Module, path: str, rank: int, part: str) -> None:
        cls = type(module)
        line = {"module": path, "rank": rank, "class": cls.__name__, "class_path": f"{cls.__module__}:{cls.__qualname__}",
                "settings": module_settings(module)}
        if self.params:
            buffers = {name for name, _ in module.named_buffers(recurse=False)}
            line["params"] = {name: {**self._store(tensor), **({"buffer": True} if name in buffers else {})}
                              for name, tensor in _own_tensors(module)}
        if self._file is None:
            folder = self.root / MODULES_DIR
            folder.mkdir(exist_ok=True)
            self._file = open(folder / f"{part}.jsonl", "ab", buffering=0)  # noqa: SIM115 - open for the part
        data = memoryview((json.dumps(line) + "\n").encode())
        while data:   # an unbuffered write may take part of the line (a full disk raises OSError)
            written = self._file.write(data)
            if not written:
                raise OSError(errno.EIO, "the file took none of the line")
            data = data[written:]

    def _store(self, tensor: torch.Tensor) -> dict:
        """Store a parameter's bytes under its fingerprint unless the dump holds them already."""
        host = tensor.detach().to("cpu").contiguous()
        fingerprint = xxh3_fingerprint(host)
        folder = self.root / MODULES_DIR / PARAMS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / param_file(fingerprint)
        if not target.exists():
            temporary = folder / f".{target.name}.{os.getpid()}.tmp"
            temporary.write_bytes(to_bytes_view(host).numpy().tobytes())
            os.replace(temporary, target)   # atomic: another process may store the same bytes
        return {"fingerprint": fingerprint, "dtype": dtype_name(host.dtype), "shape": list(host.shape)}


def _own_tensors(module: torch.nn.Module):
    """The module's own parameters and buffers (not its children's), where they have values."""
    for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        if tensor is not None and tensor.device.type != "meta" and not tensor.is_quantized:
            yield name, tensor
