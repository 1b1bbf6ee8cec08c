"""MoE combine in fp32 in a fixed slot order: each token's weighted expert outputs are summed in
fp32 in ascending expert id, one add after the other, and rounded once.

Ascending expert id is the one order every framework can reproduce (Megatron's routing map keeps
no top-k rank); summing slot by slot with element-wise adds makes the result independent of how
tokens were dispatched, of scatter/atomic ordering and of the device.
"""

from __future__ import annotations

import torch


def sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """[tokens, slots, hidden] -> [tokens, hidden]: slot 0 + slot 1 + ..., left to right."""
    total = slots[:, 0]
    for slot in range(1, slots.shape[1]):
        total = total + slots[:, slot]
    return total


def ranks_by_expert(expert_ids: torch.Tensor) -> torch.Tensor:
    """For [tokens, k] expert ids, each slot's position when the token's slots are sorted by expert id."""
    order = expert_ids.argsort(dim=-1, stable=True)
    positions = torch.arange(expert_ids.shape[1], device=expert_ids.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


class SlotCombine:
    """Hugging Face's experts loop: collect each (token, slot) output, then sum in expert order."""

    def __init__(self, top_k_index: torch.Tensor, like: torch.Tensor):
        self.rank = ranks_by_expert(top_k_index)
        self.slots = torch.zeros(*top_k_index.shape, like.shape[-1], dtype=torch.float32, device=like.device)

    def put(self, token_idx: torch.Tensor, top_k_pos: torch.Tensor, values: torch.Tensor) -> None:
        self.slots[token_idx, self.rank[token_idx, top_k_pos]] = values.float()

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return sum_slots(self.slots).to(dtype)


def sum_in_expert_order(slots: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """[tokens, k, hidden] values of each token's k slots and their [tokens, k] expert ids -> the
    fp32 sum of each token's slots in ascending expert id."""
    order = expert_ids.argsort(dim=-1, stable=True)
    return sum_slots(slots.float().gather(1, order[..., None].expand_as(slots)))


def weighted_slot_sum(outputs: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """SGLang's native MoE: [tokens, k, hidden] expert outputs weighted in fp32, summed in expert order."""
    return sum_in_expert_order(outputs.float() * weights.float()[..., None], expert_ids)


def combine_rows_in_order(rows: torch.Tensor, token_of_row: torch.Tensor, shape) -> torch.Tensor:
    """Megatron's unpermute: rows arrive expert by expert; each token's rows are summed in that order."""
    tokens, hidden = shape
    order = token_of_row.argsort(stable=True)
    counts = torch.bincount(token_of_row, minlength=tokens)
    starts = torch.cumsum(counts, 0) - counts
    slot_of_sorted = torch.arange(len(order), device=rows.device) - starts[token_of_row[order]]
    width = int(counts.max()) if len(order) else 1
    slots = torch.zeros(tokens, width, hidden, dtype=torch.float32, device=rows.device)
    slots[token_of_row[order], slot_of_sorted] = rows[order].float()
    return sum_slots(slots)
