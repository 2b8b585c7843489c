"""Generator on CPU: stop conditions, streaming, the context check, KV buckets, stats; and the
model's weight-format plumbing (`convert`, byte counts)."""

import pytest
import torch

import minfer.generate as generate_module
from minfer.checkpoint import random_init
from minfer.config import ModelConfig
from minfer.errors import ContextLengthError, FormatError, MinferError
from minfer.formats import FORMATS, DenseWeight, convert
from minfer.generate import Generator
from minfer.model import Transformer
from minfer.sampling import SamplingParams

TINY = {"model_type": "llama", "vocab_size": 301, "hidden_size": 48, "intermediate_size": 72,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "eos_token_id": 2}


def tiny_model(**overrides) -> Transformer:
    model = random_init(Transformer(ModelConfig.from_hf(TINY | overrides)), 0, torch.float32, "cpu")
    with torch.no_grad():  # wider than HF's 0.02 so greedy choices are well separated
        for tensor in model.checkpoint_tensors().values():
            if tensor.dim() == 2:
                tensor.mul_(8.0)
    return model


def greedy_without_cache(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    """Oracle: recompute the whole sequence for every token (no decode path, no buckets)."""
    sequence = list(prompt)
    model.setup_caches(1, len(prompt) + steps)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([sequence]), torch.arange(len(sequence)), kv_len=len(sequence))
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt):]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_decode_matches_recompute_across_kv_buckets(model, monkeypatch):
    monkeypatch.setattr(generate_module, "KV_BUCKET", 8)  # cross several buckets in a short run
    prompt = [1, 5, 9, 200, 31]
    expected = greedy_without_cache(model, prompt, 30)
    generator = Generator(model, None, max_seq_len=64, device="cpu")
    generator.eos_id = None
    assert generator.generate(prompt, max_new_tokens=30).tokens == expected


@pytest.mark.parametrize("tokens, expected", [(1, 1), (3, 4), (64, 64), (65, 128), (128, 128), (129, 256),
                                             (300, 384), (500, 512)])
def test_prefill_buckets(tokens, expected):
    assert generate_module.prefill_bucket(tokens, 512) == expected
    assert generate_module.prefill_bucket(tokens, 200) == min(expected, 200)


def test_a_padded_prefill_reads_the_prompt_and_leaves_decode_unchanged(model):
    """What a captured prefill relies on: the prompt padded past its end gives the same logits at its last
    token, and the decode steps after it (which write the padded cache rows before reading them) the same."""
    prompt, padding = [1, 5, 9, 200, 31], [7, 7, 250]
    outputs = []
    with torch.inference_mode():
        for tokens in (prompt, prompt + padding):
            model.setup_caches(1, 16)
            last = torch.tensor([len(prompt) - 1])
            logits = [model(torch.tensor([tokens]), torch.arange(len(tokens)), kv_len=len(tokens),
                            last_logits_only=True, last_index=last)]
            for pos, token in enumerate([3, 44, 100], start=len(prompt)):
                logits.append(model(torch.tensor([[token]]), torch.tensor([pos]), kv_len=16))
            outputs.append(torch.cat(logits, dim=1))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-4)


def test_each_generator_runs_on_its_own_caches(model):
    """Setting up another generator (or perplexity) on the model must not move an earlier one's caches:
    it puts the model back on its own before each generation."""
    prompt = [1, 5, 9, 200, 31]
    expected = greedy_without_cache(model, prompt, 40)
    long_context = Generator(model, None, max_seq_len=64, device="cpu")
    short_context = Generator(model, None, max_seq_len=16, device="cpu")
    long_context.eos_id = short_context.eos_id = None
    assert long_context.generate(prompt, max_new_tokens=40).tokens == expected
    assert short_context.generate(prompt, max_new_tokens=40).tokens == expected[:11]
    assert long_context.generate(prompt, max_new_tokens=40).tokens == expected


def test_streams_every_token_in_order(model):
    generator = Generator(model, None, max_seq_len=64, device="cpu")
    generator.eos_id = None
    seen = []
    result = generator.generate([1, 2, 3], max_new_tokens=12, on_token=seen.append)
    assert seen == result.tokens and len(seen) == 12
    assert result.stats.stop_reason == "max_new_tokens"


def test_stops_at_eos_without_returning_it(model):
    generator = Generator(model, None, max_seq_len=64, device="cpu")
    generator.eos_id = None
    free = generator.generate([1, 7, 8], max_new_tokens=20).tokens
    stop_at = next(i for i in range(3, 20) if free[i] not in free[:i])  # a token's first appearance
    generator.eos_id = free[stop_at]
    result = generator.generate([1, 7, 8], max_new_tokens=20)
    assert result.tokens == free[:stop_at]
    assert result.stats.stop_reason == "eos"


def test_stops_at_the_context_end(model):
    generator = Generator(model, None, max_seq_len=24, device="cpu")
    generator.eos_id = None
    result = generator.generate(list(range(3, 13)), max_new_tokens=100)
    assert len(result.tokens) == 24 - 10
    assert result.stats.stop_reason == "context"


def test_prompt_longer_than_context_is_refused_before_running(model):
    generator = Generator(model, None, max_seq_len=16, device="cpu")
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ContextLengthError, match="max-seq-len"):
            generator.generate(list(range(1, 17)), max_new_tokens=4)
    finally:
        handle.remove()
    assert not calls


@pytest.mark.parametrize("prompt", [[], [1, 301], [-1]])
def test_bad_prompts_are_refused(model, prompt):
    with pytest.raises(MinferError):
        Generator(model, None, max_seq_len=16, device="cpu").generate(prompt)


def test_cache_longer_than_the_model_allows_is_refused(model):
    with pytest.raises(ContextLengthError, match="max-seq-len 256"):
        Generator(model, None, max_seq_len=257, device="cpu")


def test_sampled_generation_is_reproducible(model):
    generator = Generator(model, None, max_seq_len=64, device="cpu")
    generator.eos_id = None
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    first = generator.generate([1, 4], params, max_new_tokens=16).tokens
    assert generator.generate([1, 4], params, max_new_tokens=16).tokens == first
    other = generator.generate([1, 4], SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=8), max_new_tokens=16)
    assert other.tokens != first


def test_stats_are_filled(model):
    generator = Generator(model, None, max_seq_len=64, device="cpu")
    generator.eos_id = None
    stats = generator.generate([1, 2, 3, 4], max_new_tokens=8).stats
    assert (stats.prompt_tokens, stats.new_tokens) == (4, 8)
    assert stats.prefill_ms > 0 and stats.ttft_ms >= stats.prefill_ms
    assert stats.decode_tok_s > 0
    assert stats.weight_gb_s == pytest.approx(model.decode_weight_bytes() * stats.decode_tok_s / 1e9)
    assert set(stats.as_dict()) >= {"prefill_ms", "ttft_ms", "decode_tok_s", "weight_gb_s", "peak_mem_gb"}


@pytest.mark.parametrize("tied", [False, True])
def test_decode_weight_bytes_counts_what_a_step_reads(tied):
    model = tiny_model(tie_word_embeddings=tied)
    config, element = model.config, 4
    embedding_bytes = config.vocab_size * config.hidden_size * element
    # All stored weights, minus the embedding table (one row is read) unless lm_head reads it as well.
    expected = config.weight_bytes(torch.float32) - (0 if tied else embedding_bytes) + config.hidden_size * element
    assert model.decode_weight_bytes() == expected


def test_tied_lm_head_shares_the_embedding():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.fmt.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert "lm_head.fmt.weight" not in model.checkpoint_tensors()


def test_convert_swaps_every_projection_and_nothing_else():
    model = tiny_model()
    model.setup_caches(1, 16)
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(tokens, torch.arange(4), kv_len=4)
    lm_head_format = model.lm_head.fmt

    class Marked(DenseWeight):  # a stand-in format: dense storage under another name
        name = "marked"

    FORMATS["marked"] = Marked
    try:
        convert(model, "marked")
    finally:
        del FORMATS["marked"]
    names = [name for name, _ in model.projections()]
    assert len(names) == 4 * model.config.num_layers
    assert all(isinstance(linear.fmt, Marked) for _, linear in model.projections())
    assert model.lm_head.fmt is lm_head_format
    with torch.inference_mode():
        assert torch.equal(model(tokens, torch.arange(4), kv_len=4), before)


def test_convert_refuses_unknown_formats():
    with pytest.raises(FormatError, match="dense"):
        convert(tiny_model(), "no-such-format")


def test_dense_format_contract():
    weight = torch.randn(5, 3)
    fmt = DenseWeight.from_dense(weight)
    assert fmt.shape == (5, 3) and fmt.nbytes == 60
    assert torch.equal(fmt.to_dense(), weight)
    x = torch.randn(2, 3)
    assert torch.allclose(fmt(x), x @ weight.T)
    with pytest.raises(FormatError):
        DenseWeight(torch.randn(2, 3, 4))


def test_linear_refuses_a_format_of_another_shape():
    model = tiny_model()
    linear = model.layers[0].mlp.down_proj
    with pytest.raises(MinferError, match="shape"):
        linear.set_format(DenseWeight(torch.zeros(3, 3)))
