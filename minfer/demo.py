"""The embedded default model, stories260K, and the bundled tokenizer.

- stories260K (minfer/assets/stories260K/) is a real trained tiny Llama (hidden 64, 5 layers, vocab
  512) from Andrej Karpathy's llama2.c, trained on TinyStories; its NOTICE.md says where it comes
  from. It is shipped as an HF checkpoint converted from its GGUF file:
  `python -m minfer.demo --convert stories260K.gguf` rebuilds config.json and model.safetensors
  bit for bit.
- The bundled tokenizer (minfer/assets/tokenizer.model), used with random weights and by tests, is
  trained with the sentencepiece trainer on the prose in data/corpus/ and shipped;
  `python -m minfer.demo --tokenizer` rebuilds it bit for bit and `--check` verifies the shipped file.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from .errors import MinferError
from .tokenizer import BUNDLED_TOKENIZER

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
DEMO_NAME = "stories260K"
DEMO_NAMES = (DEMO_NAME, "minfer-demo")  # minfer-demo: the default's name before it had real weights
DEMO_DIR = Path(__file__).resolve().parent / "assets" / DEMO_NAME
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.demo", description=__doc__.split("\n\n")[0])
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
        from .gguf_source import save_as_hf

        try:
            save_as_hf(args.convert, DEMO_DIR)
        except MinferError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {DEMO_DIR / 'config.json'} and {DEMO_DIR / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
