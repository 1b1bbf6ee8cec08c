"""The environment of two runs, as their dumps record it: package versions, devices, dtypes.

A dump records the versions its capturing processes ran with (torch and tdiff in every manifest
part's header; other packages under a ``versions`` object of the dump or part header). A package
the dump does not record is shown with the version installed where the report is made, marked so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata

from tdiff.store import Dump
from tdiff.version import __version__

PACKAGES = ("torch", "transformers", "megatron-core", "sglang", "tdiff")


@dataclass
class SideEnvironment:
    label: str
    path: str
    versions: dict[str, str]            # recorded by the dump; missing: not recorded
    devices: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    processes: int = 0
    hosts: list[str] = field(default_factory=list)
    command: list[str] | None = None

    def to_json(self) -> dict:
        return {"label": self.label, "path": self.path, "versions": self.versions,
                "devices": dict(self.devices), "dtypes": dict(self.dtypes), "processes": self.processes,
                "hosts": self.hosts, "command": self.command}


@dataclass
class Environment:
    a: SideEnvironment
    b: SideEnvironment
    report_host: dict[str, str | None]  # versions installed where the report was made

    def to_json(self) -> dict:
        return {"a": self.a.to_json(), "b": self.b.to_json(), "report_host": self.report_host}


def environment_of(a: Dump, b: Dump) -> Environment:
    return Environment(side_environment(a), side_environment(b), installed_versions())


def side_environment(dump: Dump) -> SideEnvironment:
    seen: dict[str, list[str]] = {}
    sources = [dump.info.get("versions"), *(part.header.get("versions") for part in dump.parts),
               *({"torch": p.header.get("torch"), "tdiff": p.header.get("tdiff")} for p in dump.parts)]
    for versions in sources:
        for package, version in (versions or {}).items() if isinstance(versions, dict) else ():
            if isinstance(version, str) and version not in seen.setdefault(package, []):
                seen[package].append(version)
    command = dump.info.get("command")
    return SideEnvironment(
        label=dump.side, path=str(dump.path),
        versions={package: ", ".join(found) for package, found in seen.items() if found},
        devices=Counter(r.device for r in dump.records), dtypes=Counter(r.dtype for r in dump.records),
        processes=len(dump.parts),
        hosts=sorted({str(p.header["host"]) for p in dump.parts if p.header.get("host")}),
        command=[str(c) for c in command] if isinstance(command, list) else None)


def installed_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"tdiff": __version__}
    for package in PACKAGES[:-1]:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found
