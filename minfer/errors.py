"""One exception family for every bad input; apps print the message and exit with code 2."""


class MinferError(Exception):
    """Base class: the message names the problem and the fix."""


class UnknownModelError(MinferError):
    pass


class CheckpointError(MinferError):
    pass


class ContextLengthError(MinferError):
    pass


class DeviceError(MinferError):
    """A CUDA-only option without a GPU, or not enough GPU memory."""


class KernelBuildError(MinferError):
    pass


class FormatError(MinferError):
    """A weight format got input it cannot represent (wrong dtype, shape or device)."""
