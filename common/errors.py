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


class SiteError(InputError, KeyError, IndexError):
    """A residual site that is not one: a name that is no residual site (a hook point inside a
    block, a typo) or a layer or index out of the model's range. A ``KeyError`` and an
    ``IndexError`` too, as the site parsers raised before."""

    __str__ = Exception.__str__  # the message as written, not KeyError's quoted repr


class ContextLengthError(InputError):
    """Input longer than the model's context window."""


class NonFiniteActivationError(DepthscopeError, FloatingPointError):
    """NaN or inf in the residual stream."""


class OutputError(DepthscopeError, OSError):
    """An output place that cannot take the results: an existing file where a folder is wanted,
    a read-only or unwritable place, a folder of another run or one another process is writing,
    a full disk."""
