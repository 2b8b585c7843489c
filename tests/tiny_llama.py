"""Tiny seeded Llama checkpoints made with transformers (the oracle), saved as sharded safetensors,
and the same weights loaded into minfer through `minfer.checkpoint`."""

from __future__ import annotations

from pathlib import Path

import torch

from minfer.checkpoint import load_weights
from minfer.config import ModelConfig
from minfer.model import Transformer

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# name -> LlamaConfig overrides; the vocabulary (997) is deliberately not a multiple of 64.
VARIANTS = {
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "gqa-llama3-rope": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_scaling=LLAMA3_SCALING,
                            rope_theta=500000.0),
}


def hf_tiny_llama(variant: str, seed: int = 0, vocab_size: int = 997):
    """A random LlamaForCausalLM in fp32. Weights are drawn wider than HF's default and norm weights
    are perturbed, so logits are peaked (greedy choices are not near-ties) and norms matter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
                         num_attention_heads=4, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                         initializer_range=0.15, bos_token_id=1, eos_token_id=2, **VARIANTS[variant])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    return model


def save_sharded(hf_model, folder: Path) -> Path:
    hf_model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def load_minfer(folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    model = Transformer(ModelConfig.from_json(folder / "config.json"))
    return load_weights(model, folder, dtype, device)
