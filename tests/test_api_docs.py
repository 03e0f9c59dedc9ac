"""The API reference and the type hints: ``mkdocs build --strict`` renders every public package from its
docstrings without a warning, ``mypy`` passes on the package (configured in pyproject.toml), and the
package ships its ``py.typed`` marker (PEP 561).

The two builds run the real tools in a subprocess (about 10 s for mkdocs, 1-2 min for a cold mypy on 2 CPU
cores); they are skipped when the tools are not installed (``pip install -e ".[test]"`` installs them).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_dp

ROOT = Path(__file__).resolve().parents[1]
# every package of the public API has a page under docs/api/ (and mkdocs.yml's nav)
API_MODULES = ["callbacks", "privacy", "federated", "flower", "audit", "datamodules", "metrics", "models", "tracking",
               "commands", "grid", "cli"]


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_mkdocs_build_strict(tmp_path):
    missing = _missing("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")
    if missing:
        pytest.skip(f"the API reference build needs {missing} (pip install mkdocs mkdocs-material "
                    "'mkdocstrings[python]', or the project's [test] extra)")
    site = tmp_path / "site"
    proc = _run(["-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                 "--site-dir", str(site)], timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (warnings are errors):\n{output}"
    for name in API_MODULES:
        page = site / "api" / name / "index.html"
        assert page.is_file(), f"no API page for lightning_dp.{name}"
        html = page.read_text(encoding="utf-8")
        assert f'id="lightning_dp.{name}"' in html, f"docs/api/{name}.md does not render lightning_dp.{name}"
    # the exports are rendered, not only the module docstring
    assert 'id="lightning_dp.callbacks.DPSGD"' in (site / "api" / "callbacks" / "index.html").read_text("utf-8")
    privacy = (site / "api" / "privacy" / "index.html").read_text("utf-8")
    assert 'id="lightning_dp.privacy.GradSampleEngine"' in privacy
    # Google-style "Example:" sections are rendered as code (docs/griffe_extensions.py), not as block quotes
    commands = (site / "api" / "commands" / "index.html").read_text("utf-8")
    assert "&gt;&gt;&gt;" in commands and "<blockquote>" not in commands


def test_mypy_passes():
    if _missing("mypy"):
        pytest.skip("the type check needs mypy (pip install mypy, or the project's [test] extra)")
    # the files to check and the options are pyproject.toml's [tool.mypy]
    proc = _run(["-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")], timeout=900)
    output = proc.stdout + proc.stderr
    print(output)
    assert proc.returncode == 0, f"mypy found type errors:\n{output}"


def test_py_typed_ships_with_the_package():
    package_dir = Path(lightning_dp.__file__).resolve().parent
    assert (package_dir / "py.typed").is_file(), f"no py.typed in {package_dir}"
    # a regular (non-editable) install lists the marker among its files; an editable one lists none of them
    files = importlib.metadata.files("lightning-dp") or []
    installed = [str(f) for f in files if str(f).startswith("lightning_dp/")]
    if installed:
        assert "lightning_dp/py.typed" in installed, "py.typed is missing from the installed distribution"
    # and the build configuration includes it in wheels
    if sys.version_info >= (3, 11):
        import tomllib

        config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
        package_data = config["tool"]["setuptools"]["package-data"]["lightning_dp"]
        assert "py.typed" in package_data
