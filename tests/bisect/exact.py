"""Exact results computed independently of tdiff.bisect.reference, to check its figures."""

import math

import torch


def nearest_bf16(exact: torch.Tensor) -> torch.Tensor:
    """Each value's nearest bfloat16 (ties to the even one), chosen among the bfloat16 values
    next to a first guess: an independent check of correctly_rounded."""
    guess = exact.to(torch.bfloat16)
    bits = guess.view(torch.int16)
    candidates = torch.stack([(bits + step).view(torch.bfloat16) for step in (-1, 0, 1)])
    distance = (candidates.double() - exact).abs().nan_to_num(nan=math.inf)  # (0's bits - 1: a NaN)
    best = distance.min(0).values
    even = (torch.stack([bits - 1, bits, bits + 1]) % 2 == 0)
    # the nearest; between two equally near, the one whose last bit is 0
    score = torch.where(distance == best, torch.where(even, 0, 1), 2)
    return candidates.gather(0, score.argmin(0, keepdim=True))[0]


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
