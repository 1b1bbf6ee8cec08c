"""Read the output of SGLang's dumper (``sglang.srt.debug_utils.dumper``) as a tdiff dump.

The dumper writes one ``torch.save`` file per value, named by its tags
(``step=0___rank=0___dump_index=7___name=non_intrusive__model.layers.0.mlp.output.pt``), holding
``{"value": ..., "meta": {...}}``; older versions saved the bare tensor and kept the tags in the
file name only. Files are read with ``torch.load(weights_only=True)``: nothing but tensors and
plain containers is ever unpickled. A file that holds anything else is reported, not loaded.

Names map onto tdiff's: ``non_intrusive__<module>.inputs.<arg>[.<key>]`` and
``non_intrusive__<module>.output[.<key>]`` become module inputs and outputs, the core fields the
dumper lifts out of model inputs (``input_ids``, ``positions``, ...) inputs of the outermost model,
and every other name an explicit dump. The dumper records no module classes; the framework comes
from the parallel information it stores (``megatron_parallel_info`` / ``sglang_parallel_info``).
The calls of a module shared by the layers go to the layer id the dumper tagged them with.
"""

from __future__ import annotations

import re
import reprlib
from collections import defaultdict
from pathlib import Path

import torch

from tdiff.errors import DumpError
from tdiff.store.dtypes import dtype_name
from tdiff.store.files import check_regular
from tdiff.store.manifest import Part
from tdiff.store.record import Record
from tdiff.vocab.nested import Nested, leaf_name
from tdiff.vocab.paths import ROOT_LABEL, layer_of

FORMAT = "sglang-dumper"
_NON_INTRUSIVE = "non_intrusive__"
_MODULE_VALUE = re.compile(r"(?:(?P<module>.*?)\.)?(?P<role>inputs|output)(?:\.(?P<sub>.+))?")
_CORE_FIELDS = {"input_ids", "positions", "seq_lens", "req_pool_indices", "rids", "position_ids",
                "cu_seqlens_q", "cu_seqlens_kv", "qkv_format"}
_MAX_DEPTH = 64  # containers inside containers; real values nest a few levels
_STANDARD_TAGS = {"step", "rank", "dump_index", "name", "recompute_status"}
# dumper axis names -> tdiff's (tdiff.align.unshard.MODEL_PARALLEL_AXES)
_AXES = {"tp": "tp", "attn_tp": "tp", "ep": "ep", "moe_ep": "ep", "etp": "etp", "moe_tp": "etp"}


def find_dumper_dir(path: Path) -> Path | None:
    """The directory of dumper files at ``path``: itself, or its only experiment sub-directory."""
    if _has_dumper_files(path):
        return path
    experiments = sorted(p for p in path.iterdir() if p.is_dir() and _has_dumper_files(p))
    if len(experiments) > 1:
        names = ", ".join(p.name for p in experiments[:5])
        raise DumpError(f"{path}: holds {len(experiments)} SGLang dumper experiments ({names}); "
                        "pass one of them")
    return experiments[0] if experiments else None


def _has_dumper_files(path: Path) -> bool:
    return any("___" in p.name or p.name.startswith("name=") for p in path.glob("*.pt"))


def load_tensor(path: Path, record: Record) -> torch.Tensor:
    """One record's tensor from the dumper directory ``path`` (the reader's loader for FORMAT)."""
    if record.file is None or record.key is None:
        raise DumpError(f"{path}: {record.name} names no dumper file")
    file = path / record.file
    tensor = _DumperValue(file).leaf_at(_unwrap(_read(file, mmap=False))[0], record.key)
    if tensor is None:
        raise DumpError(f"{file}: no tensor at {record.key!r}")
    return tensor.detach().contiguous()


def index_dumper_dir(path: Path) -> tuple[dict, list[Part], list[Record], list[str]]:
    """Index every file of a dumper directory (metadata only: tensors stay on disk): the dump's
    info, parts, records and problems, as :class:`tdiff.store.reader.Dump` takes them."""
    by_rank: dict[int, list[Record]] = defaultdict(list)
    problems, skipped = [], 0
    for file in sorted(path.glob("*.pt")):
        tags = _tags_from_name(file.name)
        try:
            value, meta = _unwrap(_read(file, mmap=True))
            odd = [k for k in meta if not isinstance(k, str)]
            if odd:
                raise DumpError(f"{file}: the meta has a key {reprlib.repr(odd[0])}; tdiff reads metadata "
                                "keyed by text")
            tensors = list(_DumperValue(file).leaves(value))
        except DumpError as exc:
            problems.append(str(exc))
            continue
        tags.update(meta)
        if not tensors:
            skipped += 1          # an int, a string, None: not a tensor to compare
            continue
        for key, tensor in tensors:
            by_rank[_int(tags.get("rank"), 0)].append(_record(file.name, key, tensor, tags))
    parts = []
    for rank, records in sorted(by_rank.items()):
        records = _attribute_shared_modules(_number_calls(sorted(records, key=lambda r: (r.step, r.seq))))
        part = Part(name=f"{FORMAT}-rank{rank}", header={"format": FORMAT, "rank": rank}, records=records)
        for r in records:
            r.part = part.name
        parts.append(part)
    records = [r for part in parts for r in part.records]
    info = {"format": FORMAT, "side": path.name, "mode": "full", "storage": "torch.save",
            "skipped_values": skipped}
    return info, parts, records, problems


def _read(file: Path, *, mmap: bool):
    check_regular(file, "SGLang dumper file")  # a FIFO or /dev/zero would hang torch.load or fill memory
    try:
        return torch.load(file, weights_only=True, map_location="cpu", mmap=mmap)
    except RuntimeError as exc:
        if mmap and "mmap" in str(exc):
            return _read(file, mmap=False)  # the legacy (non-zip) torch.save format cannot be mapped
        raise DumpError(f"{file}: not readable as tensors ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - weights_only refuses arbitrary objects with many kinds of errors
        raise DumpError(f"{file}: not readable as tensors ({_first_line(exc)}); only tensors and plain "
                        "containers are loaded, never arbitrary objects") from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _unwrap(obj) -> tuple[object, dict]:
    if isinstance(obj, dict) and "value" in obj and isinstance(obj.get("meta", {}), dict):
        return obj["value"], dict(obj.get("meta") or {})
    return obj, {}


class _DumperValue(Nested[torch.Tensor]):
    """The walk of one file's value, refusing what the reader could not find again by sub-name:
    a key that is not text without dots, a value nested deeper than _MAX_DEPTH."""

    def __init__(self, file: Path):
        super().__init__(torch.Tensor, max_depth=_MAX_DEPTH)
        self.file = file

    def mapping_key(self, key: object, prefix: str) -> str:
        if not isinstance(key, str) or "." in key or not key:
            raise DumpError(f"{self.file}: the value has a key {reprlib.repr(key)} at {prefix or 'the top'}; "
                            "tdiff reads values whose keys are non-empty text without dots")
        return key

    def too_deep(self, prefix: str) -> None:
        raise DumpError(f"{self.file}: value nested deeper than {_MAX_DEPTH} levels; not one tdiff reads")


def _tags_from_name(name: str) -> dict:
    tags = {}
    for item in name.removesuffix(".pt").split("___"):
        key, sep, value = item.partition("=")
        if sep:
            tags[key] = value
    return tags


def _int(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _record(file: str, key: str, tensor: torch.Tensor, tags: dict) -> Record:
    name = str(tags.get("name", file))
    module, role, sub = "", "explicit", ""
    if name.startswith(_NON_INTRUSIVE):
        match = _MODULE_VALUE.fullmatch(name[len(_NON_INTRUSIVE):])
        if match:
            module = match.group("module") or ""
            role = "input" if match.group("role") == "inputs" else "output"
            sub = ".".join(p for p in (match.group("sub"), key) if p)
    elif name in _CORE_FIELDS:
        role, sub = "input", ".".join(p for p in (name, key) if p)
    else:
        sub = key
    base = name if role == "explicit" else (module or ROOT_LABEL)
    return Record(seq=_int(tags.get("dump_index"), 0), name=leaf_name(base, sub), module=module, role=role,
                  step=_int(tags.get("step"), 0), call=0, rank=_int(tags.get("rank"), 0),
                  dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), sub=sub,
                  device="cpu", file=file, key=key, attrs=_attrs(tags))


def _number_calls(records: list[Record]) -> list[Record]:
    """A name seen again within a step is its next call (the dumper does not count calls)."""
    seen: dict[tuple, int] = defaultdict(int)
    for r in records:
        key = (r.step, r.name, r.role)
        r.call = seen[key]
        seen[key] += 1
    return records


def _attribute_shared_modules(records: list[Record]) -> list[Record]:
    """A module whose calls in one step carry several layer ids is shared by the layers (SGLang's
    one rotary_emb, named after layer 0): each call belongs to its layer id, recorded as
    ``Record.layer`` where the module path says another layer."""
    layer_ids: dict[tuple, set] = defaultdict(set)
    for r in records:
        if r.role != "explicit":
            layer_ids[(r.step, r.module)].add(_layer_id(r))
    for r in records:
        layer = _layer_id(r)
        if r.role != "explicit" and layer is not None and len(layer_ids[(r.step, r.module)]) > 1 \
                and layer != layer_of(r.module):
            r.layer = layer
    return records


def _layer_id(record: Record) -> int | None:
    value = _int((record.attrs.get("tags") or {}).get("layer_id"), -1)
    return value if value >= 0 else None


def _attrs(tags: dict) -> dict:
    attrs: dict[str, object] = {}
    framework, info = _framework(tags)
    if framework:
        attrs["framework"] = framework
    parallel = _parallel(framework, info, tags)
    if parallel:
        attrs["parallel"] = parallel
        spec = _shard_spec(tags.get("dims"))
        if spec:
            attrs["shard"] = spec
    extra = {k: v for k, v in tags.items() if k not in _STANDARD_TAGS and not isinstance(v, (dict, list))
             and not k.endswith("_parallel_info") and k not in ("world_rank", "world_size", "tokenizer_path")}
    if extra:
        attrs["tags"] = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in extra.items()}
    return attrs


def _framework(tags: dict) -> tuple[str | None, dict]:
    """The framework whose dumper plugin reported parallel information without an error."""
    found = []
    for framework, error in (("megatron", "megatron_error"), ("sglang", "distributed_error")):
        info = tags.get(f"{framework}_parallel_info")
        if isinstance(info, dict) and info and not info.get(error):
            found.append((framework, info))
    return found[0] if len(found) == 1 else (None, {})


def _parallel(framework: str | None, info: dict, tags: dict) -> dict:
    if framework is None or _int(tags.get("world_size"), 1) <= 1 or not info:
        return {}
    keys = {"megatron": {"tp": "tp", "ep": "ep", "etp": "etp", "dp": "dp", "edp": "edp", "pp": "pp"},
            "sglang": {"tp": "tp", "moe_ep": "ep", "moe_tp": "etp", "attn_dp": "dp", "pp": "pp"}}[framework]
    out = {}
    for source, axis in keys.items():
        rank, size = info.get(f"{source}_rank"), info.get(f"{source}_size")
        if isinstance(rank, int) and isinstance(size, int):
            out[axis] = [rank, size]
    return out


def _shard_spec(dims) -> list[dict] | None:
    """The dims annotation a dumper call may carry ("t h[tp]", "t h[tp:partial]") as a shard spec."""
    if not isinstance(dims, str):
        return None
    tokens = dims.split("#")[0].split()
    spec: list[dict] = []
    for index, token in enumerate(tokens):
        match = re.fullmatch(r"[^\[]+\[(?P<mods>[^\]]+)\]", token)
        if not match:
            continue
        for modifier in match.group("mods").split(","):
            axis, _, qualifiers = modifier.strip().partition(":")
            if axis not in _AXES:
                return None            # an axis tdiff does not reassemble (cp, sp): leave it unsharded
            if "partial" in qualifiers.split("+"):
                spec.append({"axis": _AXES[axis], "reduce": "sum"})
            else:
                spec.append({"axis": _AXES[axis], "dim": index - len(tokens)})
    return spec or None
