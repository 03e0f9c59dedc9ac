"""Named registries: the one way the package lets a config or a command name a part (issue 49).

Accountants, layer rules, clipping strategies, federated parts and membership attacks are each a
:class:`Registry`: it registers under a name, refuses a name already held, and resolves a name or a class path
``package.module.ClassName``, naming the closest registered name for an unknown one (docs/architecture.md).

Example:
    >>> class Shape: ...
    >>> shapes = Registry("shape", base=Shape, argument="shape")
    >>> @shapes.register("square")
    ... class Square(Shape): ...
    >>> shapes.resolve("square") is Square
    True
    >>> shapes.resolve("squar")
    Traceback (most recent call last):
    ...
    ValueError: shape='squar' is not a registered shape; choose one of ['square'] or a class path (package.module.ClassName). Did you mean 'square'?
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Generic, Optional, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")
_MISSING: Any = object()


def _path(obj: Any) -> str:
    """``module.QualifiedName`` of a class, or of an instance's class."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Registry(Mapping, Generic[T]):
    """Objects of one kind by name; a read-only mapping ``{name: object}`` in registration order.

    Args:
        what: what an entry is, for messages (``"clipping strategy"``).
        base: every entry, and every class a class path names, is a subclass (or an instance) of it.
        accepts: a stricter test than ``base`` for what may be registered or named by class path
            (``accepts(obj) -> bool``); by default, being a subclass or an instance of ``base``.
        argument: the argument whose value is resolved, for messages (``"clipping"`` in
            ``clipping='quantil' is not a registered clipping strategy``); ``what`` by default.
        class_paths: whether :meth:`resolve` also takes a class path; off where an entry is rebuilt later from the
            name it reports (an accountant's ``name`` in a saved state), which an unregistered class cannot be.
    """

    def __init__(self, what: str, *, base: Optional[type] = None, accepts: Optional[Callable[[Any], bool]] = None,
                 argument: Optional[str] = None, class_paths: bool = True) -> None:
        self.what = what
        self.base = base
        self.argument = argument or what
        self.class_paths = class_paths
        self._accepts = accepts
        self._entries: dict[Hashable, T] = {}

    # ------------------------------------------------------------------ mapping

    def __getitem__(self, name: Hashable) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"

    # ------------------------------------------------------------------ registering

    def accepts(self, obj: Any) -> bool:
        """Whether ``obj`` is of the registry's kind."""
        if self._accepts is not None:
            return bool(self._accepts(obj))
        if self.base is None:
            return True
        return (isinstance(obj, type) and issubclass(obj, self.base)) or isinstance(obj, self.base)

    def _kind(self) -> str:
        article = "an" if self.what[:1].lower() in "aeiou" else "a"
        return f"{article} {self.what}" + (f" (a {_path(self.base)})" if self.base is not None else "")

    def register(self, name: Hashable, obj: Any = _MISSING, *, replace: bool = False) -> Any:
        """Registers ``obj`` as ``name`` and returns it; without ``obj``, a decorator that does so.

        The same definition registered again (a module imported twice) is fine; another object under a taken name
        is refused unless ``replace`` (a layer rule that overrides a built-in one).

        Raises:
            ValueError: the name is held by another object (the message names both).
            TypeError: ``obj`` is not of the registry's kind.
        """
        if obj is _MISSING:
            return lambda target: self.register(name, target, replace=replace)
        if not self.accepts(obj):
            raise TypeError(f"{self.what} {name!r}: {_path(obj)} is not {self._kind()}; subclass the base class")
        taken = self._entries.get(name)
        if taken is not None and not replace and taken is not obj and _path(taken) != _path(obj):
            raise ValueError(f"{self.what} {name!r} is already registered ({_path(taken)}), so {_path(obj)} cannot "
                             "take it; choose another name")
        self._entries[name] = obj
        return obj

    # ------------------------------------------------------------------ resolving

    def resolve(self, value: Any, *, argument: Optional[str] = None, hint: Optional[str] = None) -> T:
        """The entry registered as ``value``, or the class a class path ``package.module.ClassName`` names (unless
        the registry takes no class paths).

        Args:
            value: a registered name, or a class path.
            argument: the argument's name in messages (the registry's ``argument`` by default).
            hint: a sentence appended to the refusal (what the choices mean).

        Raises:
            ValueError: an unknown name (with the registered names and the closest one), a class path that cannot
                be imported, or one that names something of another kind.
        """
        argument = argument or self.argument
        if isinstance(value, Hashable) and value in self._entries:
            return self._entries[value]
        names = sorted(str(name) for name in self._entries)
        if self.class_paths and isinstance(value, str) and "." in value.strip("."):
            return self._imported(value, argument, names)
        close = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
        raise ValueError(f"{argument}={value!r} is not a registered {self.what}; choose one of {names}"
                         + (" or a class path (package.module.ClassName)." if self.class_paths else ".")
                         + (f" Did you mean {close[0]!r}?" if close else "") + (f" {hint}" if hint else ""))

    def _imported(self, path: str, argument: str, names: list[str]) -> T:
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes (nested classes)
            module = ".".join(parts[:cut])
            try:
                obj: Any = importlib.import_module(module)
            except ModuleNotFoundError as err:
                if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
                    continue  # no such module: a shorter prefix may be the module
                raise ValueError(f"{argument}={path!r}: importing {module!r} failed ({err})") from err
            for attribute in parts[cut:]:
                if not hasattr(obj, attribute):
                    raise ValueError(f"{argument}={path!r} is not a registered {self.what} ({names}), and "
                                     f"{module!r} has no attribute {attribute!r}; check the class path")
                obj = getattr(obj, attribute)
            if not self.accepts(obj):
                raise ValueError(f"{argument}={path!r} names {obj!r}, which is not {self._kind()}; name one of "
                                 f"{names} or a subclass of the base class")
            return obj
        raise ValueError(f"{argument}={path!r} is neither a registered {self.what} ({names}) nor an importable class "
                         f"path: no module {parts[0]!r} or below it could be imported; check the spelling and that the "
                         "package is installed")
