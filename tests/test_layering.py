"""The package's import graph: no cycles, and every import runs down the layers

    integrations, serve -> engine -> reuse -> model / cache / chat -> kernels, errors, timing;
    kernels import nothing

(apps on top: bench, fidelity, demos, cli). Inside reuse, storage is at the bottom, views read it,
and KVCMAS and the baselines never import each other. Engine code dispatches on no reuse-mode name.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvcmas_agents.reuse import names

ROOT = Path(__file__).resolve().parent.parent / "kvcmas_agents"
PKG = "kvcmas_agents"

# What each top-level part may import of the package (itself always allowed).
BASE = {"errors", "timing", "switches"}          # leaf modules every part may use
ALLOWED = {
    "errors": set(),
    "timing": set(),
    "switches": set(),
    "kernels": set(),
    "model": BASE | {"kernels"},        # the block products (kernels.cpu_quant)
    "cache": BASE,
    "chat": BASE,
    "reuse": BASE | {"kernels", "model", "cache", "chat"},
    "engine": BASE | {"kernels", "model", "cache", "chat", "reuse"},
    "registry": BASE | {"model", "engine"},
    "integrations": BASE | {"model", "chat", "engine", "registry"},
    "serve": BASE | {"model", "chat", "engine", "registry"},
}
APPS = {"bench", "fidelity", "demos", "cli", ""}          # "": the package's __init__
# Inside reuse: (importer prefix, forbidden prefix).
REUSE_FORBIDDEN = [
    ("reuse.storage", "reuse."),             # only storage itself (checked below)
    ("reuse.realign", "reuse."),             # only storage
    ("reuse.views", "reuse."),               # only storage, realign and views
    ("reuse.kvcmas", "reuse.baselines"),
    ("reuse.baselines", "reuse.kvcmas"),
    # correction, selection and prefetch read a RequestView, never the method class (issue 46)
    ("reuse.kvcmas.correction", "reuse.cross_agent"),
    ("reuse.kvcmas.select", "reuse.cross_agent"),
    ("reuse.kvcmas.prefetch", "reuse.cross_agent"),
]
REUSE_EXCEPT = {"reuse.storage": ("reuse.storage",), "reuse.realign": ("reuse.storage",),
                "reuse.views": ("reuse.storage", "reuse.realign", "reuse.views")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Modules of the package this file imports (relative to the package; "" is its __init__),
    TYPE_CHECKING and function-level imports included."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == PKG or node.module.startswith(PKG + ".")):
                target = node.module[len(PKG) + 1:]
            else:
                continue
            # "from . import x" names submodules: count each that is a module of the package.
            subs = [f"{target}.{a.name}".strip(".") for a in node.names]
            found = [s for s in subs if (ROOT / (s.replace(".", "/") + ".py")).exists()
                     or (ROOT / s.replace(".", "/") / "__init__.py").exists()]
            out.update(found or [target])
        elif isinstance(node, ast.Import):
            out.update(a.name[len(PKG) + 1:] for a in node.names if a.name.startswith(PKG + "."))
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) - {module_name(p)} for p in ROOT.rglob("*.py")}


def top(mod: str) -> str:
    return mod.split(".")[0]


def test_the_graph_has_every_module():
    g = graph()
    assert {"engine.engine", "reuse.base", "reuse.kvcmas.method", "model.llama", "kernels.view_attention"} <= set(g)
    assert "reuse.storage.readers" in g["reuse.views.gather"]      # the parser resolves relative imports


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d in g and not state.get(d):
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if not state.get(m):
            visit(m)


def test_imports_run_down_the_layers():
    bad = []
    for mod, deps in graph().items():
        part = top(mod)
        if part in APPS:
            continue
        allowed = ALLOWED[part] | {part}
        bad += [f"{mod} -> {d}" for d in deps if top(d) not in allowed]
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_inside_reuse_storage_views_and_methods_keep_apart():
    bad = []
    for mod, deps in graph().items():
        for importer, forbidden in REUSE_FORBIDDEN:
            if mod == importer or mod.startswith(importer + "."):
                ok = REUSE_EXCEPT.get(importer, ())
                bad += [f"{mod} -> {d}" for d in deps
                        if (d == forbidden.rstrip(".") or d.startswith(forbidden)) and not d.startswith(ok or "\0")]
    assert not bad, "\n".join(sorted(bad))


def _mode_tests(tree: ast.AST, modes: set[str]) -> list[int]:
    """Lines comparing a reuse mode (``x.reuse``, ``reuse``, ``mode``) with a mode's name."""
    def is_mode(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "reuse") or (isinstance(n, ast.Name) and n.id in ("reuse",
                                                                                                             "mode"))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_mode(n) for n in [node.left, *node.comparators]):
            if modes & {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}:
                lines.append(node.lineno)
    return lines


def test_the_engine_dispatches_on_no_reuse_mode_name():
    """Reuse modes are methods behind the seam: the engine and the layers below never compare a mode
    with a mode's name (the registry maps names to methods)."""
    modes = set(names())
    assert _mode_tests(ast.parse('if req.options.reuse == "kvcmas": pass'), modes) == [1]
    found = [f"{module_name(p)}:{line}" for p in ROOT.rglob("*.py") if top(module_name(p)) not in APPS
             for line in _mode_tests(ast.parse(p.read_text()), modes)]
    assert not found, found
