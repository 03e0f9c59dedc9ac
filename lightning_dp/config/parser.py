"""The jsonargparse parsers of ``lightning-dp``: short errors (:mod:`lightning_dp.config.errors`) and short help.

Kept apart from :mod:`lightning_dp.config.errors` because these subclass jsonargparse's and Lightning's
parsers, which import torch: ``lightning-dp --help``, ``--version`` and the argument errors of the
standard-library commands must answer without them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Optional

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from lightning_dp.config.errors import (
    class_help_spelling,
    condense,
    plain_text,
    short_error,
    show_tracebacks,
    suggest,
    suggest_in_config,
)

__all__ = ["ShortErrorParser", "ShortHelpFormatter", "ShortJsonParser", "shorten_known_subclasses"]


def _short_error(parser: Any, message: str, ex: Optional[Exception]) -> NoReturn:
    """Print a jsonargparse error as :func:`~lightning_dp.config.errors.short_error` and exit with status 2."""
    argv = getattr(parser, "given_args", None)  # kept by the root parser (ShortJsonParser.parse_args)
    parser = getattr(ex, "subcommand_parser", None) or parser
    prog = parser.prog.replace(" [options]", "")
    text = condense(message)
    options = list(getattr(parser, "_option_string_actions", {}))
    in_file = suggest_in_config(text, sys.argv[1:] if argv is None else argv, options)
    sys.stderr.write(short_error(prog, *in_file) if in_file else short_error(prog, text, suggest(text, options)))
    sys.exit(2)


_KNOWN = re.compile(r", known subclasses: ([^)]*)")


def shorten_known_subclasses(help_text: str, keep: int = 6) -> str:
    """jsonargparse's ``known subclasses: a, b, ...`` cut to lightning_dp's and then others, ``keep`` in all.

    >>> shorten_known_subclasses("(type: Module, known subclasses: torch.nn.Linear, torch.nn.ReLU, "
    ...                          "lightning_dp.models.GPT2)", keep=2)
    '(type: Module, known subclasses: lightning_dp.models.GPT2, torch.nn.Linear, ... 1 more)'
    """
    def cut(match: re.Match[str]) -> str:
        paths = [p.strip() for p in match[1].split(",") if p.strip()]
        ours = [p for p in paths if p.startswith("lightning_dp.")]
        shown = (ours + [p for p in paths if p not in ours])[:keep]
        more = len(paths) - len(shown)
        return ", known subclasses: " + ", ".join(shown) + (f", ... {more} more" if more else "")

    return _KNOWN.sub(cut, help_text)


class ShortHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter with the lists of known subclasses cut (:func:`shorten_known_subclasses`)."""

    @override
    def _get_help_string(self, action: Any) -> str:
        return shorten_known_subclasses(super()._get_help_string(action))


class ShortJsonParser(ArgumentParser):
    """jsonargparse's parser whose errors print our message in a few lines and exit with status 2, and whose help
    is short (:class:`ShortHelpFormatter`, unless given another ``formatter_class``) and plain
    (:func:`~lightning_dp.config.errors.plain_text`, :func:`~lightning_dp.config.errors.class_help_spelling`); for the
    commands that are not LightningCLI (``audit``, ``audit mia``) and, through :class:`ShortErrorParser`, for
    LightningCLI. With ``exit_on_error=False`` or ``LIGHTNING_DP_TRACEBACK=1`` its errors are jsonargparse's own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ShortHelpFormatter)
        super().__init__(*args, **kwargs)

    @override
    def format_help(self, formatter: Any = None) -> str:
        return class_help_spelling(plain_text(super().format_help(formatter)))

    @override
    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's; the arguments are kept (``given_args``) so that an error can tell a key of a
        ``--config`` file from one typed on the command line and name the file and line."""
        given = args[0] if args else kwargs.get("args")
        self.given_args = list(sys.argv[1:] if given is None else given)
        return super().parse_args(*args, **kwargs)

    @override
    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error or show_tracebacks():
            super().error(message, ex)
        _short_error(self, message, ex)

    def parse_checked(self, argv: Sequence[str], problems: Callable[[Any], list[str]]) -> tuple[Any, str]:
        """``argv`` parsed, every one of ``problems(cfg)`` refused in one error before anything runs, and the config
        as it is logged (``config.yaml``: secrets such as a DPSGD seed redacted)."""
        from lightning_dp.tracking import redact_secrets

        cfg = self.parse_args(list(argv))
        found = problems(cfg)
        if found:
            self.error("invalid settings:\n  " + "\n  ".join(found))
        return cfg, redact_secrets(self.dump(cfg, skip_none=False))


class ShortErrorParser(ShortJsonParser, LightningArgumentParser):
    """LightningCLI's parser with :class:`ShortJsonParser`'s errors and help (the method order puts those before
    :class:`~lightning.pytorch.cli.LightningArgumentParser`'s, which it otherwise is)."""
