"""Kronecker-sparse (KS) chains: a projection stored as a product of Kronecker-sparse factors (Monarch,
butterfly; docs/FORMATS.md, "Kronecker-sparse factors").

A factor of pattern (a, b, c, d) is a tensor W of shape (a, b, c, d), the (a·b·d) x (a·c·d) matrix
K[i·b·d + j·d + l, i·c·d + k·d + l] = W[i, j, k, l]. A chain lists its factors in application order, as
the KSMM seed's `KSLinear` does: entry 0 is the right-most factor K_L (it reads the input, applied first),
the last entry is K_1 (it writes the output); the matrix is W = K_1 ... K_L.

On a GPU under minfer's kernels, forward runs one fused kernel per factor (ops.ksmm, kernels/ksmm: the
stride-d gather and scatter in place, fp32 sums) for fp16/bf16 chains, the intermediates rounded to that
dtype between factors; elsewhere it is the pure-PyTorch reference (one einsum per factor, fp32 intermediates).
From minfer.ops.ksmm.KSMM_WGMMA_MIN_TOKENS (17) tokens, and for factors of 8 MB from 4 tokens
(ops.ksmm_wgmma_factor), on an sm_90 GPU, the chain's factors whose b and c the wgmma kernel takes run it
(ops.ksmm_wgmma). A d > 1 factor reads x in its batch-major order (ops.to_batch_major), which the factor before
it writes when that one runs the kernel too, and which is gathered by a block transpose otherwise
(ops.transpose_blocks; large or many groups only: ops.ksmm_wgmma_gathers); it reads its W in
the per-l layout [a·d, b, c] (ops.ksmm_groups), a copy built at the first such prefill and counted in nbytes.
A chain whose factors all run that kernel is one op (ops.ksmm_wgmma_chain, the gathers inside): one dispatch
per projection, as a 512-token prefill took as long to enqueue as to run (docs/perf-notes.md, 2026-11-28).
The projection of a dense matrix onto a chain (from_dense) lives here too: sparsity.factorize applies it
to a whole model, and this package must not import that one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from .. import ops
from ..errors import FormatError
from .base import WeightFormat, expect_tensors, register

Pattern = tuple[int, int, int, int]


def pattern_inputs(pattern: Pattern) -> int:
    a, _, c, d = pattern
    return a * c * d


def pattern_outputs(pattern: Pattern) -> int:
    a, b, _, d = pattern
    return a * b * d


def check_chain(patterns: Sequence[Pattern], shape: tuple[int, int]) -> None:
    """Raise FormatError (one line naming the pair) unless `patterns`, in application order, multiply to a
    matrix of `shape` (N, K)."""
    if not patterns:
        raise FormatError("a KS chain needs at least one factor pattern (a, b, c, d)")
    for pattern in patterns:
        if len(pattern) != 4 or any(not isinstance(v, int) or v < 0 for v in pattern) or pattern[0] < 1 \
                or pattern[3] < 1:
            raise FormatError(f"a KS pattern is four integers (a, b, c, d) with a, d >= 1 and b, c >= 0, got "
                              f"{tuple(pattern)}")
    for first, second in zip(patterns, patterns[1:]):
        if pattern_outputs(first) != pattern_inputs(second):
            raise FormatError(f"the KS patterns {tuple(first)} and {tuple(second)} do not chain: the first writes "
                              f"{pattern_outputs(first)} values, the second reads {pattern_inputs(second)}")
    rows, cols = shape
    if pattern_inputs(patterns[0]) != cols:
        raise FormatError(f"the KS chain's first factor {tuple(patterns[0])} reads {pattern_inputs(patterns[0])} "
                          f"inputs, but the matrix has {cols} columns")
    if pattern_outputs(patterns[-1]) != rows:
        raise FormatError(f"the KS chain's last factor {tuple(patterns[-1])} writes {pattern_outputs(patterns[-1])} "
                          f"outputs, but the matrix has {rows} rows")


# A factor's step in a prefill: (factor, None, None) for ops.ksmm, or (groups, order, gather) for the wgmma kernel.
Step = tuple[torch.Tensor, tuple[int, int, int] | None, tuple[int, int] | None]


class PrefillSteps(NamedTuple):
    """What KSWeight.forward runs on one kind of input (KSWeight.prefill_steps)."""

    per_factor: list[Step]
    chain: tuple[list[torch.Tensor], list[int]] | None  # every factor on wgmma: ops.ksmm_wgmma_chain's groups, plan


@register
class KSWeight(WeightFormat):
    """A chain of KS factors, in application order (factor0 = K_L first; see the module docstring)."""

    name = "ksmm"

    def __init__(self, factors: Sequence[torch.Tensor]):
        factors = list(factors)
        patterns = [tuple(f.shape) for f in factors]
        if any(f.dim() != 4 for f in factors):
            raise FormatError(f"each KS factor is a 4-D (a, b, c, d) tensor, got shapes {patterns}")
        if not factors:
            raise FormatError("a KS chain needs at least one factor")
        check_chain(patterns, (pattern_outputs(patterns[-1]), pattern_inputs(patterns[0])))
        if any(not f.is_floating_point() or f.dtype != factors[0].dtype for f in factors):
            raise FormatError(f"the factors of a KS chain share one float dtype, got "
                              f"{', '.join(str(f.dtype) for f in factors)}")
        super().__init__(pattern_outputs(patterns[-1]), pattern_inputs(patterns[0]))
        for index, factor in enumerate(factors):
            self.register_buffer(f"factor{index}", factor)
        self.factor_count = len(factors)
        self._factor_names = tuple(f"factor{index}" for index in range(self.factor_count))
        # factor index -> (the factor's device, data_ptr and version it was built from, its per-l layout)
        self._wgmma_groups: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._steps: tuple[tuple, PrefillSteps] | None = None  # prefill_steps' (key, steps)

    @property
    def factors(self) -> list[torch.Tensor]:
        buffers = self._buffers  # not Module.__getattr__: prefill asks per projection
        return [buffers[name] for name in self._factor_names]

    @property
    def patterns(self) -> list[Pattern]:
        return [tuple(f.shape) for f in self.factors]

    def wgmma_groups(self, index: int) -> torch.Tensor:
        """Factor `index` as the wgmma kernel's groups (ops.ksmm_groups): a view at d = 1; at d > 1 the per-l
        copy, built once per device and contents of the factor (a loader fills buffers in place, `.to()` moves
        them)."""
        factor = getattr(self, f"factor{index}")
        if factor.shape[3] == 1:
            return ops.ksmm_groups(factor)
        source = (factor.device, factor.data_ptr(), factor._version)
        built = self._wgmma_groups.get(index)
        if built is None or built[0] != source:
            built = (source, ops.ksmm_groups(factor))
            self._wgmma_groups[index] = built
        return built[1]

    @property
    def nbytes(self) -> int:
        """The factors, plus the per-l copies of the d > 1 factors once a prefill has built them."""
        copies = (groups for _, groups in self._wgmma_groups.values())
        return super().nbytes + sum(groups.numel() * groups.element_size() for groups in copies)

    def wgmma_plan(self, flat: torch.Tensor) -> list[tuple[int, int, int, bool] | None]:
        """Per factor, for the chain input `flat`: None where the factor runs ops.ksmm, else the (d, next_c,
        next_d, gather) it runs ops.ksmm_wgmma with. For batches ops.ksmm_wgmma_factor takes for it, the wgmma
        kernel runs a factor of its shapes (a d = 1 factor when 16-byte aligned). A factor followed by a d > 1 one
        that runs the kernel writes that one's batch-major order (next_c, next_d), otherwise its natural order
        (1, 1); `gather`: a d > 1 factor whose input is in the natural order (the chain's first, or after a
        factor on ops.ksmm) has it copied into its batch-major order first, where that pays
        (ops.ksmm_wgmma_gathers)."""
        runs = ops.ksmm_wgmma_takes(flat)
        patterns = self.patterns
        on: list[bool] = []
        gathers: list[bool] = []
        for factor, batch, (a, b, c, d) in zip(self.factors, self._wgmma_batch(flat), patterns):
            gathers.append(d > 1 and not (on and on[-1]))
            takes = ops.ksmm_wgmma_gathers(b, c, a * d) if gathers[-1] else ops.ksmm_wgmma_shape(b, c)
            on.append(runs and batch and takes and (d > 1 or factor.data_ptr() % 16 == 0))
        plan: list[tuple[int, int, int, bool] | None] = []
        for index, (_, _, _, d) in enumerate(patterns):
            following = index + 1 < len(on) and on[index + 1] and patterns[index + 1][3] > 1
            next_c, next_d = patterns[index + 1][2:] if following else (1, 1)
            plan.append((d, next_c, next_d, gathers[index]) if on[index] else None)
        return plan

    def _wgmma_batch(self, flat: torch.Tensor) -> tuple[bool, ...]:
        """Per factor, whether the batch of `flat` is one it runs the wgmma kernel for (ops.ksmm_wgmma_factor)."""
        tokens = flat.shape[0]
        return tuple(ops.ksmm_wgmma_factor(tokens, f.numel() * f.element_size()) for f in self.factors)

    def prefill_steps(self, flat: torch.Tensor) -> PrefillSteps:
        """What forward runs on `flat`: per factor (factor, None, None) for ops.ksmm, or (groups, order, gather)
        for the wgmma kernel (wgmma_plan, wgmma_groups), gather the (c, d) whose batch-major order x is copied
        into first, or None; where every factor runs that kernel, the groups and the flat plan of the one
        ops.ksmm_wgmma_chain call that replaces the loop. Cached per kind of input (wgmma batch or not, device,
        dtype, 16-byte alignment) and the factors' storage and versions: built per call, it cost a 512-token
        prefill more host time than its factors take on the GPU (docs/perf-notes.md, 2026-11-28)."""
        factors = self.factors
        key = (self._wgmma_batch(flat), flat.device, flat.dtype, flat.data_ptr() % 16 == 0,
               [(factor.data_ptr(), factor._version) for factor in factors])
        if self._steps is None or self._steps[0] != key:
            steps = []
            for index, (factor, plan) in enumerate(zip(factors, self.wgmma_plan(flat))):
                if plan is None:
                    steps.append((factor, None, None))
                    continue
                *order, gather = plan
                steps.append((self.wgmma_groups(index), tuple(order), tuple(factor.shape[2:]) if gather else None))
            chain = None
            if all(order is not None for _, order, _ in steps):
                groups = [weights for weights, _, _ in steps]
                chain = (groups, [value for _, order, gather in steps for value in (*order, *(gather or (0, 0)))])
            self._steps = (key, PrefillSteps(steps, chain))
        return self._steps[1]

    @classmethod
    def from_factors(cls, factors: Sequence[torch.Tensor]) -> KSWeight:
        """The chain of these factors, in application order (each tensor's shape is its pattern)."""
        return cls(factors)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, patterns: Sequence[Sequence[int]] | None = None) -> KSWeight:
        """The best chain of `patterns` for `weight` (project_chain); without patterns,
        the matrix itself as one full factor (1, N, K, 1), exactly."""
        if weight.dim() != 2:
            raise FormatError(f"a KS weight encodes a 2-D [out, in] matrix, got shape {tuple(weight.shape)}")
        if patterns is None:
            return cls([weight.reshape(1, *weight.shape, 1)])
        return cls(project_chain(weight, [tuple(p) for p in patterns]).factors)

    @classmethod
    def random(cls, patterns: Sequence[Pattern], dtype: torch.dtype, device: torch.device | str,
               generator: torch.Generator) -> KSWeight:
        """Random factors (uniform in ±1/sqrt(c), as KSLinear initializes them) for benchmarks."""
        factors = [((torch.rand(p, generator=generator) * 2 - 1) / max(p[2], 1) ** 0.5).to(dtype=dtype, device=device)
                   for p in patterns]
        return cls(factors)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                     options: Mapping[str, object]) -> KSWeight:
        patterns = [tuple(p) for p in options.get("patterns", ())]
        check_chain(patterns, tuple(shape))
        names = tuple(f"factor{index}" for index in range(len(patterns)))
        expect_tensors(cls, tensors, names)
        for name, pattern in zip(names, patterns):
            if tuple(tensors[name].shape) != pattern:
                raise FormatError(f"the KS tensor {name} has shape {tuple(tensors[name].shape)}, but its pattern "
                                  f"is {pattern}")
        return cls([tensors[name] for name in names])

    def options(self) -> dict:
        return {"patterns": [list(p) for p in self.patterns]}

    def check(self) -> None:
        check_chain(self.patterns, self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._buffers["factor0"].dtype

    def _apply_chain(self, flat: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        for factor in self.factors:
            flat = ops.ksmm_reference(flat, factor.to(compute))
        return flat

    def to_dense(self) -> torch.Tensor:
        """The chain applied to the identity in float64, rounded once to the storage dtype (a single factor
        is placed exactly)."""
        eye = torch.eye(self.in_features, dtype=torch.float64, device=self.factor0.device)
        return self._apply_chain(eye, torch.float64).T.to(self.dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        dtype = self.dtype
        if ops.use_kernels(flat) and x.dtype == dtype and dtype in ops.KSMM_DTYPES:
            flat = flat.contiguous()
            steps = self.prefill_steps(flat)
            if steps.chain is not None:
                return ops.ksmm_wgmma_chain(flat, *steps.chain).reshape(*x.shape[:-1], self.out_features)
            for weights, order, gather in steps.per_factor:
                if order is None:
                    flat = ops.ksmm(flat, weights)
                    continue
                if gather is not None:
                    flat = ops.transpose_blocks(flat, *gather)
                flat = ops.ksmm_wgmma_planned(flat, weights, *order)
            return flat.reshape(*x.shape[:-1], self.out_features)
        compute = torch.promote_types(x.dtype, torch.float32)
        return self._apply_chain(flat.to(compute), compute).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
        """Where ops.ksmm runs the gemv kernel (2..KSMM_ROWS_MAX_TOKENS tokens), the norm runs inside the first
        factor's kernel and the MLP activation or the residual add inside the last one's (ops.ksmm_gemv); at one
        token the rows kernel runs, with the residual add alone fused. A step a factor's kernel cannot fuse runs as
        its own op."""
        tokens = x.numel() // max(self.in_features, 1)
        if not (ops.use_kernels(x) and x.dtype == self.dtype and self.dtype in ops.KSMM_DTYPES
                and 1 <= tokens <= ops.KSMM_ROWS_MAX_TOKENS and not (silu_mul and residual is not None)):
            return super().project(x, norm_weight, eps, residual, silu_mul)
        factors = self.factors
        first, last = tuple(factors[0].shape), tuple(factors[-1].shape)

        def gemv_fuses(pattern: Pattern, silu: bool = False) -> bool:
            return ops.ksmm_path(pattern, tokens) == "gemv" and ops.ksmm_gemv_fuses(pattern, tokens, silu)

        fuse_norm = norm_weight is not None and gemv_fuses(first)
        fuse_silu = silu_mul and gemv_fuses(last, silu=True)
        fuse_residual = residual is not None and residual.is_contiguous() and ops.ksmm_gemv_fuses(last, tokens)
        flat = x.reshape(tokens, self.in_features).contiguous()
        if norm_weight is not None and not fuse_norm:
            flat = ops.rms_norm(flat, norm_weight, eps)
        for index, factor in enumerate(factors):
            norm = norm_weight if index == 0 and fuse_norm else None
            if index == len(factors) - 1 and (fuse_silu or fuse_residual):
                out = residual.view(tokens, self.out_features) if fuse_residual else None
                flat = ops.ksmm_gemv(flat, factor, out, norm_weight=norm, eps=eps, accumulate=fuse_residual,
                                     silu_mul=fuse_silu)
            elif norm is not None:
                flat = ops.ksmm_gemv(flat, factor, norm_weight=norm, eps=eps)
            else:
                flat = ops.ksmm(flat, factor)
        if fuse_residual:
            return residual
        if silu_mul and not fuse_silu:
            flat = ops.silu_mul(flat)
        y = flat.reshape(*x.shape[:-1], flat.shape[-1])
        return y if residual is None else residual.add_(y)

    def extra_repr(self) -> str:
        return f"{self.name}, shape={self.shape}, patterns={self.patterns}"


class Projection(NamedTuple):
    factors: list[torch.Tensor]  # in application order, float32
    error: float  # ||W - chain||_F (absolute)


def pair_product(first: Pattern, second: Pattern) -> Pattern:
    """The pattern of K_second K_first (first applied first), or FormatError when the pair does not chain:
    a_second | a_first, d_first | d_second, and r = a_second·c_second / a_first = b_first·d_first / d_second
    an integer (the pair's rank)."""
    a2, b2, c2, d2 = first
    a1, b1, c1, d1 = second
    rank_in, rank_out = a1 * c1, b2 * d2
    if a2 % a1 or d1 % d2 or rank_in % a2 or rank_out % d1 or rank_in // a2 != rank_out // d1:
        raise FormatError(f"the KS patterns {first} and {second} are not a chainable pair (they need a2 % a1 == 0, "
                          f"d1 % d2 == 0 and a1·c1/a2 == b2·d2/d1 an integer, (a2, b2, c2, d2) the one applied first)")
    return (a1, b1 * d1 // d2, a2 * c2 // a1, d2)


def project_pair(weight: torch.Tensor, first: Pattern, second: Pattern) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors (first, second) minimizing ||W - K_second K_first||_F: the matrix splits into
    a1·d2 independent problems, each into d1'·a2' blocks of b1 x c2 whose rank-r truncated SVD is kept,
    sqrt(S) going to each factor."""
    pair_product(first, second)
    a2, b2, c2, d2 = first
    a1, b1, c1, d1 = second
    sub_a, sub_d = a2 // a1, d1 // d2  # the sub-problems' patterns: (sub_a, b2, c2, 1) then (1, b1, c1, sub_d)
    rank = c1 // sub_a
    rows, cols = weight.shape
    w = weight.to(torch.float32).reshape(a1, rows // (a1 * d2), d2, a1, cols // (a1 * d2), d2)
    sub = torch.einsum("ipliql->ilpq", w)  # (a1, d2, b1·sub_d, sub_a·c2): the diagonal blocks
    blocks = sub.reshape(a1, d2, b1, sub_d, sub_a, c2).permute(0, 1, 3, 4, 2, 5)  # (.., sub_d, sub_a, b1, c2)
    u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    kept = min(rank, s.shape[-1])
    root = s[..., :kept].sqrt()
    left = torch.zeros(*blocks.shape[:-2], b1, rank, dtype=torch.float32, device=weight.device)
    right = torch.zeros(*blocks.shape[:-2], rank, c2, dtype=torch.float32, device=weight.device)
    left[..., :kept] = u[..., :kept] * root[..., None, :]
    right[..., :kept, :] = root[..., :, None] * vh[..., :kept, :]
    # left[i, l2, l', i', j, t] = K_second[i, j, i'·r + t, l'·d2 + l2]
    second_factor = left.permute(0, 4, 3, 5, 2, 1).reshape(a1, b1, sub_a * rank, sub_d * d2)
    # right[i, l2, l', i', t, k] = K_first[i·sub_a + i', t·sub_d + l', k, l2]
    first_factor = right.permute(0, 3, 4, 2, 5, 1).reshape(a1 * sub_a, rank * sub_d, c2, d2)
    return first_factor, second_factor


def project_chain(weight: torch.Tensor, patterns: Sequence[Pattern]) -> Projection:
    """The chain of `patterns` (application order) approximating `weight`: the last factor is split off the
    product of the others by project_pair, then that product is factorized the same way."""
    patterns = [tuple(p) for p in patterns]
    check_chain(patterns, tuple(weight.shape))
    target = weight.to(torch.float32)
    if len(patterns) == 1:
        a, b, c, d = patterns[0]
        factors = [torch.einsum("ijlikl->ijkl", target.reshape(a, b, d, a, c, d)).contiguous()]
    else:
        rest = patterns[0]
        for pattern in patterns[1:-1]:
            rest = pair_product(rest, pattern)
        first, last = project_pair(target, rest, patterns[-1])
        inner = project_chain(KSWeight.from_factors([first]).to_dense(), patterns[:-1]).factors
        factors = [*inner, last]
    error = float(torch.linalg.norm(target - KSWeight.from_factors(factors).to_dense()))
    return Projection(factors, error)
