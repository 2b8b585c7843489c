"""GPU timing: back-to-back launches inside a CUDA graph, inputs rotated past L2, a warm-up of fixed
length, median of replays."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch


def rotation_count(bytes_per_call: int, l2_multiple: float = 4.0, max_copies: int = 64) -> int:
    """How many input copies to cycle through so that they cannot all sit in L2."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, min(max_copies, int(l2 * l2_multiple // max(bytes_per_call, 1)) + 1))


# Untimed calls before timing. On an H100 a freshly built 32000x4096 MACKO matrix ran its first ~30
# back-to-back calls per copy (~5 ms) 15% slower than every later one, whatever the idle time before
# them (docs/perf-notes.md, the 2026-11-24 b255d11 entry); the 3 replays used before timed that slow start.
WARMUP_MS = 25.0
WARMUP_CALLS = 50
# Each timed replay holds at least this much work: the events around a replay also time the graph's
# launch, a few microseconds, which was ~7% of a 4096x11008 SpMV timed over 4 calls (same entry).
MIN_REPLAY_MS = 0.5


def warm_up(replay: Callable[[], None], calls_per_replay: int = 1) -> None:
    """Runs `replay()` and waits for the GPU until WARMUP_CALLS calls and WARMUP_MS have passed."""
    start = time.perf_counter()
    calls = 0
    while calls < WARMUP_CALLS or (time.perf_counter() - start) * 1e3 < WARMUP_MS:
        replay()
        torch.cuda.synchronize()
        calls += calls_per_replay


def _capture(run: Callable[[int], None], calls: int, copies: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            run(i % copies)
    return graph


def elapsed_ms(launch: Callable[[], None]) -> float:
    """GPU milliseconds between two events around what `launch()` enqueues."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_graph(run: Callable[[int], None], copies: int, replays: int = 20) -> float:
    """Median milliseconds of one call of `run(i)`.

    `run(i)` launches the work on input copy i (0 <= i < copies). One graph holds the calls back to
    back, cycling through the copies (so each call reads cold data), as many rounds as make a replay
    last MIN_REPLAY_MS; after `warm_up`, each replay is timed with CUDA events and the median replay
    time is divided by the number of calls.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # eager warm-up: lazy init, autotuning, allocator growth
            run(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    calls = copies
    graph = _capture(run, calls, copies)
    graph.replay()  # the first replay also uploads the graph
    round_ms = elapsed_ms(graph.replay)
    if round_ms < MIN_REPLAY_MS:
        calls = copies * math.ceil(MIN_REPLAY_MS / max(round_ms, 1e-4))
        graph = _capture(run, calls, copies)
    warm_up(graph.replay, calls)
    return statistics.median(elapsed_ms(graph.replay) / calls for _ in range(replays))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written: the memory ceiling.

    The copy is an SM kernel (an fp16 multiply by one): a memcpy captured in a CUDA graph runs on a copy
    engine, which measured only 2.73 TB/s on an H200 where SM kernels move 4.2 TB/s.
    """
    src = torch.randn(nbytes // 4, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_graph(lambda i: torch.mul(src, 1.0, out=dst), copies=1, replays=20)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
