"""The layout of docs/design.md holds: `unbroken.policy` imports without torch, numpy, runtime or sim (checked in
a subprocess that blocks them); the import rules hold for every import statement, relative ones included
(AST scan of src/unbroken); the import graph has no circle and no arrow from a lower layer up; every file
of runtime/ stands in a folder named for its process; no file but
runtime/store/keys.py spells a store key; and no module exceeds 500 lines."""
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
    "unbroken.runtime": ("unbroken.sim", "unbroken.eval", "unbroken.cli", "unbroken.commands"),
    "unbroken.sim": ("unbroken.runtime", "unbroken.eval", "torch"),
    # what a person looks at: folds and draws records, runs no part of a run and reads no store
    "unbroken.observe": ("unbroken.runtime", "unbroken.sim", "torch"),
    # one folder per process: the store layer everything uses imports none of the processes; the
    # coordinator, the snapshot agents and the launcher never import the trainer's code (a trainer's death
    # never takes them along, and none holds a model); the trainer's mechanics never import its process
    "unbroken.runtime.store": ("unbroken.runtime.coordinator", "unbroken.runtime.trainer", "unbroken.runtime.launcher",
                               "unbroken.runtime.parallel", "unbroken.runtime.persist", "unbroken.runtime.snapshot",
                               "torch.nn"),
    "unbroken.runtime.coordinator": ("unbroken.runtime.trainer", "unbroken.runtime.launcher",
                                     "unbroken.runtime.persist.persistence", "unbroken.runtime.persist.state",
                                     "unbroken.runtime.parallel", "torch.nn"),
    "unbroken.runtime.snapshot": ("unbroken.runtime.trainer", "unbroken.runtime.coordinator", "unbroken.runtime.launcher",
                                  "unbroken.runtime.persist"),
    "unbroken.runtime.launcher": ("unbroken.runtime.trainer", "unbroken.runtime.persist", "unbroken.runtime.parallel"),
    "unbroken.runtime.trainer": ("unbroken.runtime.coordinator", "unbroken.runtime.launcher"),
    "unbroken.runtime.persist": ("unbroken.runtime.launcher", "unbroken.runtime.trainer", "unbroken.runtime.coordinator"),
    "unbroken.runtime.parallel": ("unbroken.runtime.launcher", "unbroken.runtime.trainer", "unbroken.runtime.coordinator",
                                  "unbroken.runtime.persist"),
}


def test_the_scan_resolves_relative_imports():
    text = "from ..runtime import trainer\nfrom . import y\nimport torch.nn as nn\n"
    found = imports(SRC / "policy" / "x.py", text)
    assert found >= {"unbroken.runtime", "unbroken.runtime.trainer", "unbroken.policy.y", "torch.nn"}
    assert hits("unbroken.runtime.trainer.step", RULES["unbroken.policy"]) and not hits("torchvision", ("torch",))
    assert imports(SRC / "sim" / "strategies" / "__init__.py", "from ...runtime import x\n") >= {"unbroken.runtime"}


@pytest.mark.parametrize("package, banned", RULES.items())
def test_import_rules(package, banned):
    root = SRC.joinpath(*package.split(".")[1:])
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


# -- the import graph --------------------------------------------------------------------------------------

NAMES = {dotted(f): f for f in MODULES}


def edges(path: Path) -> set[str]:
    """The modules of src that `path` needs at import time, TYPE_CHECKING imports included: `from P import m`
    names module P.m (not P's __init__) when m is a module, P otherwise."""
    found = set()
    for name in imports(path):
        if name in NAMES:
            found.add(name)
    # `from P import m` adds both P and P.m: keep P only where some imported name is not a module
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if all(f"{base}.{a.name}" in NAMES for a in node.names) and not _imported_plainly(path, base):
                found.discard(base)
    found.discard(dotted(path))
    return found


def _imported_plainly(path: Path, base: str) -> bool:
    """Whether another statement of `path` imports `base` itself (`import base`, or names from it)."""
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == base for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            b = node.module or ""
            if node.level:
                b = ".".join(package[: len(package) - node.level + 1] + ([b] if b else []))
            if b == base and not all(f"{b}.{a.name}" in NAMES for a in node.names):
                return True
    return False


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = {n: edges(f) for n, f in NAMES.items()}
    assert not circles(graph), f"import circles: {circles(graph)}"


# Layers, bottom up: a module imports only from its own layer or below. Longest prefix wins.
LAYERS = {
    "unbroken.topology": 0, "unbroken.config": 0, "unbroken.events": 0, "unbroken.faultspec": 0,
    "unbroken.storeurl": 0,
    "unbroken.policy": 0,
    "unbroken.model": 1, "unbroken.observe": 1, "unbroken.audit": 1,
    # runtime, by how much of a trainer a file needs: the store first, then the mechanics, then processes
    "unbroken.runtime": 2, "unbroken.runtime.store": 2,
    "unbroken.runtime.parallel": 3, "unbroken.runtime.snapshot": 3,
    "unbroken.runtime.persist": 4,
    "unbroken.runtime.coordinator": 5,
    "unbroken.runtime.trainer": 5, "unbroken.runtime.trainer.lifecycle": 6,
    "unbroken.runtime.trainer.replan_reform": 6,
    "unbroken.runtime.trainer.forkrun": 7, "unbroken.runtime.trainer._forked_entry": 7,
    "unbroken.runtime.trainer.__main__": 7,
    "unbroken.runtime.launcher": 6, "unbroken.runtime.launcher.resume": 6,
    "unbroken.sim": 2,
    "unbroken.api": 7, "unbroken": 7,
    "unbroken.eval": 8, "unbroken.commands": 8,
    "unbroken.cli": 9,
}


def layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def test_no_import_runs_back_up_a_layer():
    up = {n: sorted(d for d in edges(f) if layer(d) > layer(n)) for n, f in NAMES.items()}
    assert not {n: d for n, d in up.items() if d}, "imports from a lower layer into a higher one"


PROCESS_FOLDERS = {"store", "coordinator", "trainer", "launcher", "snapshot", "parallel", "persist"}


def test_runtime_files_stand_in_a_folder_of_their_process():
    """runtime/ holds only its package file: every module is in the folder of the process it runs in (or of
    the mechanics that process uses), and every folder says in its docstring what runs there."""
    runtime = SRC / "runtime"
    loose = sorted(f.stem for f in runtime.glob("*.py") if f.stem != "__init__")
    folders = sorted(d.name for d in runtime.iterdir() if d.is_dir() and d.name != "__pycache__")
    assert not loose, f"runtime/ files outside a process folder: {loose}"
    assert set(folders) == PROCESS_FOLDERS, folders
    for folder in folders:
        doc = ast.get_docstring(ast.parse((runtime / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"runtime/{folder}/__init__.py says nothing of what runs there"



def test_topology_imports_only_the_standard_library():
    found = {n.split(".")[0] for n in imports(SRC / "topology.py")}
    assert found <= set(sys.stdlib_module_names) | {"__future__"}, found


# -- store keys ---------------------------------------------------------------------------------------------

KEYS_MODULE = SRC / "runtime" / "store" / "keys.py"
STORE_CALLS = {"set", "get", "add", "check", "compare_set", "multi_get", "multi_set", "wait", "delete_key"}


def key_families() -> tuple[str, ...]:
    """The literal start of every slash-separated key that keys.py builds ("members/", "done/", ...)."""
    from unbroken.runtime.store import keys
    out = set()
    for name in dir(keys):
        fn = getattr(keys, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type):
            continue
        n = fn.__code__.co_argcount - len(fn.__defaults__ or ())  # the required arguments
        text = fn(*([987654321] * n))
        head = text.split("987654321")[0]
        if "/" in head:
            out.add(head[: head.index("/") + 1])
    out.add("unbroken/snap/")
    return tuple(sorted(out))


def key_literals(text: str, families: tuple[str, ...]) -> list[str]:
    """String literals in `text` that look like store keys: a constant (or an f-string's leading constant)
    starting with a key family, or any literal given as the key of a store call (`store.get("epoch")`,
    `PrefixStore("g0/", ...)`) on a receiver named like a store."""
    found = set()  # (line, column, literal)

    def terminal(node) -> str:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""

    def literal(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            return head.value + "{}" if isinstance(head, ast.Constant) else "{}"
        return None

    tree = ast.parse(text)
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        value = None if id(node) in inner else literal(node)
        if value is not None and value.startswith(families):
            found.add((node.lineno, node.col_offset, value))
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            storeish = (isinstance(func, ast.Attribute) and func.attr in STORE_CALLS
                        and any(w in terminal(func.value).lower() for w in ("store", "raw", "client")))
            prefix = isinstance(func, ast.Name | ast.Attribute) and ast.unparse(func).endswith("PrefixStore")
            if storeish or prefix:
                first = node.args[0]
                items = first.elts if isinstance(first, ast.List | ast.Tuple) else [first]
                found |= {(i.lineno, i.col_offset, v) for i in items if (v := literal(i)) is not None}
    return [v for _, _, v in sorted(found)]


def test_the_key_scan_catches_what_it_claims():
    fam = key_families()
    assert {"members/", "decision/", "done/", "hb/", "unbroken/snap/"} <= set(fam)
    text = ('store.get("epoch")\nx = f"done/{s}/{e}/{r}"\nself.store.check([f"dead/{m}"])\n'
            'PrefixStore(f"g{n}/", raw)\nd.get("epoch")\nrec["epoch"]\n')
    assert key_literals(text, fam) == ["epoch", "done/{}", "dead/{}", "g{}"]


def test_no_store_key_is_spelled_outside_the_keys_module():
    fam = key_families()
    spelled = {str(f.relative_to(SRC)): key_literals(f.read_text(), fam) for f in MODULES if f != KEYS_MODULE}
    assert not {f: k for f, k in spelled.items() if k}, "store keys spelled outside runtime/store/keys.py"


def test_every_imported_unbroken_name_exists():
    """A function-level import of a moved module is caught here too (the import test only runs top levels)."""
    missing = {}
    for f in MODULES:
        for n in imports(f):
            if n.startswith("unbroken.") and n not in NAMES:
                parent = n.rsplit(".", 1)[0]
                if parent not in NAMES:  # `from unbroken.x import name`: x must exist
                    missing.setdefault(str(f.relative_to(SRC)), []).append(n)
    assert not missing, missing


def import_time_env_reads(text: str) -> list[int]:
    """Lines that read the environment (`os.environ`, `environ`, `getenv`) in code that runs when the module
    is imported: module and class bodies, default values and decorators, not function bodies."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for part in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
                if part is not None:
                    visit(part)
            return
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            found.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(text))
    return found


def test_the_env_scan_catches_what_it_claims():
    assert import_time_env_reads("import os\nX = os.environ.get('A')\n") == [2]
    assert import_time_env_reads("import os\nclass C:\n    y = os.getenv('B')\n") == [3]
    assert import_time_env_reads("import os\ndef f(a=os.environ['C']):\n    pass\n") == [2]
    assert import_time_env_reads("import os\ndef f():\n    return os.environ['D']\nL = lambda: os.getenv('E')\n") == []


def test_no_module_reads_the_environment_at_import():
    """What a process's environment says is read when it is used, never when a module is imported: the
    test suite forks every CLI run from a server that imported the modules once (tests/conftest.py:
    `unbroken`), and the fork servers fork trainers and agents the same way (zygote.py), so an
    import-time read would see the server's environment, not the run's."""
    bad = {str(f.relative_to(SRC)): lines for f in MODULES if (lines := import_time_env_reads(f.read_text()))}
    assert not bad, bad


# -- runtime/parallel applies a plan and never names a module -----------------------------------------------

def model_module_names() -> set[str]:
    """Every module name (one dotted atom, indices aside) of the built-in models: what the parallel
    mechanics and the trainer must learn from a model's plan (model/plan.py), never spell."""
    from unbroken.config import ModelConfig
    from unbroken.model.gpt import GPT
    from unbroken.model.llama import Llama

    models = [GPT(ModelConfig()), Llama(ModelConfig(arch="llama"))]
    return {atom for m in models for path, _ in m.named_modules() for atom in path.split(".")
            if atom and not atom.isdigit()}


def module_names_in(text: str, names: set[str]) -> list[str]:
    """The string literals (docstrings aside) and attribute reads (method calls aside: `x.drop()` is no
    module) of `text` that spell one of `names` as a dotted atom ("blocks", "attn.qkv", f"blocks.{i}",
    `model.tok`), with their line numbers."""
    tree = ast.parse(text)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            spelled = [a for a in node.value.split(".") if a in names]
        elif isinstance(node, ast.Attribute) and id(node) not in calls:
            spelled = [node.attr] if node.attr in names else []
        else:
            continue
        found += [f"{node.lineno}: {a}" for a in spelled]
    return found


def test_the_module_name_scan_catches_what_it_claims():
    names = {"blocks", "qkv", "tok"}
    text = 'x = model.blocks\ny = "attn.qkv"\nz = f"blocks.{i}"\ndef f():\n    """tok here is prose."""\n'
    assert sorted(module_names_in(text, names)) == ["1: blocks", "2: qkv", "3: blocks"]
    assert module_names_in('w = "token"\nv = x.tokens\nu = x.tok()\n', names) == []


@pytest.mark.parametrize("package", ["runtime/parallel", "runtime/trainer"])
def test_the_parallel_mechanics_and_the_trainer_name_no_module_of_a_model(package):
    """runtime/parallel applies a model's plan (model/plan.py) and the trainer hands it on; neither spells
    a module of the built-in models (a string or an attribute), so any model with a plan runs the same."""
    names = model_module_names()
    assert {"blocks", "qkv", "tok", "head", "layers", "wq", "tok_embeddings"} <= names
    spelled = {str(f.relative_to(SRC)): module_names_in(f.read_text(), names)
               for f in sorted((SRC / package).rglob("*.py"))}
    assert not {f: s for f, s in spelled.items() if s}, spelled
