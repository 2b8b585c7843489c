"""The embedded default: a tiny Llama-architecture model with seeded random weights and the
bundled sentencepiece tokenizer, both reproducible from this file.

- The tokenizer (minfer/assets/tokenizer.model) is trained with the sentencepiece trainer on the
  prose in data/corpus/ and shipped; `python -m minfer.demo --tokenizer` rebuilds it bit for bit
  and `--check` verifies the shipped file.
- The demo checkpoint (about 6 MB of fp16 safetensors) is built from DEMO_CONFIG and DEMO_SEED on
  first use (`checkpoint.demo_checkpoint_dir`), on the CPU, and cached under `cache_root()`, so
  the demo goes through the same loader as a real checkpoint.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

from .config import ModelConfig
from .corpus import corpus_lines
from .tokenizer import BUNDLED_TOKENIZER

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.demo", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--tokenizer", action="store_true", help=f"retrain and overwrite {BUNDLED_TOKENIZER.name}")
    action.add_argument("--check", action="store_true", help="verify the shipped tokenizer is reproduced bit for bit")
    args = parser.parse_args(argv)
    if args.tokenizer:
        BUNDLED_TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
        BUNDLED_TOKENIZER.write_bytes(train_tokenizer())
        print(f"wrote {BUNDLED_TOKENIZER}")
    elif args.check:
        same = train_tokenizer() == BUNDLED_TOKENIZER.read_bytes()
        print("tokenizer reproduced bit for bit" if same else "tokenizer differs from the shipped file")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
