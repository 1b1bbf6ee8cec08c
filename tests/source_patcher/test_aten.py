"""The aten overrides: batch-invariant matmul, mean and log-softmax; log-softmax in fp32.

Whether a stock kernel is batch-variant (a row alone taking another path than the same row in a
batch) depends on the CPU and the thread count: fp32 GEMMs and long-row means were variant with
two threads on AVX-512 and AVX2 machines, a long-row mean was invariant with one thread. So each
test checks that the override ran and made every row equal to that row alone, whatever the stock
kernel does here.
"""

import torch
import pytest

from tdiff.source_patcher import apply_patches
from tdiff.source_patcher.catalogue import builtin
from tdiff.source_patcher.fixes import aten


@pytest.fixture
def mode():
    disables = []

    def enable(name):
        disables.append(aten.enable(name))
    yield enable
    for disable in disables:
        disable()
    assert aten.active_modes() == set()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the override kernels (wrapped before a mode registers them)."""
    calls: dict[str, int] = {}

    def counted(op, kernel):
        def wrapper(*args, **kwargs):
            calls[op] = calls.get(op, 0) + 1
            return kernel(*args, **kwargs)
        return wrapper
    for op, kernel in list(aten._KERNELS.items()):
        monkeypatch.setitem(aten._KERNELS, op, counted(op, kernel))
    return calls


def rows_alone_equal(op, batch: torch.Tensor) -> bool:
    together = op(batch)
    return all(torch.equal(together[i:i + 1], op(batch[i:i + 1].clone())) for i in range(batch.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_matmul(mode, kernel_calls, dtype):
    torch.manual_seed(0)
    a, weight, bias = torch.randn(16, 64, dtype=dtype), torch.randn(128, 64, dtype=dtype), torch.randn(128, dtype=dtype)
    ops = {"mm": lambda x: x @ weight.t(), "linear": lambda x: torch.nn.functional.linear(x, weight, bias)}
    alone = {name: torch.cat([op(a[i:i + 1].clone()) for i in range(len(a))]) for name, op in ops.items()}
    mode(aten.BATCH_INVARIANT_MATMUL)
    for name, op in ops.items():
        assert rows_alone_equal(op, a), name
        assert torch.equal(op(a), alone[name]), name   # exact: what the stock kernel gives each row alone
    assert kernel_calls.get("mm", 0) + kernel_calls.get("addmm", 0) > 0
    sequences = torch.randn(3, 7, 64, dtype=dtype)
    linear3d = torch.nn.functional.linear(sequences, weight)
    assert torch.equal(linear3d[1, 2:3], torch.nn.functional.linear(sequences[1, 2:3].clone(), weight))
    q, k = torch.randn(4, 5, 16, dtype=dtype), torch.randn(4, 16, 6, dtype=dtype)
    assert torch.equal(torch.bmm(q, k)[2, 3], torch.bmm(q[2:3, 3:4].clone(), k[2:3].clone())[0, 0])
    assert torch.allclose(torch.bmm(q, k).float(), torch.einsum("bmk,bkn->bmn", q.float(), k.float()), atol=0.1)


def test_batch_invariant_mean(mode, kernel_calls):
    torch.manual_seed(0)
    long_rows = torch.randn(4, 151_936)
    mean = lambda x: x.mean(-1)  # noqa: E731
    alone = torch.cat([mean(long_rows[i:i + 1].clone()) for i in range(len(long_rows))])
    mode(aten.BATCH_INVARIANT_MEAN)
    assert rows_alone_equal(mean, long_rows)
    assert torch.equal(mean(long_rows), alone) and kernel_calls.get("mean.dim", 0) > 0
    x = torch.randn(2, 3, 5)
    assert torch.equal(x.mean(dim=(0, 2)), x.permute(1, 0, 2).reshape(3, -1).mean(-1))
    assert x.mean(-1, keepdim=True).shape == (2, 3, 1) and x.mean([0, 2], keepdim=True).shape == (1, 3, 1)
    assert x.bfloat16().mean(-1, dtype=torch.float32).dtype == torch.float32


def test_batch_invariant_log_softmax_is_active_and_exact(mode):
    torch.manual_seed(0)
    logits = torch.randn(8, 4099)
    stock_rows = torch.cat([torch.log_softmax(logits[i:i + 1].clone(), -1) for i in range(8)])
    assert rows_alone_equal(lambda x: torch.log_softmax(x, -1), logits)   # already invariant here
    calls = []
    original = aten._KERNELS["_log_softmax"]
    aten._KERNELS["_log_softmax"] = lambda *args: calls.append(1) or original(*args)
    try:
        mode(aten.BATCH_INVARIANT_LOG_SOFTMAX)
        result = torch.log_softmax(logits, -1)
    finally:
        aten._KERNELS["_log_softmax"] = original
    assert calls and torch.equal(result, stock_rows)
    assert torch.equal(torch.log_softmax(logits.t(), 0), stock_rows.t())


def test_log_softmax_in_fp32_returns_fp32_and_keeps_gradients(mode):
    torch.manual_seed(0)
    logits = torch.randn(3, 50).bfloat16()
    mode(aten.LOG_SOFTMAX_FP32)
    result = torch.nn.functional.log_softmax(logits, dim=-1)
    assert result.dtype == torch.float32 and torch.equal(result, torch.log_softmax(logits.float(), -1))
    leaf = logits.clone().requires_grad_()
    torch.log_softmax(leaf, -1).sum().backward()
    assert leaf.grad.dtype == torch.bfloat16
    mode(aten.BATCH_INVARIANT_LOG_SOFTMAX)            # the two modes combine
    assert torch.equal(logits.log_softmax(-1), torch.log_softmax(logits.float(), -1))


def test_activate_patches_turn_overrides_on_and_off():
    a, b = torch.randn(8, 32), torch.randn(32, 48)
    with apply_patches(builtin(["batch-invariant"])[0].patches):
        assert aten.active_modes() == {aten.BATCH_INVARIANT_MATMUL, aten.BATCH_INVARIANT_MEAN,
                                       aten.BATCH_INVARIANT_LOG_SOFTMAX}
        assert rows_alone_equal(lambda x: x @ b, a)
    assert aten.active_modes() == set()
    assert not rows_alone_equal(lambda x: x @ b, a)    # the stock kernels are back
