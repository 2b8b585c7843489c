"""Device-side sampling: greedy is argmax, truncation never emits excluded tokens, and the
exponential race draws from the intended distribution."""

import pytest
import torch

from minfer.errors import MinferError
from minfer.sampling import SamplingParams, filter_logits, sample

DRAWS = 20000


def draws(logits_row: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    """DRAWS independent samples from one row of logits (one row per draw, one call)."""
    generator = torch.Generator().manual_seed(seed)
    return sample(logits_row.expand(DRAWS, -1), params, generator)


def frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / ids.numel()


def test_temperature_zero_is_argmax():
    logits = torch.randn(8, 1003, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.5)), logits.argmax(-1))


def test_full_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.7)
    expected = torch.softmax(logits.double() / 0.7, -1)
    assert (frequencies(draws(logits, params), 6) - expected).abs().max() < 0.015


def test_top_k_never_emits_excluded_tokens():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.5, top_k=7)
    ids = draws(logits, params)
    allowed = set(torch.topk(logits[0], 7).indices.tolist())
    assert set(ids.tolist()) <= allowed
    expected = torch.softmax(logits[0].double() / 1.5, -1)[list(allowed)]
    freq = frequencies(ids, 500)[list(allowed)]
    assert (freq - expected / expected.sum()).abs().max() < 0.015


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    ids = draws(logits, SamplingParams(temperature=1.0, top_p=0.7))
    # Sorted: 0.5, 0.3 (mass before 0.5 < 0.7: kept), 0.15 (mass before 0.8: dropped), 0.05.
    assert set(ids.tolist()) <= {1, 3}
    assert abs(frequencies(ids, 4)[1].item() - 0.5 / 0.8) < 0.015


def test_top_p_never_emits_excluded_tokens_random_logits():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 301, generator=generator) * 3
    params = SamplingParams(temperature=0.9, top_p=0.8)
    for row in logits:
        probs = torch.softmax(row.double() / 0.9, -1)
        order = probs.argsort(descending=True)
        mass_before = probs[order].cumsum(0) - probs[order]
        allowed = set(order[mass_before < 0.8].tolist())
        assert set(draws(row[None], params, seed=4).tolist()) <= allowed


def test_top_k_and_top_p_combine():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, 2.7]])
    ids = draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))
    # top-3 keeps {0, 1, 2}; renormalized, token 0 holds < 0.5, so 0 and 1 remain.
    assert set(ids.tolist()) == {0, 1}


def test_filter_logits_marks_exclusions_minus_inf():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    filtered = filter_logits(logits, SamplingParams(temperature=2.0, top_k=2))
    assert torch.equal(torch.isinf(filtered), torch.tensor([[True, False, False, True]]))
    assert torch.allclose(filtered[0, 1:3], torch.tensor([2.0, 1.5]))


def test_same_seed_same_samples():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    first = sample(logits, params, torch.Generator().manual_seed(9))
    again = sample(logits, params, torch.Generator().manual_seed(9))
    assert torch.equal(first, again)


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.2)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(MinferError):
        SamplingParams(**bad)
