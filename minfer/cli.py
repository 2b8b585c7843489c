"""What every command-line entry point shares: an argument parser whose errors are one line and that
takes no abbreviated flags, the flags that choose the model and where it runs, the handling of errors
around a run, and a quiet exit when the reader of the output goes away (`| head`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from . import formats, ops
from .checkpoint import DEMO_NAME
from .config import ALIASES
from .errors import MinferError
from .runtime import DTYPES

# What a shell reports for a Unix tool stopped by a closed pipe (128 + SIGPIPE), so `set -o pipefail`
# scripts see minfer as they see `cat`.
CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


class ArgumentParser(argparse.ArgumentParser):
    """Flags only by their full names (`--temp` is not taken for `--temperature`), and bad flags as one
    line on stderr with exit code 2, like every other input error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "model" group: which model, its tokenizer and weights, dtype, device, weight format, backend."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="NAME",
                       help=f"alias ({', '.join(ALIASES)}), HF repo id (owner/name), local folder or .gguf file "
                            f"(default: {DEMO_NAME}, the embedded TinyStories model)")
    model.add_argument("--tokenizer", default=None, metavar="FILE",
                       help="tokenizer.model or tokenizer.json to use instead of the model's own (default: the "
                            "model's; for a .gguf file, the tokenizer.model beside it)")
    model.add_argument("--weights", choices=("hf", "random"), default="hf",
                       help="hf: the checkpoint's weights (downloaded if needed); random: the same architecture "
                            "with seeded random weights, no download (default: hf)")
    model.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                       help="weight and activation dtype (default: float16 on GPU, float32 on CPU)")
    model.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    model.add_argument("--sparse", choices=formats.format_choices(), default=None,
                       help="weight format of the attention and MLP projections (default: none = dense; a "
                            "compressed model loads as stored)")
    model.add_argument("--backend", choices=ops.BACKENDS, default=ops.current_backend(),
                       help="minfer: our CUDA kernels on a GPU; torch: the plain-PyTorch path of the same model "
                            "(default: %(default)s, or $MINFER_BACKEND)")
    return model


def note(message: str) -> None:
    """Notes and stats go to stderr, so stdout holds only the result."""
    print(message, file=sys.stderr, flush=True)


def run_app(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)` under the chosen backend, with bad input (and running out of memory) reported in one
    line and exit code 2."""
    try:
        with ops.backend(args.backend):
            return run(args)
    except MinferError as e:
        note(f"error: {e}")
        return 2
    except torch.OutOfMemoryError:
        note("error: out of memory while loading or running the model; try a 16-bit --dtype, "
             "a shorter context or a smaller model")
        return 2
    except KeyboardInterrupt:
        note("\ninterrupted")
        return 130


def run_main(main: Callable[[], int]) -> NoReturn:
    """sys.exit(main()); when stdout or stderr is a pipe its reader closed, exit quietly instead.
    Characters the output's encoding cannot show (PYTHONIOENCODING=ascii, a latin-1 terminal) print
    as ? rather than ending the run."""
    sys.stdout.reconfigure(errors="replace")
    try:
        try:
            code = main()
        except SystemExit as exit_:  # argparse ends --help and bad flags this way, with the text still buffered
            code = exit_.code
        sys.stdout.flush()  # inside the try: a flush at interpreter exit would report the closed pipe
        sys.stderr.flush()
    except BrokenPipeError:
        # Point both streams at /dev/null so the interpreter's own final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())
        code = CLOSED_PIPE_EXIT
    sys.exit(code)
