"""The training side: megatron-core's GPTModel scoring the finished sequences of a rollout.

    python examples/rollout/trainer.py --rollout rollout.json [--layout padded|thd] [--pad-to N]

One forward over the sequences examples/rollout/engine.py generated (prompt + response), with the
same weights (the tiny Qwen2 of seed 0, converted to Megatron's fused layout), fp32, on the CPU:

- ``padded``: a [batch, seq] batch, right-padded, with a [batch, 1, seq, seq] mask (causal and
  padding keys);
- ``thd``: the sequences packed into one row, ``PackedSeqParams(qkv_format="thd")`` with their
  ``cu_seqlens``; with --pad-to N each sequence is padded to a multiple of N tokens
  (``cu_seqlens_q_padded``), as tensor or context parallelism asks. The local layer spec's attention refuses THD, so each layer's core attention is
  a per-segment causal SDPA here (../shared/notes/cpu-stacks.md); everything else is megatron-core's.

Records the log-prob of every response token with ``tdiff.dump("logprobs", ..., positions=...,
seq_ids=...)``, as an RL trainer computes them; tdiff reads the forward's tokens (input ids,
packed_seq_params or mask) from the model call by itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tdiff
from tests.helpers import tiny_qwen2
from tests.stacks.megatron import init_megatron
from tests.stacks.models import megatron_twin


def packed_core_attention(config):
    from megatron.core.transformer.module import MegatronModule

    class PackedSDPA(MegatronModule):
        """Core attention for THD input: causal SDPA within each packed sequence. Megatron's
        Attention has already applied RoPE per sequence and squeezed q, k, v to [tokens, heads, dim]."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = (packed_seq_params.cu_seqlens_q if bounds is None else bounds).tolist()
            out = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (query, key, value)),
                                                  is_causal=True, enable_gqa=True).transpose(0, 1)
                   for a, b in itertools.pairwise(bounds)]
            return torch.cat(out).reshape(query.shape[0], -1)

    return PackedSDPA(config=config)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def score(model, sequences: list[list[int]], layout: str, pad_to: int = 1) -> list[torch.Tensor]:
    """Each sequence's per-token log-probs: entry p is the log-prob of token p+1."""
    lens = [len(s) for s in sequences]
    with torch.no_grad():
        if layout == "thd":
            from megatron.core.packed_seq_params import PackedSeqParams

            padded = [-(-n // pad_to) * pad_to for n in lens]
            real, starts = cumulative(lens), cumulative(padded)
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                                     cu_seqlens_q_padded=starts if pad_to > 1 else None,
                                     cu_seqlens_kv_padded=starts if pad_to > 1 else None,
                                     max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
            ids = torch.tensor(list(itertools.chain(*(s + [0] * (p - len(s)) for s, p in zip(sequences, padded)))))
            # RoPE restarts at each cu_seqlens_q_padded bound by itself; position_ids as a trainer's batch has them
            positions = torch.cat([torch.arange(p) for p in padded])[None]
            logits = model(input_ids=ids[None], position_ids=positions, attention_mask=None,
                           packed_seq_params=packed)[0]
            rows = [logits[a:a + n] for a, n in zip(starts.tolist(), lens)]
        else:
            width = max(lens)
            ids = torch.zeros(len(lens), width, dtype=torch.long)
            real = torch.zeros(len(lens), width, dtype=torch.bool)
            for row, sequence in enumerate(sequences):
                ids[row, :len(sequence)] = torch.tensor(sequence)
                real[row, :len(sequence)] = True
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            mask = ~(causal[None] & real[:, None, :])[:, None]       # True: masked out
            logits = model(input_ids=ids, position_ids=torch.arange(width).expand(len(lens), width),
                           attention_mask=mask)
            rows = [logits[row, :n] for row, n in enumerate(lens)]
    return [torch.log_softmax(r[:-1].float(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            for r, s in zip(rows, sequences)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout", type=Path, required=True, help="the engine's finished sequences (JSON)")
    parser.add_argument("--layout", choices=("padded", "thd"), default="padded")
    parser.add_argument("--pad-to", type=int, default=1, help="thd: pad each sequence to a multiple of N tokens")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rollout = json.loads(args.rollout.read_text())
    init_megatron()
    model = megatron_twin(tiny_qwen2()).eval()
    if args.layout == "thd":
        for layer in model.decoder.layers:
            layer.self_attention.core_attention = packed_core_attention(model.config)
    sequences, prompt_lens = rollout["sequences"], rollout["prompt_lens"]
    if args.pad_to < 1 or (args.pad_to > 1 and args.layout != "thd"):
        parser.error("--pad-to takes a positive N, with --layout thd")
    per_token = score(model, sequences, args.layout, args.pad_to)
    # the response tokens' log-probs, packed, as an RL loss takes them: position p scores token p
    positions = [torch.arange(n, len(s)) for n, s in zip(prompt_lens, sequences)]
    tdiff.dump("logprobs", torch.cat([lp[n - 1:] for lp, n in zip(per_token, prompt_lens)]),
               positions=torch.cat(positions),
               seq_ids=torch.cat([torch.full_like(p, i) for i, p in enumerate(positions)]))


if __name__ == "__main__":
    main()
