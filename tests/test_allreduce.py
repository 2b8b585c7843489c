"""minfer's one-shot all-reduce (kernels/allreduce): one rank on one GPU (the copy and the checks, opcheck,
graph capture), and 2+ ranks on as many GPUs against a float64 sum, every rank with the same bits."""

import sys
import textwrap

import pytest
import torch

from minfer import ops
from minfer.parallel import launch
from tests.conftest import requires_cuda

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def one_rank_tables(slot_bytes: int):
    """A single rank's buffer, signal pad and epochs, with int64 [1] pointer tables."""
    buffer = torch.zeros(2 * slot_bytes, dtype=torch.uint8, device="cuda")
    pad = torch.zeros(1024, dtype=torch.int32, device="cuda")
    as_table = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device="cuda")  # noqa: E731
    return buffer, pad, as_table(buffer), as_table(pad), torch.zeros(ops.ALL_REDUCE_MAX_BLOCKS, dtype=torch.int32, device="cuda")


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.racecheck
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [8, 2056, 32768])
def test_one_rank_copies_its_part_and_advances_its_epochs(numel, dtype):
    numel = numel * 4 // torch.finfo(dtype).bits * 4  # a multiple of 16 bytes in every dtype
    _, _, buffers, signals, epochs = keep = one_rank_tables(ops.ALL_REDUCE_MAX_BYTES)
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    for call in range(3):
        ops.one_shot_all_reduce(src, dst, buffers, signals, epochs, ops.ALL_REDUCE_MAX_BYTES, 0)
        assert torch.equal(dst, src)
    blocks = -(-numel * src.element_size() // (256 * 16))
    assert epochs[:blocks].tolist() == [3] * blocks and not epochs[blocks:].any()
    del keep


@requires_cuda
def test_opcheck_and_graph_capture():
    _, _, buffers, signals, epochs = keep = one_rank_tables(4096)
    src = torch.randn(512, device="cuda").half()
    dst = torch.empty_like(src)
    torch.library.opcheck(torch.ops.minfer.one_shot_all_reduce, (src, dst, buffers, signals, epochs, 4096, 0))
    expected = src.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.one_shot_all_reduce(src, src, buffers, signals, epochs, 4096, 0)
    before = epochs[0].item()
    for _ in range(4):
        graph.replay()
    assert epochs[0].item() == before + 4 and torch.equal(src, expected)
    del keep


@requires_cuda
def test_refusals_name_the_problem():
    _, _, buffers, signals, epochs = keep = one_rank_tables(64)
    odd = torch.zeros(9, dtype=torch.float16, device="cuda")
    assert not ops.one_shot_all_reduce_fits(odd, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.minfer.one_shot_all_reduce(odd, odd, buffers, signals, epochs, 64, 0)
    big = torch.zeros(64, dtype=torch.float16, device="cuda")
    assert not ops.one_shot_all_reduce_fits(big, 64)
    with pytest.raises(RuntimeError, match="fit a slot"):
        torch.ops.minfer.one_shot_all_reduce(big, big, buffers, signals, epochs, 64, 0)
    with pytest.raises(RuntimeError, match="rank out of range"):
        torch.ops.minfer.one_shot_all_reduce(odd[:8], odd[:8], buffers, signals, epochs, 64, 1)
    del keep


# Each rank builds every rank's inputs from the same seeds, so it knows the float64 sum (the largest size
# goes to NCCL); eager calls and graph replays alternate the slots; all ranks' results are compared bit for bit.
RANKS_PROGRAM = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from minfer import ops, parallel
    ops.build()
    sharding, device = parallel.init("cuda")
    world, rank = sharding.world, sharding.rank
    def parts(numel, dtype, seed):
        return [torch.randn(numel, generator=torch.Generator().manual_seed(seed * 31 + r)).to(dtype).to(device)
                for r in range(world)]
    failures = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for step, numel in enumerate((8, 1032, 4096, 16384 * 2 // torch.finfo(dtype).bits * 16, 40000)):
            every = parts(numel, dtype, step)
            out = every[rank].clone()
            sharding.all_reduce_(out)
            expected = torch.stack([p.double() for p in every]).sum(0)
            error = ((out.double() - expected).norm() / expected.norm()).item()
            if error > (1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-6):
                failures.append(f"{dtype} {numel}: error {error}")
            gathered = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(gathered, out)
            if not all(torch.equal(g, out) for g in gathered):
                failures.append(f"{dtype} {numel}: ranks differ")
    hidden = torch.zeros(4096, dtype=torch.float16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(7):
            sharding.all_reduce_(hidden)
    for replay in range(5):
        hidden.fill_(1.0 / world)
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(hidden, torch.full_like(hidden, float(world ** 6))):
            failures.append(f"graph replay {replay}: {hidden[:4].tolist()}")
    if failures:
        print("error: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)
    if rank == 0:
        print("ok")
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on a multi-GPU device)")
def test_ranks_sum_to_the_float64_reference_with_the_same_bits(capfd):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    code = launch([sys.executable, "-c", RANKS_PROGRAM], world)
    assert code == 0, capfd.readouterr().err
    assert capfd.readouterr().out.split() == ["ok"]
