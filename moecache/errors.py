"""Exceptions that reach the user as one clear line (the CLI prints ``error: <message>`` and exits 1)."""


class MoecacheError(Exception):
    """Base class: an error whose message is meant for the user, without a traceback."""


class GGUFError(MoecacheError):
    """A GGUF file is missing, foreign, truncated, misaligned or inconsistent."""


class UnsupportedArchError(GGUFError):
    """``general.architecture`` names an architecture moecache does not implement."""


class UnsupportedQuantError(MoecacheError):
    """A tensor uses a GGML type that has no kernel here."""


class ChatTemplateError(MoecacheError, ValueError):
    """A chat template (code from the GGUF, or given) broke a limit of its sandbox: too slow, too
    much output, memory or arithmetic (see :mod:`moecache.chat_jinja`)."""


class InsufficientMemoryError(MoecacheError):
    """An allocation the settings ask for (the KV cache of ``-c`` tokens, ...) does not fit in the
    memory available; the message says which flag to change."""


class NonFiniteError(MoecacheError):
    """The model's weights or outputs hold NaN or infinity (a corrupt file, or an overflow)."""
