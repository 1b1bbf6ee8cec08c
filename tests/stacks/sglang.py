"""SGLang's model classes on the CPU: import shims, single-process gloo set-up, a prefill forward.

No CPU build of SGLang's kernels exists; its model classes still run with native forwards.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
import torch.nn.functional as F

from tests.stacks import free_port


class _Anything:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{self._name}.{key}")

    def __call__(self, *args, **kwargs):
        return _Anything(self._name + "()")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{self.__name__}.{key}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import-only stand-ins for packages SGLang imports but a CPU run never calls."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_ready = False


def install_import_shims() -> None:
    """Let SGLang's modules import on a CPU machine (idempotent)."""
    if any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        return
    # transformers must keep seeing torchvision as absent (PyPI's torchvision breaks beside the
    # CPU torch); prime its cached checks before the stub makes the import succeed
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()
    sys.meta_path.insert(0, _StubFinder({"torchvision", "vllm"}))  # vllm: RoPE's CPU fallback import


def init_sglang(port: int | None = None) -> None:
    """Shims and SGLang's single-process distributed state (gloo), once per process."""
    global _ready
    if _ready:
        return
    install_import_shims()

    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"),
            role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    _ready = True


class SDPABackend:
    """Causal attention for one prefill sequence, no KV cache."""

    token_to_kv_pool = types.SimpleNamespace(dtype=torch.float32)  # read by fused-KV checks

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        tokens = q.shape[0]
        q = q.view(tokens, layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)
        k = k.view(tokens, layer.tp_k_head_num, layer.qk_head_dim).transpose(0, 1)
        v = v.view(tokens, layer.tp_v_head_num, layer.v_head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
        return out.transpose(0, 1).reshape(tokens, -1)


class PrefillBatch:
    """The parts of SGLang's ForwardBatch a prefill of one sequence reads; other fields are None."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        tokens = len(input_ids)
        self.forward_mode = ForwardMode.EXTEND
        self.input_ids, self.positions = input_ids, positions
        self.batch_size = 1
        self.seq_lens = self.seq_lens_cpu = self.extend_seq_lens = torch.tensor([tokens])
        self.extend_seq_lens_cpu = [tokens]
        self.extend_prefix_lens = torch.tensor([0])
        self.extend_prefix_lens_cpu = [0]
        self.extend_start_loc = torch.tensor([0])
        self.global_num_token_non_padded_cpu = None
        self.moe_num_token_non_padded = None
        self.return_logprob = False

    def __getattr__(self, key):
        """Any other field a model reads is unset (None); dunder lookups still fail."""
        if key.startswith("__"):
            raise AttributeError(key)


def build_qwen2(config):
    init_sglang()
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM(config).eval()


def build_qwen3_moe(config):
    init_sglang()
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(config).eval()


def load_hf_weights(model, hf_state_dict: dict) -> None:
    """Load a transformers state dict; 5.x fused experts are split per expert first."""
    weights = []
    for key, value in hf_state_dict.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2, dim=0)
                weights += [(f"{base}{e}.gate_proj.weight", gate), (f"{base}{e}.up_proj.weight", up)]
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            weights += [(f"{base}{e}.down_proj.weight", value[e]) for e in range(value.shape[0])]
        else:
            weights.append((key, value))
    model.load_weights(weights)


def prefill(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Run ``model.model`` on one sequence of token ids [tokens]; returns the final hidden states."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    positions = torch.arange(len(input_ids))
    batch = PrefillBatch(input_ids, positions)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=SDPABackend()), forward_batch=batch):
        return model.model(input_ids, positions, batch)
