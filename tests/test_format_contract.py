"""The weight-format contract, for every registered format: a format gets these tests by registering.

Round trip through to_dense, the product against float64, the fused `project` against the unfused steps,
rebuilding from its tensors, save/load through a compressed folder, its report stats, and (GPU only)
opcheck of every minfer op its forward and project call."""

import json

import pytest
import torch
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode

from minfer.checkpoint import ResolvedModel, load_model, random_init
from minfer.config import ModelConfig
from minfer.errors import FormatError
from minfer.formats import FORMATS, WeightFormat, convert
from minfer.model import Transformer
from minfer.sparsity import prune_model_, prune_to_structure_
from minfer.sparsity.compressed import WEIGHTS_FILE, is_compressed, save_compressed
from tests.conftest import requires_cuda
from tests.numerics import fused_linear_reference64, rel_error

FORMAT_NAMES = sorted(FORMATS)
ON_GPU = pytest.param("cuda", marks=requires_cuda, id="cuda")
DEVICES = ["cpu", ON_GPU]
# Odd sizes; an even row count, since silu_mul reads the rows as [gate; up].
ROWS, COLS = 70, 203


def sparse_matrix(rows: int, cols: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """About half the entries zero, the rest normal / sqrt(cols) (unit-variance products)."""
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.randn(rows, cols, generator=generator) / cols**0.5
    matrix[torch.rand(rows, cols, generator=generator) < 0.5] = 0
    return matrix.to(dtype=dtype, device=device)


def ks_sample(dtype: torch.dtype, device: str) -> tuple[WeightFormat, torch.Tensor]:
    """A two-factor Monarch-like KS chain of shape (ROWS, COLS): a structured format's own sample."""
    generator = torch.Generator().manual_seed(0)
    factors = [(torch.randn(pattern, generator=generator) / pattern[2] ** 0.5).to(dtype=dtype, device=device)
               for pattern in ((7, 10, 29, 1), (1, 7, 7, 10))]
    fmt = FORMATS["ksmm"].from_factors(factors)
    return fmt, fmt.to_dense()


def encoded(name: str, dtype: torch.dtype = torch.float16, device: str = "cpu", rows: int = ROWS,
            cols: int = COLS) -> tuple[WeightFormat, torch.Tensor]:
    if name == "ksmm" and (rows, cols) == (ROWS, COLS):
        return ks_sample(dtype, device)
    matrix = sparse_matrix(rows, cols, dtype, device)
    if FORMATS[name].structure is not None:  # N:M formats: the N largest of every M
        prune_to_structure_(matrix, matrix.abs(), FORMATS[name].structure)
    return FORMATS[name].from_dense(matrix), matrix


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_to_dense_gives_back_the_matrix(name, dtype):
    fmt, matrix = encoded(name, dtype)
    assert fmt.shape == (ROWS, COLS) and fmt.dtype == dtype and fmt.name == name
    dense = fmt.to_dense()
    assert dense.dtype == dtype and torch.equal(dense, matrix)
    assert torch.equal(FORMATS[name].from_dense(dense).to_dense(), matrix)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_an_empty_and_a_zero_matrix(name):
    for rows, cols in ((0, 16), (5, 0), (6, 40)):
        fmt = FORMATS[name].from_dense(torch.zeros(rows, cols, dtype=torch.float16))
        assert fmt.shape == (rows, cols) and torch.equal(fmt.to_dense(), torch.zeros(rows, cols, dtype=torch.float16))
        if rows and cols:
            assert torch.equal(fmt(torch.ones(3, cols, dtype=torch.float16)), torch.zeros(3, rows, dtype=torch.float16))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, 16, 40])  # decode, batched decode, SpMM, prefill
def test_product_matches_float64(name, device, dtype, tokens):
    fmt, matrix = encoded(name, dtype, device)
    x = torch.randn(2, tokens, COLS, generator=torch.Generator().manual_seed(tokens)).to(dtype=dtype, device=device)
    out = fmt(x)
    assert out.shape == (2, tokens, ROWS) and out.dtype == dtype
    assert rel_error(out, x.double() @ matrix.double().T) < tolerance(dtype)


# The steps the model fuses around its projections: qkv (norm), o and down (residual), gate_up (norm and
# silu_mul); and the other combinations a format may fuse.
FUSIONS = [dict(norm=True), dict(residual=True), dict(norm=True, silu_mul=True), dict(norm=True, residual=True),
           dict(silu_mul=True), dict(silu_mul=True, residual=True)]


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 16, 20])
@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda f: "+".join(f))
def test_project_matches_the_unfused_steps(name, device, dtype, tokens, fusion):
    fmt, matrix = encoded(name, dtype, device)
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, COLS, generator=generator).to(dtype=dtype, device=device)
    norm_weight = (torch.rand(COLS, generator=generator) + 0.5).to(dtype=dtype, device=device) \
        if fusion.get("norm") else None
    silu_mul = fusion.get("silu_mul", False)
    out_rows = ROWS // 2 if silu_mul else ROWS
    residual = torch.randn(1, tokens, out_rows, generator=generator).to(dtype=dtype, device=device) \
        if fusion.get("residual") else None
    args = dict(norm_weight=norm_weight, eps=1e-5, silu_mul=silu_mul)
    fused = fmt.project(x, residual=None if residual is None else residual.clone(), **args)
    unfused = WeightFormat.project(fmt, x, residual=None if residual is None else residual.clone(), **args)
    assert fused.shape == unfused.shape == (1, tokens, out_rows) and fused.dtype == dtype
    expected = fused_linear_reference64(x, matrix, norm_weight, 1e-5, residual, silu_mul)
    assert rel_error(unfused, expected) < 2 * tolerance(dtype)
    assert rel_error(fused, unfused) < 2 * tolerance(dtype)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_project_adds_into_the_residual_in_place(name):
    fmt, _ = encoded(name)
    residual = torch.randn(2, ROWS, dtype=torch.float16)
    assert fmt.project(torch.randn(2, COLS, dtype=torch.float16), residual=residual) is residual


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_rebuilt_from_its_tensors_on_any_device(name):
    fmt, matrix = encoded(name)
    tensors, options = fmt.tensors(), fmt.options()
    json.dumps(options)  # stored in the checkpoint's metadata
    assert set(tensors) == {n for n, _ in fmt.named_buffers()}
    rebuilt = FORMATS[name].from_tensors(tensors, fmt.shape, options)
    assert type(rebuilt) is type(fmt) and torch.equal(rebuilt.to_dense(), matrix)
    on_meta = FORMATS[name].from_tensors({n: t.to("meta") for n, t in tensors.items()}, fmt.shape, options)
    assert on_meta.shape == fmt.shape and {n: t.shape for n, t in on_meta.tensors().items()} == \
        {n: t.shape for n, t in tensors.items()}
    first = sorted(tensors)[0]
    with pytest.raises(FormatError, match=first):
        FORMATS[name].from_tensors({n: t for n, t in tensors.items() if n != first}, fmt.shape, options)
    with pytest.raises(FormatError, match="stray"):
        FORMATS[name].from_tensors({**tensors, "stray": tensors[first]}, fmt.shape, options)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_stats_for_the_report(name):
    fmt, matrix = encoded(name)
    stats = fmt.stats()
    assert stats.elements == ROWS * COLS and stats.nonzeros == int(torch.count_nonzero(matrix))
    assert stats.stored_bytes == fmt.nbytes and stats.dense_bytes == ROWS * COLS * 2
    assert 0 <= stats.rows_larger_than_dense <= ROWS and stats.density == stats.nonzeros / stats.elements


def tiny_model(dtype: torch.dtype, structure: tuple[int, int] | None = None) -> Transformer:
    config = ModelConfig(vocab_size=96, hidden_size=40, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=10,
                         intermediate_size=56, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = random_init(Transformer(config), seed=5, dtype=dtype, device="cpu")
    return prune_model_(model, None if structure else 0.5, progress=False, structure=structure)


def logits(model: Transformer) -> torch.Tensor:
    model.setup_caches(1, 16)
    with torch.no_grad():
        return model(torch.arange(1, 9)[None], torch.arange(8), kv_len=8)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_save_and_load_through_a_compressed_folder(name, dtype, tmp_path):
    from safetensors import safe_open

    model = convert(tiny_model(dtype, FORMATS[name].structure), name)
    folder = save_compressed(model, tmp_path / "saved")
    assert is_compressed(folder)
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as f:
        layout = json.loads(f.metadata()["minfer_formats"])
    resolved = ResolvedModel("tiny", model.config, folder, folder / "tokenizer.model", is_random=False)
    loaded = load_model(resolved, dtype, "cpu")
    for (projection, saved), (_, restored) in zip(model.projections(), loaded.projections()):
        assert type(restored.fmt) is FORMATS[name]
        assert layout[projection] == {"format": name, "shape": list(saved.fmt.shape), "options": saved.fmt.options()}
        for key, tensor in saved.fmt.tensors().items():
            assert torch.equal(restored.fmt.tensors()[key], tensor), (projection, key)
    assert torch.equal(logits(model), logits(loaded))


class MinferOpCalls(TorchDispatchMode):
    """Records every torch.ops.minfer call (the op and a copy of its arguments, taken before it runs)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "minfer" and func not in self.calls:
            self.calls[func] = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return func(*args, **kwargs)


@requires_cuda
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("tokens", [1, 16, 40])
def test_opcheck_of_every_op_the_format_calls(name, tokens):
    fmt, _ = encoded(name, device="cuda")
    x = torch.randn(tokens, COLS, dtype=torch.float16, device="cuda")
    norm_weight = torch.rand(COLS, dtype=torch.float16, device="cuda") + 0.5
    recorder = MinferOpCalls()
    with recorder:
        fmt(x)
        fmt.project(x, norm_weight, 1e-5)
        fmt.project(x, norm_weight, 1e-5, silu_mul=True)
        fmt.project(x, residual=torch.randn(tokens, ROWS, dtype=torch.float16, device="cuda"))
    if tokens <= 16:  # decode and its SpMM run minfer's kernels in every format (prefill may run torch's matmul)
        assert recorder.calls, f"the {name} format ran no minfer op"
    for op, (args, kwargs) in recorder.calls.items():
        torch.library.opcheck(op, args, kwargs)
