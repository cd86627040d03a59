"""The developers' guide's shape rule, checked: no product function (the entry points, core/, recipes/,
scripts/, benchmarks/; tests are not product) is longer than 80 lines, nested functions included."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("train.py", "predict.py", "generate.py", "checkpoint.py", "core", "recipes", "scripts", "benchmarks")
MAX_LINES = 80


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """("file:line name", lines from `def` to its last line) of every function in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((f"{path.relative_to(REPO)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1))
    return found


def test_no_product_function_is_longer_than_80_lines():
    files = [
        f for root in PRODUCT for f in ([REPO / root] if root.endswith(".py") else sorted((REPO / root).rglob("*.py")))
    ]
    assert len(files) > 50  # the roots exist: a moved folder must not make this pass by finding nothing
    long = [f"{where}: {lines} lines" for f in files for where, lines in function_lengths(f) if lines > MAX_LINES]
    assert not long, "split these into parts of one concept each:\n" + "\n".join(long)
