"""MACKO-16-4 format: the reference compressor's arrays byte for byte, exact round trips, edge cases."""

import json

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from minfer.formats import convert
from minfer.formats.macko import MackoWeight, compress, concat_rows


def walk_compress(matrix: torch.Tensor):
    """The compression rules of docs/FORMATS.md, one column at a time (the slow oracle)."""
    values, nibbles, row_ptr = [], [], [0]
    for row in matrix:
        skipped, kept = 0, len(values)
        for value in row:
            if value != 0 or skipped == 15:
                values.append(value)
                nibbles.append(skipped)
                skipped = 0
                if value != 0:
                    kept = len(values)
            else:
                skipped += 1
        del values[kept:], nibbles[kept:]  # explicit zeros after the last nonzero
        row_ptr.append(len(values))
    pad = -len(values) % 8
    values = torch.stack(values + [matrix.new_zeros(())] * pad) if values or pad else matrix.new_zeros(0)
    nibbles += [0] * pad
    deltas = torch.tensor([lo | hi << 4 for lo, hi in zip(nibbles[0::2], nibbles[1::2])], dtype=torch.uint8)
    return values, deltas, torch.tensor(row_ptr, dtype=torch.int32)


def assert_same_arrays(got, expected):
    for name, g, e in zip(("values", "deltas", "row_ptr"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, \
            f"{name}: {g.dtype} {tuple(g.shape)} vs {e.dtype} {tuple(e.shape)}"
        if g.is_floating_point():  # bit patterns, so -0.0 and padding +0.0 count too
            g, e = g.view(torch.int16), e.view(torch.int16)
        assert torch.equal(g, e), f"{name} differs:\n{g}\n{e}"


def sparse_rows(cols: int, rows: list[dict[int, float]]) -> torch.Tensor:
    matrix = torch.zeros(len(rows), cols, dtype=torch.float16)
    for r, entries in enumerate(rows):
        for c, v in entries.items():
            matrix[r, c] = v
    return matrix


# The reference library's 5x32 test matrix (macko_spmv tests), as {column: value} per row.
WORKED_EXAMPLE = sparse_rows(32, [
    {0: 0.5498, 1: 0.7124, 8: 0.7998, 12: 0.1611, 29: 0.4663},
    {0: 0.2241, 1: 0.6528, 14: 0.4761, 19: 0.4673},
    {21: 0.0166},
    {5: 0.1958},
    {4: 0.5195, 5: 0.5762, 7: 0.8965, 13: 0.5625, 23: 0.2041, 26: 0.8770, 28: 0.1123, 29: 0.4966, 31: 0.5132},
])


def test_worked_example_byte_for_byte():
    values, deltas, row_ptr = compress(WORKED_EXAMPLE)
    expected_values = torch.tensor([
        0.5498, 0.7124, 0.7998, 0.1611, 0.0, 0.4663,   # row 0: the zero at column 28 ends a 15-zero gap
        0.2241, 0.6528, 0.4761, 0.4673,
        0.0, 0.0166,                                    # row 2: explicit zero at column 15
        0.1958,                                         # row 3: its trailing explicit zero is dropped
        0.5195, 0.5762, 0.8965, 0.5625, 0.2041, 0.8770, 0.1123, 0.4966, 0.5132,
        0.0, 0.0,                                       # padding to a multiple of 8
    ], dtype=torch.float16)
    assert_same_arrays((values, deltas, row_ptr), (
        expected_values,
        torch.tensor([0, 54, 15, 0, 76, 95, 69, 16, 149, 18, 16, 0], dtype=torch.uint8),
        torch.tensor([0, 6, 10, 12, 13, 22], dtype=torch.int32),
    ))
    # docs/FORMATS.md: row 0's nibbles are 0, 0, 6, 3, 15, 0 and pack into the bytes 0, 54, 15
    row0 = [0, 0, 6, 3, 15, 0]
    assert deltas[:3].tolist() == [lo | hi << 4 for lo, hi in zip(row0[0::2], row0[1::2])] == [0, 54, 15]
    assert torch.equal(ops.macko_decompress_reference(values, deltas, row_ptr, 32), WORKED_EXAMPLE)


def test_empty_rows_and_last_column_example():
    matrix = torch.tensor([[0] * 32, [0] * 31 + [1], [0, 2] + [0] * 30], dtype=torch.float16)
    assert_same_arrays(compress(matrix), (
        torch.tensor([0, 1, 2, 0, 0, 0, 0, 0], dtype=torch.float16),
        torch.tensor([255, 1, 0, 0], dtype=torch.uint8),
        torch.tensor([0, 0, 2, 3], dtype=torch.int32),
    ))


@pytest.mark.parametrize("gap", [14, 15, 16, 17, 31, 32, 33])
def test_zero_gaps_around_the_nibble_limit(gap):
    matrix = sparse_rows(gap + 2, [{0: 1.0, gap + 1: 2.0}, {gap: 3.0}, {gap + 1: 4.0}])
    got = compress(matrix)
    assert_same_arrays(got, walk_compress(matrix))
    assert torch.equal(ops.macko_decompress_reference(*got, gap + 2), matrix)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 7), (5, 9), (8, 16), (13, 100), (2, 257)])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.3, 0.7, 1.0])
def test_matches_walk_and_round_trips(rows, cols, density):
    generator = torch.Generator().manual_seed(rows * 1000 + cols + int(density * 100))
    matrix = torch.randn(rows, cols, generator=generator).half()
    matrix[torch.rand(rows, cols, generator=generator) >= density] = 0
    arrays = compress(matrix)
    assert_same_arrays(arrays, walk_compress(matrix))
    assert torch.equal(ops.macko_decompress_reference(*arrays, cols), matrix)


def test_fully_dense_and_all_zero():
    dense = torch.randn(6, 13).half().clamp_min(0.01)
    values, deltas, row_ptr = compress(dense)
    assert row_ptr.tolist() == list(range(0, 79, 13)) and values.numel() == 80
    assert torch.equal(deltas, torch.zeros(40, dtype=torch.uint8))
    values, deltas, row_ptr = compress(torch.zeros(4, 50, dtype=torch.float16))
    assert values.numel() == 0 and deltas.numel() == 0 and row_ptr.tolist() == [0] * 5


def test_negative_zero_counts_as_zero_but_keeps_its_bits():
    matrix = torch.zeros(1, 20, dtype=torch.float16)
    matrix[0, 15] = -0.0  # stored (15 zeros before it), with its sign
    matrix[0, 19] = 1.0
    values, _, row_ptr = compress(matrix)
    assert row_ptr.tolist() == [0, 2]
    assert values[0].view(torch.int16) == torch.tensor(-0.0, dtype=torch.float16).view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_random_round_trip_exact(dtype):
    generator = torch.Generator().manual_seed(7)
    for density in (0.01, 0.1, 0.5, 0.9):
        matrix = torch.randn(37, 301, generator=generator).to(dtype)
        matrix[torch.rand(37, 301, generator=generator) >= density] = 0
        weight = MackoWeight.from_dense(matrix)
        assert weight.values.dtype == dtype
        assert torch.equal(weight.to_dense(), matrix)


def test_concat_rows_equals_compressing_the_stack():
    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(r, 45, generator=generator).half() for r in (3, 5, 1)]
    for p in parts:
        p[torch.rand(p.shape, generator=generator) > 0.2] = 0
    assert_same_arrays(concat_rows([compress(p) for p in parts]), compress(torch.cat(parts)))


def test_weight_buffers_nbytes_and_size_report():
    matrix = torch.randn(9, 40).half()
    matrix[torch.rand(9, 40) > 0.5] = 0
    matrix[4] = torch.randn(40).half()  # a dense row: 2.5 bytes per entry beat 2 bytes per column
    weight = MackoWeight.from_dense(matrix)
    stored = int(weight.row_ptr[-1])
    assert weight.shape == (9, 40)
    assert {name for name, _ in weight.named_buffers()} == {"values", "deltas", "row_ptr"}
    assert weight.nbytes == 2 * weight.values.numel() + weight.values.numel() // 2 + 4 * 10
    assert weight.values.numel() == stored + (-stored % 8)
    stats = weight.stats()
    assert stats.nonzeros == int(torch.count_nonzero(matrix)) and stats.elements == 9 * 40
    assert stats.stored_bytes == weight.nbytes and stats.dense_bytes == 2 * 9 * 40
    assert stats.rows_larger_than_dense >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_larger_than_dense_counts_the_value_size(dtype):
    """A row of c entries takes c values, c / 2 bytes of nibbles and its row_ptr slot: more than
    the dense row in any dtype; a row of a quarter of its columns takes less in any dtype."""
    matrix = torch.randn(6, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    matrix[3:, 16:] = 0
    assert MackoWeight.from_dense(matrix).stats().rows_larger_than_dense == 3


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 40])
def test_forward_on_cpu_matches_float64(tokens):
    matrix = torch.randn(24, 72)
    matrix[torch.rand(24, 72) > 0.4] = 0
    weight = MackoWeight.from_dense(matrix.half())
    x = torch.randn(2, tokens, 72).half()
    out = weight(x)
    ref = x.double() @ matrix.half().double().T
    assert out.shape == (2, tokens, 24) and out.dtype == torch.float16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_spmv_reference_with_norm_and_residual_matches_float64():
    """The CPU path of macko_spmv with the fusions: (g * RMSNorm(x)) @ W.T + residual."""
    matrix = torch.randn(24, 72)
    matrix[torch.rand(24, 72) > 0.4] = 0
    values, deltas, row_ptr = compress(matrix.half())
    x, g, residual = torch.randn(1, 72).half(), (torch.rand(72) + 0.5).half(), torch.randn(1, 24).half()
    x64 = x.double()
    normed = x64 * g.double() * torch.rsqrt(x64.square().mean(dim=-1, keepdim=True) + 1e-5)
    ref = normed @ matrix.half().double().T + residual.double()
    ops.macko_spmv(values, deltas, row_ptr, x, out=residual, norm_weight=g, eps=1e-5, accumulate=True)
    assert ((residual.double() - ref).norm() / ref.norm()).item() < 2e-3
    with pytest.raises(FormatError, match="norm_weight must be"):
        ops.macko_spmv(values, deltas, row_ptr, x, norm_weight=g[:8])


def test_bad_inputs_raise_format_errors():
    with pytest.raises(FormatError, match="float16, bfloat16 or float32"):
        compress(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(FormatError, match="2-D"):
        compress(torch.zeros(4, dtype=torch.float16))
    values, deltas, row_ptr = compress(torch.eye(8, dtype=torch.float16))
    with pytest.raises(FormatError, match="row_ptr"):
        MackoWeight(values, deltas, row_ptr, shape=(7, 8))
    with pytest.raises(FormatError, match="deltas"):
        MackoWeight(values, deltas[:-1], row_ptr, shape=(8, 8))
    with pytest.raises(FormatError, match="past column"):
        ops.macko_decompress_reference(values, deltas, row_ptr, 4)


def test_array_checks_refuse_wrong_dtypes_and_dimensions():
    """A file's arrays reach the kernels only through check_macko_arrays: int8 nibbles (which unpack
    negative and understate each row's columns), integer values, float or 2-D row_ptr are refused."""
    values, deltas, row_ptr = compress(torch.eye(8, dtype=torch.float16))
    ops.check_macko_arrays(values, deltas, row_ptr.long(), 8)  # an int64 row_ptr is fine
    for bad, message in (((values, deltas.view(torch.int8), row_ptr), "deltas must be a uint8 1-D"),
                         ((values.view(torch.int16), deltas, row_ptr), "values must be a float 1-D"),
                         ((values.view(-1, 8), deltas, row_ptr), "values must be a float 1-D"),
                         ((values, deltas, row_ptr.float()), "row_ptr must be an int32 or int64 1-D"),
                         ((values, deltas, row_ptr[None]), "row_ptr must be an int32 or int64 1-D")):
        with pytest.raises(FormatError, match=message):
            ops.check_macko_arrays(*bad, 8)


def test_from_dense_takes_a_non_contiguous_matrix():
    matrix = torch.randn(6, 9).half()
    matrix[matrix.abs() < 0.6] = 0
    assert not matrix.T.is_contiguous()
    assert torch.equal(MackoWeight.from_dense(matrix.T).to_dense(), matrix.T)
    assert_same_arrays(compress(matrix.T), compress(matrix.T.contiguous()))


# --- compressed checkpoints -----------------------------------------------------------------------

def tiny_pruned_model(dtype):
    from minfer.checkpoint import random_init
    from minfer.config import ModelConfig
    from minfer.model import Transformer
    from minfer.sparsity import prune_model_

    config = ModelConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = random_init(Transformer(config), seed=3, dtype=dtype, device="cpu")
    return prune_model_(model, 0.3, progress=False)


def logits(model):
    model.setup_caches(1, 16)
    with torch.no_grad():
        return model(torch.arange(1, 9)[None], torch.arange(8), kv_len=8)


def test_save_and_load_compressed_round_trip(tmp_path):
    from minfer.checkpoint import ResolvedModel, load_model
    from minfer.sparsity.compressed import is_compressed, save_compressed

    model = convert(tiny_pruned_model(torch.float16), "macko")
    folder = save_compressed(model, tmp_path / "compressed")
    assert is_compressed(folder) and not is_compressed(tmp_path)
    resolved = ResolvedModel("tiny", model.config, folder, folder / "tokenizer.model", is_random=False)
    loaded = load_model(resolved, torch.float16, "cpu")
    for (name, a), (_, b) in zip(model.projections(), loaded.projections()):
        assert isinstance(b.fmt, MackoWeight), name
        assert_same_arrays((b.fmt.values, b.fmt.deltas, b.fmt.row_ptr), (a.fmt.values, a.fmt.deltas, a.fmt.row_ptr))
    assert torch.equal(logits(model), logits(loaded))


def test_a_folder_saved_before_options_were_recorded_still_loads(tmp_path):
    """Earlier saves recorded each projection's format and shape only (and config.json no copy of them): they
    load with no options."""
    from safetensors.torch import load_file, save_file

    from minfer.checkpoint import ResolvedModel, load_model
    from minfer.sparsity.compressed import METADATA_KEY, RANDOM_KEY, save_compressed

    model = convert(tiny_pruned_model(torch.float16), "macko")
    folder = save_compressed(model, tmp_path / "compressed")
    file = folder / "model.safetensors"
    earlier = {name: {"format": fmt.name, "shape": list(fmt.shape)} for name, fmt in
               ((name, linear.fmt) for name, linear in model.projections())}
    save_file(load_file(str(file)), str(file),
              metadata={"format": "pt", METADATA_KEY: json.dumps(earlier), RANDOM_KEY: "false"})
    config = json.loads((folder / "config.json").read_text())
    del config["minfer"]  # nor did their config.json carry a copy of the layout
    (folder / "config.json").write_text(json.dumps(config))
    resolved = ResolvedModel("tiny", model.config, folder, folder / "tokenizer.model", is_random=False)
    assert torch.equal(logits(model), logits(load_model(resolved, torch.float16, "cpu")))


def test_a_float32_run_saves_16_bit_values_when_they_are_exact(tmp_path):
    """A float32 CPU run of a 16-bit checkpoint writes fp16 MACKO values (the format's own layout);
    a tensor that 16 bits cannot hold exactly stays float32, so saving never rounds."""
    from safetensors import safe_open

    from minfer.checkpoint import ResolvedModel, load_model
    from minfer.sparsity.compressed import save_compressed

    model = tiny_pruned_model(torch.float32)
    with torch.no_grad():
        for name, tensor in model.checkpoint_tensors().items():
            if name not in ("norm.weight", "embed_tokens.weight"):
                tensor.copy_(tensor.half().float())
        model.norm.weight[0] = 1 + 2**-20  # neither 16-bit type holds it
        model.embed_tokens.weight.copy_(model.embed_tokens.weight.bfloat16().float())
        model.embed_tokens.weight[0, 0] = 2**-30  # below float16's range, exact in bfloat16
    model = convert(model, "macko")
    folder = save_compressed(model, tmp_path / "compressed")
    with safe_open(folder / "model.safetensors", "pt") as f:
        stored = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert stored["norm.weight"] == "F32" and stored["embed_tokens.weight"] == "BF16"
    assert {dtype for name, dtype in stored.items() if name.endswith(".values")} == {"F16"}
    resolved = ResolvedModel("tiny", model.config, folder, folder / "tokenizer.model", is_random=False)
    loaded = load_model(resolved, torch.float32, "cpu")
    for name, tensor in model.checkpoint_tensors().items():
        assert torch.equal(loaded.checkpoint_tensors()[name], tensor), name
    assert torch.equal(logits(model), logits(loaded))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_stored_weight_bytes_is_what_loading_allocates(tmp_path, dtype):
    """The memory check's figure for a compressed folder: every tensor's bytes in the loading dtype."""
    from minfer.checkpoint import ResolvedModel, load_model
    from minfer.sparsity.compressed import save_compressed, stored_weight_bytes

    model = convert(tiny_pruned_model(torch.float16), "macko")
    folder = save_compressed(model, tmp_path / "compressed")
    assert not list(folder.glob("*.partial"))
    resolved = ResolvedModel("tiny", model.config, folder, folder / "tokenizer.model", is_random=False)
    loaded = load_model(resolved, dtype, "cpu")
    allocated = sum(t.numel() * t.element_size() for t in loaded.checkpoint_tensors().values())
    assert stored_weight_bytes(folder, dtype) == allocated


def compress_keeping_trailing_zeros(weight: torch.Tensor):
    """An older reference compressor's arrays: docs/FORMATS.md's walk, one row at a time, without dropping
    the stored zeros after a row's last nonzero."""
    from minfer.formats.macko import _pack

    values, nibbles, counts = [], [], []
    for row in weight.tolist():
        skipped, stored = 0, 0
        for value in row:
            if value != 0 or skipped == 15:
                values.append(value)
                nibbles.append(skipped)
                skipped, stored = 0, stored + 1
            else:
                skipped += 1
        counts.append(stored)
    return _pack(torch.tensor(values, dtype=weight.dtype), torch.tensor(nibbles), torch.tensor(counts))


@pytest.mark.parametrize("trailing_zeros", ["dropped", "kept"])
def test_load_reference_tool_checkpoint(tmp_path, trailing_zeros):
    """The reference script's layout: HF names, `.weight` -> `.c_0`..`.c_4`, written by torch.save;
    also from an older version that kept the stored zeros after each row's last nonzero."""
    from minfer.checkpoint import hf_state_dict
    from minfer.model import Transformer
    from minfer.errors import CheckpointError
    from minfer.sparsity.reference import load_reference

    model = tiny_pruned_model(torch.float16)
    with torch.no_grad():  # room after each row's last nonzero for a kept zero every 16 columns
        for _, linear in model.projections():
            linear.fmt.weight[:, -40:] = 0
    compressor = compress if trailing_zeros == "dropped" else compress_keeping_trailing_zeros
    state = {}
    for name, tensor in hf_state_dict(model).items():
        if "self_attn" in name or "mlp" in name:
            values, deltas, row_ptr = compressor(tensor.contiguous())
            assert torch.equal(MackoWeight(values, deltas, row_ptr, tuple(tensor.shape)).to_dense(), tensor)
            assert (row_ptr[-1] > compress(tensor.contiguous())[2][-1]) == (trailing_zeros == "kept")
            for i, part in enumerate((values, deltas, row_ptr, *tensor.shape)):
                state[name.replace("weight", f"c_{i}")] = part
        else:
            state[name] = tensor.clone()
    torch.save(state, tmp_path / "llama_compressed")
    loaded = load_reference(Transformer(model.config), MackoWeight, tmp_path / "llama_compressed", torch.float16,
                            "cpu")
    for (name, dense), (_, sparse) in zip(model.projections(), loaded.projections()):
        assert_same_arrays((sparse.fmt.values, sparse.fmt.deltas, sparse.fmt.row_ptr),
                           compressor(dense.fmt.weight.contiguous()))
    assert torch.equal(logits(convert(model, "macko")), logits(loaded))
    key = next(name for name in state if name.endswith(".c_2") and int(state[name][-1]) > 0)
    torch.save({**state, key: state[key].flip(0)}, tmp_path / "reversed_row_ptr")
    with pytest.raises(CheckpointError, match=r"\.c_0 \.\. .*\.c_2 .*row_ptr must start at 0 and never decrease"):
        load_reference(Transformer(model.config), MackoWeight, tmp_path / "reversed_row_ptr", torch.float16, "cpu")
