"""Tensors that are not one strided block of memory, recorded as the strided tensors they are
made of: whatever a module returns or receives, capture never breaks the program on it.

==========================  ====================================================================
tensor                      recorded as (sub-names appended to the tensor's own; docs/FORMAT.md)
==========================  ====================================================================
nested (``torch.nested``)   its constituent tensors: ``nested.0``, ``nested.1``, ...
sparse COO                  ``sparse_coo.indices``, ``sparse_coo.values`` (coalesced: one order)
sparse CSR / BSR            ``sparse_csr.crow_indices``, ``.col_indices``, ``.values`` (``sparse_bsr``)
sparse CSC / BSC            ``sparse_csc.ccol_indices``, ``.row_indices``, ``.values`` (``sparse_bsc``)
MKL-DNN (opaque)            the dense tensor it holds, under its own name
wrapper subclass            the inner tensors its ``__tensor_flatten__`` names (a DTensor's
                            ``DTensor._local_tensor``): ``<class>.<attribute>``
==========================  ====================================================================

A tensor with no values of its own (the meta device, FakeTensorMode, inside torch.func's vmap or
grad) is not recorded: :func:`unrecordable` says why, and capture notes it in the dump.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from tdiff.vocab.nested import join

_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
_MAX_NESTING = 4   # wrapper subclasses of wrapper subclasses


def strided_parts(sub: str, tensor: torch.Tensor, nesting: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(sub-name, strided tensor) for ``tensor`` named ``sub``: itself when it is an ordinary
    tensor, else the tensors it is made of (see the module's table)."""
    if tensor.layout is torch.strided and not tensor.is_nested and not _is_wrapper(tensor):
        yield sub, tensor
        return
    if nesting >= _MAX_NESTING:
        yield sub, tensor   # left to unrecordable()
        return
    if tensor.requires_grad:
        tensor = tensor.detach()
    for part, inner in _parts(tensor):
        yield from strided_parts(join(sub, part) if part else sub, inner, nesting + 1)


def _parts(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if tensor.device.type == "meta":
        return [("", tensor)]  # no values to take apart
    if tensor.is_nested:   # either layout (the jagged one is a wrapper subclass too)
        return [(f"nested.{i}", part) for i, part in enumerate(tensor.unbind())]
    if _is_wrapper(tensor):
        attributes, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]  # the subclass protocol
        kind = type(tensor).__name__
        return [(f"{kind}.{name}", getattr(tensor, name)) for name in attributes]
    layout = tensor.layout
    if layout is torch.sparse_coo:
        tensor = tensor.coalesce()
        return [("sparse_coo.indices", tensor.indices()), ("sparse_coo.values", tensor.values())]
    if layout in _COMPRESSED:
        kind = str(layout).rpartition(".")[2]
        return [(f"{kind}.{name}", getattr(tensor, name)()) for name in _COMPRESSED[layout]]
    if layout is torch._mkldnn:  # type: ignore[attr-defined]  # an opaque layout of a dense tensor
        return [("", tensor.to_dense())]
    return [("", tensor)]   # left to unrecordable()


def _is_wrapper(tensor: torch.Tensor) -> bool:
    """A tensor subclass that wraps other tensors (torch's ``__tensor_flatten__`` protocol)."""
    return type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__")


def unrecordable(tensor: torch.Tensor) -> str | None:
    """Why capture cannot record ``tensor`` (a part :func:`strided_parts` gave), None when it can."""
    if (type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_meta
            and not tensor.is_nested and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)):
        return None   # the common case, asked of every record: an ordinary tensor (no subclass is fake)
    if tensor.is_meta:
        return "tensors on the meta device hold no values"
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return "tensors inside torch.func transforms (vmap, grad) have no storage of their own"
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and isinstance(tensor, fake.FakeTensor):
        return "fake tensors (FakeTensorMode) hold no values"
    if tensor.layout is not torch.strided or tensor.is_nested or _is_wrapper(tensor):
        return f"tensors of layout {tensor.layout} ({type(tensor).__name__}) cannot be taken apart"
    return None
