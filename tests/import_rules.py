"""The import contract of ../shared/DESIGN.md (its walls) and issue 22, read from the code's own imports.

Every ``.py`` file under rlhfkit/ and the programs (step1_sft/, step2_reward/, step2_dpo/, step3_ppo/)
is parsed with ``ast``; every ``import`` statement counts wherever it stands: at module level, inside a
function (a lazy import) or under ``if TYPE_CHECKING:``. The rules:

a. rlhfkit/algos is pure math: it imports the standard library, torch (but not torch.distributed), numpy,
   scipy and rlhfkit.algos.* only: no rlhfkit.config or other rlhfkit module, no deepspeed, no transformers.
b. A program (stepN_*/*.py) imports rlhfkit.* and its own package, never another program's package.
c. The library imports on a CPU machine without ray, vllm or flash_attn: no module of rlhfkit or of the
   programs imports them at its top level. Rollout backends are lazy: no file outside rlhfkit/rollout/
   (rlhfkit/, the programs and tests/ are checked; tests/rollout/ tests the backends, bench/ measures
   them) imports a backend module (rlhfkit.rollout.hf, hf_synced, deepspeed_he, fast_decode, shared_decode,
   sampling), at any level, either directly or through a name that a module re-exports from one; and
   rlhfkit/rollout/__init__.py imports none at its top level.
d. rlhfkit/rollout/base.py imports nothing from rlhfkit.rollout.* (the backends build on it, never the
   reverse), not even inside a function or for type checking.
e. No import cycles among the modules of rlhfkit and the programs.

Targets and edges. ``import a.b.c`` imports a.b.c. ``from a.b import x`` imports a.b.x when that is a
module of the tree (a submodule), else a.b: x is a name that a.b defines or re-exports, and taking it runs
a.b (a package's ``__init__``). Relative imports are resolved against the importing module first. For a
module outside the tree (``from torch import distributed``) the target is a.b.x, so that a submodule is
never missed (rule a). The implicit import of the parent packages (``import a.b.c`` runs a/__init__ and
a/b/__init__ first) is no edge: a package's ``__init__`` has finished, or is itself the importer, before its
submodule's code runs, so it orders nothing; what ``__init__`` imports is its own edges.

Re-exports. A package ``__init__`` that re-exports a name (``from .base import X`` in rlhfkit/rollout/
__init__.py) is an edge package -> base; a module that takes X from the package is an edge to the
package, not past it. So a cycle through a re-export is still a cycle (m -> package -> base -> m), and a
submodule that takes its sibling's name from its own package's ``__init__`` while that ``__init__`` imports
it is a cycle too (import siblings directly). For rule c a name is followed to the module that a re-export
takes it from (any ``import`` in the module that binds the name, also inside a function such as a
module-level ``__getattr__`` that re-exports lazily), so that no facade lets a backend past the rule.

Which imports count where. Function-level imports are edges (a lazy import still depends on its target,
and a cycle hidden in a function is what rule e must find). Imports under ``if TYPE_CHECKING:`` never run:
they are no edge of rule e, and no import at module level for rule c's first clause; rules a, b, c's second
clause and d count them (what a module may know of at all). ``importlib.import_module`` with a computed
name (the rollout registry) is no edge; test_importing_every_module_loads_no_backend_and_no_cluster_package
imports every module of rlhfkit and sees what really gets loaded.

Each checker takes the root of a tree, so test_imports.py plants each violation in a small tree under
tmp_path and checks that it is reported, naming the file, the line and the statement.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

LIBRARY = "rlhfkit"
PROGRAMS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
PACKAGES = (LIBRARY, *PROGRAMS)
BACKENDS = tuple(f"rlhfkit.rollout.{m}" for m in ("hf", "hf_synced", "deepspeed_he", "fast_decode", "shared_decode",
                                                          "sampling"))
NEVER_AT_TOP = ("ray", "vllm", "flash_attn")  # GPU-cluster-only packages: a CPU machine has none of them
ALGOS_MAY_IMPORT = ("torch", "numpy", "scipy", "rlhfkit.algos")  # besides the standard library
ALGOS_MAY_NOT = ("torch.distributed",)  # inside what ALGOS_MAY_IMPORT allows


@dataclass(frozen=True)
class Import:
    """One imported module of one import statement."""

    file: str  # path relative to the root, e.g. rlhfkit/rollout/base.py
    line: int
    importer: str  # dotted name of the importing module
    target: str  # dotted name of the imported module (see the module docstring)
    names: tuple[str, ...]  # for ``from target import ...``: the names taken (empty for ``import target``)
    where: str  # "module", "function" or "type-checking"
    text: str  # the statement, on one line (as ast.unparse writes it)

    def __str__(self) -> str:
        where = "" if self.where == "module" else f" [{self.where}]"
        return f"{self.file}:{self.line}: {self.text}{where}"


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(root: Path, top: str) -> list[Path]:
    return sorted(p for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=None)
def tree_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the library and the programs under ``root``."""
    return {module_name(p.relative_to(root)): p for top in PACKAGES for p in python_files(root, top)}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def statements(tree: ast.AST, where: str = "module"):
    """Yield (import node, where) for every import statement under ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if not isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)):
            continue  # an expression holds no import statement
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, where
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from statements(node, "function" if where == "module" else where)
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            yield from statements(ast.Module(body=node.body, type_ignores=[]), "type-checking")
            yield from statements(ast.Module(body=node.orelse, type_ignores=[]), where)
        else:
            yield from statements(node, where)


def absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: dict) -> list[tuple[str, tuple]]:
    if isinstance(node, ast.Import):
        return [(alias.name, ()) for alias in node.names]
    source = absolute(node, importer, is_package)
    in_tree = source.split(".")[0] in PACKAGES
    out: dict[str, list[str]] = {}
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        target = source if alias.name == "*" or (in_tree and sub not in modules) else sub
        out.setdefault(target, []).append(alias.name)
    return [(t, tuple(names)) for t, names in out.items()]


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@functools.lru_cache(maxsize=None)
def imports_of_file(root: Path, rel: str) -> tuple[Import, ...]:
    path = root / rel
    importer = module_name(Path(rel))
    modules = tree_modules(root)
    found = []
    for node, where in statements(parsed(path)):
        text = ast.unparse(node)
        for target, names in targets(node, importer, path.name == "__init__.py", modules):
            found.append(Import(rel, node.lineno, importer, target, names, where, text))
    return tuple(found)


def imports_under(root: Path, *tops: str) -> list[Import]:
    return [imp for top in tops for p in python_files(root, top) for imp in imports_of_file(root, str(p.relative_to(root)))]


@functools.lru_cache(maxsize=None)
def bindings(root: Path, module: str) -> dict[str, tuple[str, str | None]]:
    """Name -> (module, name in it) for every name that an import statement of ``module`` binds, at any
    level (a module-level ``__getattr__`` that imports the name counts); (module, None) when the name is
    bound to a module itself."""
    path = tree_modules(root).get(module)
    if path is None:
        return {}
    modules = tree_modules(root)
    out: dict[str, tuple[str, str | None]] = {}
    for node, _ in statements(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:  # ``import a.b`` binds a; ``import a.b as n`` binds n to a.b
                bound = alias.name if alias.asname else alias.name.split(".")[0]
                out.setdefault(alias.asname or bound, (bound, None))
            continue
        source = absolute(node, module, path.name == "__init__.py")
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            out.setdefault(alias.asname or alias.name, (sub, None) if sub in modules else (source, alias.name))
    return out


def reexport_source(root: Path, module: str, name: str, depth: int = 0) -> str | None:
    """The module that ``module`` takes ``name`` from by an import, followed through chains of
    re-exports; None when ``module`` defines ``name`` itself (or is no module of the tree)."""
    if depth > 10 or name not in bindings(root, module):
        return None
    source, original = bindings(root, module)[name]
    return source if original is None else (reexport_source(root, source, original, depth + 1) or source)


def reached(root: Path, imp: Import) -> list[str]:
    """``imp``'s target and, for names taken from a module of the tree, the modules that re-export them."""
    out = [imp.target]
    for name in imp.names:
        source = reexport_source(root, imp.target, name)
        if source and source not in out:
            out.append(source)
    return out


# ---------------------------------------------------------------------------------------------
# the rules: each returns its violations, one line each


def rule_a_algos_are_pure_math(root: Path) -> list[str]:
    stdlib = sys.stdlib_module_names
    bad = []
    for imp in imports_under(root, "rlhfkit/algos"):
        allowed = imp.target.split(".")[0] in stdlib or any(in_package(imp.target, p) for p in ALGOS_MAY_IMPORT)
        if not allowed or any(in_package(imp.target, p) for p in ALGOS_MAY_NOT):
            bad.append(f"{imp}: rlhfkit/algos imports {imp.target} (allowed: the standard library, "
                       f"{', '.join(ALGOS_MAY_IMPORT)}; never {', '.join(ALGOS_MAY_NOT)})")
    return bad


def rule_b_programs_import_no_other_program(root: Path) -> list[str]:
    bad = []
    for program in PROGRAMS:
        for imp in imports_under(root, program):
            top = imp.target.split(".")[0]
            if top in PROGRAMS and top != program:
                bad.append(f"{imp}: the program {program} imports another program's package, {imp.target}")
    return bad


def rule_c_backends_are_lazy(root: Path) -> list[str]:
    bad = []
    for imp in imports_under(root, *PACKAGES):
        if imp.where == "module" and any(in_package(imp.target, p) for p in NEVER_AT_TOP):
            bad.append(f"{imp}: {imp.target} imported at module level (a CPU machine has no {imp.target.split('.')[0]})")
    outside = [imp for imp in imports_under(root, *PACKAGES, "tests")
               if not imp.file.startswith(("rlhfkit/rollout/", "tests/rollout/"))]
    for imp in outside:
        for module in reached(root, imp):
            if any(in_package(module, b) for b in BACKENDS):
                via = "" if module == imp.target else f" (through {imp.target}, which re-exports it)"
                bad.append(f"{imp}: imports the rollout backend {module}{via} outside rlhfkit/rollout/")
    for imp in imports_under(root, "rlhfkit/rollout"):
        if imp.file == "rlhfkit/rollout/__init__.py" and imp.where == "module":
            for module in reached(root, imp):
                if any(in_package(module, b) for b in BACKENDS):
                    bad.append(f"{imp}: rlhfkit/rollout/__init__.py imports the backend {module} at module level")
    return bad


def rule_d_rollout_base_imports_no_rollout_module(root: Path) -> list[str]:
    return [f"{imp}: rlhfkit/rollout/base.py imports {imp.target}" for imp in imports_under(root, "rlhfkit/rollout")
            if imp.file == "rlhfkit/rollout/base.py" and in_package(imp.target, "rlhfkit.rollout")
            and imp.target != "rlhfkit.rollout.base"]


def import_graph(root: Path) -> nx.DiGraph:
    """Modules of the tree -> the modules of the tree they import (module and function level); each
    edge keeps the statements that make it."""
    modules = tree_modules(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for imp in imports_under(root, *PACKAGES):
        if imp.where != "type-checking" and imp.target in modules and imp.target != imp.importer:
            if not graph.has_edge(imp.importer, imp.target):
                graph.add_edge(imp.importer, imp.target, by=[])
            graph.edges[imp.importer, imp.target]["by"].append(imp)
    return graph


def rule_e_no_import_cycles(root: Path) -> list[str]:
    graph = import_graph(root)
    bad = []
    for component in sorted((sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)):
        cycle = nx.find_cycle(graph.subgraph(component), source=component[0])
        steps = "\n".join(f"    {a} -> {b}: {graph.edges[a, b]['by'][0]}" for a, b in cycle)
        bad.append(f"import cycle among {', '.join(component)}:\n{steps}")
    return bad


def report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)
