"""The import contract of ../shared/DESIGN.md (its walls) and issue 22, checked on the tree as it is and
on small planted trees. The rules (a-e) and how imports are read are in import_rules.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from import_rules import (
    BACKENDS, LIBRARY, NEVER_AT_TOP, import_graph, imports_under, in_package, report, rule_a_algos_are_pure_math,
    rule_b_programs_import_no_other_program, rule_c_backends_are_lazy, rule_d_rollout_base_imports_no_rollout_module,
    rule_e_no_import_cycles, tree_modules,
)
from testutils import REPO, env_for_ranks


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
