"""The kernel limits Python relies on (token counts, tile sizes, split counts, kernel names) match the
constants in the kernel sources, read from the files themselves (no build, no GPU)."""

import re

import pytest
import torch

from minfer import ops
from minfer.errors import KernelBuildError
from minfer.ops import attention, dense, elementwise, macko, runtime
from minfer.ops.runtime import KERNEL_DIR

CONSTANT = re.compile(r"constexpr\s+(?:int|int64_t)\s+(k\w+)\s*=\s*([0-9<\s]+);")


def constants(relative_path: str) -> dict[str, int]:
    """Every `constexpr int kName = <number or a << b>;` of a kernel source file."""
    values = {}
    for name, expression in CONSTANT.findall((KERNEL_DIR / relative_path).read_text()):
        base, _, shift = expression.partition("<<")
        values[name] = int(base) << int(shift or 0)
    return values


@pytest.mark.parametrize("python_value, source, names", [
    (ops.GEMV_MAX_TOKENS, "dense/gemv.h", ["kGemvMaxTokens"]),
    (ops.DECODE_ATTENTION_MAX_SPLITS, "attention/decode_attention.h", ["kDecodeAttnMaxSplits"]),
    (attention.DECODE_ATTENTION_MAX_GROUP, "attention/decode_attention.h", ["kDecodeAttnMaxGroup"]),
    (attention.DECODE_ATTENTION_SPLIT_ROWS, "attention/decode_attention.h", ["kDecodeAttnStepRows", "kDecodeAttnWarps"]),
    (ops.MACKO_SPMM_MAX_TOKENS, "macko/macko.h", ["kMackoTensorCoreTokens"]),
    (ops.MACKO_WINDOW_COLS, "macko/macko.h", ["kMackoWindowCols"]),
    (ops.MACKO_TILE_ROWS, "macko/macko.h", ["kMackoTileRows"]),
    (ops.MACKO_TENSOR_CORE_MAX_COLS, "macko/macko.h", ["kMackoTensorCoreMaxCols"]),
    (ops.MACKO_FUSED_MAX_COLS, "macko/macko.h", ["kMackoFusedMaxCols"]),
    (macko._ORIGIN_BIAS, "macko/macko_tensor_core_spmm.cu", ["kOriginBias"]),
    (ops.KSMM_ROWS_MAX_TOKENS, "ksmm/ksmm.h", ["kKsmmRowsMaxTokens"]),
    (ops.KSMM_ROWS_MAX_D, "ksmm/ksmm.h", ["kKsmmRowsMaxD"]),
    (ops.KSMM_WGMMA_MULTIPLE, "ksmm/ksmm.h", ["kKsmmWgmmaMultiple"]),
    (ops.BLOCKSPARSE_TILE, "blocksparse_attention/blocksparse_attention.h", ["kBlocksparseTile"]),
    (ops.SPARSE24_CHUNK_COLS, "sparse24/sparse24.h", ["kSparse24ChunkCols"]),
    (ops.SPARSE24_GEMV_MAX_TOKENS, "sparse24/sparse24.h", ["kSparse24MaxTokens"]),
    (ops.SPARSE24_GEMM_ATOM_WORDS, "sparse24/sparse24.h", ["kSparse24GemmAtomWords"]),
    (ops.SPARSE24_GEMM_ROW_MULTIPLE, "sparse24/sparse24.h", ["kSparse24GemmRowMultiple"]),
    (ops.SPARSE24_GEMM_K_MULTIPLE, "sparse24/sparse24.h", ["kSparse24GemmKMultiple"]),
    (ops.ALL_REDUCE_MAX_BLOCKS, "allreduce/one_shot_all_reduce.h", ["kAllReduceMaxBlocks"]),
    (ops.ALL_REDUCE_MAX_BYTES // ops.ALL_REDUCE_MAX_BLOCKS // 16, "allreduce/one_shot_all_reduce.h",
     ["kAllReduceThreads"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_python_limit_matches_the_kernel_source(python_value, source, names):
    found = constants(source)
    product = 1
    for name in names:
        assert name in found, f"{name} is no longer a constexpr in kernels/{source}"
        product *= found[name]
    assert python_value == product


def test_hgemm_kernel_names_match_the_dispatch_table():
    table = (KERNEL_DIR / "dense/hgemm.cu").read_text()
    kernels = table[table.index("kKernels[] = {"):table.index("};", table.index("kKernels[] = {"))]
    assert dense.HGEMM_KERNELS == ("auto", *re.findall(r'\{"(\w+)",', kernels))


def test_ksmm_path_numbers_match_the_kernel_enum():
    enum = re.search(r"enum class KsmmPath : int \{([^}]*)\}", (KERNEL_DIR / "ksmm/ksmm.h").read_text()).group(1)
    numbers = [int(v) for v in re.findall(r"= (\d+)", enum)]
    assert sorted(ops.KSMM_PATHS.values()) == numbers


def test_rms_norm_row_limits_match_the_kernel():
    """A row lives in the registers of kMaxThreads threads: packs_per_thread 16-byte packs each, or that
    many single elements when the row cannot be read in 16-byte packs."""
    source = (KERNEL_DIR / "elementwise/rms_norm.cu").read_text()
    threads = constants("elementwise/rms_norm.cu")["kMaxThreads"]
    scalar, packed = map(int, re.search(r"packs_per_thread\(int vec\) \{ return vec == 1 \? (\d+) : (\d+); \}",
                                        source).groups())
    for dtype, longest in elementwise.RMS_NORM_MAX_HIDDEN.items():
        assert longest == threads * packed * (16 // torch.empty((), dtype=dtype).element_size())
    assert elementwise.RMS_NORM_MAX_UNALIGNED_HIDDEN == threads * scalar


def test_the_build_takes_every_family_folder_and_refuses_a_file_name_twice(tmp_path, monkeypatch):
    """kernels/<family>/*.cpp and *.cu, nothing at the top level; two sources of one file name would
    share an object file, so the build names both instead."""
    for path in ("common/common_ops.cpp", "dense/gemv.cu", "dense/gemv.h", "newfamily/newfamily_ops.cpp",
                 "stray.cu"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("")
    monkeypatch.setattr(runtime, "KERNEL_DIR", tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in runtime.kernel_sources()] == [
        "common/common_ops.cpp", "newfamily/newfamily_ops.cpp", "dense/gemv.cu"]
    (tmp_path / "newfamily/gemv.cu").write_text("")
    with pytest.raises(KernelBuildError, match="dense/gemv.cu and newfamily/gemv.cu share a file name"):
        runtime.kernel_sources()
