"""Rebuilding the shipped assets: the embedded default model, stories260K, and the bundled tokenizer.

- stories260K (minfer/assets/stories260K/) is a real trained tiny Llama (hidden 64, 5 layers, vocab
  512) from Andrej Karpathy's llama2.c, trained on TinyStories; its NOTICE.md says where it comes
  from. It is shipped as an HF checkpoint converted from its GGUF file:
  `python -m minfer.demo --convert stories260K.gguf` rebuilds config.json and model.safetensors
  bit for bit.
- The bundled tokenizer (minfer/assets/tokenizer.model), used with random weights and by tests, is
  trained with the sentencepiece trainer on the prose in minfer/data/corpus/ and shipped;
  `python -m minfer.demo --tokenizer` rebuilds it bit for bit and `--check` verifies the shipped file.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from .checkpoint import DEMO_DIR, copy_weights, save_hf
from .corpus import corpus_lines
from .errors import MinferError
from .gguf_source import GGUFCheckpoint
from .model import Transformer
from .tokenizer import BUNDLED_TOKENIZER

DEMO_PROMPT = "Once upon a time"
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


def train_tokenizer() -> bytes:
    """The serialized sentencepiece model; trained from an iterator into memory, so no file path
    ends up in the model's recorded trainer options."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()), model_writer=model,
                                             **_TRAINER_OPTIONS)
    return model.getvalue()


def save_as_hf(path: str | Path, folder: str | Path) -> Path:
    """Write the model of a GGUF file to `folder` as an HF checkpoint (config.json, model.safetensors),
    in the dtype its embedding is stored in; the same file always gives the same bytes."""
    checkpoint = GGUFCheckpoint(path)
    dtype = checkpoint.dtype("model.embed_tokens.weight")
    return save_hf(copy_weights(Transformer(checkpoint.config), checkpoint.tensor, dtype, "cpu"), folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.demo", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--tokenizer", action="store_true", help=f"retrain and overwrite {BUNDLED_TOKENIZER.name}")
    action.add_argument("--check", action="store_true", help="verify the shipped tokenizer is reproduced bit for bit")
    action.add_argument("--convert", metavar="GGUF",
                        help=f"rewrite config.json and model.safetensors of {DEMO_DIR.name} from its GGUF file")
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
        try:
            save_as_hf(args.convert, DEMO_DIR)
        except MinferError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {DEMO_DIR / 'config.json'} and {DEMO_DIR / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
