"""pyproject.toml lists its packages by name (the engine's folder is mapped to `cdna2_engine`), so a new
subpackage left out of that list would work in this editable checkout and be missing from a built wheel; and its
pytest settings keep pytest's own features working."""

from __future__ import annotations

import os
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _packages_on_disk(folder: str, name: str) -> set[str]:
    """Every folder holding an __init__.py under `folder`, as the dotted name `name` maps it to."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if "__init__.py" in filenames:
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return found


def test_every_package_folder_is_listed_in_pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setup["packages"])
    on_disk = set()
    for name, folder in setup["package-dir"].items():
        on_disk |= _packages_on_disk(folder, name)
    assert "cdna2_engine.ops.triton.kernels" in on_disk  # the walk sees subpackages
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"


def test_the_project_config_keeps_last_failed_working(pytester):
    """pyproject.toml once disabled the cache plugin (addopts -p no:cacheprovider), so --lf, --ff and --sw did
    nothing, silently, and -p cacheprovider crashed. Under the project's own config, --lf reruns the last
    failure."""
    pytester.makepyfile("def test_ok(): pass\ndef test_bad(): assert False\n")
    args = ["-c", os.path.join(ROOT, "pyproject.toml"), "--rootdir", str(pytester.path), "-o",
            f"cache_dir={pytester.path / 'cache'}", "--cdna2-device=cpu", "-p", "no:xdist", str(pytester.path)]
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=1, failed=1)
    r = pytester.runpytest_subprocess(*args, "--lf")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure"])


def test_the_suite_extra_installs_the_plugins_the_suite_needs():
    """README's suite command installs `.[suite]`; suite/test_perf.py takes pytest-benchmark's `benchmark` fixture,
    which `.[suite]` lacked: on a GPU the whole suite passed and then both perf tests errored with "fixture
    'benchmark' not found"."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        suite = tomllib.load(f)["project"]["optional-dependencies"]["suite"]
    with open(os.path.join(ROOT, "suite", "test_perf.py"), encoding="utf-8") as f:
        assert re.search(r"def test_\w+\(benchmark\b", f.read())
    assert "pytest-benchmark" in {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower() for req in suite}
