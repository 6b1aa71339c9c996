"""The layout of DESIGN.md holds: `unbroken.policy` imports without torch, numpy, runtime or sim (checked in
a subprocess that blocks them); the import rules hold for every import statement, relative ones included
(AST scan of src/unbroken); and no module exceeds 500 lines."""
from __future__ import annotations

import ast
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import unbroken

SRC = Path(unbroken.__file__).parent
MODULES = sorted(SRC.rglob("*.py"))


def dotted(path: Path) -> str:
    parts = ["unbroken", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, text: str | None = None) -> set[str]:
    """Every module an import statement in `path` (or `text`, as if it were `path`) names, relative
    imports resolved to absolute names."""
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from . import runtime` names a module
    return found


def hits(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


RULES = {  # package -> what it must never import
    "unbroken.policy": ("unbroken.runtime", "unbroken.sim", "torch"),
    "unbroken.runtime": ("unbroken.sim",),
    "unbroken.sim": ("unbroken.runtime", "torch"),
}


def test_the_scan_resolves_relative_imports():
    text = "from ..runtime import trainer\nfrom . import y\nimport torch.nn as nn\n"
    found = imports(SRC / "policy" / "x.py", text)
    assert found >= {"unbroken.runtime", "unbroken.runtime.trainer", "unbroken.policy.y", "torch.nn"}
    assert hits("unbroken.runtime.trainer", RULES["unbroken.policy"]) and not hits("torchvision", ("torch",))
    assert imports(SRC / "sim" / "strategies" / "__init__.py", "from ...runtime import x\n") >= {"unbroken.runtime"}


@pytest.mark.parametrize("package, banned", RULES.items())
def test_import_rules(package, banned):
    root = SRC / package.split(".")[1]
    files = sorted(root.rglob("*.py"))
    assert files, root
    broken = {str(f.relative_to(SRC)): sorted(n for n in imports(f) if hits(n, banned)) for f in files}
    assert not {f: n for f, n in broken.items() if n}, f"{package} must not import {banned}"


@pytest.mark.timeout(30)
def test_policy_imports_without_torch_numpy_runtime_or_sim():
    names = sorted(dotted(f) for f in (SRC / "policy").rglob("*.py"))
    code = f"""
import importlib, importlib.abc, sys
BANNED = ("torch", "numpy", "unbroken.runtime", "unbroken.sim")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BANNED):
            raise ImportError(f"blocked import of {{name}}")
sys.meta_path.insert(0, Block())
for name in {names!r}:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")]
print(len({names!r}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) == len(names) > 3


def test_no_module_over_500_lines():
    lines = {str(f.relative_to(SRC)): len(f.read_text().splitlines()) for f in MODULES}
    median = statistics.median(lines.values())
    big = {f: n for f, n in lines.items() if n > 500}
    assert not big, f"modules over 500 lines: {big} (median {median:.0f} lines over {len(lines)} modules)"


@pytest.mark.timeout(60)
def test_every_module_imports():
    """A move that leaves a stale import (relative ones included) fails here, not in a worker's log."""
    names = sorted(dotted(f) for f in MODULES if f.name != "__main__.py")
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\nprint(len({names!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=55)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) == len(names)
