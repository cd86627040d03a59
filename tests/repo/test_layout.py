"""The tests are laid out like the code (docs/testing.md): unit tests in tests/unit/<package>/, named after a
package of core/ or a top-level module of the repository; a recipe's tests in tests/recipes/<recipe>/; runs across
components in tests/e2e/; GPU tests in tests/gpu/; shared tools in tests/support/; rules about the repository itself
in tests/repo/. No test file lies loose in tests/."""

from __future__ import annotations

from pathlib import Path

from tests.support.helpers import REPO

TESTS = REPO / "tests"
FOLDERS = {"unit", "recipes", "e2e", "gpu", "support", "repo"}


def layout_problems(tests: Path, repo: Path) -> list[str]:
    """What breaks the layout in the tests folder `tests` of the repository `repo`, one line each."""
    problems = [
        f"{p.relative_to(repo)}: a test file directly under tests/ (it goes in one of {sorted(FOLDERS)})"
        for p in sorted(tests.glob("test_*.py"))
    ]
    for p in sorted(tests.iterdir()):
        if p.is_dir() and p.name not in FOLDERS and p.name != "__pycache__":
            problems.append(f"{p.relative_to(repo)}: not one of the folders {sorted(FOLDERS)}")
    code = {p.name for p in (repo / "core").iterdir() if (p / "__init__.py").exists()}
    code |= {p.stem for p in repo.glob("*.py")} | {p.name for p in repo.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    code -= {"tests", "recipes", "core"}
    recipes = {p.parent.name for p in (repo / "recipes").glob("*/recipe.py")}  # as recipes/registry.py finds them
    for folder, known in (("unit", code), ("recipes", recipes)):
        for p in sorted((tests / folder).iterdir()) if (tests / folder).is_dir() else []:
            what = "package of core/ or top-level module" if folder == "unit" else "recipe"
            if p.is_dir() and p.name != "__pycache__" and p.name not in known:
                problems.append(f"{p.relative_to(repo)}: names no {what}")
            if p.is_file() and p.name.startswith("test_"):
                problems.append(f"{p.relative_to(repo)}: belongs in a tests/{folder}/<name>/ folder")
    for p in sorted(tests.rglob("test_*.py")):
        if p.parent.name == "support":
            problems.append(f"{p.relative_to(repo)}: tests/support/ holds tools, not tests")
        # Without __init__.py, two folders' test files of the same name would clash as one module.
        for folder in p.relative_to(tests).parents:
            if folder != Path(".") and not (tests / folder / "__init__.py").exists():
                problems.append(f"tests/{folder}: no __init__.py")
    return sorted(set(problems))


def test_every_test_file_lies_in_the_folder_of_what_it_tests():
    assert layout_problems(TESTS, REPO) == []


def test_the_check_sees_a_loose_test_file_an_unknown_package_and_a_missing_init(tmp_path):
    repo = tmp_path
    for package in ("core/data", "recipes/vit"):
        (repo / package).mkdir(parents=True)
        (repo / package / "__init__.py").touch()
    (repo / "recipes/vit/recipe.py").touch()
    (repo / "train.py").touch()
    tests = repo / "tests"
    for folder in ("unit/data", "unit/train", "unit/dataa", "recipes/vit", "recipes/vitt", "e2e", "stuff"):
        (tests / folder).mkdir(parents=True)
    for folder in ("", "unit", "unit/data", "unit/train", "unit/dataa", "recipes", "recipes/vit", "recipes/vitt"):
        (tests / folder / "__init__.py").touch()
    for name in ("test_loose.py", "unit/data/test_ok.py", "unit/train/test_ok.py", "e2e/test_run.py"):
        (tests / name).touch()
    assert layout_problems(tests, repo) == [
        "tests/e2e: no __init__.py",
        "tests/recipes/vitt: names no recipe",
        "tests/stuff: not one of the folders ['e2e', 'gpu', 'recipes', 'repo', 'support', 'unit']",
        "tests/test_loose.py: a test file directly under tests/ (it goes in one of "
        "['e2e', 'gpu', 'recipes', 'repo', 'support', 'unit'])",
        "tests/unit/dataa: names no package of core/ or top-level module",
    ]
