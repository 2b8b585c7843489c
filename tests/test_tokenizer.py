"""Tokenizer: round trips (ASCII, multi-byte UTF-8, leading spaces, byte fallback), the chat
template, incremental detokenization, and the bundled model's bit-for-bit reproducibility."""

import pytest
import sentencepiece

from minfer import demo
from minfer.tokenizer import IncrementalDecoder, Tokenizer, bundled_tokenizer_path

TEXTS = [
    "The lighthouse turns every five seconds.",
    "  two leading spaces, and   three inside",
    " one leading space",
    "trailing space ",
    "tabs\tand\nnewlines\n",
    "Café, naïve, crème brûlée; Straße; Ελληνικά; русский",
    "パン屋は朝五時に店を開け、面包师每天早上五点开门。",
    "unseen characters fall back to bytes: 😀 🦀 ♞ ᚠ 𝔘",
    "digits 1234567890 and symbols π ≈ 3.14159 → ∞",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(bundled_tokenizer_path())


def test_special_ids_match_llama2(tok):
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, demo.TOKENIZER_VOCAB_SIZE)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=False, eos=True)) == text


def test_byte_fallback_is_used_for_unseen_characters(tok):
    ids = tok.encode("🦀", bos=False)
    pieces = [tok._backend._sp.id_to_piece(i) for i in ids]
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    assert tok.decode(ids) == "🦀"


def test_out_of_vocabulary_ids_decode_as_unknown(tok):
    assert tok.decode([tok.vocab_size + 5]) == tok.decode([0]) != ""


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_equals_full_decode(tok, text):
    ids = tok.encode(text, bos=True)
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.feed(i) for i in ids]
    streamed = "".join(deltas) + decoder.flush()
    assert streamed == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas), "a partial multi-byte character was printed"


def test_incremental_decoding_after_a_prompt_keeps_the_leading_space(tok):
    prompt = tok.encode("Mara counts the")
    reply = tok.encode("seconds 😀 between flashes", bos=False)  # "▁seconds": a space in context
    decoder = IncrementalDecoder(tok, context_ids=prompt)
    streamed = "".join(decoder.feed(i) for i in reply) + decoder.flush()
    assert tok.decode(prompt + reply) == "Mara counts the seconds 😀 between flashes"
    assert streamed == " seconds 😀 between flashes"


def test_incremental_decoding_holds_back_split_characters(tok):
    ids = tok.encode("🦀", bos=False)
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.feed(i) for i in ids]
    assert deltas == [""] * (len(ids) - 1) + ["🦀"]
    assert decoder.flush() == ""


def test_flush_emits_an_incomplete_tail(tok):
    decoder = IncrementalDecoder(tok)
    first_byte = tok.encode("🦀", bos=False)[-4]
    assert decoder.feed(first_byte) == ""
    assert decoder.flush() == "\ufffd"


def test_chat_template(tok):
    plain = tok.chat_prompt("  Hello there ")
    assert plain == tok.encode("[INST] Hello there [/INST]")
    with_system = tok.chat_prompt("Hi", system="Be brief.")
    assert tok.decode(with_system) == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"
    assert with_system[0] == tok.bos_id


def test_bundled_tokenizer_is_reproducible():
    trained = demo.train_tokenizer()
    assert trained == demo.train_tokenizer(), "the trainer is not deterministic"
    if sentencepiece.__version__ != demo.TOKENIZER_BUILT_WITH:
        pytest.skip(f"shipped tokenizer was built with sentencepiece {demo.TOKENIZER_BUILT_WITH}")
    assert trained == bundled_tokenizer_path().read_bytes()


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    from minfer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        Tokenizer(tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="not a sentencepiece model"):
        Tokenizer(tmp_path / "tokenizer.model")


def test_tokenizer_json_backend(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(demo.corpus_lines(), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|begin|>", "eos_token": {"content": "<|end|>"}}')
    tok = Tokenizer(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0 and tok.decode(ids) == text
        decoder = IncrementalDecoder(tok)
        assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == text


def test_tokenizer_json_unknown_token_with_id_zero(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(demo.corpus_lines(), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<|begin|>", "eos_token": "<|end|>", "unk_token": "<unk>"}')
    tok = Tokenizer(tmp_path / "tokenizer.json")
    assert (tok._backend.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2)


def test_unreadable_tokenizer_json_is_a_clear_error(tmp_path):
    pytest.importorskip("tokenizers")
    from minfer.errors import MinferError

    broken = tmp_path / "tokenizer.json"
    broken.write_text("{ this is not a tokenizer")
    with pytest.raises(MinferError, match="not a readable tokenizer.json"):
        Tokenizer(broken)
