"""GPU timing: back-to-back launches inside a CUDA graph, inputs rotated past L2, a warm-up of fixed
length, median of replays."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def rotation_count(bytes_per_call: int, l2_multiple: float = 4.0, max_copies: int = 64) -> int:
    """How many input copies to cycle through so that they cannot all sit in L2."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, min(max_copies, int(l2 * l2_multiple // max(bytes_per_call, 1)) + 1))


# Untimed replays before timing. On an H100 a freshly built 32000x4096 MACKO matrix ran its first ~30
# back-to-back replays (~5 ms) 15% slower than every later one, whatever the idle time before them
# (docs/perf-notes.md, session 24); the 3 replays used before timed that slow start.
WARMUP_MS = 25.0
WARMUP_REPLAYS = 50


def warm_up(replay: Callable[[], None]) -> None:
    """Runs `replay()` and waits for the GPU until both WARMUP_REPLAYS runs and WARMUP_MS have passed."""
    start = time.perf_counter()
    count = 0
    while count < WARMUP_REPLAYS or (time.perf_counter() - start) * 1e3 < WARMUP_MS:
        replay()
        torch.cuda.synchronize()
        count += 1


def time_graph(run: Callable[[int], None], copies: int, replays: int = 20) -> float:
    """Median milliseconds of one call of `run(i)`.

    `run(i)` launches the work on input copy i (0 <= i < copies). One graph holds `copies` calls
    back to back, so launch gaps shrink and each call reads cold data; the graph is warmed up
    (`warm_up`), then each replay is timed with CUDA events and the median replay time is divided by
    `copies`.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # eager warm-up: lazy init, autotuning, allocator growth
            run(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            run(i)
    warm_up(graph.replay)

    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written: the memory ceiling.

    The copy is an SM kernel (an fp16 multiply by one): a memcpy captured in a CUDA graph runs on a copy
    engine, which measured only 2.73 TB/s on an H200 where SM kernels move 4.2 TB/s.
    """
    src = torch.randn(nbytes // 4, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_graph(lambda i: torch.mul(src, 1.0, out=dst), copies=1, replays=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
