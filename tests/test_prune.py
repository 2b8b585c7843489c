"""Pruning: per-row density, Wanda against a direct reimplementation, generation after pruning."""

import copy

import pytest
import torch

from minfer.checkpoint import random_init
from minfer.config import ModelConfig
from minfer.errors import MinferError
from minfer.formats import convert
from minfer.model import Linear, Transformer
from minfer.sparsity import block_reports, format_report, prune_magnitude_, prune_model_, wanda_score
from minfer.sparsity.prune import calibration_tokens

TINY = ModelConfig(vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=96, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_model(seed=0) -> Transformer:
    return random_init(Transformer(TINY), seed=seed, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("density", [0.05, 0.3, 0.5, 0.9, 1.0])
def test_magnitude_hits_the_density_of_every_row(density):
    weight = torch.randn(33, 70)
    original = weight.clone()
    prune_magnitude_(weight, density)
    kept = weight != 0
    assert kept.sum(dim=1).tolist() == [round(density * 70)] * 33
    assert torch.equal(weight[kept], original[kept])
    # every kept weight is at least as large as every dropped one in its row
    smallest_kept = torch.where(kept, original.abs(), torch.inf).min(dim=1).values
    largest_dropped = torch.where(kept, -torch.inf, original.abs()).max(dim=1).values
    assert bool((smallest_kept >= largest_dropped).all())


def test_bad_density_and_method():
    with pytest.raises(MinferError, match="density"):
        prune_magnitude_(torch.randn(2, 4), 0.0)
    with pytest.raises(MinferError, match="method"):
        prune_model_(tiny_model(), 0.5, method="random")
    with pytest.raises(MinferError, match="calibration"):
        prune_model_(tiny_model(), 0.5, method="wanda")


def test_model_magnitude_pruning_touches_only_projections():
    model = tiny_model()
    embed, head = model.embed_tokens.weight.clone(), model.lm_head.fmt.weight.clone()
    prune_model_(model, 0.25, progress=False)
    for _, linear in model.projections():
        w = linear.fmt.weight
        assert (w != 0).sum(dim=1).eq(round(0.25 * w.shape[1])).all()
    assert torch.equal(model.embed_tokens.weight, embed) and torch.equal(model.lm_head.fmt.weight, head)


def wanda_direct(model: Transformer, tokens: torch.Tensor, density: float) -> None:
    """Wanda written out plainly: for block i, capture each projection's inputs with a full forward
    pass of the model (blocks < i already pruned), score |W| * ||X_j||, keep the top of each row."""
    model.setup_caches(tokens.shape[0], tokens.shape[1])
    for layer in model.layers:
        inputs = {}

        def capture(name):
            def hook(module, args, kwargs):  # what the projection multiplies: its input, normed if it norms
                norm = kwargs.get("norm")
                inputs[name] = args[0] if norm is None else norm(args[0])
            return hook

        hooks = [m.register_forward_pre_hook(capture(name), with_kwargs=True) for name, m in layer.named_modules()
                 if isinstance(m, Linear)]
        with torch.no_grad():
            model(tokens, torch.arange(tokens.shape[1]), kv_len=tokens.shape[1])
        for h in hooks:
            h.remove()
        for name, m in layer.named_modules():
            if isinstance(m, Linear):
                x = inputs[name].reshape(-1, inputs[name].shape[-1]).double()
                score = m.fmt.weight.abs().double() * x.norm(dim=0)[None, :]
                keep = round(density * score.shape[1])
                mask = torch.zeros_like(m.fmt.weight, dtype=torch.bool)
                mask.scatter_(1, score.topk(keep, dim=1).indices, True)
                m.fmt.weight.mul_(mask)


def test_wanda_matches_a_direct_reimplementation():
    tokens = torch.randint(0, TINY.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    ours, direct = tiny_model(seed=4), tiny_model(seed=4)
    prune_model_(ours, 0.5, method="wanda", calibration=tokens, batch_size=3, progress=False)
    wanda_direct(direct, tokens, 0.5)
    for (name, a), (_, b) in zip(ours.projections(), direct.projections()):
        assert torch.equal(a.fmt.weight != 0, b.fmt.weight != 0), name


def test_wanda_differs_from_magnitude_when_inputs_are_uneven():
    weight = torch.ones(4, 8)
    weight[:, :4] = 2.0  # magnitude keeps columns 0-3; wanda, with loud features 4-7, keeps those
    norms = torch.tensor([1.0] * 4 + [10.0] * 4)
    score = wanda_score(weight, norms)
    keep = score.topk(4, dim=1).indices.sort(dim=1).values
    assert keep.tolist() == [[4, 5, 6, 7]] * 4


def test_calibration_tokens_from_the_shipped_text_and_a_file(tmp_path):
    class Chars:  # a stand-in tokenizer: one id per character
        def encode(self, text, bos=True):
            return [ord(c) % 256 for c in text]

    tokens = calibration_tokens(Chars(), samples=4, seq_len=32)
    assert tokens.shape == (4, 32) and tokens.dtype == torch.long
    text = tmp_path / "calib.txt"
    text.write_text("abc" * 20)
    assert calibration_tokens(Chars(), 2, 30, text).view(-1).tolist() == [ord(c) for c in ("abc" * 20)]
    with pytest.raises(MinferError, match="fewer than"):
        calibration_tokens(Chars(), 3, 30, text)
    for samples, seq_len in ((0, 30), (2, 0), (-1, 30)):
        with pytest.raises(MinferError, match="at least 1 sample"):
            calibration_tokens(Chars(), samples, seq_len, text)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe text")
    with pytest.raises(MinferError, match="is not UTF-8 text"):
        calibration_tokens(Chars(), 1, 4, binary)


def test_a_density_that_keeps_no_weight_of_a_row_is_refused():
    weight = torch.randn(3, 64)
    with pytest.raises(MinferError, match="keeps round.* = 0 weights of a 64-column row"):
        prune_magnitude_(weight, 0.001)
    assert int((prune_magnitude_(weight, 0.02) != 0).sum()) == 3  # round(1.28) = 1 per row


def test_generation_runs_after_pruning_and_compression():
    model = tiny_model()
    dense = copy.deepcopy(model)
    prune_model_(model, 0.5, progress=False)
    pruned = copy.deepcopy(model)
    convert(model, "macko")
    reports = block_reports(model)
    assert [r.block for r in reports] == [0, 1, 2]
    assert all(abs(r.density - 0.5) < 0.01 for r in reports)
    assert "projections: density 0.500" in format_report(reports, model)
    tokens = torch.randint(0, TINY.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    outputs = []
    for m in (model, pruned, dense):
        m.setup_caches(1, 32)
        with torch.no_grad():
            outputs.append(m(tokens, torch.arange(10), kv_len=10))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4)  # MACKO computes the pruned model
    assert not torch.allclose(outputs[1], outputs[2], atol=1e-3)  # and pruning changed it


def test_corrupt_reference_checkpoint_is_a_clear_error(tmp_path):
    from minfer.errors import CheckpointError
    from minfer.formats.macko import MackoWeight
    from minfer.sparsity.reference import load_reference

    corrupt = tmp_path / "compressed.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    model = Transformer(tiny_model().config)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_reference(model, MackoWeight, corrupt, torch.float32, "cpu")
