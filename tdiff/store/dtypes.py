"""Torch dtypes by name, and the raw-byte views that make every dtype storable bit-exactly.

Examples:
    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    >>> raw = to_bytes_view(torch.ones(2, 3, dtype=torch.bfloat16))   # uint8, shape [12]
    >>> from_bytes_view(raw, "bfloat16", [2, 3]).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import torch

from tdiff.errors import DumpError

# Floating dtypes whose bit patterns order like sign-magnitude integers (ULP distance is defined).
FLOAT_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e4m3fnuz: torch.int8,
    torch.float8_e5m2: torch.int8,
    torch.float8_e5m2fnuz: torch.int8,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)   # capture names a tensor's dtype for every record
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


_dtype_names: dict[torch.dtype, str] = {}


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise DumpError(f"unknown dtype {name!r}: this dump was written by a newer torch; upgrade torch")
    return dtype


# Quantized tensors are stored and compared as their integer representation, their scale and zero
# point beside it (quantization_of).
QUANTIZED_REPR = {
    torch.qint8: torch.int8,
    torch.quint8: torch.uint8,
    torch.qint32: torch.int32,
    torch.quint4x2: torch.uint8,
    torch.quint2x4: torch.uint8,
}


def quantization_of(tensor: torch.Tensor) -> dict:
    """A quantized tensor's scale and zero point (per tensor, or per channel along ``axis``): what
    its integer representation means, kept in its record's attrs["quantization"]."""
    scheme = tensor.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return {"scheme": str(scheme).removeprefix("torch."), "scale": float(tensor.q_scale()),
                "zero_point": int(tensor.q_zero_point())}
    return {"scheme": str(scheme).removeprefix("torch."), "axis": int(tensor.q_per_channel_axis()),
            "scales": tensor.q_per_channel_scales().tolist(),
            "zero_points": tensor.q_per_channel_zero_points().tolist()}


def to_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    if tensor.is_quantized:
        tensor = tensor.int_repr()
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() > 1 or (flat.numel() == 1 and flat.stride(0) != 1):
        # a one-element view keeps its stride (torch.where's indices): view(uint8) needs stride 1
        flat = flat if flat.stride(0) == 1 else flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _stored_dtype(dtype: str | torch.dtype) -> torch.dtype:
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    return QUANTIZED_REPR.get(dtype, dtype)


def stored_nbytes(dtype: str | torch.dtype, shape) -> int:
    """How many bytes :func:`to_bytes_view` gives for a tensor of this dtype and shape."""
    return torch.Size(tuple(shape)).numel() * _stored_dtype(dtype).itemsize


def from_bytes_view(raw: torch.Tensor, dtype: str | torch.dtype, shape) -> torch.Tensor:
    """Rebuild a tensor from its flat uint8 bytes; the inverse of :func:`to_bytes_view`."""
    shape = tuple(shape)
    dtype = _stored_dtype(dtype)
    expected = stored_nbytes(dtype, shape)
    raw = raw.reshape(-1)
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    if raw.numel() != expected:
        raise DumpError(f"stored tensor has {raw.numel()} bytes, its record says {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # bytes mapped from a shard at any offset: kernels need aligned elements
    return raw.view(dtype).reshape(shape)
