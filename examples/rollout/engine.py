"""The rollout side: SGLang's Qwen2 model classes generating greedily on the CPU, as its engine does.

    python examples/rollout/engine.py --rollout rollout.json [--steps 4] [--planted] [--chunk N]

Two requests (prompts of 5 and 11 tokens) are prefilled in one EXTEND batch, then decoded
together for --steps DECODE steps, one token per request per step, attention reading the rest from
the KV cache. The parts are SGLang's own: the real ``ForwardBatch``, ``TorchNativeAttnBackend``,
``ReqToTokenPool``, ``MHATokenToKVPool`` and its allocator (../shared/notes/cpu-stacks.md). The
model is a tiny Qwen2 with random weights (seed 0; tests/helpers.tiny_qwen2), fp32.

Each forward records the log-prob of the token it samples with ``tdiff.dump("logprobs", ...,
positions=...)``; tdiff reads each forward's tokens from its ForwardBatch by itself. The finished
sequences (prompt + response) go to --rollout, for the trainer (examples/rollout/trainer.py).

--planted: layer 1's decode attention writes its output in bf16 (as a decode kernel with a bf16
output buffer would); prefill attention stays fp32. A fault on the decode path alone.
--chunk N: a chunked prefill, the prompts' first N tokens in an EXTEND forward of their own, then
the rest on top of their KV cache (``extend_prefix_lens`` N).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tdiff
from tests.helpers import tiny_qwen2
from tests.stacks.sglang import init_sglang, load_hf_weights

PROMPT_LENGTHS = (5, 11)
PLANTED_LAYER = 1


def prompts(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in PROMPT_LENGTHS]


def attention_backend(runner, planted: bool):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class DecodeInBf16(TorchNativeAttnBackend):
        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            return out.bfloat16().float() if layer.layer_id == PLANTED_LAYER else out

    return (DecodeInBf16 if planted else TorchNativeAttnBackend)(runner)


class Engine:
    """SGLang's model over its token-slot table and KV pool, serving a fixed batch of requests."""

    def __init__(self, hf_model, planted: bool):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM

        config = hf_model.config
        self.model = Qwen2ForCausalLM(config).eval()
        load_hf_weights(self.model, hf_model.state_dict())
        self.req_pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        kv_pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32,
                                   head_num=config.num_key_value_heads,
                                   head_dim=config.hidden_size // config.num_attention_heads,
                                   layer_num=config.num_hidden_layers, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=256, dtype=torch.float32, device="cpu", kvcache=kv_pool,
                                                need_sort=False)
        runner = types.SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=kv_pool)
        self.backend = attention_backend(runner, planted)

    def forward(self, batch) -> torch.Tensor:
        """One forward; the log-probs of the next token of each request [requests, vocab]."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.backend.init_forward_metadata(batch)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.backend), forward_batch=batch):
            out = self.model(batch.input_ids, batch.positions, batch)
        return torch.log_softmax(out.next_token_logits.float(), dim=-1)

    @staticmethod
    def extend_batch(rows, rids, fed: list[torch.Tensor], prefix: list[int], slots: list[torch.Tensor]):
        """An EXTEND batch: each request is fed ``fed`` after the ``prefix`` tokens already in its KV cache."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        new = [len(f) for f in fed]
        total = torch.tensor([p + n for p, n in zip(prefix, new)])
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=len(fed), input_ids=torch.cat(fed), req_pool_indices=rows,
            seq_lens=total, out_cache_loc=torch.cat(slots), seq_lens_sum=int(total.sum()), seq_lens_cpu=total.clone(),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)]), extend_num_tokens=sum(new),
            extend_seq_lens=torch.tensor(new), extend_seq_lens_cpu=new, extend_prefix_lens=torch.tensor(prefix),
            extend_prefix_lens_cpu=list(prefix), extend_start_loc=torch.tensor([sum(new[:i]) for i in range(len(new))]),
            rids=list(rids), return_logprob=False, capture_hidden_mode=CaptureHiddenMode.NULL)

    def generate(self, prompt_ids: list[torch.Tensor], rids: list[str], steps: int,
                 chunk: int | None = None) -> list[list[int]]:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

        lens = [len(p) for p in prompt_ids]
        rows = torch.tensor(self.req_pool.alloc_rows(len(prompt_ids)), dtype=torch.int64)
        slots = self.allocator.alloc(sum(lens))
        starts = [sum(lens[:i]) for i in range(len(lens))]
        for row, start, n in zip(rows.tolist(), starts, lens):
            self.req_pool.write((row, slice(0, n)), slots[start:start + n].to(torch.int32))
        slots_of = [slots[start:start + n] for start, n in zip(starts, lens)]
        prefix = [0] * len(lens)
        if chunk is not None:   # chunked prefill: the first `chunk` prompt tokens in a forward of their own
            self.forward(self.extend_batch(rows, rids, [p[:chunk] for p in prompt_ids], prefix,
                                           [s[:chunk] for s in slots_of]))
            prefix = [chunk] * len(lens)
        batch = self.extend_batch(rows, rids, [p[c:] for p, c in zip(prompt_ids, prefix)], prefix,
                                  [s[c:] for s, c in zip(slots_of, prefix)])
        seq_lens = torch.tensor(lens)
        sequences = [p.tolist() for p in prompt_ids]
        for step in range(steps + 1):
            logprobs = self.forward(batch)
            chosen = logprobs.argmax(-1)
            # the log-prob of each sampled token, at the position that token will take
            tdiff.dump("logprobs", logprobs.gather(1, chosen[:, None])[:, 0], positions=seq_lens)
            for sequence, token in zip(sequences, chosen.tolist()):
                sequence.append(token)
            if step == steps:
                return sequences
            slots = self.allocator.alloc(len(lens))            # one new KV slot per request
            self.req_pool.write((rows, seq_lens), slots.to(torch.int32))
            positions, seq_lens = seq_lens.clone(), seq_lens + 1
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=len(lens), input_ids=chosen, req_pool_indices=rows,
                seq_lens=seq_lens, out_cache_loc=slots, seq_lens_sum=int(seq_lens.sum()),
                seq_lens_cpu=seq_lens.clone(), positions=positions, rids=list(rids), return_logprob=False,
                capture_hidden_mode=CaptureHiddenMode.NULL)
        raise AssertionError("unreachable")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout", type=Path, required=True, help="where to write the finished sequences (JSON)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    parser.add_argument("--planted", action="store_true", help="layer 1's decode attention writes bf16")
    parser.add_argument("--chunk", type=int, help="chunked prefill: the first N prompt tokens in a forward of "
                                                  "their own, the rest on top of their KV cache")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_sglang()
    hf_model = tiny_qwen2()
    engine = Engine(hf_model, args.planted)
    rids = [f"req-{i}" for i in range(len(PROMPT_LENGTHS))]
    if args.chunk is not None and not 0 < args.chunk < min(PROMPT_LENGTHS):
        parser.error(f"--chunk takes 1 to {min(PROMPT_LENGTHS) - 1} tokens")
    sequences = engine.generate(prompts(hf_model.config.vocab_size), rids, args.steps, args.chunk)
    args.rollout.parent.mkdir(parents=True, exist_ok=True)
    args.rollout.write_text(json.dumps({"rids": rids, "prompt_lens": list(PROMPT_LENGTHS),
                                        "sequences": sequences}) + "\n")


if __name__ == "__main__":
    main()
