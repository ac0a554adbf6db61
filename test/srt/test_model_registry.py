"""The architecture table is derived from the model files (models/registry.py reads each module's
``EntryClass`` and the classes' hook attributes), and an unsupported architecture is a one-line error that names
it and the supported list (#70 item 4)."""

import importlib
import os
import pkgutil
import subprocess
import sys
import time

import pytest
import transformers

from sgl_jax.srt import models
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.models.llama import MODEL_ROLES, NORM_PLACEMENTS
from sgl_jax.srt.models.registry import get_model_class, model_registry, supported_architectures
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.utils import find_free_port

EAGLE_HEADS = {"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3"}  # SafeAILab's names: no transformers class
ENCODER_FAMILIES = ("Bert", "XLMRoberta")


def _kind_by_transformers_name(arch: str) -> str:
    """The role transformers' class name implies: ...ForCausalLM generates, ...ForSequenceClassification is a
    classification head, ...Model is the stack without a head (served as embeddings)."""
    if arch.endswith("ForCausalLM"):
        return "causal"
    if arch.endswith("ForSequenceClassification"):
        return "classifier"
    assert arch.endswith("Model"), arch
    return "embedding"


def test_every_model_module_declares_its_entry_classes():
    names = [m.name for m in pkgutil.iter_modules(models.__path__) if m.name != "registry"]
    assert len(names) >= 8
    served = set()
    for name in names:
        entries = importlib.import_module(f"sgl_jax.srt.models.{name}").EntryClass
        assert entries, name
        for cls in entries:
            served.update(cls.architectures)
    assert served == set(model_registry())


def test_each_architecture_is_a_transformers_class_served_in_its_role():
    table = model_registry()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
            "Qwen3MoeForCausalLM", "BertModel", "XLMRobertaForSequenceClassification"} <= set(table)
    for arch, cls in table.items():
        assert arch in cls.architectures and cls.role in MODEL_ROLES, arch
        assert getattr(cls, "norm_placement", "pre") in NORM_PLACEMENTS, arch
        assert cls.is_encoder == arch.startswith(ENCODER_FAMILIES), arch
        if arch in EAGLE_HEADS:
            assert cls.role == "causal"
            continue
        assert hasattr(transformers, arch), f"{arch}: transformers has no class of that name"
        assert cls.role == _kind_by_transformers_name(arch), arch


def test_is_embedding_builds_the_decoder_stack_without_its_head():
    for causal, stack in [("LlamaForCausalLM", "LlamaModel"), ("Qwen2ForCausalLM", "Qwen2Model"),
                          ("Qwen3ForCausalLM", "Qwen3Model")]:
        cls = get_model_class(causal, embedding=True)
        assert cls is get_model_class(stack) and cls.role == "embedding"
    # no headless form: the class itself (its final hidden states are pooled)
    assert get_model_class("Gemma3ForCausalLM", embedding=True) is get_model_class("Gemma3ForCausalLM")


def test_dense_qwen2_has_qkv_biases_from_its_class_not_its_model_type():
    assert get_model_class("Qwen2ForCausalLM").qkv_bias and get_model_class("Qwen2Model").qkv_bias
    assert get_model_class("Qwen2ForSequenceClassification").qkv_bias
    assert not get_model_class("LlamaForCausalLM").qkv_bias and not get_model_class("Qwen3ForCausalLM").qkv_bias


UNSUPPORTED = "Model architecture 'Qwen2_5_VLForConditionalGeneration' is not supported; supported: "


@pytest.fixture(scope="module")
def vl_model_dir(tmp_path_factory):
    """A Qwen2.5-VL config.json (transformers' own): its text sizes sit under text_config, so reading
    num_attention_heads off it fails unless the architecture is refused first."""
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    transformers.Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"]).save_pretrained(path)
    return str(path)


def test_a_vision_language_config_is_a_one_line_error_naming_it_and_the_supported_list(vl_model_dir):
    with pytest.raises(ValueError) as raised:
        ModelConfig.from_server_args(ServerArgs(model_path=vl_model_dir, load_format="dummy"), "cpu")
    message = str(raised.value)
    assert "\n" not in message and message.startswith(UNSUPPORTED)
    assert message[len(UNSUPPORTED):].split(", ") == supported_architectures()


def _session_processes(sid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_launch_server_on_an_unsupported_architecture_says_so_in_one_line_and_leaves_no_process(vl_model_dir):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sgl_jax.launch_server", "--model-path", vl_model_dir, "--load-format", "dummy",
         "--host", "127.0.0.1", "--port", str(find_free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, output
    lines = output.strip().splitlines()
    assert lines[-1].startswith("sgl-jax: Scheduler failed to start: " + UNSUPPORTED), output
    assert "Traceback" not in output, output
    deadline = time.time() + 15
    while _session_processes(launcher.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not _session_processes(launcher.pid)
