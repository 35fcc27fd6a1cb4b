"""Errors the engine raises for bad input. Callers (CLI, HTTP) turn them into one-line messages / 4xx."""


class EagleError(ValueError):
    """Bad input or an unusable configuration: the message is meant for the user, one line."""


class UnknownTargetError(EagleError):
    """The target spec names neither a built-in target nor a local model directory."""


class HeadMismatchError(EagleError):
    """A head was built for another target (hidden size, vocabulary or architecture differ)."""


class ContextLengthError(EagleError):
    """A request's prompt plus its token budget does not fit the context the decoder serves."""
