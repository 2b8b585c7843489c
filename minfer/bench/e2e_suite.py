"""End-to-end benchmark: prefill and decode speed of a random-weight model at batch 1, minfer's
kernels against the plain-torch path of the same model code (`ops.backend("torch")`), or, given a
block-sparse layout, minfer with that layout's attention against minfer with dense attention.

Each backend gets a fresh Generator and one full warm-up generation (graph capture, library init);
the next TIMED_RUNS generations are timed and their medians reported (a single 512-token prefill
measured 13-36 ms on one H100 from run to run). EOS is disabled so every run decodes all its tokens.

Under tensor parallelism (a `sharding` of several ranks, apps/benchmark.py --tp N) every rank runs the
same generations on its slice; memory and bandwidth are per GPU, and the minfer decode row gives the
share of the step that the collectives alone take (`collective_ms`).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics

from collections.abc import Callable

import torch

from .. import ops
from ..checkpoint import load_model, resolve
from ..formats.macko import release_scratch
from ..generate import Generator
from ..model import Transformer
from ..parallel import SINGLE, Sharding
from ..sampling import SamplingParams
from . import report
from .report import Column
from .suites import Suite, SuiteRun, register
from .timing import elapsed_ms

TIMED_RUNS = 3
MEDIAN_STATS = ("prefill_ms", "ttft_ms", "decode_tok_s", "weight_gb_s")

COLUMNS = [
    Column("model", "model"),
    Column("backend", "backend"),
    Column("embedding", "embedding"),
    Column("phase", "phase"),
    Column("tokens", "tokens"),
    Column("ms", "ms (prefill: all; decode: per token)", "{:.1f}"),
    Column("tok_s", "tok/s", "{:.1f}"),
    Column("gb_s", "weights GB/s", "{:.0f}"),
    Column("pct_copy", "% copy BW", "{:.1f}"),
    Column("speedup", "vs base", "{:.2f}x"),
    Column("tp", "TP", "{}"),
    Column("peak_mem_gb", "peak GB/GPU", "{:.1f}"),
    Column("collective_pct", "% step in collectives", "{:.1f}"),
]


def build_model(name: str, dtype: torch.dtype, seed: int = 0, sharding: Sharding = SINGLE, max_seq_len: int = 0):
    """A random-weight model of a known architecture on the GPU (no download), with RoPE tables for
    `max_seq_len` positions when that is beyond the architecture's limit; this rank's part of it under
    tensor parallelism, built on its GPU directly."""
    resolved = resolve(name, "random")
    sharding.check(resolved.config)
    if max_seq_len > resolved.config.max_position_embeddings:
        resolved = dataclasses.replace(resolved, config=dataclasses.replace(resolved.config,
                                                                            max_position_embeddings=max_seq_len))
    return load_model(resolved, dtype, "cuda", seed=seed, sharding=sharding)


def collective_ms(model: Transformer, replays: int = 20) -> float:
    """GPU milliseconds of one decode step's collectives alone: two all-reduces of the hidden vector per
    layer and the logits gather, back to back in a CUDA graph (median of `replays`). Every rank runs the
    same fixed number of replays (collectives must match across ranks)."""
    sharding, dtype = model.sharding, model.norm.weight.dtype
    hidden = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype, device="cuda")
    logits = torch.zeros(1, 1, model.lm_head.fmt.out_features, dtype=dtype, device="cuda")

    def step() -> None:
        for _ in range(2 * model.config.num_layers):
            sharding.all_reduce_(hidden)
        sharding.gather_last_dim(logits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    return statistics.median(elapsed_ms(graph.replay) for _ in range(replays))


def memory_held() -> int:
    """Bytes this process has allocated on the current GPU; taken before a model is built, it is what
    earlier suites left, which `measure_backend(held_before=)` leaves out of the peak."""
    return torch.cuda.memory_allocated()


def measure_backend(model, backend: str, prompt_ids: list[int], new_tokens: int, embedding: str = "host",
                    held_before: int = 0, layout: str | None = None) -> dict:
    """Generation stats on `backend`: the medians of TIMED_RUNS generations after a warm-up one, and
    the highest peak memory of those runs, less `held_before` bytes (see memory_held). minfer reads
    the token embedding from `embedding` ("host": pinned host memory, see
    Transformer.place_embedding), the torch backend always from the GPU. With a `layout`, attention is
    block-sparse over it."""
    model.place_embedding(embedding if backend == "minfer" else "gpu")
    try:
        with ops.backend(backend):  # the Generator runs under the backend it was built in
            generator = Generator(model, None, len(prompt_ids) + new_tokens, "cuda",
                                  attention="dense" if layout is None else "blocksparse",
                                  attention_options=None if layout is None else {"layout": layout})
        generator.eos_id = None
        runs = [generator.generate(prompt_ids, SamplingParams(), max_new_tokens=new_tokens).stats.as_dict()
                for _ in range(1 + TIMED_RUNS)][1:]  # the first captures the graphs and initialises libraries
        del generator
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    stats = dict(runs[-1])
    stats.update({key: statistics.median(run[key] for run in runs) for key in MEDIAN_STATS})
    stats["peak_mem_gb"] = max(run["peak_mem_gb"] for run in runs) - held_before / 1e9
    return stats


def random_prompt(vocab_size: int, tokens: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure_format(model_name: str, dtype: torch.dtype, prepare: Callable[[Transformer], None], prompt_tokens: int,
                   new_tokens: int, embedding: str = "host", sharding: Sharding = SINGLE) -> dict:
    """Batch-1 generation stats on minfer's kernels of a fresh random-weight model after `prepare(model)`
    (prune, convert), with the weight GB a decode step reads and where the embedding ended up. Peak memory
    counts from before the model is built, so what earlier models of the same process left is not in it."""
    release_scratch()  # the previous model's prefill buffer belongs to its own peak
    gc.collect()
    torch.cuda.empty_cache()
    held_before = memory_held()
    model = build_model(model_name, dtype, sharding=sharding)
    prepare(model)
    torch.cuda.empty_cache()
    weight_gb = model.decode_weight_bytes() / 1e9
    stats = measure_backend(model, "minfer", random_prompt(model.config.vocab_size, prompt_tokens), new_tokens,
                            embedding, held_before)
    placed = model.embedding_place()  # a tied embedding stays on the GPU whatever was asked
    del model
    return {"weight_gb": weight_gb, "embedding": placed, **stats}


def run(model_name: str = "llama2-7b", prompt_tokens: int = 512, new_tokens: int = 256,
        dtype: torch.dtype = torch.float16, copy_gbs: float | None = None, seed: int = 0,
        embedding: str = "host", layout: str | None = None, sharding: Sharding = SINGLE,
        on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Rows per (backend, phase); 'speedup' is against torch's rows, or with a `layout` (minfer with dense
    attention, then minfer with the layout) against dense attention's."""
    held_before = memory_held()
    model = build_model(model_name, dtype, seed, sharding, prompt_tokens + new_tokens)
    prompt_ids = random_prompt(model.config.vocab_size, prompt_tokens, seed)
    variants = [("minfer", "minfer", None), ("torch", "torch", None)]  # (ops backend, row label, layout)
    if layout is not None:
        variants = [("minfer", "minfer dense attention", None), ("minfer", f"minfer {layout}", layout)]
    base = variants[-1 if layout is None else 0][1]
    rows = []
    for backend, label, variant_layout in variants:
        stats = measure_backend(model, backend, prompt_ids, new_tokens, embedding, held_before, variant_layout)
        common = {"model": model_name, "backend": label, "dtype": str(dtype).removeprefix("torch."),
                  "embedding": model.embedding_place(), "tp": sharding.world,
                  "peak_mem_gb": stats["peak_mem_gb"]}
        rows.append({**common, "phase": "prefill", "tokens": prompt_tokens, "ms": stats["prefill_ms"],
                     "tok_s": prompt_tokens / stats["prefill_ms"] * 1e3, "gb_s": None, "pct_copy": None})
        decode_gbs = stats["weight_gb_s"]
        step_ms = 1e3 / stats["decode_tok_s"]
        rows.append({**common, "phase": "decode", "tokens": stats["new_tokens"], "ms": step_ms,
                     "tok_s": stats["decode_tok_s"], "gb_s": decode_gbs,
                     "pct_copy": 100 * decode_gbs / copy_gbs if copy_gbs else None,
                     "collective_pct": 100 * collective_ms(model) / step_ms if sharding.active else None})
        on_row(rows[-2])
        on_row(rows[-1])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    base_rows = {row["phase"]: row for row in rows if row["backend"] == base}
    for row in rows:
        row["speedup"] = row["tok_s"] / base_rows[row["phase"]]["tok_s"]
    return rows


def run_step(bench: SuiteRun) -> dict:
    args = bench.args
    copy_gbs = bench.copy_gbs()
    return {"e2e": run(args.model, args.prompt_tokens, args.new_tokens, bench.dtype, copy_gbs,
                       embedding=args.embedding, layout=args.layout, sharding=bench.sharding,
                       on_row=lambda row: print(f"  e2e {row['backend']} {row['phase']}: {row['tok_s']:.1f} "
                                                "tok/s", flush=True))}


def report_step(bench: SuiteRun) -> None:
    args = bench.args
    if bench.results["e2e"]:
        versus = f"'vs base': against dense attention, {args.layout}" if args.layout else "'vs base': against torch"
        report.print_table(f"end to end: {args.model}, random weights, batch 1, {args.prompt_tokens}-token prompt, "
                           f"{args.new_tokens} new tokens, minfer's embedding on the {args.embedding}; {versus}",
                           COLUMNS, bench.results["e2e"])


register(Suite("e2e", {"e2e": list}, run_step, report_step,
               flags=("plot", "model", "prompt_tokens", "new_tokens", "embedding"),
               alone_flags=("context", "attention", "layout", "tp"), e2e=True, in_all=True,
               plot=report.plot_kernels_and_e2e))
