"""minfer.api composes the engine's own steps: what it generates, prunes and refuses, against those steps
called one by one (CPU, float32, the embedded demo model)."""

import pytest
import torch

from minfer.api import load
from minfer.checkpoint import load_model, resolve
from minfer.errors import ContextLengthError, MinferError
from minfer.generate import Generator
from minfer.sampling import SamplingParams
from minfer.sparsity.prune import keep_per_row, prune_model_
from minfer.tokenizer import Tokenizer

PROMPT = "Once upon a time"
CONTEXT = 64
NEW_TOKENS = 8


def tokens_step_by_step(density: float | None = None) -> list[int]:
    """Greedy tokens after PROMPT from the demo loaded, optionally pruned by magnitude, and run by hand."""
    resolved = resolve(None)
    model = load_model(resolved, torch.float32, "cpu")
    if density is not None:
        prune_model_(model, density, progress=False)
    tokenizer = Tokenizer(resolved.tokenizer_path)
    generator = Generator(model, tokenizer, CONTEXT, "cpu")
    return generator.generate(tokenizer.encode(PROMPT), SamplingParams(), NEW_TOKENS).tokens


def test_generate_matches_the_generator_and_repeats():
    engine = load(device="cpu", max_seq_len=CONTEXT)
    first = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert first.tokens == tokens_step_by_step()
    assert first.text == engine.tokenizer.decode(first.tokens)
    assert engine.generate(PROMPT, max_new_tokens=NEW_TOKENS).tokens == first.tokens


def test_prune_stores_the_pruned_projections_as_macko():
    engine = load(device="cpu", max_seq_len=CONTEXT).prune(0.5, sparse="macko")
    assert {linear.fmt.name for _, linear in engine.model.projections()} == {"macko"}
    assert engine.generate(PROMPT, max_new_tokens=NEW_TOKENS).tokens == tokens_step_by_step(0.5)


def test_prune_with_wanda_on_a_calibration_text(tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("The lighthouse keeper counted the boats coming home before the storm. " * 20, encoding="utf-8")
    engine = load(device="cpu", max_seq_len=CONTEXT)
    engine.prune(0.5, method="wanda", sparse="dense", calibration_text=text, calibration_samples=2,
                 calibration_seq_len=16)
    for _, linear in engine.model.projections():
        weight = linear.fmt.to_dense()
        kept = (weight != 0).sum(dim=1)
        assert torch.equal(kept, torch.full_like(kept, keep_per_row(weight.shape[1], 0.5)))


def test_load_refuses_an_unknown_model():
    with pytest.raises(MinferError, match="unknown model"):
        load("no-such-model", device="cpu")


def test_generate_refuses_a_prompt_longer_than_the_context():
    engine = load(device="cpu", max_seq_len=4)
    with pytest.raises(ContextLengthError):
        engine.generate(PROMPT + " there lived a keeper of the light", max_new_tokens=1)
