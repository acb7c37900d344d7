"""The suite's own conftest at collection: a broken golden store (one without prompts too) and a disabled plugin stop
the session in one line that no -k or -m can deselect."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_plugin_fake_engine import FAST

from pytest_cdna2.goldens import BUNDLED_GOLDENS

TOKENS = Path(__file__).resolve().parent.parent / "suite" / "test_tokens.py"


def collect(pytester, *args):
    return pytester.runpytest_inprocess(str(TOKENS), *FAST, "-p", "no:cacheprovider", "--co", "-q", *args)


def test_an_unreadable_manifest_is_a_collection_error_that_k_cannot_hide(pytester, tmp_path):
    store = tmp_path / "g"
    shutil.copytree(BUNDLED_GOLDENS, store)
    (store / "manifest.json").write_text("{")
    r = collect(pytester, "--cdna2-device=cpu", f"--cdna2-goldens={store}", "-k", "p00")
    assert r.ret == pytest.ExitCode.INTERRUPTED
    r.stdout.fnmatch_lines([f"cdna2: {store / 'manifest.json'}: not valid JSON (*); rebuild with *"])
    assert "Traceback" not in r.stdout.str() and "During handling" not in r.stdout.str()


def test_a_store_without_prompts_is_a_collection_error_not_a_green_run(pytester, tmp_path):
    """The suite parametrized over no prompt and passed (the store itself is opened only by a test's fixture)."""
    import json

    store = tmp_path / "g"
    shutil.copytree(BUNDLED_GOLDENS, store)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "prompts": []}))
    r = collect(pytester, "--cdna2-device=cpu", f"--cdna2-goldens={store}")
    assert r.ret == pytest.ExitCode.INTERRUPTED
    r.stdout.fnmatch_lines([f"cdna2: {store / 'manifest.json'}: no prompts, so the token tier would check nothing; *"])


def test_a_missing_manifest_names_the_store(pytester, tmp_path):
    (tmp_path / "empty").mkdir()
    r = collect(pytester, "--cdna2-device=cpu", f"--cdna2-goldens={tmp_path / 'empty'}", "-m", "token")
    assert r.ret == pytest.ExitCode.INTERRUPTED
    r.stdout.fnmatch_lines([f"cdna2: no manifest.json in {tmp_path / 'empty'}: not a golden store; *"])


def test_the_suite_without_the_plugin_is_a_usage_error(pytester):
    r = collect(pytester, "-p", "no:cdna2")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: suite/ needs the pytest-cdna2 plugin, which is not loaded (-p no:cdna2*"])
