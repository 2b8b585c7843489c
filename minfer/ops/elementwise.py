"""Per-token element-wise ops (kernels/elementwise): SiLU-and-mul, RMSNorm with the fused residual add,
and RoPE fused with the KV-cache write."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MinferError
from .runtime import fake_impl, use_kernels

# kernels/elementwise/rms_norm.cu: a row stays in the registers of 512 threads, 4 16-byte packs each
# (16 elements each when the row cannot be read in 16-byte packs)
RMS_NORM_MAX_HIDDEN = {torch.float16: 16384, torch.bfloat16: 16384, torch.float32: 8192}
RMS_NORM_MAX_UNALIGNED_HIDDEN = 8192


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@fake_impl("minfer::silu_mul")
def _silu_mul_fake(gate_up, out):
    return None


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up over the fused gate_up projection [..., 2I] -> [..., I]."""
    if out is None:
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if use_kernels(gate_up):
        torch.ops.minfer.silu_mul(gate_up, out)
    else:
        out.copy_(silu_mul_reference(gate_up))
    return out


# ---- RMSNorm, with the residual add fused ----


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: variance in fp32 (or wider), the normalised value cast back to x's dtype,
    then multiplied by the weight."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * F.rms_norm(wide, (x.shape[-1],), eps=eps).to(x.dtype)  # torch's fused kernel on GPU


def _check_rms_norm_row(x: torch.Tensor, weight: torch.Tensor) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise MinferError(f"rms_norm needs a {x.dtype} weight of shape ({hidden},), got {weight.dtype} "
                          f"{tuple(weight.shape)}")
    if hidden > RMS_NORM_MAX_HIDDEN.get(x.dtype, 0) or (hidden > RMS_NORM_MAX_UNALIGNED_HIDDEN and hidden % 8):
        raise MinferError(f"the rms_norm kernel holds rows of up to {RMS_NORM_MAX_HIDDEN.get(x.dtype, 0)} "
                          f"{x.dtype} elements ({RMS_NORM_MAX_UNALIGNED_HIDDEN} when not a multiple of 8), got "
                          f"{hidden}; ops.backend('torch') runs the reference")


@fake_impl("minfer::rms_norm")
def _rms_norm_fake(x, weight, eps, out):
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x) * weight over the last dim, one pass over x (out may be x itself)."""
    if out is None:
        out = torch.empty_like(x)
    if use_kernels(x):
        _check_rms_norm_row(x, weight)
        torch.ops.minfer.rms_norm(x, weight, eps, out)
    else:
        out.copy_(rms_norm_reference(x, weight, eps))
    return out


@fake_impl("minfer::add_rms_norm")
def _add_rms_norm_fake(residual, x, weight, eps, out):
    return None


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x in place (rounded to its dtype, as `residual + x` is), then returns
    rms_norm(residual) * weight; one pass over residual and x."""
    if out is None:
        out = torch.empty_like(x)
    if use_kernels(x):
        _check_rms_norm_row(x, weight)
        torch.ops.minfer.add_rms_norm(residual, x, weight, eps, out)
    else:
        residual.add_(x)
        out.copy_(rms_norm_reference(residual, weight, eps))
    return out


# ---- RoPE fused with the KV-cache write ----


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """HF half-split RoPE (rotate_half) in fp32: q [B, T, Hq, D] rotated in place; rotated k and v
    [B, T, Hkv, D] stored into the [B, Hkv, S, D] caches at positions input_pos [T]."""
    c = cos[input_pos][:, None, :]  # [T, 1, D/2], broadcast over batch and heads
    s = sin[input_pos][:, None, :]
    cos_full, signed_sin = torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)

    def rotate(x):
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] folded into the sign of sin
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return torch.addcmul(wide * cos_full, wide.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    q.copy_(rotate(q))
    k_cache.index_copy_(2, input_pos, rotate(k).to(k.dtype).transpose(1, 2))
    v_cache.index_copy_(2, input_pos, v.transpose(1, 2))


@fake_impl("minfer::rope_write_kv")
def _rope_write_kv_fake(q, k, v, cos, sin, input_pos, k_cache, v_cache):
    return None


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """RoPE on q in place and on k, then k and v written into the caches at input_pos, in one pass.

    q [B, T, Hq, D], k and v [B, T, Hkv, D] may be strided views (e.g. of the fused qkv output) with a
    contiguous last dim; cos and sin are fp32 [>= S, D/2] tables (Llama-3 scaling included), input_pos
    int64 [T] on the device, so the call is graph-capturable. k itself is left as it was. The kernel
    skips tokens whose position is outside the cache; the caller checks the context length.
    """
    if use_kernels(q):
        torch.ops.minfer.rope_write_kv(q, k, v, cos, sin, input_pos, k_cache, v_cache)
    else:
        rope_write_kv_reference(q, k, v, cos, sin, input_pos, k_cache, v_cache)
