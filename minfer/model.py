"""The Llama transformer in HF weight layout, with a static KV cache.

Layout follows HF `LlamaForCausalLM` (half-split RoPE, so checkpoints load without permuting q/k),
except that q/k/v are fused into one `qkv_proj` and gate/up into one `gate_up_proj`: one matrix
read per sublayer input. Every tensor is a buffer; the model only runs inference.

The numerical steps go through `minfer.ops` (projections, RMSNorm, RoPE fused with the KV-cache
write, SiLU-mul): CUDA kernels on a GPU with the minfer backend, their pure-PyTorch references
otherwise. Attention goes through the backend `setup_caches` picks (minfer.attention).

Each sublayer is `residual += proj_out(f(proj_in(norm(residual))))`, and the norm and the add are
arguments of the projections (`Linear.forward(x, norm=, residual=)`): at decode the GEMV computes
the RMS scale from the x it loads and adds its result into the residual stream in place, so a
layer runs no norm or add kernel of its own (other formats and prefill run them as separate ops).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .attention import AttentionBackend, AttentionPass, attention_class
from .config import ModelConfig
from .errors import CheckpointError, ContextLengthError, MinferError
from .formats import DenseWeight, WeightFormat
from .kv_cache import KVCache
from .parallel import SINGLE, Sharding, shard_index

# ----------------------------------------------------------------------------------------------
# RoPE tables
# ----------------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32), with Llama-3 scaling when the config asks for it.

    Llama-3 scaling divides low frequencies (wavelength above original_len / low_freq_factor) by
    `factor`, keeps high frequencies (wavelength below original_len / high_freq_factor), and blends
    linearly in between, exactly as transformers' `_compute_llama3_parameters`.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") != "llama3":
        raise CheckpointError(f"rope scaling {scaling!r} is not implemented; minfer supports 'llama3' scaling")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = ~(wavelen < original_len / high) * ~(wavelen > original_len / low)
    return torch.where(in_between, blended, scaled)


def rope_tables(config: ModelConfig, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of position * inv_freq, each [max_seq_len, D/2] fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_inv_freq(config))
    return angles.cos().to(device), angles.sin().to(device)


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


class Linear(nn.Module):
    """A bias-free projection whose weight lives in one `WeightFormat` (child module `fmt`). A row-parallel
    one (`row_parallel`, the Sharding of a tensor-parallel model) sums its residual update over the ranks."""

    def __init__(self, in_features: int, out_features: int, row_parallel: Sharding = SINGLE):
        super().__init__()
        self.fmt: WeightFormat = DenseWeight(torch.empty(out_features, in_features))
        self.row_parallel = row_parallel

    def set_format(self, fmt: WeightFormat) -> None:
        if fmt.shape != self.fmt.shape:
            raise MinferError(f"a {fmt.name} weight of shape {fmt.shape} cannot replace one of shape {self.fmt.shape}")
        self.fmt = fmt

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
        """self(norm(x)); with `silu_mul` (a [gate; up] matrix) silu(gate) * up of it; added into
        `residual` in place when given (WeightFormat.project: decode kernels fuse these steps)."""
        if norm is None and residual is None and not silu_mul:
            return self.fmt(x)
        norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        if residual is None or not self.row_parallel.active:
            return self.fmt.project(x, norm_weight, eps, residual, silu_mul)
        # Row-parallel: rank 0 adds its partial product into the residual, the other ranks keep theirs
        # apart, and the sum over the ranks lands in every rank's residual.
        mine = self.fmt.project(x, norm_weight, eps, None if self.row_parallel.rank else residual, silu_mul)
        return self.row_parallel.reduce_into_(mine, residual)


EMBEDDING_PLACES = ("host", "gpu")  # Transformer.place_embedding


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(vocab_size, hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.weight.device == tokens.device:
            return F.embedding(tokens, self.weight)
        return ops.embedding(self.weight, tokens)  # the table in pinned host memory (place_embedding)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """`config`: the rank's layer config (its heads); o_proj sums over the ranks of `sharding`."""

    def __init__(self, config: ModelConfig, sharding: Sharding = SINGLE):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size)
        self.o_proj = Linear(config.q_size, config.hidden_size, row_parallel=sharding)
        self.kv_cache: KVCache | None = None
        self.backend: AttentionBackend | None = None  # the model's, set with the cache (setup_caches)

    def forward(self, residual: torch.Tensor, norm: RMSNorm, step: AttentionPass,
                rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """residual += o_proj(attention(qkv_proj(norm(residual)))), in place."""
        batch, seq, _ = residual.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(residual, norm=norm).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.view(batch, seq, self.num_heads, d)
        k = k.view(batch, seq, self.num_kv_heads, d)
        v = v.view(batch, seq, self.num_kv_heads, d)
        cache = self.kv_cache
        ops.rope_write_kv(q, k, v, *rope, step.input_pos, cache.k_cache, cache.v_cache)
        out = self.backend.decode(q, cache, step) if seq == 1 else self.backend.prefill(q, cache, step)
        self.o_proj(out.reshape(batch, seq, self.num_heads * d), residual=residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, sharding: Sharding = SINGLE):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)  # rows: gate, then up
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, row_parallel=sharding)

    def forward(self, residual: torch.Tensor, norm: RMSNorm) -> None:
        """residual += down_proj(silu(gate) * up) of gate_up_proj(norm(residual)), in place."""
        self.down_proj(self.gate_up_proj(residual, norm=norm, silu_mul=True), residual=residual)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, sharding: Sharding = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, sharding)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, sharding)

    def forward(self, residual: torch.Tensor, step: AttentionPass, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Updates the residual stream in place: attention, then the MLP, each on its normed input."""
        self.self_attn(residual, self.input_layernorm, step, rope)
        self.mlp(residual, self.post_attention_layernorm)


class CacheState(NamedTuple):
    """What `Transformer.setup_caches` prepares for generation: the attention backend, one KV cache per layer,
    the RoPE tables and positions for max_seq_len positions."""

    attention: AttentionBackend
    kv_caches: list[KVCache]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    positions: torch.Tensor
    max_batch_size: int
    max_seq_len: int


class Transformer(nn.Module):
    """Llama decoder. Built on the meta device (no memory); `materialize` allocates it, a loader
    (`minfer.checkpoint`) fills `checkpoint_tensors()`, and `setup_caches` prepares generation.

    With a `sharding` of several ranks it is one rank's part of a tensor-parallel model (minfer.parallel):
    `config` stays the whole model's, `layer_config` holds this rank's heads and MLP width, and lm_head
    this rank's slice of the vocabulary."""

    def __init__(self, config: ModelConfig, sharding: Sharding = SINGLE):
        super().__init__()
        self.config = config
        self.sharding = sharding
        self.layer_config = sharding.layer_config(config)
        if sharding.active and config.tie_word_embeddings:
            raise MinferError("tensor parallelism splits lm_head by vocabulary, so a model whose lm_head is tied to "
                              "its embedding runs on one GPU only")
        with torch.device("meta"):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(Block(self.layer_config, sharding) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size // sharding.world)
        self._tie_lm_head()
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # arange(max_seq_len) on the cache device
        self.attention: AttentionBackend | None = None  # chosen by setup_caches
        self.max_batch_size = self.max_seq_len = 0
        self.cache_state: CacheState | None = None  # what setup_caches made (or use_caches set) last

    def _tie_lm_head(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.fmt.weight = self.embed_tokens.weight

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> Transformer:
        """Allocate every weight on `device` in `dtype`, uninitialised (a tied lm_head shares the embedding);
        on a GPU that runs minfer's kernels, build them (or load them from the cache) first."""
        ops.build_for(device)
        if self.config.tie_word_embeddings:
            self.lm_head.fmt.weight = None  # allocate the shared matrix once
        self.to(dtype=dtype).to_empty(device=device)
        self._tie_lm_head()
        return self

    def place_embedding(self, where: str) -> None:
        """Keep the token embedding on the "gpu" (with the rest of the model) or on the "host", in
        page-locked memory that minfer's kernel reads over PCIe: one row per decode step (8 KB for
        Llama-2-7B), and vocab x hidden weights less GPU memory (262 MB). A tied lm_head reads the
        whole matrix every step, so a tied embedding stays where the model is, as does a CPU model's.
        Generators recapture their CUDA graphs after a move."""
        if where not in EMBEDDING_PLACES:
            raise MinferError(f"place_embedding: where must be one of {EMBEDDING_PLACES}, got {where!r}")
        weight = self.embed_tokens.weight
        if self.config.tie_word_embeddings or self.norm.weight.device.type != "cuda":
            return
        if where == "host" and weight.device.type != "cpu":  # no pageable copy on the way
            self.embed_tokens.weight = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True).copy_(weight)
        elif where == "gpu" and weight.device != self.norm.weight.device:
            self.embed_tokens.weight = weight.to(self.norm.weight.device)

    def embedding_place(self) -> str:
        """Where the token embedding is: "host" (pinned host memory) or "gpu" (the model's device)."""
        return "host" if self.embed_tokens.weight.device != self.norm.weight.device else "gpu"

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of every weight a checkpoint provides, in minfer names (a loader copies
        into these in place). Fused rows: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
        tensors = self.state_dict()
        if self.config.tie_word_embeddings:
            del tensors["lm_head.fmt.weight"]
        return tensors

    def tensor_places(self) -> dict[str, TensorPlace]:
        """HF tensor name -> where (this rank's slice of) it goes among `checkpoint_tensors()`."""
        return tensor_places(self.config, self.sharding)

    def projections(self) -> Iterator[tuple[str, Linear]]:
        """The attention and MLP linears: what `formats.convert` re-encodes (not embeddings/lm_head)."""
        for name, module in self.layers.named_modules(prefix="layers"):
            if isinstance(module, Linear):
                yield name, module

    def _linear_and_norm_bytes(self) -> int:
        linears = sum(m.fmt.nbytes for m in self.modules() if isinstance(m, Linear))
        return linears + sum(m.weight.nbytes for m in self.modules() if isinstance(m, RMSNorm))

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every linear in its current format, the norms, one embedding row."""
        return self._linear_and_norm_bytes() + self.embed_tokens.weight[0].nbytes

    def weight_bytes(self) -> int:
        """Bytes all weights take in their current formats (a tied embedding counted once, as lm_head)."""
        embedding = 0 if self.config.tie_word_embeddings else self.embed_tokens.weight.nbytes
        return self._linear_and_norm_bytes() + embedding

    def setup_caches(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None, attention: str = "dense",
                     attention_options: dict | None = None) -> None:
        """Preallocate the KV cache of every layer and the RoPE tables for positions < max_seq_len, and
        choose the `attention` backend (minfer.attention) for these caches, under the current ops backend,
        with its `attention_options` (e.g. {"layout": "sink-window:sink=64,window=1024"} for blocksparse)."""
        limit = self.config.max_position_embeddings
        if max_seq_len > limit:
            raise ContextLengthError(
                f"max_seq_len {max_seq_len} exceeds the {limit} positions this model supports; "
                f"use --max-seq-len {limit} or less"
            )
        dtype = dtype or self.norm.weight.dtype
        device = torch.device(device or self.norm.weight.device)
        layer_config = self.layer_config  # this rank's heads: its KV cache holds its KV groups only
        backend = attention_class(attention).create(layer_config, max_batch_size, max_seq_len, dtype, device,
                                                    **(attention_options or {}))
        caches = [KVCache(max_batch_size, layer_config.num_kv_heads, max_seq_len, layer_config.head_dim, dtype, device)
                  for _ in self.layers]
        self.use_caches(CacheState(backend, caches, *rope_tables(self.config, max_seq_len, device),
                                   torch.arange(max_seq_len, device=device), max_batch_size, max_seq_len))

    def use_caches(self, state: CacheState) -> None:
        """Run on `state`, made by an earlier setup_caches: a Generator's CUDA graphs hold its addresses, so it
        puts the model back on its own state before each generation (another one may have set up since)."""
        self.cache_state = state
        self.attention = state.attention
        for layer, cache in zip(self.layers, state.kv_caches, strict=True):
            layer.self_attn.kv_cache = cache
            layer.self_attn.backend = state.attention
        self.rope_cos, self.rope_sin, self.positions = state.rope_cos, state.rope_sin, state.positions
        self.max_batch_size, self.max_seq_len = state.max_batch_size, state.max_seq_len

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int | None = None,
                last_logits_only: bool = False, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] at positions input_pos [T] (increasing) -> logits [B, T, V].

        Attention reads cache positions [0, kv_len) (default: the whole cache); kv_len must exceed
        every position in input_pos. T == kv_len means a prompt at positions 0..T-1 (plain causal).
        last_logits_only returns logits [B, 1, V] for the last position only (what prefill samples
        from), skipping the lm_head work for the others; with `last_index` (int64 [1] on the device) the
        position at that index in T instead, as a prompt padded to a captured length needs.
        """
        if self.rope_cos is None:
            raise MinferError("call setup_caches(max_batch_size, max_seq_len) before running the model")
        kv_len = self.max_seq_len if kv_len is None else kv_len
        rope = (self.rope_cos, self.rope_sin)
        residual = self.embed_tokens(tokens)
        with self.attention.forward_pass(input_pos, tokens.shape[1], kv_len) as step:
            for layer in self.layers:
                layer(residual, step, rope)
        if last_logits_only:
            residual = residual[:, -1:] if last_index is None else residual.index_select(1, last_index)
        logits = self.lm_head(residual, norm=self.norm)
        return self.sharding.gather_last_dim(logits)


def hf_tensor_map(config: ModelConfig) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """HF tensor name -> (minfer tensor name, first row inside that tensor, HF shape).

    q/k/v fill the rows of one qkv_proj matrix and gate/up the rows of one gate_up_proj matrix.
    """
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    inter, vocab = config.intermediate_size, config.vocab_size
    layout = {
        "model.embed_tokens.weight": ("embed_tokens.weight", 0, (vocab, h)),
        "model.norm.weight": ("norm.weight", 0, (h,)),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = ("lm_head.fmt.weight", 0, (vocab, h))
    for i in range(config.num_layers):
        hf, attn, mlp = f"model.layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        layout |= {
            hf + "self_attn.q_proj.weight": (attn + "qkv_proj.fmt.weight", 0, (q, h)),
            hf + "self_attn.k_proj.weight": (attn + "qkv_proj.fmt.weight", q, (kv, h)),
            hf + "self_attn.v_proj.weight": (attn + "qkv_proj.fmt.weight", q + kv, (kv, h)),
            hf + "self_attn.o_proj.weight": (attn + "o_proj.fmt.weight", 0, (h, q)),
            hf + "mlp.gate_proj.weight": (mlp + "gate_up_proj.fmt.weight", 0, (inter, h)),
            hf + "mlp.up_proj.weight": (mlp + "gate_up_proj.fmt.weight", inter, (inter, h)),
            hf + "mlp.down_proj.weight": (mlp + "down_proj.fmt.weight", 0, (h, inter)),
            hf + "input_layernorm.weight": (f"layers.{i}.input_layernorm.weight", 0, (h,)),
            hf + "post_attention_layernorm.weight": (f"layers.{i}.post_attention_layernorm.weight", 0, (h,)),
        }
    return layout


class TensorPlace(NamedTuple):
    """Where one HF checkpoint tensor goes on a tensor-parallel rank: rows [row, row + shape[0]) of minfer
    tensor `target`, filled from `source[index]` (the rank's slice of the HF tensor)."""

    target: str
    row: int
    shape: tuple[int, ...]
    index: tuple[slice, ...]


def tensor_places(config: ModelConfig, sharding: Sharding = SINGLE) -> dict[str, TensorPlace]:
    """HF tensor name -> its TensorPlace on the rank of `sharding`: hf_tensor_map of the rank's layer config,
    with the embedding whole and lm_head's vocabulary split."""
    full = hf_tensor_map(config)
    places = {}
    for name, (target, row, shape) in hf_tensor_map(sharding.layer_config(config)).items():
        if name == "lm_head.weight":
            shape = (config.vocab_size // sharding.world, config.hidden_size)
        elif name == "model.embed_tokens.weight":
            shape = full[name][2]
        places[name] = TensorPlace(target, row, shape, shard_index(full[name][2], shape, sharding.rank))
    return places
