"""Generate text with minfer.

With no flags it runs the embedded default, stories260K (a tiny Llama trained on children's
stories), offline, on the GPU if there is one, and tells a short story. Generated text streams to
stdout; notes and stats go to stderr.

Examples:
  python apps/generate.py
  python apps/generate.py --prompt "The little dog" --temperature 0.8 --seed 3
  python apps/generate.py --model stories260K.gguf --tokenizer tok512.model
  python apps/generate.py --model llama2-7b --weights random --max-new-tokens 256
  HF_TOKEN=hf_... python apps/generate.py --model llama2-7b-chat --chat --prompt "Name three rivers."
  python apps/generate.py --model tinyllama-1.1b --temperature 0.8 --top-p 0.95 --prompt "The ocean"
  python apps/generate.py --model /path/to/hf-checkpoint --dtype bfloat16 --json
  python apps/generate.py --sparse macko --density 0.7
  python apps/generate.py --model llama2-7b --sparse macko --density 0.5 --prune wanda --save-compressed ./l7-macko
  python apps/generate.py --model ./l7-macko
  python apps/generate.py --model llama2-7b --weights random --max-seq-len 32768 --attention blocksparse \
      --layout sink-window:sink=64,window=1024 --layout-plot layout.png
  python apps/generate.py --model llama2-70b --weights random --tp 2
  torchrun --nproc-per-node 2 apps/generate.py --model llama2-70b --weights random --sparse macko --density 0.5

Tensor parallelism (--tp N, or started by torchrun) splits every projection and the KV cache over N GPUs
of this host (NCCL; gloo on the CPU: --device cpu, or no GPU); rank 0 alone prints and writes --json.

Real weights come from the Hugging Face Hub (safetensors only) into the HF cache. The meta-llama
repos are gated: accept the license on huggingface.co, then export HF_TOKEN=<access token>.
A local folder with config.json, *.safetensors and tokenizer.model works offline, as does a Llama
GGUF file (F32, F16 or BF16 tensors) with its tokenizer.

Exit status: 0 done, 2 bad input (one `error:` line on stderr), 141 when the reader of the output
went away (e.g. `| head`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, no install

import torch  # noqa: E402

from minfer import formats  # noqa: E402
from minfer.attention import ATTENTION_BACKENDS  # noqa: E402
from minfer.attention.layouts import LAYOUT_HELP, build_layout, density, parse_layout, plot_layout  # noqa: E402
from minfer.cli import ArgumentParser, add_model_arguments, note, run_app, run_main  # noqa: E402
from minfer.checkpoint import resolve  # noqa: E402
from minfer.demo import DEMO_PROMPT  # noqa: E402
from minfer.errors import MinferError  # noqa: E402
from minfer.generate import Generator, check_prompt_ids  # noqa: E402
from minfer.model import EMBEDDING_PLACES  # noqa: E402
from minfer import parallel  # noqa: E402
from minfer.runtime import (  # noqa: E402
    DEFAULT_MAX_SEQ_LEN,
    RANDOM_WEIGHTS_MAX_SEQ_LEN,
    check_memory,
    context_length,
    pick_device,
    pick_dtype,
)
from minfer.sampling import MIN_TEMPERATURE, SamplingParams  # noqa: E402
from minfer.sparsity import cli as sparsity_cli  # noqa: E402
from minfer.sparsity.report import report_summary  # noqa: E402
from minfer.tokenizer import IncrementalDecoder, Tokenizer, require_utf8  # noqa: E402

REAL_MODEL_HINT = ("for real text run a trained model: the default (no --model), or e.g. --model tinyllama-1.1b "
                   "(about 2.2 GB, no login), --model llama2-7b-chat --chat with HF_TOKEN set, or --model "
                   "/path/to/hf-checkpoint")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="apps/generate.py", description=__doc__)
    model = add_model_arguments(parser)
    model.add_argument("--embedding", choices=EMBEDDING_PLACES, default=None,
                       help="where the token embedding lives on a GPU run: host = pinned host memory, read one row "
                            "per step over PCIe, vocab x hidden weights less GPU memory (default with --backend "
                            "minfer; the torch backend keeps it on the gpu)")
    model.add_argument("--tp", type=int, default=None, metavar="N",
                       help="tensor parallelism: split the model over N GPUs of this host, one process each (started "
                            "here; under torchrun N is its --nproc-per-node); N must divide the key/value heads")
    model.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                       help=f"context length: KV cache positions for prompt + generated tokens "
                            f"(default: the model's limit, at most {DEFAULT_MAX_SEQ_LEN}; with --weights random up "
                            f"to {RANDOM_WEIGHTS_MAX_SEQ_LEN} whatever the model's limit)")
    attention = parser.add_argument_group("attention")
    attention.add_argument("--attention", choices=tuple(ATTENTION_BACKENDS), default="dense",
                           help="dense: every query attends to every earlier token; blocksparse: the prompt's "
                                "and decode queries visit only the --layout's kept blocks "
                                "(default: %(default)s)")
    attention.add_argument("--layout", default=None, metavar="NAME[:k=v,...]",
                           help=f"the block-sparse layout, sizes in tokens, blocks of 64: {LAYOUT_HELP} "
                                f"(needs --attention blocksparse)")
    attention.add_argument("--layout-plot", default=None, metavar="PNG",
                           help="write a picture of the layout's first head over the context to this .png file "
                                "and print its density on stderr (needs --layout)")
    sparsity_cli.add_arguments(parser)
    text = parser.add_argument_group("generation")
    text.add_argument("--prompt", default=DEMO_PROMPT, help="text to continue (default: %(default)r)")
    text.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the Llama-2 chat template ([INST] ... [/INST])")
    text.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: %(default)s")
    text.add_argument("--temperature", type=float, default=0.0,
                      help=f"0 = greedy, else at least {MIN_TEMPERATURE} (default: %(default)s)")
    text.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    text.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: 1.0, off)")
    text.add_argument("--seed", type=int, default=0,
                      help="seeds sampling and random weights, 0 to 2**64 - 1 (default: %(default)s)")
    text.add_argument("--json", action="store_true",
                      help="print one JSON object (prompt ids, generated ids, text, stats) instead of streaming")
    return parser


def tensor_parallel(args: argparse.Namespace) -> tuple[parallel.Sharding, torch.device]:
    """This process's rank and device: one rank, or the process group a launcher started it in."""
    world = parallel.launched_world()
    if args.tp is not None and args.tp < 1:
        raise MinferError(f"--tp must be at least 1, got {args.tp}")
    if args.tp not in (None, world):
        raise MinferError(f"--tp {args.tp} but the launcher started {world} processes; pass one of them")
    if world == 1:
        return parallel.SINGLE, pick_device(args.device)
    if args.device not in (None, "cpu", "cuda"):
        raise MinferError(f"--device {args.device}: tensor-parallel rank r runs on cuda:r; pass --device cuda or cpu")
    sparsity_cli.check_tensor_parallel(args)
    sharding, device = parallel.init(pick_device(args.device).type)  # no --device: the GPUs if any, else the CPU
    parallel.quiet_other_ranks(sharding)
    return sharding, device


def run(args: argparse.Namespace) -> int:
    require_utf8(args.prompt, "--prompt")
    sharding, device = tensor_parallel(args)
    dtype = pick_dtype(args.dtype, device)
    if args.max_new_tokens < 1:
        raise MinferError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.embedding == "host" and args.backend != "minfer":
        raise MinferError("--embedding host needs --backend minfer (its kernel reads the table from host memory)")
    check_attention_flags(args)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    resolved = resolve(args.model, sparsity_cli.weights_source(args), args.tokenizer)
    sparsity_cli.check(args, resolved)
    config = resolved.config
    sharding.check(config)
    tokenizer = Tokenizer(resolved.tokenizer_path)
    prompt_ids = tokenizer.chat_prompt(args.prompt) if args.chat else tokenizer.encode(args.prompt)
    check_prompt_ids(prompt_ids, config.vocab_size)
    calibration_ids = sparsity_cli.calibration(args, tokenizer, config)

    max_seq_len = context_length(config, args.max_seq_len, len(prompt_ids), random_weights=resolved.is_random)
    if max_seq_len > config.max_position_embeddings:  # random weights: RoPE tables for the longer context
        config = dataclasses.replace(config, max_position_embeddings=max_seq_len)
        resolved = dataclasses.replace(resolved, config=config)
    check_memory(config, dtype, device, max_seq_len, sparsity_cli.stored_weight_bytes(args, resolved, dtype),
                 ranks=sharding.world)
    if args.layout is not None:
        show_layout(args, config.num_heads, max_seq_len)

    model = sparsity_cli.load_model(resolved, dtype, device, args, seed=args.seed, sharding=sharding)
    # The header only once the weights loaded: an error while loading stays the one line on stderr.
    dtype_name = str(dtype).removeprefix("torch.")
    params_count = config.param_count()
    size = f"{params_count / 1e9:.2f}B" if params_count >= 1e9 else f"{params_count / 1e6:.1f}M"
    stored = sparsity_cli.compressed_source(args, resolved) is not None
    sparse = formats.format_class(sparsity_cli.sparse_format(args)).name
    where = f"{sharding.world} x {device.type} (tensor parallel)" if sharding.active else str(device)
    note(f"minfer: {resolved.name} ({size} parameters, {dtype_name}) on {where}, "
         f"{'random' if resolved.is_random else 'checkpoint'} weights, "
         f"{'projections as stored compressed' if stored else f'sparse={sparse}'}")
    if resolved.is_random:
        note(f"NOTE: {resolved.name}'s architecture with RANDOM weights: the output below is meaningless "
             f"random-weight text (it exercises the whole pipeline); {REAL_MODEL_HINT}.")
        if config.vocab_size > tokenizer.vocab_size:
            note(f"NOTE: the bundled {tokenizer.vocab_size}-piece tokenizer stands in for the real one, so token ids "
                 f"beyond it print as ⁇.")
    sparsity = sparsity_cli.apply(model, args, calibration_ids, resolved.tokenizer_path, note, resolved.is_random,
                                  seed=args.seed)
    model.place_embedding(args.embedding or ("host" if args.backend == "minfer" else "gpu"))
    if args.embedding == "host" and device.type == "cuda" and model.embedding_place() != "host":
        note("NOTE: the embedding is tied to lm_head, which reads it every step: it stays on the GPU.")
    generator = Generator(model, tokenizer, max_seq_len, device, attention=args.attention,
                          attention_options=None if args.layout is None else {"layout": args.layout})

    if args.json:
        result = generator.generate(prompt_ids, params, args.max_new_tokens)
        print(json.dumps({"model": resolved.name, "random_weights": resolved.is_random, "device": str(device),
                          "tensor_parallel": sharding.world,
                          "dtype": dtype_name, "sparse": sparsity_cli.weight_formats(model),
                          "sparsity": None if sparsity is None else report_summary(sparsity), "prompt_ids": prompt_ids,
                          "generated_ids": result.tokens, "text": result.text, "stats": result.stats.as_dict()}))
        return 0

    decoder = IncrementalDecoder(tokenizer, context_ids=prompt_ids)

    def stream(token: int) -> None:
        sys.stdout.write(decoder.feed(token))
        sys.stdout.flush()

    if not args.chat:
        sys.stdout.write(args.prompt)  # the continuation reads on from the prompt
    result = generator.generate(prompt_ids, params, args.max_new_tokens, on_token=stream)
    print(decoder.flush(), flush=True)
    print_stats(result.stats, device, resolved.is_random)
    return 0


def check_attention_flags(args: argparse.Namespace) -> None:
    """--layout goes with --attention blocksparse and only with it; the layout string parses."""
    if args.layout is None:
        if args.attention == "blocksparse":
            raise MinferError(f"--attention blocksparse needs --layout NAME[:k=v,...]; choose {LAYOUT_HELP}")
        if args.layout_plot is not None:
            raise MinferError("--layout-plot needs --attention blocksparse and a --layout to draw")
        return
    if args.attention != "blocksparse":
        raise MinferError(f"--layout needs --attention blocksparse (got --attention {args.attention})")
    parse_layout(args.layout)
    if args.layout_plot is not None:
        plot = Path(args.layout_plot)
        if plot.suffix.lower() != ".png":
            raise MinferError(f"--layout-plot {plot}: name a .png file")
        if not plot.parent.is_dir():
            raise MinferError(f"--layout-plot {plot}: the folder {plot.parent} does not exist")


def show_layout(args: argparse.Namespace, heads: int, max_seq_len: int) -> None:
    """Build the layout over the whole context (a file layout too small fails here, before loading),
    note its density and draw it when asked."""
    layout = build_layout(args.layout, heads, max_seq_len)
    note(f"layout {parse_layout(args.layout)}: {density(layout):.3f} of the causal blocks kept over {max_seq_len} "
         f"positions")
    if args.layout_plot is not None:
        plot_layout(layout, args.layout_plot, f"{parse_layout(args.layout)}, {max_seq_len} tokens")
        note(f"layout plot written to {args.layout_plot}")


def print_stats(stats, device: torch.device, is_random: bool) -> None:
    peak = f"{stats.peak_mem_gb:.2f} GB" if device.type == "cuda" else "n/a (CPU)"
    note(f"\n[{stats.prompt_tokens} prompt + {stats.new_tokens} new tokens, stopped by {stats.stop_reason}]")
    note(f"prefill {stats.prefill_ms:.1f} ms | time to first token {stats.ttft_ms:.1f} ms | "
         f"decode {stats.decode_tok_s:.1f} tok/s | weights read {stats.weight_gb_s:.1f} GB/s | peak GPU memory {peak}")
    if stats.graph_capture_ms >= 1 or stats.warmup_ms >= 1:  # something was set up in this call
        note(f"one-time setup in this call: CUDA-graph capture {stats.graph_capture_ms:.0f} ms, "
             f"first-prefill warm-up {stats.warmup_ms:.0f} ms")
    if is_random:
        note("(random-weight output: the text above means nothing)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.tp is not None and args.tp > 1 and parallel.launched_world() == 1:  # start the ranks, each runs this
        return parallel.launch([sys.executable, str(Path(__file__).resolve()), *argv], args.tp)
    try:
        return run_app(run, args)
    except torch.distributed.DistError as e:  # another rank stopped (or timed out) inside a collective
        note(f"error: tensor-parallel collective failed ({type(e).__name__}: {str(e).splitlines()[0]})")
        return 2
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    run_main(main)
