"""A summation whose order is fixed by the shape alone: a pairwise tree of element-wise adds.

Every add is one correctly rounded element-wise operation, so a row's result depends only on that
row's values: not on the batch it sits in, the thread count, the kernel a library picks, or the
device. The last dimension is padded with zeros to a power of two and halved until one element
is left: ``((x0 + x2) + (x1 + x3))`` for four elements.

    >>> fixed_order_sum(torch.tensor([[1.0, 2.0, 3.0]]), dim=-1)
    tensor([6.])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fixed_order_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    x = x.movedim(dim, -1)
    size = x.shape[-1]
    width = 1 << max(size - 1, 0).bit_length()
    if width != size:
        x = F.pad(x, (0, width - size))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.movedim(-1, dim) if keepdim else x.squeeze(-1)


def fixed_order_mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return fixed_order_sum(x, dim, keepdim) / x.shape[dim]
