"""One exception family for every bad input; apps print the message and exit with code 2."""


class MinferError(Exception):
    """Base class: the message names the problem and the fix."""


class UnknownModelError(MinferError):
    """A model name that is no alias, HF repo id or local folder."""


class CheckpointError(MinferError):
    """A missing, truncated or mismatched checkpoint file or tensor."""


class ContextLengthError(MinferError):
    """A prompt (plus generation) longer than the context the model or cache allows."""


class DeviceError(MinferError):
    """A CUDA-only option without a GPU, or not enough GPU memory."""


class KernelBuildError(MinferError):
    """The CUDA extension failed to compile or load; the message points at the build log."""


class FormatError(MinferError):
    """A weight format got input it cannot represent (wrong dtype, shape or device)."""
