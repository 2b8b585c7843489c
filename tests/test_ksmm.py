"""The KS chain format (minfer/formats/ksmm.py), the dense-to-KS projection (minfer/sparsity/factorize.py)
and `--sparse ksmm --ks-patterns` end to end. The format contract (tests/test_format_contract.py) covers
the rest of what every format must do."""

import json

import pytest
import torch

from minfer.errors import CheckpointError, FormatError
from minfer.formats.ksmm import KSWeight, pattern_inputs, project_chain
from minfer.sparsity.factorize import chain_for, monarch_chain, parse_patterns
from tests.helpers import APP, assert_input_error, in_process, load_app, tiny_random_model
from tests.numerics import rel_error

# Application order: entry 0 reads the input.
MONARCH = [(3, 4, 5, 1), (1, 7, 6, 2)]  # 14 x 15, rank 2
BUTTERFLY = [(4, 2, 3, 1), (2, 2, 2, 2), (1, 2, 2, 4)]  # 8 x 12, rank 1 per pair
GENERAL_PAIR = [(4, 3, 5, 2), (2, 5, 6, 2)]  # a1 = 2 and d2 = 2: 4 independent Monarch problems
CHAINS = [MONARCH, BUTTERFLY, GENERAL_PAIR, [(2, 3, 5, 3)]]


def random_factors(patterns, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p, generator=generator).to(dtype) for p in patterns]


def factor_by_index_formula(factor: torch.Tensor) -> torch.Tensor:
    """K[i·b·d + j·d + l, i·c·d + k·d + l] = W[i, j, k, l], one entry at a time (docs/FORMATS.md)."""
    a, b, c, d = factor.shape
    dense = torch.zeros(a * b * d, a * c * d, dtype=factor.dtype)
    for i in range(a):
        for j in range(b):
            for k in range(c):
                for l in range(d):
                    dense[i * b * d + j * d + l, i * c * d + k * d + l] = factor[i, j, k, l]
    return dense


@pytest.mark.parametrize("patterns", CHAINS, ids=str)
def test_to_dense_is_the_index_formula_product(patterns):
    factors = random_factors(patterns)
    expected = factor_by_index_formula(factors[0])
    for factor in factors[1:]:
        expected = factor_by_index_formula(factor) @ expected  # K_1 ... K_L: later factors on the left
    chain = KSWeight.from_factors(factors)
    assert chain.patterns == patterns and chain.shape == tuple(expected.shape)
    assert torch.allclose(chain.to_dense(), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(KSWeight.from_factors(factors[:1]).to_dense(), factor_by_index_formula(factors[0]))


@pytest.mark.parametrize("patterns", CHAINS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_forward_matches_float64(patterns, dtype, batch):
    factors = random_factors(patterns, seed=batch)
    chain = KSWeight.from_factors([f.to(dtype) for f in factors])
    x = torch.randn(batch, chain.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = x.double() @ KSWeight.from_factors([f.to(dtype).double() for f in factors]).to_dense().T
    out = chain(x)
    assert out.shape == (batch, chain.out_features) and out.dtype == dtype
    assert rel_error(out, expected) < {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]


@pytest.mark.parametrize("patterns", CHAINS, ids=str)
def test_a_product_of_ks_factors_is_recovered_exactly(patterns):
    dense = KSWeight.from_factors(random_factors(patterns, dtype=torch.float32)).to_dense()
    projection = project_chain(dense, patterns)
    assert [tuple(f.shape) for f in projection.factors] == patterns
    assert projection.error / torch.linalg.norm(dense) < 1e-5
    assert rel_error(KSWeight.from_factors(projection.factors).to_dense(), dense) < 1e-5


def brute_force_error(weight: torch.Tensor, first, second) -> float:
    """Monarch pair (a, r·d, K/a, 1)·(1, N/d, r·a, d): block (l, i) is rows l, l + d, ... and columns
    i·K/a ... (i + 1)·K/a - 1; its best rank-r approximation drops all but its r largest singular values."""
    a, b2, c2, _ = first
    _, b1, c1, d = second
    rank = c1 // a
    squared = 0.0
    for l in range(d):
        for i in range(a):
            block = weight[l::d][:, i * c2:(i + 1) * c2].double()
            squared += float((torch.linalg.svdvals(block)[rank:] ** 2).sum())
    return squared ** 0.5


@pytest.mark.parametrize("patterns", [MONARCH, [(2, 3, 7, 1), (1, 5, 2, 3)], [(1, 2, 9, 1), (1, 11, 2, 1)]], ids=str)
def test_projection_error_is_the_per_block_svd_tail(patterns):
    weight = torch.randn(patterns[-1][1] * patterns[-1][3], patterns[0][0] * patterns[0][2],
                         generator=torch.Generator().manual_seed(3))
    projection = project_chain(weight, patterns)
    expected = brute_force_error(weight, *patterns)
    assert abs(projection.error - expected) < 1e-4 * expected
    chain = KSWeight.from_factors(projection.factors).to_dense()
    assert abs(float(torch.linalg.norm(weight - chain)) - expected) < 1e-4 * expected


def test_from_dense_projects_onto_its_patterns():
    weight = torch.randn(14, 15, generator=torch.Generator().manual_seed(4))
    chain = KSWeight.from_dense(weight, patterns=MONARCH)
    assert chain.patterns == MONARCH and chain.options() == {"patterns": [list(p) for p in MONARCH]}
    assert torch.equal(KSWeight.from_dense(weight).to_dense(), weight)  # no patterns: one full factor


@pytest.mark.parametrize("factors, fragments", [
    ([torch.zeros(3, 4, 5, 1), torch.zeros(1, 7, 5, 2)], ["(3, 4, 5, 1) and (1, 7, 5, 2) do not chain", "12", "10"]),
    ([torch.zeros(3, 4, 5)], ["4-D"]),
    ([torch.zeros(3, 4, 5, 1), torch.zeros(1, 7, 6, 2, dtype=torch.float16)], ["share one float dtype"]),
])
def test_bad_chains_are_refused_in_one_line(factors, fragments):
    with pytest.raises(FormatError) as raised:
        KSWeight.from_factors(factors)
    assert "\n" not in str(raised.value) and all(f in str(raised.value) for f in fragments)


def test_a_chain_that_does_not_fit_the_matrix_is_refused():
    with pytest.raises(FormatError, match=r"first factor \(3, 4, 5, 1\) reads 15 inputs, but the matrix has 16"):
        KSWeight.from_dense(torch.zeros(14, 16), patterns=MONARCH)
    with pytest.raises(FormatError, match=r"last factor \(1, 7, 6, 2\) writes 14 outputs, but the matrix has 13"):
        KSWeight.from_tensors({"factor0": torch.zeros(3, 4, 5, 1), "factor1": torch.zeros(1, 7, 6, 2)}, (13, 15),
                              {"patterns": MONARCH})
    with pytest.raises(FormatError, match=r"\(4, 3, 5, 1\) and \(1, 5, 2, 6\) are not a chainable pair"):
        project_chain(torch.zeros(30, 20), [(4, 3, 5, 1), (1, 5, 2, 6)])


@pytest.mark.parametrize("text, fragment", [
    ("monarch-33", "'monarch-33' is not 'NxK:a,b,c,d/a,b,c,d' nor a preset"),
    ("14x15:3,4,5", "'14x15:3,4,5' is not"),
    ("14x15;", "'14x15' is not"),
    ("14y15:3,4,5,1/1,7,6,2", "is not"),
    ("14x16:3,4,5,1/1,7,6,2", "the matrix has 16 columns"),
    (" ; ", "names no preset"),
])
def test_bad_specs_are_refused_in_one_line(text, fragment):
    with pytest.raises(FormatError) as raised:
        parse_patterns(text)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_presets_cover_the_llama_projections():
    assert monarch_chain((4096, 4096), 0.5) == [(4, 1024, 1024, 1), (1, 1024, 1024, 4)]
    for preset, fraction in (("monarch-50", 0.5), ("monarch-25", 0.25)):
        for shape in ((4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096), (22016, 4096), (40, 56)):
            chain = chain_for(parse_patterns(preset), shape)
            KSWeight.from_factors([torch.empty(p, device="meta") for p in chain]).check()
            kept = sum(a * b * c * d for a, b, c, d in chain) / (shape[0] * shape[1])
            assert kept <= fraction and (shape[0] < 4096 or kept > fraction - 0.01), (preset, shape, kept)
    spec = parse_patterns("14x15:3,4,5,1/1,7,6,2; 8X12:4,2,3,1/2,2,2,2/1,2,2,4")
    assert chain_for(spec, (8, 12)) == BUTTERFLY
    with pytest.raises(FormatError, match="no chain for the 9x9 projections"):
        chain_for(spec, (9, 9))


def test_save_and_load_round_trip(tmp_path):
    from minfer.checkpoint import ResolvedModel, load_model
    from minfer.sparsity.compressed import save_compressed
    from minfer.sparsity.factorize import factorize_model

    model = tiny_random_model()
    layers, total = factorize_model(model, parse_patterns("monarch-50"))
    assert [e.layer for e in layers] == ["layers.0", "layers.1"] and 0 < total < 1
    folder = save_compressed(model, tmp_path / "ks")
    config = json.loads((folder / "config.json").read_text())
    for name, linear in model.projections():  # the patterns are readable from config.json too
        entry = config["minfer"]["formats"][name]
        assert entry["format"] == "ksmm" and entry["options"]["patterns"] == [list(p) for p in linear.fmt.patterns]
    resolved = ResolvedModel("tiny", model.config, folder, None, is_random=False)
    loaded = load_model(resolved, torch.float32, "cpu")
    for (name, saved), (_, restored) in zip(model.projections(), loaded.projections()):
        assert isinstance(restored.fmt, KSWeight) and restored.fmt.patterns == saved.fmt.patterns, name
        assert all(torch.equal(a, b) for a, b in zip(saved.fmt.factors, restored.fmt.factors))
    entry = config["minfer"]["formats"]["layers.0.mlp.down_proj"]
    entry["options"]["patterns"] = entry["options"]["patterns"][::-1]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r'config.json lists other formats under "minfer" than model.safetensors '
                                              r'holds \(layers.0.mlp.down_proj\)'):
        load_model(resolved, torch.float32, "cpu")


@pytest.fixture(scope="module")
def generate_app():
    return load_app(APP)


def test_generate_with_ks_chains(generate_app, capsys):
    base = ["--device", "cpu", "--max-new-tokens", "4", "--json"]
    factorized = in_process(generate_app, [*base, "--sparse", "ksmm", "--ks-patterns", "monarch-50"], capsys)
    assert factorized.returncode == 0, factorized.stderr
    assert json.loads(factorized.stdout)["sparse"] == "ksmm"
    assert "relative Frobenius error of the KS projection: layers.0 " in factorized.stderr
    assert "; total 0." in factorized.stderr
    random = in_process(generate_app, [*base, "--weights", "random", "--sparse", "ksmm", "--ks-patterns", "monarch-25"],
                        capsys)
    assert random.returncode == 0 and "random ksmm factors (monarch-25)" in random.stderr, random.stderr


@pytest.mark.parametrize("args, fragments", [
    (["--sparse", "ksmm"], ["--sparse ksmm needs --ks-patterns"]),
    (["--ks-patterns", "monarch-50"], ["add --sparse ksmm"]),
    (["--sparse", "ksmm", "--ks-patterns", "monarch-7"], ["'monarch-7' is not"]),
    (["--sparse", "ksmm", "--ks-patterns", "monarch-50", "--density", "0.5"], ["drop --density"]),
    (["--sparse", "ksmm", "--ks-patterns", "64x64:4,8,16,1/1,16,8,4"], ["no chain for the"]),
])
def test_bad_ks_flags_exit_2_in_one_line(generate_app, capsys, args, fragments):
    assert_input_error(in_process(generate_app, ["--device", "cpu", "--max-new-tokens", "2", *args], capsys),
                       *fragments)


FUSIONS = [dict(norm=True), dict(residual=True), dict(silu_mul=True), dict(norm=True, silu_mul=True)]


@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("pattern", [(1, 6, 5, 2), (3, 4, 2, 1), (1, 8, 3, 3)], ids=str)
def test_fused_factor_reference_is_the_fused_dense_reference(pattern, fusion):
    """ops.ksmm_gemv_reference on one factor computes what ops.linear_reference does on its dense matrix, and
    ops.ksmm_gemv on the CPU is that reference."""
    from minfer import ops

    generator = torch.Generator().manual_seed(1)
    factor = torch.randn(pattern, generator=generator, dtype=torch.float64)
    dense = KSWeight.from_factors([factor]).to_dense()
    x = torch.randn(3, dense.shape[1], generator=generator, dtype=torch.float64)
    norm = torch.rand(dense.shape[1], generator=generator, dtype=torch.float64) + 0.5 if fusion.get("norm") else None
    residual = torch.randn(3, dense.shape[0], generator=generator, dtype=torch.float64) \
        if fusion.get("residual") else None
    silu = fusion.get("silu_mul", False)
    got = ops.ksmm_gemv_reference(x, factor, norm, 1e-5, residual, silu)
    assert rel_error(got, ops.linear_reference(x, dense, norm, 1e-5, residual, silu)) < 1e-6  # that one is fp32
    assert rel_error(ops.ksmm_gemv(x, factor, None if residual is None else residual.clone(), norm_weight=norm,
                                   eps=1e-5, accumulate=residual is not None, silu_mul=silu), got) < 1e-12


def test_fused_factor_refusals():
    from minfer import ops

    x, factor = torch.randn(2, 10), torch.randn(1, 3, 5, 2)
    with pytest.raises(FormatError, match="adds into `out`"):
        ops.ksmm_gemv(x, factor, accumulate=True)
    with pytest.raises(FormatError, match="an even a·b·d"):
        ops.ksmm_gemv(torch.randn(2, 5), torch.randn(1, 3, 5, 1), silu_mul=True)
    with pytest.raises(FormatError, match="out must be"):
        ops.ksmm_gemv(x, factor, torch.empty(2, 5))
    assert ops.ksmm_gemv_fuses((1, 64, 96, 4), 1, silu_mul=True)
    assert not ops.ksmm_gemv_fuses((2, 64, 96, 4), 1, silu_mul=True)  # the halves are not j < b/2 of one i
    assert not ops.ksmm_gemv_fuses((1, 64, 96, 4), 17)
    assert not ops.ksmm_gemv_fuses((1, 8, 5, 3), 1)


@pytest.mark.parametrize("following", [None, (5, 6), (15, 2), (3, 10)], ids=str)
@pytest.mark.parametrize("pattern", [(3, 5, 7, 1), (1, 6, 5, 2), (3, 2, 3, 5)], ids=str)
def test_wgmma_reference_is_the_factor_in_both_orders(pattern, following):
    """The wgmma kernel's oracle (ops.ksmm_wgmma_reference) on the factor's batch-major input and per-l groups
    is ops.ksmm_reference, in the natural order or a next factor's batch-major order; ops.ksmm_wgmma on the CPU
    is that reference; to_batch_major and from_batch_major are inverses, and transpose_blocks is each of them."""
    from minfer import ops

    a, b, c, d = pattern
    if following is not None and a * b * d % (following[0] * following[1]):
        pytest.skip("the next factor does not chain with this one")
    generator = torch.Generator().manual_seed(2)
    factor = torch.randn(pattern, generator=generator, dtype=torch.float64)
    x = torch.randn(5, a * c * d, generator=generator, dtype=torch.float64)
    next_c, next_d = following or (1, 1)
    expected = ops.ksmm_reference(x, factor)
    if next_d > 1:
        expected = ops.to_batch_major(expected, next_c, next_d)
    x_batch_major = ops.to_batch_major(x, c, d)
    assert torch.equal(ops.from_batch_major(x_batch_major, c, d), x)
    assert torch.equal(ops.transpose_blocks(x, c, d), x_batch_major)
    assert torch.equal(ops.transpose_blocks(x_batch_major, d, c), x)
    groups = ops.ksmm_groups(factor)
    assert torch.equal(groups[1 % (a * d)], factor[(1 % (a * d)) // d, :, :, (1 % (a * d)) % d])
    got = ops.ksmm_wgmma_reference(x_batch_major, groups, d, next_c, next_d)
    assert rel_error(got, expected) < 1e-14
    assert torch.equal(ops.ksmm_wgmma(x_batch_major, groups, d, next_c, next_d), got)


def test_wgmma_refusals_and_cpu_plan():
    from minfer import ops

    groups = torch.randn(4, 8, 8)
    with pytest.raises(FormatError, match="takes x"):
        ops.ksmm_wgmma(torch.randn(3, 30), groups)
    with pytest.raises(FormatError, match="must chain"):
        ops.ksmm_wgmma(torch.randn(3, 32), groups, 1, 7, 3)
    with pytest.raises(FormatError, match="tile_n"):
        ops.ksmm_wgmma(torch.randn(3, 32), groups, tile_n=96)
    chain = KSWeight.from_factors(random_factors([(4, 64, 64, 1), (1, 64, 64, 4)], torch.float16))
    with ops.ksmm_wgmma_from(64):
        assert chain.wgmma_plan(torch.randn(300, 256, dtype=torch.float16)) == [None, None]  # no kernels on the CPU
        sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        assert ops.ksmm_path((4, 64, 64, 1), 300) == ("wgmma" if sm90 else "tensor-core")
        assert ops.ksmm_wgmma_batch(64) and not ops.ksmm_wgmma_batch(63)
    with ops.ksmm_wgmma_from(None):
        assert not ops.ksmm_wgmma_batch(1 << 20)
    # a gather into the batch-major order pays for large groups only
    assert ops.ksmm_wgmma_gathers(256, 1024, 4) and ops.ksmm_wgmma_gathers(2048, 512, 2)
    assert not ops.ksmm_wgmma_gathers(256, 256, 4) and not ops.ksmm_wgmma_gathers(260, 1024, 4)
    assert ops.ksmm_wgmma_gathers(256, 256, 16) and not ops.ksmm_wgmma_gathers(64, 64, 64)
    assert ops.ksmm_wgmma_factor(4, 8 << 20) and not ops.ksmm_wgmma_factor(3, 8 << 20)
    assert not ops.ksmm_wgmma_factor(16, (8 << 20) - 1) and ops.ksmm_wgmma_factor(17, 0)


@pytest.mark.parametrize("patterns", CHAINS, ids=str)
def test_wgmma_chain_reference_is_the_per_factor_composition(patterns):
    """ops.ksmm_wgmma_chain off the kernel (its reference) on a chain whose factors all take the wgmma path (a
    d > 1 first factor gathered, each factor writing the next one's batch-major order where that one's d > 1)
    is the factors applied one by one; a plan of the wrong length is refused in one line."""
    from minfer import ops

    factors = random_factors(patterns)
    x = torch.randn(5, pattern_inputs(patterns[0]), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plan = []
    for index, (_, _, c, d) in enumerate(patterns):
        following = patterns[index + 1] if index + 1 < len(patterns) else None
        next_c, next_d = following[2:] if following is not None and following[3] > 1 else (1, 1)
        plan += [d, next_c, next_d, *((c, d) if index == 0 and d > 1 else (0, 0))]
    groups = [ops.ksmm_groups(factor) for factor in factors]
    expected = x
    for factor in factors:
        expected = ops.ksmm_reference(expected, factor)
    assert rel_error(ops.ksmm_wgmma_chain(x, groups, plan), expected) < 1e-14
    for bad_groups, bad_plan in ((groups, plan[:-1]), ([], [])):
        with pytest.raises(FormatError, match="plan holds") as raised:
            ops.ksmm_wgmma_chain(x, bad_groups, bad_plan)
        assert "\n" not in str(raised.value)


def test_prefill_steps_are_cached_per_kind_of_input_and_rebuilt_when_a_factor_changes():
    chain = KSWeight.from_factors(random_factors([(4, 64, 64, 1), (1, 64, 64, 4)], torch.float16))
    x = torch.randn(300, 256, dtype=torch.float16)
    steps = chain.prefill_steps(x)
    # no kernels on the CPU: ops.ksmm for every factor, no chain op
    assert [step[1:] for step in steps.per_factor] == [(None, None)] * 2 and steps.chain is None
    assert all(weights is factor for (weights, _, _), factor in zip(steps.per_factor, chain.factors))
    assert chain.prefill_steps(torch.randn(300, 256, dtype=torch.float16)) is steps
    assert chain.prefill_steps(torch.randn(3, 256, dtype=torch.float16)) is not steps  # not a wgmma batch
    steps = chain.prefill_steps(x)
    chain.factor0.mul_(2)  # a loader filling the buffer in place
    assert chain.prefill_steps(x) is not steps
