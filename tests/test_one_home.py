"""Each argument check has one home (issue 49, item 6B), judged by what the checks test, not by their names.

An *argument check* is a function that returns its argument (as it is, or converted by ``float``/``int``/...) after
guards ``if <condition>: raise ...``. Its *shape* is each guard's condition with the function's own names (its
parameters and locals) replaced by ``_``, every other name resolved through the module's imports to the object it
denotes (``checks.is_real`` in one module and ``is_real`` inside ``lightning_dp/checks.py`` are the same), and strings
dropped (messages differ between copies). Two argument checks that share a guard are one check written twice: the
second must call the first (``check_clip(clip, name="clip")``) instead of repeating it. A shared check states the
argument's name, its value, the allowed range and the fix, so a caller loses nothing by calling it.

The shapes find a check copied and renamed, not the same condition written another way (``x <= 0`` for
``not x > 0``); the checks issue 49 found written in several ways are held to their homes by concept below.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dp"
CONVERSIONS = {"float", "int", "str", "bool", "tuple", "list"}
#: guards smaller than this (``x is None``, ``not x``, ``x not in NAMES``) are too plain to call a copy
MIN_GUARD_NODES = 8


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _aliases(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Name -> what it denotes, from the module's imports and its own top-level definitions."""
    names = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = f"{module}.{node.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:  # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``
                top = alias.name.split(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _own_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    own = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    return own | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return body


def _is_guard(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and any(isinstance(s, ast.Raise) for s in stmt.body)


def _returns_argument(expr: ast.expr, parameters: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in parameters
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in CONVERSIONS:
        return len(expr.args) == 1 and _returns_argument(expr.args[0], parameters)
    return False


def is_argument_check(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Guards (with assignments or a conversion in ``try``) and then ``return <the argument, converted>``."""
    body = _body(fn)
    a = fn.args
    parameters = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return (bool(body) and isinstance(body[-1], ast.Return) and body[-1].value is not None
            and _returns_argument(body[-1].value, parameters) and any(_is_guard(s) for s in body)
            and all(_is_guard(s) or isinstance(s, (ast.Assign, ast.AnnAssign, ast.Try)) for s in body[:-1]))


class _Shape(ast.NodeTransformer):
    def __init__(self, own: set[str], aliases: dict[str, str]) -> None:
        self.own, self.aliases = own, aliases

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.own:
            return ast.Name(id="_", ctx=ast.Load())
        if hasattr(builtins, node.id):
            return ast.Name(id=node.id, ctx=ast.Load())
        return ast.Name(id=self.aliases.get(node.id, node.id), ctx=ast.Load())

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant(value="S" if isinstance(node.value, str) else node.value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.Constant:
        return ast.Constant(value="S")


def guard_shapes(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Shape of each guard of an argument check -> the checks (``module:function``) that have it."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        module = _module_name(path, root)
        aliases = _aliases(tree, module, path.name == "__init__.py")
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not is_argument_check(fn):
                continue
            shape = _Shape(_own_names(fn), aliases)
            for stmt in _body(fn):
                if _is_guard(stmt):
                    test = ast.parse(ast.unparse(stmt.test), mode="eval").body  # a copy to rewrite
                    if sum(1 for _ in ast.walk(test)) >= MIN_GUARD_NODES:
                        found[ast.unparse(shape.visit(test))].add(f"{module}:{fn.name}")
    return found


def copies(root: Path = PACKAGE) -> dict[str, list[str]]:
    return {shape: sorted(where) for shape, where in guard_shapes(root).items() if len(where) > 1}


def test_the_finder_sees_a_renamed_copy_and_not_a_call_or_another_range(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "checks.py").write_text(
        "import math\n\n"
        "def is_real(v):\n    return isinstance(v, (int, float)) and not isinstance(v, bool)\n\n"
        "def check_clip(value, *, name='clip'):\n"
        "    '''The home.'''\n"
        "    if not is_real(value) or not (math.isfinite(value) and value > 0):\n"
        "        raise ValueError(f'{name}={value!r} is not allowed: pass a finite number > 0')\n"
        "    return float(value)\n")
    (root / "copy.py").write_text(  # the same guard: other names, another message, the predicate imported
        "import math\nfrom pkg.checks import is_real\n\n"
        "def _norm(c):\n"
        "    if not is_real(c) or not (math.isfinite(c) and c > 0):\n"
        "        raise ValueError('bad norm')\n"
        "    return float(c)\n")
    (root / "fine.py").write_text(  # a call of the home, and a check of another range
        "import math\nfrom pkg import checks\n\n"
        "def _clip(c):\n    return checks.check_clip(c, name='c')\n\n"
        "def _rate(q):\n"
        "    if not checks.is_real(q) or not (math.isfinite(q) and q >= 0):\n"
        "        raise ValueError('bad rate')\n"
        "    return q\n\n"
        "def mean(a):\n"  # returns something else: not an argument check
        "    if not checks.is_real(a) or not (math.isfinite(a) and a > 0):\n"
        "        raise ValueError('bad')\n"
        "    return a / 2\n")
    assert list(copies(root).values()) == [["pkg.checks:check_clip", "pkg.copy:_norm"]]


def test_no_two_argument_checks_share_a_guard():
    """Each check is written once; a component that needs it calls it with its argument's name."""
    assert copies() == {}


def test_the_privacy_parameters_have_one_check_each():
    """The checks that issue 49 found written two or three times, by their homes: of the functions named for the
    concept, one is the home and every other calls it (adding what the value means where it is used)."""
    homes = {
        r"_?check_(clip|max_grad_norm)": "lightning_dp.privacy.clipping:check_clip",
        r"_?check_(noise_multiplier|multiplier|sigma|metric_noise_multiplier|local_multiplier)":
            "lightning_dp.privacy.noise:check_noise_multiplier",
        r"_?check_(target_)?epsilon": "lightning_dp.privacy.accounting:check_target_epsilon",
        r"_?is_int": "lightning_dp.checks:is_int",
    }
    own: dict[str, list[str]] = {pattern: [] for pattern in homes}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path, PACKAGE)
        for fn in ast.walk(ast.parse(path.read_text("utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            called = {ast.unparse(n.func).rpartition(".")[2] for n in ast.walk(fn) if isinstance(n, ast.Call)}
            for pattern, home in homes.items():
                if re.fullmatch(pattern, fn.name) and home.rpartition(":")[2] not in called:
                    own[pattern].append(f"{module}:{fn.name}")
    assert own == {pattern: [home] for pattern, home in homes.items()}
