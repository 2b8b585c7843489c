"""The ops backend context, and the attention backends: the registry, the choice made once per model
(SDPA or the split-K decode kernel), and each backend's prefill and decode against float64 attention."""

import math

import pytest
import torch

from minfer import ops
from minfer.attention import ATTENTION_BACKENDS, DenseAttention, attention_class
from minfer.attention.dense import SplitKDecodeAttention
from minfer.checkpoint import random_init
from minfer.config import ModelConfig
from minfer.errors import KernelBuildError, MinferError
from minfer.generate import Generator
from minfer.kv_cache import KVCache
from minfer.model import Transformer
from minfer.ops import runtime
from tests.conftest import requires_cuda
from tests.numerics import rel_error

# Odd sizes: 6 query heads over 2 KV heads, head_dim 24, 37 cache positions.
HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 6, 2, 24, 37
CONFIG = {"model_type": "llama", "vocab_size": 101, "hidden_size": HEADS * HEAD_DIM, "intermediate_size": 40,
          "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "max_position_embeddings": 64, "eos_token_id": 2}


def attention64(q, k_cache, v_cache, input_pos, scale):
    """Query t (at position input_pos[t]) attends to cache positions 0..input_pos[t], in float64."""
    group = q.shape[2] // k_cache.shape[1]
    k = k_cache.double().repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    v = v_cache.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bthd,bhsd->bhts", q.double(), k) * scale
    visible = torch.arange(k.shape[2]) <= input_pos.cpu()[:, None]  # [T, S]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("bhts,bhsd->bthd", scores.softmax(dim=-1), v)


def filled_cache(batch, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(batch, KV_HEADS, POSITIONS, HEAD_DIM, dtype, device)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=generator))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=generator))
    return cache


def test_backend_context_scopes_the_choice_and_refuses_unknown_names():
    outside = ops.current_backend()
    with ops.backend("torch"):
        assert ops.current_backend() == "torch"
        with ops.backend("minfer"):
            assert ops.current_backend() == "minfer"
        assert ops.current_backend() == "torch"
    assert ops.current_backend() == outside
    with pytest.raises(MinferError, match="unknown backend 'cuda-magic'"), ops.backend("cuda-magic"):
        pass


def test_kernels_are_never_built_by_an_op(monkeypatch):
    """Without a build, asking for the kernels on a GPU is an error naming the build step; the torch
    backend and CPU tensors never need them."""
    monkeypatch.setattr(runtime, "_loaded", {})
    with ops.backend("minfer"), pytest.raises(KernelBuildError, match=r"call minfer.ops.build\(\) first"):
        ops.kernels_run_on("cuda")
    with ops.backend("torch"):
        assert not ops.kernels_run_on("cuda")
    assert not ops.kernels_run_on("cpu") and not ops.use_kernels(torch.zeros(1))


def test_registry_names_the_backends():
    assert attention_class("dense") is DenseAttention and ATTENTION_BACKENDS["dense"] is DenseAttention
    with pytest.raises(MinferError, match="unknown attention backend 'sliding'; choose one of: blocksparse, dense"):
        attention_class("sliding")


@pytest.mark.parametrize("kv_len", [POSITIONS, 29])
def test_dense_decode_matches_float64(kv_len):
    """One token at position 20, over the whole cache or a shorter kv_len: only positions 0..20 count."""
    config = ModelConfig.from_hf(CONFIG)
    backend = DenseAttention.create(config, 3, POSITIONS, torch.float32, torch.device("cpu"))
    cache = filled_cache(3, torch.float32, "cpu")
    q = torch.randn(3, 1, HEADS, HEAD_DIM)
    input_pos = torch.tensor([20])
    with backend.forward_pass(input_pos, 1, kv_len) as step:
        out = backend.decode(q, cache, step)
    assert rel_error(out, attention64(q, cache.k_cache, cache.v_cache, input_pos, HEAD_DIM ** -0.5)) < 1e-5


@pytest.mark.parametrize("first, tokens, kv_len", [(0, 11, 11), (9, 11, 33)])  # a prompt; a chunk after 9 positions
def test_dense_prefill_matches_float64(first, tokens, kv_len):
    config = ModelConfig.from_hf(CONFIG)
    backend = DenseAttention.create(config, 2, POSITIONS, torch.float32, torch.device("cpu"))
    cache = filled_cache(2, torch.float32, "cpu", seed=1)
    q = torch.randn(2, tokens, HEADS, HEAD_DIM)
    input_pos = torch.arange(first, first + tokens)
    with backend.forward_pass(input_pos, tokens, kv_len) as step:
        assert (step.mask is None) == (tokens == kv_len)  # a prompt from position 0 is plain causal
        out = backend.prefill(q, cache, step)
    assert rel_error(out, attention64(q, cache.k_cache, cache.v_cache, input_pos, HEAD_DIM ** -0.5)) < 1e-5


def test_model_chooses_its_backend_once_and_generator_keeps_its_ops_backend():
    """A CPU model gets SDPA attention; a Generator runs under the ops backend it was built in, whatever
    is active when generate() is called."""
    model = random_init(Transformer(ModelConfig.from_hf(CONFIG)), 0, torch.float32, "cpu")
    with ops.backend("torch"):
        generator = Generator(model, None, max_seq_len=32, device="cpu")
    assert type(model.attention) is DenseAttention
    assert all(layer.self_attn.backend is model.attention for layer in model.layers)
    seen = []
    generator.generate([1, 5, 9], max_new_tokens=3, on_token=lambda _: seen.append(ops.current_backend()))
    assert seen and set(seen) == {"torch"}


@requires_cuda
@pytest.mark.parametrize("dtype, head_dim, backend, chosen", [
    (torch.float16, 64, "minfer", SplitKDecodeAttention),
    (torch.bfloat16, 128, "minfer", SplitKDecodeAttention),
    (torch.float32, 64, "minfer", DenseAttention),  # no float32 kernel
    (torch.float16, 24, "minfer", DenseAttention),  # nor one for this head size
    (torch.float16, 64, "torch", DenseAttention),
])
def test_gpu_choice_and_split_k_decode_matches_float64(dtype, head_dim, backend, chosen):
    config = ModelConfig.from_hf(CONFIG | {"head_dim": head_dim, "hidden_size": HEADS * head_dim})
    with ops.backend(backend):
        attention = DenseAttention.create(config, 2, 300, dtype, torch.device("cuda"))
        assert type(attention) is chosen
        cache = KVCache(2, KV_HEADS, 300, head_dim, dtype, "cuda")
        cache.k_cache.normal_()
        cache.v_cache.normal_()
        q = torch.randn(2, 1, HEADS, head_dim, device="cuda").to(dtype)
        input_pos = torch.tensor([257], device="cuda")
        with attention.forward_pass(input_pos, 1, 300) as step:
            out = attention.decode(q, cache, step)
    expected = attention64(q, cache.k_cache, cache.v_cache, input_pos, 1 / math.sqrt(head_dim))
    assert rel_error(out, expected) < (2e-2 if dtype == torch.bfloat16 else 5e-3)
