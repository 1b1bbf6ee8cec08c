"""Statistics and the mix64 fingerprint of a GPU tensor in one pass over its memory (Triton).

Stats mode must cost little next to the forward pass. Computed with torch ops, a tensor's
summary takes a dozen kernels and as many passes over its memory; this one kernel reads it once:
each block writes its partials, and the last block to finish folds them in block order
(deterministic) into ``[min, max, mean, abs_mean, nan, inf, digest]`` — the same values and the
same mix64 digest as :func:`tdiff.store.fingerprint.tensor_stats` and
:func:`tdiff.store.fingerprint.mix64_fingerprint_tensor` (integer sums modulo 2**64 do not depend
on their order). A tensor of one block (most of a decode step's) is written by its block
directly: a CUDA graph's replay waits for each summary in turn, and the partials' round trip, the
counter's atomic and the fold were most of a small summary's latency.

Floating and 32- and 64-bit integer tensors (position ids) whose bytes fill whole 8-byte words take
this path; others fall back to torch.
Stats mode records hundreds of small tensors a forward, where the host's cost of a launch is what
counts: :func:`group_summary_into` summarises up to :data:`GROUP` of them (a module call's inputs,
say) in one launch; a large tensor gets a launch of its own, whose loads the compiler can vectorise.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from tdiff.store.fingerprint import MIX_INCREMENT, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_WIDE = (torch.float64, torch.int64, torch.int32)  # summed in float64, as tensor_stats does
GROUP = 8  # tensors per launch of the group kernel
GROUPED_MAX_ELEMENTS = 1 << 22  # larger tensors get a launch of their own (aligned, vectorised loads)
_BLOCK = 4096
_FOLD = 1024


def _blocks(numel: int) -> int:
    """The blocks that cover ``numel`` elements. Not ``triton.cdiv``: a constexpr function in recent
    Triton, whose Python call costs ~2 us here and ~10 us on the GPU machine's host, once a tensor."""
    return -(-numel // _BLOCK)


@triton.jit
def _xorshift_right(z, shift: tl.constexpr):
    """``z ^ (z >>> shift)`` on int64 (``>>`` is arithmetic there: the mask makes it logical)."""
    return z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))


@triton.jit
def _splitmix64_finalize(z, multiplier_1, multiplier_2):
    z = _xorshift_right(z, 30) * multiplier_1
    z = _xorshift_right(z, 27) * multiplier_2
    return _xorshift_right(z, 31)


@triton.jit
def _block_summary(values, words, local, numel, nwords, accumulator: tl.constexpr,
                   increment, multiplier_1, multiplier_2, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """Block ``local`` of one tensor: its min, max, sum, sum of magnitudes (in ``accumulator``),
    NaN and inf counts and mix64 partial sum."""
    index = local.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: logits exceed 2**31 elements
    inside = index < numel
    # float32 for 16- and 32-bit floats, float64 for float64 and integers (as tensor_stats)
    x = tl.load(values + index, mask=inside, other=0).to(accumulator)
    is_nan = x != x  # noqa: PLR0124 - NaN is the one value unequal to itself (Triton's test for it)
    is_inf = (x == float("inf")) | (x == float("-inf"))
    numeric = inside & ~is_nan
    finite = numeric & ~is_inf
    kept = tl.where(finite, x, 0.0)
    word_index = local.to(tl.int64) * WORDS + tl.arange(0, WORDS)
    word_inside = word_index < nwords
    word = tl.load(words + word_index, mask=word_inside, other=0)
    key = _splitmix64_finalize((word_index + 1) * increment, multiplier_1, multiplier_2)
    mixed = _splitmix64_finalize(word ^ key, multiplier_1, multiplier_2)
    return (tl.min(tl.where(numeric, x, float("inf")), axis=0), tl.max(tl.where(numeric, x, float("-inf")), axis=0),
            tl.sum(kept, axis=0), tl.sum(tl.abs(kept), axis=0),
            tl.sum((inside & is_nan).to(tl.int64), axis=0), tl.sum((inside & is_inf).to(tl.int64), axis=0),
            tl.sum(tl.where(word_inside, mixed, 0), axis=0))


@triton.jit
def _block_partials(values, words, local, numel, nwords, partial_f, partial_i, pid,
                    increment, multiplier_1, multiplier_2, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """:func:`_block_summary` into row ``pid`` of the partials."""
    lo, hi, total, abs_total, nans, infs, digest = _block_summary(
        values, words, local, numel, nwords, partial_f.dtype.element_ty, increment, multiplier_1, multiplier_2,
        BLOCK, WORDS)
    tl.store(partial_f + pid * 4 + 0, lo)
    tl.store(partial_f + pid * 4 + 1, hi)
    tl.store(partial_f + pid * 4 + 2, total)
    tl.store(partial_f + pid * 4 + 3, abs_total)
    tl.store(partial_i + pid * 3 + 0, nans)
    tl.store(partial_i + pid * 3 + 1, infs)
    tl.store(partial_i + pid * 3 + 2, digest)


@triton.jit
def _store_summary(out_f, out_i, numel, lo, hi, total, abs_total, n_nan, n_inf, digest):
    """A tensor's summary from its totals: out_f[0:6] and the digest into out_i[6] (the same row)."""
    n_finite = tl.maximum(numel - n_nan - n_inf, 1).to(tl.float64)
    tl.store(out_f + 0, lo.to(tl.float64))
    tl.store(out_f + 1, hi.to(tl.float64))
    tl.store(out_f + 2, total.to(tl.float64) / n_finite)
    tl.store(out_f + 3, abs_total.to(tl.float64) / n_finite)
    tl.store(out_f + 4, n_nan.to(tl.float64))
    tl.store(out_f + 5, n_inf.to(tl.float64))
    tl.store(out_i + 6, digest)


@triton.jit
def _fold(partial_f, partial_i, first, blocks, numel, out_f, out_i, FOLD: tl.constexpr):
    """Fold partial rows ``first`` to ``first + blocks``, in block order, into out_f[0:6] and the
    digest into out_i[6]."""
    lo = tl.full((FOLD,), float("inf"), partial_f.dtype.element_ty)
    hi = tl.full((FOLD,), float("-inf"), partial_f.dtype.element_ty)
    total = tl.zeros((FOLD,), tl.float64)
    abs_total = tl.zeros((FOLD,), tl.float64)
    nans = tl.zeros((FOLD,), tl.int64)
    infs = tl.zeros((FOLD,), tl.int64)
    digest = tl.zeros((FOLD,), tl.int64)
    for start in range(0, blocks, FOLD):
        block = start + tl.arange(0, FOLD)
        ok = block < blocks
        row = first + block
        lo = tl.minimum(lo, tl.load(partial_f + row * 4 + 0, mask=ok, other=float("inf")))
        hi = tl.maximum(hi, tl.load(partial_f + row * 4 + 1, mask=ok, other=float("-inf")))
        total += tl.load(partial_f + row * 4 + 2, mask=ok, other=0).to(tl.float64)
        abs_total += tl.load(partial_f + row * 4 + 3, mask=ok, other=0).to(tl.float64)
        nans += tl.load(partial_i + row * 3 + 0, mask=ok, other=0)
        infs += tl.load(partial_i + row * 3 + 1, mask=ok, other=0)
        digest += tl.load(partial_i + row * 3 + 2, mask=ok, other=0)
    _store_summary(out_f, out_i, numel, tl.min(lo, axis=0), tl.max(hi, axis=0), tl.sum(total, axis=0),
                   tl.sum(abs_total, axis=0), tl.sum(nans, axis=0), tl.sum(infs, axis=0), tl.sum(digest, axis=0))


@triton.jit
def _summary_kernel(values, words, partial_f, partial_i, finished, out_f, out_i, numel, nwords,
                    increment, multiplier_1, multiplier_2,
                    BLOCK: tl.constexpr, WORDS: tl.constexpr, FOLD: tl.constexpr):
    """Each program summarises one block into the partials; the last program to finish folds
    them, in block order, into out_f[0:6] and the digest into out_i[6]."""
    pid = tl.program_id(0)
    _block_partials(values, words, pid, numel, nwords, partial_f, partial_i, pid,
                    increment, multiplier_1, multiplier_2, BLOCK, WORDS)
    blocks = tl.num_programs(0)
    # release: this program's partials are visible to whoever sees the count; acquire: the last
    # program sees everyone's
    if tl.atomic_add(finished, 1, sem="acq_rel") == blocks - 1:
        _fold(partial_f, partial_i, 0, blocks, numel, out_f, out_i, FOLD)
        tl.store(finished, 0)  # ready for the next tensor


@triton.jit
def _pick(take, new, old):
    return tl.where(take, new, old)


@triton.jit(do_not_specialize=["slot", "a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7",
                               "n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"])
def _group_summary_kernel(dtype_witness, partial_f, partial_i, finished, out_f, out_i, slot,
                          a0, a1, a2, a3, a4, a5, a6, a7, n0, n1, n2, n3, n4, n5, n6, n7,
                          increment, multiplier_1, multiplier_2, ELEMENT_BYTES: tl.constexpr,
                          BLOCK: tl.constexpr, WORDS: tl.constexpr, FOLD: tl.constexpr):
    """Up to 8 tensors of one dtype (``dtype_witness``'s) in one launch, at addresses ``a*`` with
    element counts ``n*`` (unused ones trail with count 0): the programs cover each tensor's blocks
    in turn, and the last program of each tensor folds its partials into table row ``slot + i``
    and resets counter ``slot + i``. Addresses are 64-bit integers, so the kernel compiles once per
    dtype whatever the tensors."""
    pid = tl.program_id(0)
    # which tensor this program's block belongs to: the last whose first block is <= pid
    first = pid * 0
    index = pid * 0
    address = a0
    numel = n0.to(tl.int64)
    start = tl.cdiv(n0, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 1, index), _pick(take, a1, address), \
        _pick(take, n1.to(tl.int64), numel)
    start += tl.cdiv(n1, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 2, index), _pick(take, a2, address), \
        _pick(take, n2.to(tl.int64), numel)
    start += tl.cdiv(n2, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 3, index), _pick(take, a3, address), \
        _pick(take, n3.to(tl.int64), numel)
    start += tl.cdiv(n3, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 4, index), _pick(take, a4, address), \
        _pick(take, n4.to(tl.int64), numel)
    start += tl.cdiv(n4, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 5, index), _pick(take, a5, address), \
        _pick(take, n5.to(tl.int64), numel)
    start += tl.cdiv(n5, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 6, index), _pick(take, a6, address), \
        _pick(take, n6.to(tl.int64), numel)
    start += tl.cdiv(n6, BLOCK)
    take = pid >= start
    first, index, address, numel = _pick(take, start, first), _pick(take, 7, index), _pick(take, a7, address), \
        _pick(take, n7.to(tl.int64), numel)
    values = address.to(dtype_witness.dtype)
    words = address.to(tl.pointer_type(tl.int64))
    nwords = numel * ELEMENT_BYTES // 8
    blocks = tl.cdiv(numel, BLOCK)
    row = slot + index
    if blocks == 1:  # most tensors of a decode step: no partials, no counter, no fold (latency is the cost)
        lo, hi, total, abs_total, n_nan, n_inf, digest = _block_summary(
            values, words, pid - first, numel, nwords, partial_f.dtype.element_ty, increment, multiplier_1, multiplier_2,
            BLOCK, WORDS)
        _store_summary(out_f + row * 7, out_i + row * 7, numel, lo, hi, total, abs_total, n_nan, n_inf, digest)
    else:
        _block_partials(values, words, pid - first, numel, nwords, partial_f, partial_i, pid,
                        increment, multiplier_1, multiplier_2, BLOCK, WORDS)
        if tl.atomic_add(finished + row, 1, sem="acq_rel") == blocks - 1:
            _fold(partial_f, partial_i, first, blocks, numel, out_f + row * 7, out_i + row * 7, FOLD)
            tl.store(finished + row, 0)  # ready for the next tensor


def fused_summary_supported(tensor: torch.Tensor) -> bool:
    """Whether the fused kernels take the tensor: a dtype they read, contiguous, and whole 8-byte
    words from a word boundary (stats mode asks this of every tensor: the cheap tests first)."""
    size = _ITEM_BYTES.get(tensor.dtype)
    if size is None:
        return False
    numel = tensor.numel()
    return (numel > 0 and numel * size % 8 == 0 and tensor.storage_offset() * size % 8 == 0
            and tensor.is_contiguous())


_ITEM_BYTES = {dtype: dtype.itemsize for dtype in FUSED_DTYPES}


def fused_summary_into(tensor: torch.Tensor, out: torch.Tensor, finished: torch.Tensor) -> None:
    """Write ``[min, max, mean, abs_mean, nan, inf, digest bits]`` into ``out`` (7 float64 on the
    tensor's device; the last is the int64 mix64 digest, reinterpreted): one kernel launch, no
    host synchronisation. ``finished`` is a zeroed int32 counter the kernel leaves zeroed again."""
    values = tensor.reshape(-1)
    words = values.view(torch.int64)
    blocks = _blocks(values.numel())
    partial_f = torch.empty(blocks * 4, dtype=_accumulator(tensor.dtype), device=tensor.device)
    partial_i = torch.empty(blocks * 3, dtype=torch.int64, device=tensor.device)
    _summary_kernel[(blocks,)](values, words, partial_f, partial_i, finished, out, out.view(torch.int64),
                               values.numel(), words.numel(), MIX_INCREMENT, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2,
                               BLOCK=_BLOCK, WORDS=_BLOCK * values.element_size() // 8, FOLD=_FOLD)


def group_summary_into(tensors: list[torch.Tensor], table: torch.Tensor, counters: torch.Tensor,
                       slot: int, partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`fused_summary_into` for up to :data:`GROUP` tensors of one dtype on one device, in
    one launch: tensor ``i`` into ``table[slot + i]``, with counter ``counters[slot + i]``. Each
    tensor must pass :func:`fused_summary_supported`.

    Stats mode launches this once or twice per module call, so a launch's host time is what
    counts: the kernel is compiled once per device and dtype (its arguments are 64-bit addresses
    and integers it does not specialise on, so the kernel compiled first fits every later launch),
    later launches go to the compiled kernel directly, past the JIT's and the runner's per-launch
    Python, and its partials live in a buffer kept per stream, or in ``partials``
    (:func:`new_partials`: a CUDA graph's own, as its replays may run on any stream)."""
    first = tensors[0]
    device = first.device
    blocks = sum(_blocks(t.numel()) for t in tensors) if len(tensors) > 1 else _blocks(first.numel())
    unused = GROUP - len(tensors)
    stream = _current_stream(device.index)
    values = (slot, *(t.data_ptr() for t in tensors), *([first.data_ptr()] * unused),
              *(t.numel() for t in tensors), *([0] * unused), MIX_INCREMENT, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2)
    key = (device.index, table.data_ptr(), counters.data_ptr(), first.dtype, stream,
           *((partials[0].data_ptr(), partials[1].data_ptr()) if partials is not None else (0, 0)))
    launch = _launches.get(key)
    if launch is None:
        launch = _first_launch(first, table, counters, stream, blocks, values, key, partials)
        if launch is None:
            return  # this launch compiled the kernel, and ran it
    compiled, hooked, head, constants = launch
    if hooked:  # a profiler's launch hooks want each launch's metadata: the runner computes it
        compiled[(blocks, 1, 1)](*head, *values, *constants)
    else:
        compiled.run(blocks, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *head, *values, *constants)


def _first_launch(first: torch.Tensor, table: torch.Tensor, counters: torch.Tensor, stream: int, blocks: int,
                  values: tuple, key: tuple, partials: tuple[torch.Tensor, torch.Tensor] | None) -> tuple | None:
    """What every later launch on this table, counters, dtype, stream and partials (``key``) passes the
    compiled kernel before and after its tensors' addresses and sizes (worked out once: a launch's host
    time is what counts); None when the kernel was not compiled yet: this launch compiled and ran it."""
    device = first.device
    element = first.element_size()
    partial_f, partial_i = partials or _partials(device, stream, first.dtype)
    constants = (element, _BLOCK, _BLOCK * element // 8, _FOLD)  # ELEMENT_BYTES, BLOCK, WORDS, FOLD
    key = (device, first.dtype)
    found = _compiled_group_kernels.get(key)
    if found is None:  # the first launch compiles: the JIT learns each pointer's type from a tensor
        compiled = _group_summary_kernel[(blocks,)](
            _dtype_witness(first), partial_f, partial_i, counters, table, table.view(torch.int64), *values,
            **dict(zip(("ELEMENT_BYTES", "BLOCK", "WORDS", "FOLD"), constants)))
        _compiled_group_kernels[key] = (compiled, _launch_hooks_installed())
        return None
    compiled, hooked = found
    # later launches pass addresses as integers: the launcher then skips its per-pointer driver query
    table_address = table.data_ptr()
    head = (_dtype_witness(first).data_ptr(), partial_f.data_ptr(), partial_i.data_ptr(), counters.data_ptr(),
            table_address, table_address)
    launch = _launches[key] = (compiled, hooked, head, constants)
    return launch


def group_kernel_compiled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the group kernel for ``dtype`` on ``device`` (a tensor's own device, with its index) is
    compiled and loaded: inside a CUDA graph's capture only such a kernel may be launched."""
    return (device, dtype) in _compiled_group_kernels


def compile_group_kernels(device: torch.device) -> None:
    """Compile and load the group kernel for every dtype it reads, on the current stream of ``device``
    (with its index; before a CUDA graph's capture: a kernel compiled or loaded inside one would break it)."""
    for dtype in FUSED_DTYPES:
        if group_kernel_compiled(device, dtype):
            continue
        witness = torch.zeros(8 // dtype.itemsize, dtype=dtype, device=device)  # one 8-byte word
        table = torch.empty(1, 7, dtype=torch.float64, device=device)
        group_summary_into([witness], table, torch.zeros(1, 1, dtype=torch.int32, device=device), 0)


def new_partials(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials for :func:`group_summary_into` of tensors of ``dtype``: room for a group of
    :data:`GROUP` tensors of :data:`GROUPED_MAX_ELEMENTS`, or one of ``GROUP`` times that."""
    return (torch.empty(_MAX_GROUP_BLOCKS * 4, dtype=_accumulator(dtype), device=device),
            torch.empty(_MAX_GROUP_BLOCKS * 3, dtype=torch.int64, device=device))


def _launch_hooks_installed() -> bool:
    """Whether a profiler hooks Triton's launches (a chain of hooks in recent Triton, never None
    but usually empty; one callable in older ones). Read when the kernel is compiled, off the
    launches' path: a profiler attached later does not see tdiff's own summaries."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)


_compiled_group_kernels: dict[tuple, tuple[Any, bool]] = {}  # CompiledKernel, launch hooks installed
_dtype_witnesses: dict[tuple, torch.Tensor] = {}
_partial_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# (device, table address, counters' address, dtype, stream, given partials' two addresses or 0, 0) -> what
# _first_launch worked out; keyed by the addresses, so a table, counters or partials allocated later
# where freed ones were never meet stale ones
_launches: dict[tuple, tuple] = {}
_MAX_GROUP_BLOCKS = GROUP * _blocks(GROUPED_MAX_ELEMENTS)


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def _partials(device: torch.device, stream: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The group kernel's partials on this stream: launches on one stream run one after the other
    and may share them; launches on two streams may overlap and must not. (Torch hands streams out
    of a fixed pool per device, so there are few of these.)"""
    key = (device, stream, _accumulator(dtype))
    found = _partial_buffers.get(key)
    if found is None:
        found = _partial_buffers[key] = new_partials(device, dtype)
    return found


def _dtype_witness(tensor: torch.Tensor) -> torch.Tensor:
    """A one-element tensor of the tensor's dtype on its device: tells the group kernel the dtype
    to read at its addresses, always with the same (allocator) alignment."""
    key = (tensor.device, tensor.dtype)
    witness = _dtype_witnesses.get(key)
    if witness is None:
        witness = _dtype_witnesses[key] = torch.zeros(1, dtype=tensor.dtype, device=tensor.device)
    return witness


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in _WIDE else torch.float32


def fused_summary(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty(7, dtype=torch.float64, device=tensor.device)
    fused_summary_into(tensor, out, torch.zeros(1, dtype=torch.int32, device=tensor.device))
    return out
