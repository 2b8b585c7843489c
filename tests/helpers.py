"""Helpers shared by several test modules."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from minfer.checkpoint import random_init
from minfer.config import ModelConfig
from minfer.model import Transformer


def load_app(path: Path):
    """An app's module, loaded in this process (a subprocess each is slow)."""
    spec = importlib.util.spec_from_file_location(path.stem + "_app", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


APP = Path(__file__).resolve().parent.parent / "apps" / "generate.py"
PROFILE_APP = APP.with_name("profile.py")


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"} | (env or {})
    return subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, env=environment,
                          timeout=300)


def assert_input_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0]


def in_process(app, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """An app's main(argv) run in this process, with its exit code and output as a subprocess gives them."""
    try:
        code = app.main(argv)
    except SystemExit as exit_:  # argparse rejects a flag
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def tiny_random_model(dtype: torch.dtype = torch.float32) -> Transformer:
    config = ModelConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=96, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return random_init(Transformer(config), seed=1, dtype=dtype, device="cpu")
