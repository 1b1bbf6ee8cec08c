"""Hugging Face transformers' capture knowledge: the tokens of an outermost model call (the token
source). It has no annotator: its records carry no parallel coordinates."""

from __future__ import annotations

import inspect

import torch

FRAMEWORK = "transformers"


def tokens(module, args: tuple, kwargs: dict) -> dict | None:
    """``input_ids`` with ``attention_mask`` (padding dropped; positions counted along the mask,
    which also covers the cached tokens of a decode step), else ``position_ids``, else
    ``cache_position``."""
    kwargs = _by_name(module, args, kwargs)
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return None
    width = ids.shape[1]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == ids.shape[0] \
            and mask.shape[1] >= width:
        real = mask.detach().cpu().to(torch.long)
        positions = (real.cumsum(-1) - 1)[:, -width:]
        return {"input_ids": ids, "positions": positions, "mask": real[:, -width:].bool()}
    for key in ("position_ids", "cache_position"):
        given = kwargs.get(key)
        if isinstance(given, torch.Tensor):
            positions = given.detach().cpu().reshape(-1, given.shape[-1]) if given.dim() else given
            if positions.dim() == 2 and positions.shape[-1] == width:
                return {"input_ids": ids, "positions": positions}
    return {"input_ids": ids}


def _by_name(module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by parameter name (``model(ids, mask)`` passes them by position)."""
    if not args:
        return kwargs
    try:
        return dict(_forward_signature(type(module)).bind_partial(module, *args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {"input_ids": args[0], **kwargs}


def _forward_signature(cls: type) -> inspect.Signature:
    """The class's forward's (capture may have wrapped the instance's, ``model=``), worked out
    once: ``inspect.signature`` unwraps transformers' decorators, some 0.4 ms at every forward."""
    signature = _signatures.get(cls)
    if signature is None:
        signature = _signatures[cls] = inspect.signature(cls.forward)  # type: ignore[attr-defined]
    return signature


_signatures: dict[type, inspect.Signature] = {}
