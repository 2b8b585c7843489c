"""minfer's ops: one module per kernel family (kernels/<family>/ beside minfer/ops/<family>.py), and
`runtime`, which builds the extension and holds the backend choice.

Each op has three parts kept side by side:
- `<op>_reference`: pure PyTorch, the CPU path and the test oracle;
- a fake (meta) implementation, so the op works under torch.compile and CUDA-graph capture;
- `<op>`: the wrapper the engine calls; it runs the CUDA kernel when the tensors live on a GPU and
  the "minfer" backend is active, and the reference otherwise. `<op>_tuned` variants pin the launch
  knobs that sweeps and benchmarks vary.

`python -m minfer.ops --build` compiles every kernel (for sm_90a when no GPU is present).
"""

from .allreduce import (
    ALL_REDUCE_MAX_BLOCKS,
    ALL_REDUCE_MAX_BYTES,
    one_shot_all_reduce,
    one_shot_all_reduce_fits,
    one_shot_all_reduce_reference,
)
from .attention import (
    DECODE_ATTENTION_KEY_TILE,
    DECODE_ATTENTION_MAX_SPLITS,
    blocksparse_decode_attention,
    blocksparse_decode_attention_reference,
    decode_attention,
    decode_attention_reference,
    decode_attention_ring_stages,
    decode_attention_splits,
    decode_attention_supports,
    decode_attention_workspace,
    sink_window_decode_attention,
    sink_window_decode_attention_reference,
)
from .blocksparse_attention import (
    BLOCKSPARSE_KERNELS,
    BLOCKSPARSE_TILE,
    blocksparse_attention,
    blocksparse_attention_reference,
    blocksparse_kernel_supports,
    blocksparse_tiles,
    blocksparse_token_mask,
)
from .dense import GEMV_MAX_TOKENS, HGEMM_KERNELS, gemv, gemv_tuned, hgemm, hgemm_tuned, linear_reference
from .elementwise import (
    add_rms_norm,
    rms_norm,
    rms_norm_reference,
    rope_write_kv,
    rope_write_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from .ksmm import (
    KSMM_DTYPES,
    KSMM_PATHS,
    KSMM_ROWS_MAX_D,
    KSMM_ROWS_MAX_TOKENS,
    KSMM_WGMMA_MULTIPLE,
    KSMM_WGMMA_TILES,
    from_batch_major,
    ksmm,
    ksmm_gemv,
    ksmm_gemv_fuses,
    ksmm_gemv_reference,
    ksmm_groups,
    ksmm_kernel_takes,
    ksmm_path,
    ksmm_reference,
    ksmm_tuned,
    ksmm_wgmma,
    ksmm_wgmma_planned,
    ksmm_wgmma_batch,
    ksmm_wgmma_chain,
    ksmm_wgmma_chain_reference,
    ksmm_wgmma_factor,
    ksmm_wgmma_from,
    ksmm_wgmma_gathers,
    ksmm_wgmma_reference,
    ksmm_wgmma_shape,
    ksmm_wgmma_takes,
    to_batch_major,
    transpose_blocks,
    transpose_blocks_reference,
)
from .macko import (
    MACKO_FUSED_MAX_COLS,
    MACKO_SPMM_MAX_TOKENS,
    MACKO_TENSOR_CORE_MAX_COLS,
    MACKO_TENSOR_CORE_MIN_TOKENS,
    MACKO_TILE_ROWS,
    MACKO_WINDOW_COLS,
    check_macko_arrays,
    macko_decompress,
    macko_decompress_reference,
    macko_k_splits,
    macko_spmv,
    macko_spmv_reference,
    macko_spmv_tuned,
    macko_tensor_core_spmm,
    macko_tensor_core_spmm_tuned,
    macko_uses_tensor_cores,
    macko_window_table,
    unpack_nibbles,
)
from .runtime import (
    BACKENDS,
    backend,
    build,
    build_for,
    current_backend,
    kernels_run_on,
    require_cuda,
    target_arch_list,
    use_kernels,
)
from .sparse24 import (
    SPARSE24_CHUNK_COLS,
    SPARSE24_GEMM_ATOM_WORDS,
    SPARSE24_GEMM_K_MULTIPLE,
    SPARSE24_GEMM_ROW_MULTIPLE,
    SPARSE24_GEMM_TILES,
    SPARSE24_GEMV_MAX_TOKENS,
    check_sparse24_arrays,
    sparse24_decompress,
    sparse24_decompress_reference,
    sparse24_gemm,
    sparse24_gemm_metadata,
    sparse24_gemm_reference,
    sparse24_gemm_takes,
    sparse24_gemv,
    sparse24_gemv_metadata,
    sparse24_meta_from_gemm_metadata,
)
from .tokens import argmax, argmax_reference, embedding, embedding_reference

__all__ = [
    "ALL_REDUCE_MAX_BLOCKS", "ALL_REDUCE_MAX_BYTES", "BACKENDS", "BLOCKSPARSE_KERNELS", "BLOCKSPARSE_TILE", "DECODE_ATTENTION_KEY_TILE", "DECODE_ATTENTION_MAX_SPLITS",
    "GEMV_MAX_TOKENS", "HGEMM_KERNELS", "KSMM_DTYPES", "KSMM_PATHS", "KSMM_ROWS_MAX_D", "KSMM_ROWS_MAX_TOKENS", 
    "KSMM_WGMMA_MULTIPLE", "KSMM_WGMMA_TILES",
    "MACKO_FUSED_MAX_COLS", "MACKO_SPMM_MAX_TOKENS", "MACKO_TENSOR_CORE_MAX_COLS", "MACKO_TENSOR_CORE_MIN_TOKENS",
    "MACKO_TILE_ROWS", "MACKO_WINDOW_COLS", "SPARSE24_CHUNK_COLS", "SPARSE24_GEMM_ATOM_WORDS",
    "SPARSE24_GEMM_K_MULTIPLE", "SPARSE24_GEMM_ROW_MULTIPLE", "SPARSE24_GEMM_TILES", "SPARSE24_GEMV_MAX_TOKENS",
    "add_rms_norm", "argmax",
    "argmax_reference", "backend", "blocksparse_attention", "blocksparse_attention_reference",
    "blocksparse_decode_attention", "blocksparse_decode_attention_reference", "blocksparse_kernel_supports",
    "blocksparse_tiles",
    "blocksparse_token_mask", "build", "build_for", "check_macko_arrays", "check_sparse24_arrays", "current_backend",
    "decode_attention", "decode_attention_reference", "decode_attention_ring_stages", "decode_attention_splits", "decode_attention_supports",
    "decode_attention_workspace", "embedding", "embedding_reference", "gemv", "gemv_tuned", "hgemm", "hgemm_tuned",
    "kernels_run_on", "ksmm", "ksmm_gemv", "ksmm_gemv_fuses", "ksmm_gemv_reference", "ksmm_groups",
    "ksmm_kernel_takes", "ksmm_path", "ksmm_reference", "ksmm_tuned", "ksmm_wgmma", "ksmm_wgmma_planned",
    "ksmm_wgmma_batch", "ksmm_wgmma_chain", "ksmm_wgmma_chain_reference", "ksmm_wgmma_factor", "ksmm_wgmma_from",
    "ksmm_wgmma_gathers", "ksmm_wgmma_reference",
    "ksmm_wgmma_shape", "ksmm_wgmma_takes", "from_batch_major", "to_batch_major", "transpose_blocks",
    "transpose_blocks_reference", "linear_reference",
    "macko_decompress", "macko_decompress_reference",
    "macko_k_splits", "macko_spmv", "macko_spmv_reference", "macko_spmv_tuned", "macko_tensor_core_spmm",
    "macko_tensor_core_spmm_tuned", "macko_uses_tensor_cores", "macko_window_table", "one_shot_all_reduce",
    "one_shot_all_reduce_fits", "one_shot_all_reduce_reference", "require_cuda", "rms_norm",
    "rms_norm_reference", "rope_write_kv", "rope_write_kv_reference", "silu_mul", "silu_mul_reference",
    "sink_window_decode_attention", "sink_window_decode_attention_reference", "sparse24_decompress",
    "sparse24_decompress_reference", "sparse24_gemm", "sparse24_gemm_metadata", "sparse24_gemm_reference",
    "sparse24_gemm_takes", "sparse24_gemv", "sparse24_gemv_metadata", "sparse24_meta_from_gemm_metadata",
    "target_arch_list", "unpack_nibbles", "use_kernels",
]
