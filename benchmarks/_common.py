"""Shared pieces of the benchmarks: the Qwen2-shaped model of issue 7, timing, sizes."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.stacks (SGLang's import shims) and the working tree's tdiff


def qwen2_model(layers: int = 8, dtype=torch.float32):
    """vocab 4096, hidden 1024, intermediate 2816, 16 heads / 4 KV heads: the model of issue 7."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def input_ids(tokens: int, vocab: int = 4096, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values) -> float:
    return statistics.median(values)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def page_cache_bandwidth(work: Path, nbytes: int = 1 << 30) -> float:
    """Bytes per second one thread hands to the page cache writing one file (no fsync)."""
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    path = fresh_dir(work / "bandwidth") / "file"
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(buffer))
        times.append(time.perf_counter() - start)
        path.unlink()
    return nbytes / median(times)


def save_every_tensor(model, out: Path) -> list:
    """Forward hooks that torch.save every input and output tensor of every module, one file each
    (copied to the host first): the naive dumper both capture benchmarks measure against."""
    counter = iter(range(1 << 30))

    def save(value):
        if isinstance(value, torch.Tensor):
            torch.save(value.detach().cpu(), out / f"{next(counter)}.pt")
        elif isinstance(value, (tuple, list)):
            for item in value:
                save(item)

    def hook(module, args, kwargs, output):
        save(args), save(list(kwargs.values())), save(output)

    return [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]


def machine() -> str:
    return f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
