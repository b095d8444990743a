"""Errors raised by depthscope.hooks; each says what went wrong and what to do."""


class DepthscopeError(Exception):
    """Base class of depthscope's own errors."""


class ModelSpecError(DepthscopeError, ValueError):
    """A model spec that load_model cannot resolve."""


class CheckpointError(DepthscopeError, OSError):
    """A checkpoint that is missing, corrupt or unsafe to load."""


class DefaultModelMissing(CheckpointError):
    """The embedded default model's package is not installed."""


class UnsupportedArchitecture(DepthscopeError, NotImplementedError):
    """A model whose blocks, sublayers or norms depthscope cannot map."""


class InputError(DepthscopeError, ValueError):
    """Empty input, text longer than the context, and similar."""


class ContextLengthError(InputError):
    """Input longer than the model's context window."""


class NonFiniteActivationError(DepthscopeError, FloatingPointError):
    """NaN or inf in the residual stream."""


class OutputError(DepthscopeError, OSError):
    """An output place that cannot take the results: an existing file where a folder is wanted,
    a read-only or unwritable place, a folder of another run or one another process is writing,
    a full disk."""
