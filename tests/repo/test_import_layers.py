"""docs/architecture.md's import rule, read from the document itself: a module of core/ or recipes/ imports at
run time only from modules listed above its own in the document's layout block, or from its own folder."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.helpers import REPO

DOC = REPO / "docs" / "architecture.md"


def layers() -> list[str]:
    """The layout block's entries in order, as module prefixes: core/config/ -> core.config, core/runtime.py ->
    core.runtime."""
    block = DOC.read_text().split("```")[1]
    entries = re.findall(r"^((?:core|recipes)/[\w/]*?)(?:\.py)?/?\s", block, flags=re.MULTILINE)
    return [entry.strip("/").replace("/", ".") for entry in entries]


def layer_of(module: str, order: list[str]) -> int | None:
    matches = [i for i, prefix in enumerate(order) if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(order[i])) if matches else None


def runtime_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, line) of every import that runs: those under `if TYPE_CHECKING:` never do."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from core.parallel import mfsdp` imports core.parallel.mfsdp
            found += [(node.module, node.lineno)] + [
                (f"{node.module}.{alias.name}", node.lineno) for alias in node.names
            ]
    return found


def violations(root: Path, order: list[str]) -> list[str]:
    found = []
    for file in sorted(root.glob("core/**/*.py")) + sorted(root.glob("recipes/**/*.py")):
        module = ".".join(file.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module, order)
        for imported, line in runtime_imports(ast.parse(file.read_text(), str(file))):
            theirs = layer_of(imported, order)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(
                    f"{file.relative_to(root)}:{line} imports {imported} ({order[theirs]} is listed "
                    f"after {order[mine]})"
                )
    return found


def test_the_documented_layers_are_every_package_in_order():
    order = layers()
    assert order[:2] == ["core.config", "core.layers"] and order[-1] == "recipes", order
    packages = {p.name for p in (REPO / "core").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in (REPO / "core").glob("*.py") if p.stem != "__init__"}
    assert {f"core.{name}" for name in packages | modules} == {o for o in order if o.startswith("core.")}


def test_every_module_imports_only_from_the_layers_above_it():
    assert violations(REPO, layers()) == []


def test_the_check_sees_an_import_from_a_later_layer_and_lets_type_only_ones_pass(tmp_path):
    """The rule itself, on a tree of two layers: a run-time import upwards is reported, one under
    TYPE_CHECKING is not."""
    (tmp_path / "core" / "low").mkdir(parents=True)
    (tmp_path / "core" / "high").mkdir()
    (tmp_path / "core" / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.high.b import B\n"
    )
    assert violations(tmp_path, ["core.low", "core.high"]) == []
    (tmp_path / "core" / "low" / "a.py").write_text("from core.high import b\n")
    assert violations(tmp_path, ["core.low", "core.high"]) == [
        "core/low/a.py:1 imports core.high (core.high is listed after core.low)",
        "core/low/a.py:1 imports core.high.b (core.high is listed after core.low)",
    ]
