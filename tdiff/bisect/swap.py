"""Cross-framework op swap, offline from two dumps: each side's implementation of the culprit
run on the other side's recorded inputs ("SGLang's RMSNorm on Megatron's inputs gives Megatron's
output bitwise" tells kernel from inputs).

A side's implementation is its module rebuilt in this process from the dump's description
(tdiff.store.modules): its class imported by the path capture recorded (classes of torch,
transformers, megatron-core and SGLang only: a dump must not make bisect import any module), its scalar settings set
as attributes and its parameters and buffers (``--params``) registered, without running its
constructor (which would need the framework's whole configuration). Before it is trusted, the
rebuilt module runs on its own side's inputs and must give its own side's output bitwise: where
it does not (a forward patched on the instance, kernels this machine does not have, state its
constructor sets up), the swap says so and concludes nothing.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch

from tdiff.bisect.result import Divergence, Swap, SwapRun
from tdiff.errors import DumpError
from tdiff.store import Dump, Record
from tdiff.store.dtypes import to_bytes_view
from tdiff.store.modules import ModuleDescription, load_param, read_module_descriptions
from tdiff.vocab.nested import Nested

_VALUES = Nested(torch.Tensor, max_depth=6)
FRAMEWORKS = ("torch", "transformers", "megatron", "sglang")   # the packages whose classes a swap imports


class _Call:
    """One side's recorded call of the culprit: its module's description and tensors."""

    def __init__(self, dump: Dump, output: Record):
        self.dump = dump
        records = [r for r in dump.records if r.module == output.module and r.step == output.step
                   and r.call == output.call and r.rank == output.rank and r.part == output.part
                   and r.role in ("input", "output")]
        self.records = records
        self.description: ModuleDescription | None = read_module_descriptions(dump.path).get(
            (output.rank, output.module))

    def tensors(self, role: str) -> dict[str, torch.Tensor]:
        return {r.sub: self.dump.load(r) for r in self.records if r.role == role}


def swap_of(a: Dump, b: Dump, divergence: Divergence) -> Swap | None:
    """Side B's op on side A's inputs and side A's op on side B's; None where the culprit is not
    one module call (event ``output``)."""
    first = divergence.first
    if divergence.event != "output" or first is None or first.a is None or first.b is None:
        return None
    try:
        call_a, call_b = _Call(a, first.a), _Call(b, first.b)
        inputs_a, inputs_b = call_a.tensors("input"), call_b.tensors("input")
        outputs_a, outputs_b = call_a.tensors("output"), call_b.tensors("output")
    except DumpError as exc:
        problem = f"the culprit's tensors cannot be read: {exc}"
        return Swap(b_on_a=SwapRun.failed("B", "A", problem), a_on_b=SwapRun.failed("A", "B", problem))
    b_on_a = _run("B", call_b, inputs_b, outputs_b, "A", inputs_a, outputs_a)
    a_on_b = _run("A", call_a, inputs_a, outputs_a, "B", inputs_b, outputs_b)
    return Swap(b_on_a=b_on_a, a_on_b=a_on_b)


def _run(side: str, call: _Call, own_inputs: dict, own_outputs: dict, other: str, other_inputs: dict,
         other_outputs: dict) -> SwapRun:
    """Side ``side``'s op on side ``other``'s inputs, after checking it reproduces itself."""
    description = call.description
    if description is None or description.class_path is None:
        return SwapRun.failed(side, other, "the dump does not say the module's class path (captured by an "
                                           "older tdiff)")
    if description.params is None:
        return SwapRun.failed(side, other, "its parameters were not captured (capture both sides with --params)",
                              module_class=description.class_path)
    if [(k, v.shape) for k, v in own_inputs.items()] != [(k, v.shape) for k, v in other_inputs.items()]:
        return SwapRun.failed(side, other, "the two calls take different arguments: "
                                           f"{_signature(own_inputs)} against {_signature(other_inputs)}",
                              module_class=description.class_path)
    try:
        module = _rebuild(description, lambda name: load_param(call.dump.path, description.params[name]))  # type: ignore[index]
    except ImportError as exc:
        return SwapRun.failed(side, other, f"its framework is not importable here ({exc})",
                              module_class=description.class_path)
    except (AttributeError, TypeError, ValueError, RuntimeError, DumpError) as exc:
        return SwapRun.failed(side, other, f"it cannot be rebuilt from the dump ({type(exc).__name__}: {exc})",
                              module_class=description.class_path)
    own = _call(module, own_inputs)
    if not isinstance(own, dict) or not _equal(own, own_outputs):
        why = own if isinstance(own, str) else "it gives another output"
        return SwapRun.failed(side, other, f"rebuilt here, it does not reproduce its own output on its own inputs "
                                           f"({why}): a forward patched on the instance, kernels this machine "
                                           "lacks, or state its constructor sets up", module_class=description.class_path)
    swapped = _call(module, other_inputs)
    if not isinstance(swapped, dict):
        return SwapRun.failed(side, other, f"it fails on side {other}'s inputs ({swapped})",
                              module_class=description.class_path)
    return SwapRun(side=side.lower(), on=other.lower(), module_class=description.class_path,
                   equals_own=_equal(swapped, own_outputs), equals_other=_equal(swapped, other_outputs), problem=None)


def _rebuild(description: ModuleDescription, load: Callable[[str], torch.Tensor]) -> torch.nn.Module:
    assert description.class_path is not None
    module_name, _, qualname = description.class_path.partition(":")
    if module_name.partition(".")[0] not in FRAMEWORKS:
        # a dump names the class: importing any module it names would run that module's code
        raise TypeError(f"{description.class_path} is not a class of {', '.join(FRAMEWORKS)}: a swap imports "
                        "only those")
    cls = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"{description.class_path} is not a torch.nn.Module")
    settings = {name: tuple(value) if isinstance(value, list) else value
                for name, value in description.settings.items() if "." not in name}
    module = _constructed(cls, settings)
    if module is None:
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
    for name, value in settings.items():
        if "." not in name:
            setattr(module, name, value)
    for name, entry in (description.params or {}).items():
        tensor = load(name)
        if entry.buffer:
            module.register_buffer(name, tensor)
        else:
            module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    return module


def _constructed(cls: type, settings: dict) -> torch.nn.Module | None:
    """``cls`` built by its constructor from the recorded settings its parameters are named after
    (SGLang's ops pick their forward there), or None where it needs an argument the dump does not
    hold, or fails: the module is then assembled without it."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return None
    arguments = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name in settings:
            arguments[parameter.name] = settings[parameter.name]
        elif parameter.default is parameter.empty:
            return None
    try:
        module = cls(**arguments)
    except Exception:  # noqa: BLE001 - a framework's constructor may want its whole runtime set up
        return None
    return module if isinstance(module, torch.nn.Module) else None


def _call(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | str:
    """The module's outputs by sub-name on ``inputs`` (positional where named by position), or
    why it could not run."""
    if any("." in sub for sub in inputs):
        return "its inputs are nested values, which a swap does not rebuild"
    positional = sorted((int(sub), t) for sub, t in inputs.items() if sub.isdigit())
    if [i for i, _ in positional] != list(range(len(positional))):
        return "a positional argument was not a tensor (not recorded)"
    kwargs = {sub: t.clone() for sub, t in inputs.items() if not sub.isdigit()}
    try:
        with torch.no_grad():
            output = module(*(t.clone() for _, t in positional), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the other framework's code, on inputs it may not take
        return f"{type(exc).__name__}: {exc}"
    if isinstance(output, torch.Tensor):
        return {"": output}
    return dict(_VALUES.leaves(output))


def _equal(got: dict[str, torch.Tensor], recorded: dict[str, torch.Tensor]) -> bool:
    """Bitwise equal, output by output (NaNs of the same bits included)."""
    if list(got) != list(recorded):
        return False
    for sub, value in got.items():
        other = recorded[sub]
        if value.dtype != other.dtype or value.shape != other.shape:
            return False
        if not torch.equal(to_bytes_view(value), to_bytes_view(other)):
            return False
    return True


def _signature(inputs: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{sub or '0'} {list(t.shape)}" for sub, t in inputs.items()) or "no tensors"
