"""Where and how a model runs: device and dtype choice, and the memory check made before anything
is allocated (weights + KV cache + prefill logits against free GPU memory, or available RAM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import ContextLengthError, DeviceError, MinferError
from .kv_cache import kv_cache_bytes

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
RESERVE_BYTES = 512 * 2**20  # CUDA context, library workspaces, allocator slack
DEFAULT_MAX_SEQ_LEN = 4096  # cap on the KV cache when no context length is asked for
# Random weights were never trained at any length, so their context may pass the architecture's limit:
# long-context attention runs on Llama-2/3 shapes without a checkpoint.
RANDOM_WEIGHTS_MAX_SEQ_LEN = 32768


def pick_device(name: str | None) -> torch.device:
    """`name` or, when None, the GPU if there is one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MinferError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name} needs a CUDA GPU, but none is available; use --device cpu")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise MinferError(f"--device {name!r} is not supported; use cpu, cuda or cuda:N")
    return device


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`name` or, when None, float16 on a GPU and float32 on the CPU."""
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise MinferError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def context_length(config: ModelConfig, requested: int | None, prompt_tokens: int,
                   random_weights: bool = False) -> int:
    """KV cache positions: `requested`, or the model's limit capped at DEFAULT_MAX_SEQ_LEN; it must
    leave room for at least one generated token after the prompt. With `random_weights` the limit is at
    least RANDOM_WEIGHTS_MAX_SEQ_LEN."""
    limit = config.max_position_embeddings
    if random_weights:
        limit = max(limit, RANDOM_WEIGHTS_MAX_SEQ_LEN)
    max_seq_len = min(limit, DEFAULT_MAX_SEQ_LEN) if requested is None else requested
    if not 1 < max_seq_len <= limit:
        raise ContextLengthError(f"--max-seq-len must be in [2, {limit}] for this model, got {max_seq_len}")
    if prompt_tokens >= max_seq_len:
        raise ContextLengthError(f"the prompt has {prompt_tokens} tokens but the context holds {max_seq_len}; "
                                 f"shorten it or raise --max-seq-len (this model allows up to {limit})")
    return max_seq_len


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + RESERVE_BYTES


def estimate_memory(config: ModelConfig, dtype: torch.dtype, max_seq_len: int, batch_size: int = 1,
                    weight_bytes: int | None = None, ranks: int = 1) -> MemoryEstimate:
    """Bytes a model needs (on each of `ranks` tensor-parallel GPUs) to generate with a `max_seq_len`
    cache: its weights (`weight_bytes`, by default the dense model's; split over the ranks but for the
    replicated embedding), the cache (split by KV heads), and the largest activation, a full-context
    prefill: its hidden states and MLP intermediates, plus the last position's logits (prefill computes
    no others) in the model dtype and in fp32 for sampling."""
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size) * dtype.itemsize
    logits = batch_size * config.vocab_size * (dtype.itemsize + 4)
    weights = config.weight_bytes(dtype) if weight_bytes is None else weight_bytes
    embedding = 0 if ranks == 1 else config.vocab_size * config.hidden_size * dtype.itemsize
    return MemoryEstimate(
        weights=(weights - embedding) // ranks + embedding,
        kv_cache=kv_cache_bytes(config.num_layers, batch_size, config.num_kv_heads, max_seq_len, config.head_dim,
                                dtype) // ranks,
        activations=batch_size * max_seq_len * per_token + logits,
    )


def available_bytes(device: torch.device) -> int | None:
    """Free GPU memory, or the RAM the kernel reports available (None where it cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # no /proc on this system: cannot tell
        return None
    return None


def check_memory(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_seq_len: int,
                 weight_bytes: int | None = None, ranks: int = 1) -> MemoryEstimate:
    """Raise DeviceError, before allocating anything, if the model cannot fit on `device`
    (`weight_bytes`: what its weights take when they are not the dense model's, e.g. compressed; `ranks`:
    the tensor-parallel ranks sharing it, each on a device like this one)."""
    need = estimate_memory(config, dtype, max_seq_len, weight_bytes=weight_bytes, ranks=ranks)
    free = available_bytes(device)
    if free is not None and need.total > free:
        where = "GPU memory is free" if device.type == "cuda" else "RAM is available"
        dtype_name = str(dtype).removeprefix("torch.")
        fitting = _longest_fitting_context(config, dtype, max_seq_len, weight_bytes, free, ranks)
        shorter = f" or --max-seq-len {fitting} (the most that fits)" if fitting >= 2 else ""
        each = f" on each of {ranks} GPUs" if ranks > 1 else ""
        more_gpus = ", more GPUs (--tp N)" if device.type == "cuda" else ""
        raise DeviceError(
            f"this model needs about {need.total / 1e9:.1f} GB{each} ({need.weights / 1e9:.1f} GB of {dtype_name} "
            f"weights, {need.kv_cache / 1e9:.1f} GB of KV cache for {max_seq_len} positions) but only "
            f"{free / 1e9:.1f} GB of {where} on {device}; try a smaller model, a 16-bit --dtype{more_gpus}"
            f"{shorter}"
        )
    return need


def _longest_fitting_context(config: ModelConfig, dtype: torch.dtype, max_seq_len: int, weight_bytes: int | None,
                             free: int, ranks: int) -> int:
    """The most cache positions (below max_seq_len) whose estimate fits in `free` bytes; the estimate grows
    linearly with positions, so two points give it."""
    at_one = estimate_memory(config, dtype, 1, weight_bytes=weight_bytes, ranks=ranks).total
    per_position = (estimate_memory(config, dtype, max_seq_len, weight_bytes=weight_bytes, ranks=ranks).total
                    - at_one) / max(max_seq_len - 1, 1)
    if at_one > free or per_position <= 0:
        return 0
    return min(max_seq_len - 1, 1 + int((free - at_one) // per_position))
