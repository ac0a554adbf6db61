import pytest

from srt_helpers import load_hf_reference


@pytest.fixture(scope="session")
def hf_smollm2():
    """The transformers reference for SmolLM2 (float32), loaded once per session."""
    return load_hf_reference()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from sgl_jax.srt.configs.model_config import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None).hf_dir)
