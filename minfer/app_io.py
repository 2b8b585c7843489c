"""What every command-line entry point shares: an argument parser whose errors are one line and that
takes no abbreviated flags, and a quiet exit when the reader of the output goes away (`| head`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, NoReturn

# What a shell reports for a Unix tool stopped by a closed pipe (128 + SIGPIPE), so `set -o pipefail`
# scripts see minfer as they see `cat`.
CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


class ArgumentParser(argparse.ArgumentParser):
    """Flags only by their full names (`--temp` is not taken for `--temperature`), and bad flags as one
    line on stderr with exit code 2, like every other input error."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


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
