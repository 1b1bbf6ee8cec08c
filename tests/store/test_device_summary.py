"""The fused GPU summary kernels agree with the torch reference, run in Triton's interpreter.

On a CUDA machine the same kernels run compiled (tests/hooks/test_cuda_capture.py checks the
capture path there); here TRITON_INTERPRET=1 executes them with numpy on the CPU.
"""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

triton = pytest.importorskip("triton", reason="the fused GPU summary is written in Triton")
# Triton 3.6's interpreter cannot run a loop bounded by a runtime value (the kernel's fold over
# the blocks); where it is installed (torch 2.11's CUDA machines) the compiled kernel is tested
# against the CPU instead (tests/store/test_fingerprint.py, tests/hooks/test_cuda_capture.py).
pytestmark = pytest.mark.skipif(tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8),
                                reason="Triton's interpreter before 3.8 cannot run the fold loop")

CHECK = textwrap.dedent("""
    import torch
    from tdiff.store.device_summary import fused_summary, fused_summary_supported
    from tdiff.store.fingerprint import mix64_fingerprint_tensor, tensor_stats

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (8, 4096, 10_000, 3 * 4096 + 16):
            t = (torch.randn(n) * 3).to(dtype)
            if n == 10_000:
                t[5], t[7], t[9] = float("nan"), float("inf"), float("-inf")
            assert fused_summary_supported(t), (dtype, n)
            out = fused_summary(t)
            digest = int(out[6:].view(torch.int64)[0])
            assert digest == int(mix64_fingerprint_tensor(t)), (dtype, n)
            assert torch.allclose(out[:6], tensor_stats(t), rtol=1e-5, equal_nan=True), (dtype, n, out)
    assert not fused_summary_supported(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes: no whole word
    assert not fused_summary_supported(torch.zeros(4, 4)[:, 1])              # strided
    print("fused summary ok")
""")


def test_fused_summary_matches_the_torch_reference_in_the_interpreter():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=REPO,
                            env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                            timeout=300)
    assert "fused summary ok" in result.stdout, result.stderr[-3000:]


def test_launches_go_past_the_runner_only_while_no_profiler_hooks_them():
    """The group kernel is launched directly unless a launch hook is installed (Triton's chain of
    hooks is never None: an empty one must read as none, one with a hook as installed)."""
    pytest.importorskip("triton.knobs", reason="Triton without knobs has no launch-hook chain")
    from triton import knobs

    from tdiff.store.device_summary import _launch_hooks_installed

    chain = knobs.runtime.launch_enter_hook
    assert chain is not None and not _launch_hooks_installed()

    def hook(*_):
        pass

    chain.add(hook)
    try:
        assert _launch_hooks_installed()
    finally:
        chain.remove(hook)
    assert not _launch_hooks_installed()
