"""Shared fixtures: a tiny local DSA model directory and SGLang with our plugin loaded.

SGLang's DSA argument adjustments ask the GPU for its compute capability; on CPU-only
machines the fixtures pretend to be an H200 (sm_90) so the real validation path runs.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
}

#: DeepSeek-V4-shaped: has ``index_topk`` like a DSA model, but SGLang builds its own V4 pools
#: and ``DeepSeekV4HiSparseTokenToKVPoolAllocator`` for it (kv_cache_configurator.py:2939).
V4_CONFIG = {
    **DSA_CONFIG,
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "index_topk": 512,
    "num_hidden_layers": 4,
    "compress_ratios": [4, 128, 4, 128],
    "sliding_window": 128,
    "window_size": 128,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_nope_head_dim": 448,
    "v_head_dim": 512,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "max_position_embeddings": 65536,
}

#: MiniMax-M3 (``is_minimax_sparse`` reads the architecture): SGLang builds its sparse-index
#: pool and calls ``swap_in_selected_blocks``. MiniMax-M3.1's attention shape (minimax_sparse_nvfp4_backend.py checks these figures: 4 KV
#: heads of 128, blocks of 128, 16 top-k blocks); 4 layers, the first dense
M3_CONFIG = {
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "model_type": "minimax",
    "num_hidden_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 2048,
    "vocab_size": 1000,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "sparse_attention_config": {
        "sparse_attention_freq": [0, 1, 1, 1], "sparse_block_size": 128, "sparse_topk_blocks": 16,
        "sparse_init_block": 0, "sparse_local_block": 1, "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
    },
}

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
}


@pytest.fixture(scope="session")
def import_benchmark():
    """Import a script from ``benchmarks/`` by module name (they are scripts, not a package):
    ``benchmarks/`` is on ``sys.path`` from the first test that asks until the session ends."""
    path = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, path)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(path)


def write_model(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="session")
def dsa_model_dir(tmp_path_factory) -> Path:
    """A DeepSeek-V3.2-shaped model directory: config.json only, no weights."""
    return write_model(tmp_path_factory.mktemp("dsa_model"), DSA_CONFIG)


@pytest.fixture(scope="session")
def v4_model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("v4_model"), V4_CONFIG)


@pytest.fixture(scope="session")
def m3_model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("m3_model"), M3_CONFIG)


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama_model"), LLAMA_CONFIG)


def pretend_h200() -> None:
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"


@pytest.fixture(scope="session")
def sglang_with_plugin():
    """SGLang's real load_plugins() run once in this process: our hooks are applied."""
    pytest.importorskip("sglang")
    pretend_h200()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True
