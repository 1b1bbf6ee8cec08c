"""RMSNorm in fp32 with a fixed reduction order, for the frameworks whose norm is not an edit away.

The catalogue edits Hugging Face's and SGLang's RMSNorm in place; these functions replace the
RMSNorm that Megatron-core's local layer spec builds (``torch.nn.RMSNorm``) and route SGLang's
device-specific forwards to its (edited) native one.
"""

from __future__ import annotations

import torch

from tdiff.source_patcher.fixes.reduction import fixed_order_mean


def torch_rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.RMSNorm.forward``: variance by a fixed-order sum in fp32, weight multiplied in
    fp32, one rounding to the input dtype (torch.rms_norm's output dtype)."""
    dims = len(self.normalized_shape)
    x32 = x.float()
    flat = x32.flatten(-dims) if dims > 1 else x32
    # torch's default eps is that of the computation type (fp32 for half inputs)
    eps = self.eps if self.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    variance = fixed_order_mean(flat.pow(2), dim=-1, keepdim=True)
    y = (flat * torch.rsqrt(variance + eps)).view_as(x32)
    if self.weight is not None:
        y = y * self.weight.float()
    return y.to(x.dtype)


def sglang_native(self, x, residual=None, post_residual_addition=None, quant_linear=None):
    """SGLang RMSNorm's CUDA/CPU kernels replaced by its native forward (which the catalogue edits)."""
    return self.forward_native(x, residual, post_residual_addition)
