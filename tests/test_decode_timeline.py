"""The decode-timeline attribution on a synthetic trace (no GPU): gaps between kernel ends split a step."""

import pytest

from minfer.bench import decode_timeline as timeline


def kernel(name, start, end, grid="1x1x1"):
    return {"name": name, "grid": grid, "start": start, "end": end}


def synthetic_trace():
    # prefill, then 3 steps of: gemv (starts early, PDL) -> norm -> argmax, each step 10 µs
    kernels = [kernel("prefill_gemm", 0.0, 50.0), kernel("argmax_kernel<__half>", 50.0, 52.0)]
    for step in range(3):
        t = 52.0 + 10.0 * step
        kernels += [kernel("gemv_mma_kernel<__half, 8, 4>", t - 1.0, t + 6.0, "256x1x1"),
                    kernel("rms_norm_kernel", t + 5.0, t + 8.0),
                    kernel("argmax_kernel<__half>", t + 9.0, t + 10.0)]
    return kernels


def test_steps_are_cut_at_the_sampling_kernel_and_prefill_is_dropped():
    steps = timeline.split_steps(synthetic_trace())
    assert len(steps) == 3
    names = [k["name"] for k in steps[0]]
    assert names == ["gemv_mma_kernel<__half, 8, 4>", "rms_norm_kernel", "argmax_kernel<__half>"]


def test_added_times_sum_to_the_step():
    rows, step_us = timeline.attribute(timeline.split_steps(synthetic_trace()))
    assert step_us == pytest.approx(10.0)
    by_name = {row["kernel"]: row for row in rows}
    assert by_name["gemv_mma_kernel<__half, 8, 4>"]["added_us"] == pytest.approx(6.0)
    assert by_name["gemv_mma_kernel<__half, 8, 4>"]["own_us"] == pytest.approx(7.0)
    assert by_name["rms_norm_kernel"]["added_us"] == pytest.approx(2.0)
    assert by_name["argmax_kernel<__half>"]["added_us"] == pytest.approx(2.0)
    assert by_name["argmax_kernel<__half>"]["idle_us"] == pytest.approx(1.0)
    assert sum(row["pct"] for row in rows) == pytest.approx(100.0)


def test_kernel_names_lose_namespaces_and_parameters():
    name = "void minfer::(anonymous namespace)::gemv_mma_kernel<__half, 8, 4>(__half const*, int)"
    assert timeline.short_name(name) == "gemv_mma_kernel<__half, 8, 4>"
