"""minfer against transformers on tiny random Llamas (MHA/GQA/MQA, tied/untied, Llama-3 RoPE):
fp32 logits for prefill and every decode step, chunked prefill, batches, and greedy generation."""

import pytest
import torch

from minfer.generate import Generator
from minfer.sampling import SamplingParams
from tests.tiny_llama import VARIANTS, hf_tiny_llama, load_minfer, save_sharded

TOLERANCE = 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = hf_tiny_llama(request.param)
    folder = save_sharded(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_minfer(folder), folder


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 997, (2, 40), generator=torch.Generator().manual_seed(1))


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits


def test_checkpoint_is_sharded(pair):
    _, _, folder = pair
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1


def test_prefill_logits_match(pair, tokens):
    hf, model, _ = pair
    model.setup_caches(2, 64)
    with torch.inference_mode():
        out = model(tokens, torch.arange(40), kv_len=40)
    assert out.shape == (2, 40, 997)
    assert rel_err(out, hf_logits(hf, tokens)) < TOLERANCE


@pytest.mark.parametrize("kv_len", [None, 48])  # the whole cache, or a prefix of it
def test_every_decode_step_matches(pair, tokens, kv_len):
    hf, model, _ = pair
    model.setup_caches(2, 64)
    ref = hf_logits(hf, tokens)
    with torch.inference_mode():
        model(tokens[:, :8], torch.arange(8), kv_len=8)
        for pos in range(8, 40):
            out = model(tokens[:, pos:pos + 1], torch.tensor([pos]), kv_len=kv_len)
            assert rel_err(out[:, 0], ref[:, pos]) < TOLERANCE, f"decode step at position {pos}"


def test_chunked_prefill_matches(pair, tokens):
    """A second prompt chunk at positions 16..39 attends to the first chunk through the cache."""
    hf, model, _ = pair
    model.setup_caches(2, 64)
    ref = hf_logits(hf, tokens)
    with torch.inference_mode():
        model(tokens[:, :16], torch.arange(16), kv_len=16)
        out = model(tokens[:, 16:], torch.arange(16, 40))
    assert rel_err(out, ref[:, 16:]) < TOLERANCE


def test_batch_rows_are_independent(pair, tokens):
    _, model, _ = pair
    with torch.inference_mode():
        model.setup_caches(2, 64)
        both = model(tokens, torch.arange(40), kv_len=40)
        model.setup_caches(1, 64)
        second = model(tokens[1:], torch.arange(40), kv_len=40)
    assert rel_err(both[1:], second) < 1e-6


def test_greedy_generation_is_token_identical(pair):
    hf, model, _ = pair
    prompt = [1, 17, 503, 99, 250, 8, 771]
    generator = Generator(model, None, max_seq_len=128, device="cpu")
    generator.eos_id = None  # compare all 64 tokens; HF is told the same below
    ours = generator.generate(prompt, SamplingParams(temperature=0.0), max_new_tokens=64)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, pad_token_id=0)
    assert len(ours.tokens) == 64
    assert ours.tokens == theirs[0, len(prompt):].tolist()
