"""Module descriptions and `--params`: each recorded module's class and settings, and its
parameters stored once per dump, deduplicated by fingerprint."""

import json
from pathlib import Path

import torch

import tdiff
from tdiff.capture_options import CaptureOptions
from tdiff.launch import CaptureConfig
from tdiff.store.modules import MODULES_DIR, PARAMS_DIR, load_param, read_module_descriptions
from tests.helpers import DEMO, python_script, tdiff_process, tiny_qwen2, token_ids


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.second.weight = self.first.weight          # shared: one tensor, stored once
        with torch.no_grad():
            self.third.bias.copy_(self.first.bias)      # equal bytes: stored once too

    def forward(self, x):
        return self.third(self.second(self.first(x)))


def test_parameters_are_stored_once_per_fingerprint_and_read_back(tmp_path):
    model = Tied()
    with torch.no_grad(), tdiff.capture(tmp_path / "d", params=True):
        model(torch.ones(2, 4))
    described = read_module_descriptions(tmp_path / "d")
    entries = [(module, name, entry) for (_, module), d in described.items() for name, entry in d.params.items()]
    assert len(entries) == 6   # weight and bias of three layers
    stored = sorted(p.name for p in (tmp_path / "d" / MODULES_DIR / PARAMS_DIR).iterdir())
    assert len(stored) == len({entry.fingerprint for _, _, entry in entries}) == 4
    for module, name, entry in entries:
        assert torch.equal(load_param(tmp_path / "d", entry), model.get_submodule(module).get_parameter(name))


def test_settings_are_recorded_always_and_parameters_only_when_asked(tmp_path):
    model = tiny_qwen2(torch.bfloat16)
    with torch.no_grad(), tdiff.capture(tmp_path / "d"):
        model(token_ids())
    described = {module: d for (_, module), d in read_module_descriptions(tmp_path / "d").items()}
    norm = described["model.layers.0.input_layernorm"]
    assert (norm.module_class, norm.settings["variance_epsilon"], norm.params) == ("Qwen2RMSNorm", 1e-6, None)
    assert norm.class_path == "transformers.models.qwen2.modeling_qwen2:Qwen2RMSNorm"
    rotary = described["model.rotary_emb"]
    assert rotary.settings["config.rope_parameters.rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert not (tmp_path / "d" / MODULES_DIR / PARAMS_DIR).exists()


def test_the_capture_option_reaches_the_process_through_its_environment():
    config = CaptureConfig(out=Path("d"), options=CaptureOptions(side="a", mode="full", params=True))
    assert CaptureConfig.from_env(config.to_env()).options.params is True


def test_capture_params_from_the_command_line(tmp_path):
    done = tdiff_process("capture", "--out", tmp_path / "d", "--params", "-q", "--", "python", DEMO, "--layers", "1")
    assert done.returncode == 0, done.stderr
    norm = read_module_descriptions(tmp_path / "d")[(0, "model.layers.0.input_layernorm")]
    assert set(norm.params) == {"weight"} and norm.params["weight"].shape == (64,)


FORKING = """
import json, os, sys
import torch, tdiff

torch.set_num_threads(1)   # GNU OpenMP hangs in a forked child once the parent ran a parallel region
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
with torch.no_grad(), tdiff.capture(sys.argv[1]):
    model(torch.ones(2, 8))
    pid = os.fork()
    if pid == 0:
        model(torch.ones(2, 8))
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    model(torch.ones(2, 8))
"""


def test_a_forked_child_describes_the_modules_into_its_own_part_and_the_parents_lines_stay_once(tmp_path):
    # the part's file stays open while the capture runs: a fork must not write the parent's lines twice
    out = tmp_path / "d"
    result = python_script(FORKING, tmp_path, out)
    assert result.returncode == 0, result.stderr
    files = sorted((out / MODULES_DIR).glob("*.jsonl"))
    assert len(files) == 2
    for file in files:
        described = [json.loads(line)["module"] for line in file.read_text().splitlines()]
        assert sorted(described) == ["", "0", "1", "2"], file.name
