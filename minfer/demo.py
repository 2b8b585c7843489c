"""The embedded default: a tiny Llama-architecture model with seeded random weights and the
bundled sentencepiece tokenizer, both reproducible from this file.

- The tokenizer (minfer/assets/tokenizer.model) is trained with the sentencepiece trainer on the
  prose in data/corpus/ and shipped; `python -m minfer.demo --tokenizer` rebuilds it bit for bit
  and `--check` verifies the shipped file.
- The demo checkpoint (about 6 MB of fp16 safetensors) is built on first use, on the CPU with a
  fixed seed, and cached under the user cache dir, so the demo goes through the same loader as
  a real checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import MinferError
from .tokenizer import BUNDLED_TOKENIZER

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
DEMO_NAME = "minfer-demo"
DEMO_SEED = 0
TOKENIZER_VOCAB_SIZE = 1000
# The shipped tokenizer was trained with this sentencepiece release; others may merge differently.
TOKENIZER_BUILT_WITH = "0.2.3"

# Llama-style trainer options: BPE, byte fallback for anything unseen, digits split, no
# normalization, unk/bos/eos = 0/1/2 as in Llama 2. One thread and no sampling keep it deterministic.
_TRAINER_OPTIONS = dict(
    model_type="bpe",
    vocab_size=TOKENIZER_VOCAB_SIZE,
    character_coverage=0.9995,
    byte_fallback=True,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    num_threads=1,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    minloglevel=2,
)

DEMO_CONFIG = ModelConfig(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=704,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def corpus_lines() -> list[str]:
    """Every non-empty line of data/corpus/*.txt, in file-name order."""
    lines = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines


def train_tokenizer() -> bytes:
    """The serialized sentencepiece model; trained from an iterator into memory, so no file path
    ends up in the model's recorded trainer options."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()), model_writer=model,
                                             **_TRAINER_OPTIONS)
    return model.getvalue()


def cache_root() -> Path:
    root = os.environ.get("MINFER_CACHE_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        root = os.path.join(cache, "minfer")
    return Path(root)


def demo_checkpoint_dir() -> Path:
    """The cached demo checkpoint, built on first use. The folder name hashes everything that
    determines its contents, so a changed config or seed builds a new one."""
    recipe = json.dumps({"config": DEMO_CONFIG.to_hf(), "seed": DEMO_SEED, "torch": torch.__version__.split("+")[0]},
                        sort_keys=True)
    folder = cache_root() / f"demo-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if not (folder / "model.safetensors").is_file():
        try:
            _build_demo_checkpoint(folder)
        except OSError as e:
            raise MinferError(f"cannot write the demo checkpoint under {folder.parent} ({e.strerror}); "
                              "set MINFER_CACHE_DIR to a writable folder") from None
    return folder


def _build_demo_checkpoint(folder: Path) -> None:
    from .checkpoint import random_init, save_hf
    from .model import Transformer

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    staging.chmod(0o755)
    try:
        model = Transformer(DEMO_CONFIG)
        random_init(model, seed=DEMO_SEED, dtype=torch.float16, device="cpu")
        save_hf(model, staging)
        shutil.copyfile(BUNDLED_TOKENIZER, staging / "tokenizer.model")
        try:
            staging.rename(folder)  # atomic: a concurrent builder that won leaves the same files
        except OSError:
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.demo", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--tokenizer", action="store_true", help=f"retrain and overwrite {BUNDLED_TOKENIZER.name}")
    action.add_argument("--check", action="store_true", help="verify the shipped tokenizer is reproduced bit for bit")
    action.add_argument("--checkpoint", action="store_true", help="build (if needed) and print the demo checkpoint dir")
    args = parser.parse_args(argv)
    if args.tokenizer:
        BUNDLED_TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
        BUNDLED_TOKENIZER.write_bytes(train_tokenizer())
        print(f"wrote {BUNDLED_TOKENIZER}")
    elif args.check:
        same = train_tokenizer() == BUNDLED_TOKENIZER.read_bytes()
        print("tokenizer reproduced bit for bit" if same else "tokenizer differs from the shipped file")
        return 0 if same else 1
    else:
        print(demo_checkpoint_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
