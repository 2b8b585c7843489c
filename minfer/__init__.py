"""minfer: a minimal batch-1 Llama inference engine on in-house CUDA kernels."""

from .errors import MinferError

__all__ = ["MinferError"]
