"""Short command-line errors and help for ``lightning-dp``: our message in a few lines, with "did you mean".

jsonargparse reports a bad value as a nested tree (every Union member it tried, the value's
Python type and repr) and LightningCLI lets an exception raised while the config's classes
are built escape with a traceback through jsonargparse; either way the line the user acts on
(``lr=-1.0 must be a finite number > 0``) is buried under 40 to 80 lines. This module keeps
that line: :func:`condense` drops jsonargparse's scaffolding, :func:`root_message` finds the
exception a constructor raised, and :func:`suggest` adds the nearest option, subcommand or
class path (:mod:`difflib`, as argparse does for subcommands since Python 3.12 with
``suggest_on_error``; jsonargparse has no such option). Nothing here changes what is
accepted: the parsers decide, this only rewords their refusal.

Set ``LIGHTNING_DP_TRACEBACK=1`` to get the full error and traceback instead.

Everything here is standard library, so that ``lightning-dp --help``, ``--version`` and the argument errors
of ``epsilon``, ``grid`` and ``compare`` (:class:`ShortArgumentParser`) answer before torch is imported. The
jsonargparse parsers with the same errors and a shortened help (known subclasses cut, options spelled as
configs spell them) are in :mod:`lightning_dp.config.parser`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn, Optional

__all__ = ["ConfigurationError", "ShortArgumentParser", "class_help_spelling", "closest", "condense", "config_files",
           "is_refusal", "is_user_error", "locate_key", "option_synonyms", "plain_text", "root_cause", "root_message",
           "short_error", "show_tracebacks", "suggest", "suggest_in_config"]

TRACEBACK_ENV = "LIGHTNING_DP_TRACEBACK"


def show_tracebacks() -> bool:
    """Whether the user asked for full errors (``LIGHTNING_DP_TRACEBACK=1``) or jsonargparse's debug mode is on."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0") or bool(os.environ.get("JSONARGPARSE_DEBUG"))


class ConfigurationError(ValueError):
    """A value of the config or command line that a class refused while the run was being built.

    ``str()`` is the whole message for the user; the original exception is ``__cause__``.
    """


_NOISE = [re.compile(p) for p in (
    r"^Parser key \"[^\"]+\":?\s*$",
    r"^-?\s*Expected a <class 'NoneType'>",
    r"^Given value type:",
    r"^Given value:",
    r"^Subtypes:",
    r"^-?\s*Does not validate against any of the Union subtypes",
    r"^Errors:\s*$",
    r"^-?\s*Expected a path but .* either not accessible or invalid",
    r"^-?\s*Not a valid path",
)]
#: jsonargparse's list of what a subclass value may be: noise beside an option the class does not accept.
_SUBCLASS_NOISE = [re.compile(p) for p in (
    r"^Not a valid subclass of ",
    r"^Subclass types expect one of:",
    r"^a class path \(str\)$",
    r"^a dict with(out)? ",
)]


def condense(message: str) -> str:
    """The lines of a jsonargparse error that say what is wrong, prefixed by the config key.

    >>> text = ('Parser key "model":\\n  - Does not validate against any of the Union subtypes\\n  Errors:\\n'
    ...         "    - Problem with given class_path 'a.B':\\n        Option 'lrr' is not accepted\\n"
    ...         "    - Expected a <class 'NoneType'>\\n  Given value type: <class 'str'>")
    >>> condense(text)
    "model: class_path 'a.B': Option 'lrr' is not accepted"
    """
    key = re.match(r'\s*Parser key "([^"]+)"', message)
    kept: list[str] = []
    for line in message.splitlines():
        text = line.strip()
        if not text or any(p.search(text) for p in _NOISE):
            continue
        text = re.sub(r"^-(?!-)\s*", "", text)  # a bullet, not the dashes of an option
        text = re.sub(r"^Problem with given class_path ('[^']+'):$", r"class_path \1:", text)
        if kept and kept[-1].endswith(":"):
            kept[-1] = f"{kept[-1]} {text}"
        else:
            kept.append(text)
    if any("is not accepted" in line for line in kept):  # the option is the problem, not the kind of value
        kept = [line for line in kept if not any(p.search(line) for p in _SUBCLASS_NOISE)]
    body = "\n  ".join(dict.fromkeys(kept)) or message.strip()
    # a nested class (model.init_args.network) is reported under each enclosing class_path: keep the innermost
    body = re.sub(r"(?:class_path '[^']+': )+(class_path '[^']+')", r"\1", body)
    return f"{key[1]}: {body}" if key and not body.startswith(key[1]) else body


def root_cause(err: BaseException) -> BaseException:
    """The exception a constructor raised under jsonargparse's wrappers: the deepest ``__cause__`` (a
    :class:`~lightning_dp.extras.MissingExtraError` is the message itself: its cause is the raw ImportError)."""
    from lightning_dp.extras import MissingExtraError

    root = err
    seen = {id(root)}
    while (root.__cause__ is not None and id(root.__cause__) not in seen
           and not isinstance(root, MissingExtraError)):
        root = root.__cause__
        seen.add(id(root))
    return root


def root_message(err: BaseException) -> str:
    """The message of :func:`root_cause` (jsonargparse's own text condensed)."""
    root = root_cause(err)
    text = str(root).strip() or type(root).__name__
    return condense(text) if root is err else text


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` (by its :func:`root_cause`) is a class refusing a value, not a bug to show with its traceback.

    Refusals: ``ValueError`` and ``TypeError`` (a bad value or argument), Lightning's
    ``MisconfigurationException``, jsonargparse's ``ArgumentError``, a missing optional dependency
    (:class:`~lightning_dp.extras.MissingExtraError`) and a file an argument names that does not exist
    (:class:`~lightning_dp.checks.MissingFileError`). Anything else (an ``AttributeError``, ``KeyError``, any other
    ``OSError``, ...) keeps its traceback.
    """
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_dp.checks import MissingFileError
    from lightning_dp.extras import MissingExtraError

    return isinstance(root_cause(err), (ValueError, TypeError, MisconfigurationException, ArgumentError,
                                        MissingExtraError, MissingFileError))


def is_user_error(err: BaseException) -> bool:
    """Whether a command prints ``err`` as one short message: a refused config value
    (:class:`ConfigurationError`), a Lightning ``MisconfigurationException`` (our callbacks'
    refusals before training), a missing dataset (``DatasetUnavailableError``), a missing optional
    dependency (:class:`~lightning_dp.extras.MissingExtraError`, which names the extra to install) or a missing file
    that an argument names (:class:`~lightning_dp.checks.MissingFileError`)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_dp.checks import MissingFileError
    from lightning_dp.extras import MissingExtraError

    types: list[type[BaseException]] = [ConfigurationError, MisconfigurationException, MissingExtraError,
                                        MissingFileError]
    try:
        from lightning_dp.datamodules import DatasetUnavailableError
    except ImportError:  # pragma: no cover - a partial install
        pass
    else:
        types.append(DatasetUnavailableError)
    return isinstance(err, tuple(types))


def closest(word: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Close matches of ``word`` among ``candidates`` (difflib, cutoff 0.6), best first."""
    return difflib.get_close_matches(word, sorted(set(candidates)), n=n, cutoff=0.6)


def _did_you_mean(options: Sequence[str]) -> str:
    return "" if not options else "did you mean " + " or ".join(options) + "?"


def _class_parameters(class_path: str) -> list[str]:
    """The keyword parameters of a class's ``__init__`` (and of its bases when it takes ``**kwargs``)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _path_suggestions(path: str) -> list[str]:
    """Close class paths for a dotted path that does not import: fix the first part that fails."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        names = [n for n in dir(found) if not n.startswith("_")]
        if i == len(parts) - 1:
            return [f"{module}.{m}" for m in closest(parts[i], names)]
        return [f"{module}.{m}" + "".join("." + p for p in parts[i + 1:]) for m in closest(parts[i], names)]
    return []


def suggest(message: str, option_strings: Iterable[str] = (), synonyms: Optional[dict[str, str]] = None) -> str:
    """A "did you mean ..." for an unknown option, init argument or class path named in ``message`` ('' if none).

    Args:
        message: The parser's error message.
        option_strings: The options the parser accepts (``--trainer.max_epochs``, ...).
        synonyms: Other names users type for an option, mapped to it (``{"--sigma": "--noise-multiplier"}``,
            see :func:`option_synonyms`).

    >>> suggest("unrecognized arguments: --sigma 1.1", ["--noise-multiplier", "--steps"],
    ...         {"--sigma": "--noise-multiplier"})
    'did you mean --noise-multiplier?'
    """
    synonyms = synonyms or {}
    unknown = re.search(r"[Uu]nrecognized arguments: (.+)", message)
    if unknown:
        hints = []
        for arg in unknown[1].split():
            if arg.startswith("-"):
                name = arg.split("=")[0]
                names = [*option_strings, *synonyms]
                prefixed = [n for n in names if n.startswith(name) and len(name) > 3]  # what was begun, first
                hints += [synonyms.get(h, h) for h in [*prefixed, *closest(name, names, n=2)]]
        return _did_you_mean(list(dict.fromkeys(hints))[:3])
    option = re.search(r"class_path '([^']+)':? Option '([^']+)' is not accepted", message)
    if option:
        key = re.match(r'\s*([\w.]+): ', message)
        prefix = f"--{key[1]}.init_args." if key else ""
        return _did_you_mean([prefix + m for m in closest(option[2], _class_parameters(option[1]))])
    paths = re.findall(r"class_path '([^']+)'", message)
    if paths and re.search(r"has no attribute|No module named|not accessible|Import", message):
        return _did_you_mean(_path_suggestions(paths[-1]))  # the innermost path is the one that failed
    choice = re.search(r"invalid choice: '([^']+)' \(choose from (.+)\)", message)
    if choice:
        return _did_you_mean(closest(choice[1], re.findall(r"'([^']+)'", choice[2])))
    return ""


def config_files(argv: Sequence[str]) -> list[str]:
    """The files named by ``--config`` / ``-c`` in ``argv``, in order."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    return paths + [a.split("=", 1)[1] for a in argv if a.startswith(("--config=", "-c="))]


def locate_key(files: Sequence[str], path: Sequence[str], name: str) -> Optional[tuple[str, int]]:
    """``(file, line)`` (1-based) of the YAML key ``name`` under the keys ``path`` (in order; lists, ``init_args``
    and ``class_path`` levels in between are skipped) in the last of ``files`` that has it, or None.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    ...     _ = f.write("trainer:\\n  max_epoch: 3\\n")
    >>> locate_key([f.name], ["trainer"], "max_epoch")[1]
    2
    """
    import yaml

    found: Optional[tuple[str, int]] = None
    for file in files:
        try:
            with open(file, encoding="utf-8") as handle:
                root = yaml.compose(handle)
        except (OSError, yaml.YAMLError):
            continue
        stack: list[tuple[yaml.Node, int]] = [(root, 0)] if root is not None else []
        while stack:  # depth first; ``matched``: how many keys of ``path`` the way down has passed
            node, matched = stack.pop()
            if isinstance(node, yaml.SequenceNode):
                stack += [(child, matched) for child in node.value]
            elif isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    word = getattr(key, "value", None)
                    if matched == len(path) and word == name:
                        found = (file, key.start_mark.line + 1)
                    step = matched + 1 if matched < len(path) and word == path[matched] else matched
                    stack.append((value, step))
    return found


def suggest_in_config(message: str, argv: Sequence[str],
                      option_strings: Iterable[str] = ()) -> Optional[tuple[str, str]]:
    """For an unknown key that a ``--config`` file (not the command line) gave: ``(message, hint)`` spelled as the
    file spells it, with the file and line (:func:`locate_key`) and "did you mean" the key; None otherwise.

    Two kinds: a key the parser does not know at all (``trainer: {max_epoch: 30}``: jsonargparse's "does not accept
    option 'trainer.max_epoch'") and an ``init_args`` key that a class does not take ("class_path 'a.B': Option
    'lrr' is not accepted").
    """
    files = config_files(argv)
    if not files:
        return None
    given = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    unknown = re.search(r"does not accept option '([\w.]+)'", message)
    if unknown:
        key = unknown[1]
        if f"--{key}" in given:
            return None
        *path, name = key.split(".")
        keys = [o[2:] for o in option_strings if o.startswith("--" + ".".join(path) + ".")]
        near = [k.rsplit(".", 1)[-1] for k in closest(key, keys)]
        under = f" (under {path[-1]}:)" if path else ""
        hint = f"did you mean {' or '.join(near[:2])}{under}?" if near else ""
    else:
        option = re.search(r"([\w.]+): class_path '([^']+)':? Option '([^']+)' is not accepted", message)
        if not option or any(g.endswith(f".{option[3]}") for g in given):
            return None
        path, name = option[1].split("."), option[3]
        near = closest(name, _class_parameters(option[2]))
        hint = (f"did you mean {' or '.join(near[:2])} (init_args of {option[2].rsplit('.', 1)[-1]})?"
                if near else "")
    where = locate_key(files, path, name)
    place = f"{where[0]}, line {where[1]}" if where else " / ".join(files)
    return f"{place}: {message}", hint


def option_synonyms(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``--<metavar>`` for every long option whose metavar names it otherwise (``--noise-multiplier SIGMA``).

    What users type from a paper's notation (``--sigma``) then finds the option in "did you mean".
    """
    found: dict[str, str] = {}
    for action in parser._actions:  # argparse has no public list of its actions
        longs = [o for o in action.option_strings if o.startswith("--")]
        metavar = action.metavar if isinstance(action.metavar, str) else None
        if longs and metavar and re.fullmatch(r"[A-Za-z][\w-]*", metavar):
            alias = "--" + metavar.lower().replace("_", "-")
            if alias not in action.option_strings:
                found.setdefault(alias, longs[0])
    return found


def short_error(prog: str, message: str, hint: str = "") -> str:
    """The text printed for a refused command, three lines at most: ``<prog>: error: <message>`` (its lines
    joined by "; "), a suggestion, and where to look."""
    message = "; ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    lines = [f"{prog}: error: {message}"]
    if hint:
        lines.append(f"  {hint}")
    lines.append(f"Options: {prog} --help   (full error: {TRACEBACK_ENV}=1 {prog} ...)")
    return "\n".join(lines) + "\n"




def plain_text(text: str) -> str:
    """Docstring markup as a terminal shows it: Sphinx roles reduced to their name, double backticks dropped.

    >>> plain_text("``max_grad_norm`` of :class:`~lightning_dp.callbacks.DPSGD` (:func:`a.b.f`)")
    'max_grad_norm of DPSGD (a.b.f)'
    """
    text = re.sub(r":\w+:`~[\w.]*?\.?(\w+)`", r"\1", text)  # :class:`~a.b.C` -> C
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text)  # :func:`a.b.f` -> a.b.f
    return text.replace("``", "")


def class_help_spelling(text: str) -> str:
    """In the help of ``--KEY.help CLASS``, the options spelled as configs and our messages spell them
    (``--trainer.callbacks.init_args.epochs``; jsonargparse lists ``--trainer.callbacks.epochs``, which it
    also accepts): one spelling from help to error hint."""
    match = re.search(r"Help for --([\w.]+)\.help=", text)
    if not match:
        return text
    prefix = re.escape(match[1])
    return re.sub(rf"--{prefix}\.(?!init_args\.|help\b)(\w)", rf"--{match[1]}.init_args.\1", text)


class ShortArgumentParser(argparse.ArgumentParser):
    """A standard-library ``argparse`` parser whose errors are :func:`short_error`: the message, "did you mean"
    from its own options (and their :func:`option_synonyms`), where to look; exit status 2.

    The commands that need no class from the config (``epsilon``, ``grid``) use it, so their errors answer
    before torch is imported. ``LIGHTNING_DP_TRACEBACK=1`` restores argparse's own error with the usage block.
    """

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def error(self, message: str) -> NoReturn:
        if show_tracebacks():
            super().error(message)
        options = list(self._option_string_actions)
        sys.stderr.write(short_error(self.prog, message, suggest(message, options, option_synonyms(self))))
        sys.exit(2)
