"""What apps/generate.py and apps/evaluate.py share: a parser whose errors are one line and exit 2,
the flags that choose the model and where it runs, and the handling of errors around a run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from . import formats, ops
from .config import ALIASES
from .demo import DEMO_NAME
from .errors import MinferError
from .runtime import DTYPES


class Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        """Bad flags: one line on stderr and exit code 2, like every other input error."""
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
    model.add_argument("--sparse", choices=sorted({*formats.FORMATS, *formats.ALIASES}), default=None,
                       help="weight format of the attention and MLP projections (default: none = dense; a "
                            "compressed model loads as stored)")
    model.add_argument("--backend", choices=ops.BACKENDS, default=ops.backend(),
                       help="minfer: our CUDA kernels on a GPU; torch: the plain-PyTorch path of the same model "
                            "(default: %(default)s, or $MINFER_BACKEND)")
    return model


def note(message: str) -> None:
    """Notes and stats go to stderr, so stdout holds only the result."""
    print(message, file=sys.stderr, flush=True)


def run_app(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)`, with bad input (and running out of memory) reported in one line and exit code 2."""
    try:
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
