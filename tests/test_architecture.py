"""The package's layering, read from its source: no import circles; the top layers in their order (``cli`` over
``commands`` over ``grid``) and nothing below them importing any of the three; the functional core (``privacy/``)
imports nothing above it but the leaf ``lightning_dp.checks``, and no Lightning (DESIGN.md, "Layers"); one home per
argument check."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dp"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function (a lazy import still
    runs), without the imports under ``if TYPE_CHECKING:`` (never run).

    Importing ``pkg.sub.x`` also runs ``pkg/sub/__init__.py`` first: an import adds an edge to each parent package
    of the imported module too (but the root package, and the importing module's own parents, which Python runs
    before the module whatever it imports), so a circle through a package's ``__init__`` is found."""
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text("utf-8"))
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for n in ast.walk(stmt)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [module_of(a.name) for a in node.names if a.name.split(".")[0] == root.name]
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                if base.split(".")[0] != root.name:
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else module_of(base) for a in node.names]
            else:
                continue
            # the imported modules and the packages above them, which run first (not the root, not our own)
            targets += [".".join(t.split(".")[:i]) for t in targets if t for i in range(2, t.count(".") + 1)]
            deps |= {t for t in targets if t and t != name and t not in parents}
        graph[name] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle_through_a_lazy_import_and_ignores_typing_only_imports(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")
    (root / "sub" / "a.py").write_text("from pkg.sub import b\nA = 1\n")
    (root / "sub" / "b.py").write_text("def f():\n    from pkg.sub.a import A\n    return A\n")
    (root / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n")
    (root / "d.py").write_text("from pkg.c import *\nD = 2\n")
    graph = import_graph(root)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.c"] == set()
    assert import_circles(graph) == [["pkg.sub.a", "pkg.sub.b"]]


def test_the_checker_finds_a_circle_through_a_parent_package_init(tmp_path):
    """``from pkg.low.x import X`` runs ``pkg/low/__init__.py`` first: when that ``__init__`` imports a module that
    imports the importer back (here lazily), the circle goes through the package and must be found."""
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("from pkg.low.y import f\n")
    (root / "low" / "x.py").write_text("X = 1\n")
    (root / "low" / "y.py").write_text("def f():\n    from pkg.high import H\n    return H\n")
    (root / "high.py").write_text("from pkg.low.x import X\nH = X\n")
    graph = import_graph(root)
    assert graph["pkg.high"] == {"pkg.low", "pkg.low.x"}  # the package too, not the root
    assert graph["pkg.low.y"] == {"pkg.high"} and graph["pkg.low.x"] == set()  # not its own parents
    assert import_circles(graph) == [["pkg.high", "pkg.low", "pkg.low.y"]]
    (root / "low" / "__init__.py").write_text("")  # the same modules without the package's import: no circle
    assert import_circles(import_graph(root)) == []


def test_the_package_has_no_import_circles():
    assert import_circles(import_graph()) == []


SHELLS = ("callbacks", "federated", "flower", "audit", "datamodules", "models", "metrics", "privacy")


def _in(name: str, *layers: str) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def top_layer_violations(graph: dict[str, set[str]], root: str = PACKAGE.name) -> dict[str, list[str]]:
    """Module -> the imports that break the order of the top layers: ``cli`` (and ``__main__``) over ``commands``
    over ``grid`` over everything else, which imports none of the three."""
    cli, commands, grid = (f"{root}.{layer}" for layer in ("cli", "commands", "grid"))
    wrong = {}
    for name, deps in graph.items():
        if _in(name, f"{root}.__main__", cli):
            forbidden: tuple[str, ...] = ()
        elif _in(name, commands):
            forbidden = (cli,)
        elif _in(name, grid):
            forbidden = (cli, commands)
        else:
            forbidden = (cli, commands, grid)
        found = sorted(d for d in deps if _in(d, *forbidden))
        if found:
            wrong[name] = found
    return wrong


def test_the_top_layers_import_downwards_only():
    """The top of the package, in order: ``cli`` (the dispatcher, and ``__main__`` above it) imports the commands; a
    command (``commands/``) may import the grid machinery (``grid/``), never ``cli``; the grid imports neither the
    commands nor ``cli``. Below them nothing imports any of the three, at module level or inside a function: the
    shells (callbacks, federated, flower, audit, datamodules, models, metrics, privacy and their submodules) and the
    modules they share (``config/``, which builds a config with LightningDPCLI for the commands, the grid and the
    Flower apps; ``tracking``, ``gate``, ...). DESIGN.md, "One protocol per run (wave 4)"; docs/architecture.md."""
    graph = import_graph()
    for shell in SHELLS:
        assert f"lightning_dp.{shell}" in graph, shell  # the rule covers real packages
    assert top_layer_violations(graph) == {}
    assert {n for n, deps in graph.items() if "lightning_dp.cli" in deps} == {"lightning_dp.__main__"}


def test_the_layer_rule_sees_lazy_imports_and_the_order_of_the_top(tmp_path):
    """A shell's import of a command inside a function breaks the rule as much as one at module level; the grid may
    not import a command, a command may import the grid."""
    root = tmp_path / "lightning_dp"
    for package in ("callbacks", "commands", "grid"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "commands" / "fit.py").write_text("from lightning_dp.grid import run\n")
    (root / "grid" / "run.py").write_text("def f():\n    from lightning_dp.commands import fit\n")
    (root / "callbacks" / "tags.py").write_text("def tag():\n    from lightning_dp.commands.fit import X\n")
    assert top_layer_violations(import_graph(root)) == {
        "lightning_dp.callbacks.tags": ["lightning_dp.commands", "lightning_dp.commands.fit"],
        "lightning_dp.grid.run": ["lightning_dp.commands", "lightning_dp.commands.fit"]}


def test_the_functional_core_imports_nothing_above_it_and_no_lightning():
    graph = import_graph()
    assert graph["lightning_dp.checks"] == set()  # a leaf: anything may use it
    above = {name: sorted(d for d in deps if not d.startswith("lightning_dp.privacy") and d != "lightning_dp.checks")
             for name, deps in graph.items() if name.startswith("lightning_dp.privacy")}
    assert {name: deps for name, deps in above.items() if deps} == {}
    for path in (PACKAGE / "privacy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "lightning" or n.startswith(("lightning.", "pytorch_lightning")) for n in names), path


def test_argument_checks_have_one_home():
    """The generic checks live in lightning_dp/checks.py and delta's in privacy/accounting.py (check_delta); no
    module defines its own copy again (issue 28 counted six positive-integer checks, three generator checks, five
    real-number predicates)."""
    copy = re.compile(r"^\s*def _?(check_)?(positive_int|non_negative_int|int|integer|count|probability|open_fraction|"
                      r"positive_real|non_negative_real|is_real|finite|finite_positive|finite_non_negative|positive|"
                      r"generator|delta)\(", re.M)
    found = {str(path.relative_to(PACKAGE)): copy.findall(path.read_text("utf-8"))
             for path in PACKAGE.rglob("*.py") if path.name != "checks.py"}
    assert {path: hits for path, hits in found.items() if hits and path != "privacy/accounting.py"} == {}
    assert len(found["privacy/accounting.py"]) == 1  # check_delta


def test_every_download_goes_through_one_function():
    """Official files are fetched by lightning_dp.datamodules.offline.download_file only (a .part file, a check,
    an atomic rename, nothing left behind on failure): no other module opens a URL itself."""
    openers = {"urllib.request.urlopen", "urllib.request.urlretrieve", "requests.get", "httpx.get"}
    opens = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text("utf-8")))
             if isinstance(node, ast.Attribute) and ast.unparse(node) in openers}
    assert opens == {"datamodules/offline.py"}


def test_the_top_level_api_is_deliberate_and_lazy():
    """``from lightning_dp import DPSGD`` and the other top-level names are the objects of their subpackages, and
    ``import lightning_dp`` alone loads neither torch nor Lightning (the command line's first hundred ms)."""
    import importlib
    import subprocess
    import sys

    import lightning_dp

    for name in lightning_dp.__all__:
        if name != "__version__":
            assert getattr(lightning_dp, name) is getattr(importlib.import_module(lightning_dp._API[name]), name)
    assert set(dir(lightning_dp)) >= set(lightning_dp.__all__)
    code = ("import sys, lightning_dp; "
            "sys.exit(int(any(m in sys.modules for m in ('torch', 'lightning', 'lightning_dp.callbacks'))))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    try:
        lightning_dp.NotAName  # noqa: B018
    except AttributeError as err:
        assert "NotAName" in str(err)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_the_federated_parts_and_the_dlg_audit_load_no_lightning():
    """One sanitizer family serves the round and the DLG audit: the parts stay as Lightning-free as the audit."""
    import subprocess
    import sys

    code = ("import sys, lightning_dp.federated.parts, lightning_dp.audit.sanitizers; "
            "sys.exit(int(any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent).returncode == 0


def test_every_extension_example_of_the_architecture_doc_runs_and_registers():
    """docs/architecture.md shows adding a layer rule, a sanitizer, a clipping strategy and an attack as one registered
    class each: the blocks run as written and their classes are registered where the package looks them up."""
    import numpy as np
    import torch

    from lightning_dp.audit.attacks import AttackSetting, registered_attacks
    from lightning_dp.audit.sanitizers import PartRelease
    from lightning_dp.callbacks.clipping import Release, registered_clip_strategies
    from lightning_dp.federated.parts import registered_parts
    from lightning_dp.privacy.grad_sample.registry import rule_for

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text("utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    spaces = []
    for block in blocks[1:]:  # the first block is the top-level API
        namespace: dict = {}
        exec(compile(block, "docs/architecture.md", "exec"), namespace)  # noqa: S102  (our own documentation)
        spaces.append(namespace)
    rules, sanitizers, strategies, attacks = spaces
    assert type(rule_for(rules["Scale"](3))).__name__ == "ScaleRule"
    sign = registered_parts("sanitizer")["sign"]()
    released = PartRelease(sign)(torch.zeros(3), torch.tensor([0.5, -2.0, 0.0]), None)
    assert torch.equal(released, torch.tensor([0.01, -0.01, 0.0]))
    halving = registered_clip_strategies()["halving"]()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for step in range(200):
        halving.after_release(Release(step=step, noise_multiplier=1.0, gradient=[], extra_sums=[], clipped=0.0,
                                      examples=0.0, expected_batch_size=1.0, optimizer=optimizer,
                                      statistic_generator=lambda device=None: torch.Generator()))
    assert halving.clip == 0.25 and len(halving.trace) == 200
    split = type("Split", (), {"members": np.arange(2)})()
    setting = AttackSetting(target=None, pool=None, split=split, evaluation=None, target_losses=np.array([0.1, 0.2, 3.0]),
                            loss_seconds=0.0, config=None, statistic="loss", seeded=lambda *a: 0, make_model=None,
                            trainer_kwargs=dict)
    scores = registered_attacks()["confidence"]().run(setting)
    assert scores.members.tolist() == [-0.1, -0.2] and scores.nonmembers.tolist() == [-3.0]
