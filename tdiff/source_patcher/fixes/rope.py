"""RoPE inverse frequencies in fp32 even when the module was cast to a lower precision.

``model.to(torch.bfloat16)`` casts every floating buffer, Hugging Face's ``inv_freq`` included, so
cos/sin are then computed from frequencies rounded to bf16. This returns the buffer when it is
fp32 and otherwise recomputes it in fp32 the way the module's own initialisation does.
"""

from __future__ import annotations

import torch


def fp32_inv_freq(rotary, device) -> torch.Tensor:
    if rotary.inv_freq.dtype == torch.float32:
        return rotary.inv_freq.to(device=device)
    if rotary.rope_type == "default":
        inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, _ = ROPE_INIT_FUNCTIONS[rotary.rope_type](rotary.config, device)
    return inv_freq.to(device=device, dtype=torch.float32)
