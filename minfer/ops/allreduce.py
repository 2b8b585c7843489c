"""Collectives of a tensor-parallel decode step (kernels/allreduce): the one-shot all-reduce of a small
tensor through symmetric memory, each rank reading its peers' buffers directly."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .runtime import fake_impl, use_kernels

ALL_REDUCE_MAX_BLOCKS = 16  # kAllReduceMaxBlocks: the epoch counters a rank keeps
ALL_REDUCE_MAX_BYTES = ALL_REDUCE_MAX_BLOCKS * 256 * 16  # kAllReduceMaxBytes: blocks of 256 16-byte vectors


def one_shot_all_reduce_reference(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst = the sum of src over the ranks of the default group (src alone without one)."""
    dst.copy_(src)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(dst)
    return dst


@fake_impl("minfer::one_shot_all_reduce")
def _one_shot_all_reduce_fake(src, dst, buffers, signals, epochs, slot_bytes, rank):
    return None


def one_shot_all_reduce_fits(src: torch.Tensor, slot_bytes: int) -> bool:
    """Whether the kernel takes `src`: on a GPU, contiguous, 16-byte aligned, its bytes a multiple of 16
    that fits a slot."""
    size = src.numel() * src.element_size()
    return (src.is_cuda and src.is_contiguous() and src.data_ptr() % 16 == 0 and size % 16 == 0
            and size <= min(slot_bytes, ALL_REDUCE_MAX_BYTES) and src.dtype in (torch.float16, torch.bfloat16,
                                                                                 torch.float32))


def one_shot_all_reduce(src: torch.Tensor, dst: torch.Tensor, buffers: torch.Tensor, signals: torch.Tensor,
                        epochs: torch.Tensor, slot_bytes: int, rank: int) -> torch.Tensor:
    """dst = the sum over the ranks of each rank's `src`, summed in float32 in rank order (every rank
    gets the same bits); dst may be src. `buffers` and `signals` (int64 [world] on this GPU) hold the
    addresses of every rank's symmetric buffer (two slots of `slot_bytes`) and signal pad, `epochs`
    (int32 [ALL_REDUCE_MAX_BLOCKS], zeroed) this rank's call counters; every rank calls it with the same sizes in the
    same order (minfer.parallel.PeerAllReduce sets this up). CUDA-graph capturable. The torch backend
    runs the reference, NCCL's all-reduce."""
    if not use_kernels(src):
        return one_shot_all_reduce_reference(src, dst)
    torch.ops.minfer.one_shot_all_reduce(src, dst, buffers, signals, epochs, slot_bytes, rank)
    return dst
