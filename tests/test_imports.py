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
   them) imports a backend module (rlhfkit.rollout.hf, hf_synced, deepspeed_he, fast_decode, sampling),
   at any level, either directly or through a name that a module re-exports from one; and
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

Each checker takes the root of a tree, so the tests at the end plant each violation in a small tree
under tmp_path and check that it is reported, naming the file, the line and the statement.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

from testutils import REPO, env_for_ranks

LIBRARY = "rlhfkit"
PROGRAMS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
PACKAGES = (LIBRARY, *PROGRAMS)
BACKENDS = tuple(f"rlhfkit.rollout.{m}" for m in ("hf", "hf_synced", "deepspeed_he", "fast_decode", "sampling"))
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


# ---------------------------------------------------------------------------------------------
# the tree as it is


def test_algos_are_pure_math():
    assert imports_under(REPO, "rlhfkit/algos"), "no imports found: the checker reads nothing"
    violations = rule_a_algos_are_pure_math(REPO)
    assert not violations, report(violations)


def test_programs_import_the_library_and_their_own_package_only():
    violations = rule_b_programs_import_no_other_program(REPO)
    assert not violations, report(violations)


def test_rollout_backends_are_lazy_and_cluster_packages_absent():
    violations = rule_c_backends_are_lazy(REPO)
    assert not violations, report(violations)


def test_rollout_base_imports_no_rollout_module():
    violations = rule_d_rollout_base_imports_no_rollout_module(REPO)
    assert not violations, report(violations)


def test_no_import_cycles():
    assert import_graph(REPO).number_of_edges() > 50, "too few edges: the checker reads nothing"
    violations = rule_e_no_import_cycles(REPO)
    assert not violations, report(violations)


IMPORT_EVERYTHING = r"""
import importlib, json, sys
plain, backends, forbidden, never = json.loads(sys.argv[1])

def loaded(names):
    return sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))

found = {}
for name in plain + backends:  # every plain module first: a backend loaded on the way is then caught
    before = set(loaded(forbidden if name in plain else never))
    importlib.import_module(name)
    new = sorted(set(loaded(forbidden if name in plain else never)) - before - {name})
    if new:
        found[name] = new
print("RESULT " + json.dumps(found))
"""


def loaded_on_import(root: Path) -> dict[str, list[str]]:
    """Import rlhfkit and each of its modules under ``root`` in one fresh process, the backends last:
    module -> what its import loaded that it must not (a plain module: ray, vllm, flash_attn or a rollout
    backend; a backend: ray, vllm or flash_attn)."""
    modules = sorted(m for m in tree_modules(root) if in_package(m, LIBRARY) and not m.endswith("__main__"))
    backends = [m for m in modules if any(in_package(m, b) for b in BACKENDS)]
    plain = [m for m in modules if m not in backends]
    assert "rlhfkit" in plain and "rlhfkit.rollout" in plain and backends, (plain, backends)
    arg = json.dumps([plain, backends, [*NEVER_AT_TOP, *BACKENDS], list(NEVER_AT_TOP)])
    env = {**env_for_ranks(1), "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, arg], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_importing_every_module_loads_no_backend_and_no_cluster_package():
    found = loaded_on_import(REPO)
    assert not found, "importing these modules loaded what it must not:\n" + "\n".join(
        f"  {m}: {', '.join(new)}" for m, new in found.items())


# ---------------------------------------------------------------------------------------------
# the checkers catch what they must: violations planted in a small tree

CLEAN_TREE = {
    "rlhfkit/__init__.py": "",
    "rlhfkit/config.py": "import dataclasses\n",
    "rlhfkit/algos/__init__.py": "from rlhfkit.algos.kl import kl\n",
    "rlhfkit/algos/kl.py": "import math\nfrom typing import Optional\n\nimport torch\nfrom torch import nn\n\n\ndef kl(): ...\n",
    "rlhfkit/rollout/__init__.py": ("import importlib\n\nfrom rlhfkit.rollout.base import RolloutBatch\n\n\n"
                                    "def make(name):\n    from rlhfkit.rollout import hf\n    return hf\n"),
    "rlhfkit/rollout/base.py": ("from typing import TYPE_CHECKING\n\nimport torch\n\nif TYPE_CHECKING:\n"
                                "    from rlhfkit.models.gathered import GatheredCopy\n\nRolloutBatch = object\n"),
    "rlhfkit/rollout/sampling.py": "from rlhfkit.rollout.base import RolloutBatch\n\n\ndef hf_generate(): ...\n",
    "rlhfkit/rollout/hf.py": ("from rlhfkit.models.gathered import GatheredCopy\nfrom rlhfkit.rollout.base import RolloutBatch\n"
                              "from rlhfkit.rollout.sampling import hf_generate\n"),
    "rlhfkit/models/__init__.py": "from rlhfkit.models.gathered import GatheredCopy\n",
    "rlhfkit/models/gathered.py": "import torch.distributed\n\n\ndef load():\n    import vllm\n\n\nGatheredCopy = object\n",
    "rlhfkit/evaluation.py": "from rlhfkit.models import GatheredCopy\nfrom rlhfkit.rollout import RolloutBatch, make\n",
    "step3_ppo/__init__.py": "",
    "step3_ppo/config.py": "from rlhfkit.rollout import RolloutBatch\n",
    "step3_ppo/main.py": "import deepspeed\n\nfrom rlhfkit.models.gathered import GatheredCopy\nfrom step3_ppo.config import x\n",
    "step1_sft/main.py": "from rlhfkit.config import y\n",
    "tests/rollout/test_hf.py": "from rlhfkit.rollout.hf import GatheredCopy\n",
    "tests/test_eval.py": "from rlhfkit.evaluation import z\n",
}

RULES = [rule_a_algos_are_pure_math, rule_b_programs_import_no_other_program, rule_c_backends_are_lazy,
         rule_d_rollout_base_imports_no_rollout_module, rule_e_no_import_cycles]


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_clean_tree_passes_every_rule(tmp_path):
    root = make_tree(tmp_path, CLEAN_TREE)
    assert {rule.__name__: rule(root) for rule in RULES} == {rule.__name__: [] for rule in RULES}
    graph = import_graph(root)
    assert graph.has_edge("rlhfkit.rollout", "rlhfkit.rollout.hf")  # from-import of a submodule, inside a function
    assert graph.has_edge("rlhfkit.evaluation", "rlhfkit.rollout")  # a name from a package: the package
    assert not graph.has_edge("rlhfkit.rollout.base", "rlhfkit.models.gathered")  # TYPE_CHECKING only


PLANTED = [
    # rule a: config types, torch.distributed in every spelling, other libraries, at any level
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/kl.py": "from rlhfkit.config import Args\n"},
     "rlhfkit/algos/kl.py:1: from rlhfkit.config import Args: rlhfkit/algos imports rlhfkit.config"),
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/kl.py": "def f():\n    import torch.distributed as dist\n"},
     "rlhfkit/algos/kl.py:2: import torch.distributed as dist [function]: rlhfkit/algos imports torch.distributed"),
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/kl.py": "from torch import distributed\n"},
     "rlhfkit/algos/kl.py:1: from torch import distributed: rlhfkit/algos imports torch.distributed"),
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/stats.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                            "    from transformers import PreTrainedModel\n"},
     "rlhfkit/algos/stats.py:3: from transformers import PreTrainedModel [type-checking]: rlhfkit/algos imports "
     "transformers.PreTrainedModel"),
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/kl.py": "from ..rollout.base import RolloutBatch\n"},
     "rlhfkit/algos/kl.py:1: from ..rollout.base import RolloutBatch: rlhfkit/algos imports rlhfkit.rollout.base"),
    (rule_a_algos_are_pure_math, {"rlhfkit/algos/kl.py": "import deepspeed\n"}, "rlhfkit/algos imports deepspeed"),
    # rule b
    (rule_b_programs_import_no_other_program, {"step3_ppo/main.py": "def f():\n    from step1_sft.main import sft_args\n"},
     "step3_ppo/main.py:2: from step1_sft.main import sft_args [function]: the program step3_ppo imports another "
     "program's package, step1_sft.main"),
    # rule c: cluster packages at module level; backends outside rollout/, directly, relatively or through a re-export
    (rule_c_backends_are_lazy, {"rlhfkit/chat.py": "try:\n    import vllm\nexcept ImportError:\n    vllm = None\n"},
     "rlhfkit/chat.py:2: import vllm: vllm imported at module level"),
    (rule_c_backends_are_lazy, {"step3_ppo/main.py": "from ray.util import placement_group\n"},
     "step3_ppo/main.py:1: from ray.util import placement_group: ray.util.placement_group imported at module level"),
    (rule_c_backends_are_lazy, {"step3_ppo/main.py": "from rlhfkit.rollout.hf import GatheredCopy\n"},
     "step3_ppo/main.py:1: from rlhfkit.rollout.hf import GatheredCopy: imports the rollout backend rlhfkit.rollout.hf "
     "outside rlhfkit/rollout/"),
    (rule_c_backends_are_lazy, {"rlhfkit/models/gathered.py": "def f():\n    from ..rollout import sampling\n"},
     "rlhfkit/models/gathered.py:2: from ..rollout import sampling [function]: imports the rollout backend "
     "rlhfkit.rollout.sampling outside rlhfkit/rollout/"),
    (rule_c_backends_are_lazy, {"rlhfkit/rollout/__init__.py": "def __getattr__(name):\n"
                                                               "    from rlhfkit.rollout.sampling import hf_generate\n"
                                                               "    return hf_generate\n",
                                "rlhfkit/evaluation.py": "from rlhfkit.rollout import hf_generate\n"},
     "rlhfkit/evaluation.py:1: from rlhfkit.rollout import hf_generate: imports the rollout backend rlhfkit.rollout.sampling "
     "(through rlhfkit.rollout, which re-exports it) outside rlhfkit/rollout/"),
    (rule_c_backends_are_lazy, {"tests/test_eval.py": "import rlhfkit.rollout.fast_decode as fd\n"},
     "tests/test_eval.py:1: import rlhfkit.rollout.fast_decode as fd: imports the rollout backend rlhfkit.rollout.fast_decode"),
    (rule_c_backends_are_lazy, {"rlhfkit/rollout/__init__.py": "from rlhfkit.rollout.hf_synced import Engine\n"},
     "rlhfkit/rollout/__init__.py:1: from rlhfkit.rollout.hf_synced import Engine: rlhfkit/rollout/__init__.py imports "
     "the backend rlhfkit.rollout.hf_synced at module level"),
    # rule d: even lazily, even for types, even relatively or through the package
    (rule_d_rollout_base_imports_no_rollout_module, {"rlhfkit/rollout/base.py": "def f():\n    from . import sampling\n"},
     "rlhfkit/rollout/base.py:2: from . import sampling [function]: rlhfkit/rollout/base.py imports rlhfkit.rollout.sampling"),
    (rule_d_rollout_base_imports_no_rollout_module, {"rlhfkit/rollout/base.py": "from typing import TYPE_CHECKING\n"
                                                                                "if TYPE_CHECKING:\n"
                                                                                "    from rlhfkit.rollout import RolloutBatch\n"},
     "rlhfkit/rollout/base.py:3: from rlhfkit.rollout import RolloutBatch [type-checking]: rlhfkit/rollout/base.py imports "
     "rlhfkit.rollout"),
    # rule e: a cycle hidden in a function; a submodule taking a name from its own package's __init__
    (rule_e_no_import_cycles, {"rlhfkit/rollout/base.py": "def f():\n    from rlhfkit.rollout.sampling import decode\n"},
     "import cycle among rlhfkit.rollout.base, rlhfkit.rollout.sampling:\n"
     "    rlhfkit.rollout.base -> rlhfkit.rollout.sampling: rlhfkit/rollout/base.py:2: from rlhfkit.rollout.sampling "
     "import decode [function]\n"
     "    rlhfkit.rollout.sampling -> rlhfkit.rollout.base: rlhfkit/rollout/sampling.py:1: from rlhfkit.rollout.base "
     "import RolloutBatch"),
    (rule_e_no_import_cycles, {"rlhfkit/rollout/hf.py": "from rlhfkit.rollout import RolloutBatch\n"},
     "    rlhfkit.rollout -> rlhfkit.rollout.hf: rlhfkit/rollout/__init__.py:7: from rlhfkit.rollout import hf [function]\n"
     "    rlhfkit.rollout.hf -> rlhfkit.rollout: rlhfkit/rollout/hf.py:1: from rlhfkit.rollout import RolloutBatch"),
]


@pytest.mark.parametrize("rule,planted,message", PLANTED,
                         ids=[f"{r.__name__.split('_')[1]}-{i}" for i, (r, _, _) in enumerate(PLANTED)])
def test_a_planted_violation_is_reported_by_name(tmp_path, rule, planted, message):
    root = make_tree(tmp_path, {**CLEAN_TREE, **planted})
    violations = rule(root)
    assert any(message in v for v in violations), report(violations)


def test_a_type_only_import_makes_no_cycle(tmp_path):
    root = make_tree(tmp_path, {**CLEAN_TREE, "rlhfkit/models/gathered.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhfkit.rollout.hf import Engine\nGatheredCopy = 1\n")})
    assert rule_e_no_import_cycles(root) == []
