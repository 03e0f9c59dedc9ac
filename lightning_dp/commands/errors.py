"""Short command-line errors with "did you mean": moved to :mod:`lightning_dp.config.errors` (the layer that
builds a config, below the commands), and imported from here as before. Standard library only, as there.
"""

from lightning_dp.config.errors import (
    TRACEBACK_ENV,
    ConfigurationError,
    ShortArgumentParser,
    class_help_spelling,
    closest,
    condense,
    is_refusal,
    is_user_error,
    option_synonyms,
    plain_text,
    root_cause,
    root_message,
    short_error,
    show_tracebacks,
    suggest,
)

__all__ = ["TRACEBACK_ENV", "ConfigurationError", "ShortArgumentParser", "class_help_spelling", "closest", "condense",
           "is_refusal", "is_user_error", "option_synonyms", "plain_text", "root_cause", "root_message", "short_error",
           "show_tracebacks", "suggest"]
