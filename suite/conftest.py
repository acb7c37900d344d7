"""Parametrizes the suite over the golden store's prompts (names read from its manifest at collection;
the store itself is verified by the cdna2_golden fixture before any test uses it)."""

from __future__ import annotations

import pytest

import pytest_cdna2.plugin as cdna2_plugin
from pytest_cdna2.fixtures import SETTINGS
from pytest_cdna2.goldens import GoldenError, read_manifest


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.is_registered(cdna2_plugin):
        raise pytest.UsageError(
            "suite/ needs the pytest-cdna2 plugin, which is not loaded (-p no:cdna2, or plugin autoload disabled): "
            "drop -p no:cdna2, or add -p cdna2"
        )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "golden_prompt" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[SETTINGS]
    try:
        names, problem = [p["name"] for p in read_manifest(settings.goldens)["prompts"]], None
    except GoldenError as e:
        names, problem = ["(goldens to rebuild)"], str(e)  # regen: the cdna2_golden fixture rebuilds them, and fails
    if problem and not settings.regen:  # a collection error: unlike a test, -k or -m cannot deselect it
        pytest.fail(f"cdna2: {problem}", pytrace=False)
    metafunc.parametrize("golden_prompt", names)
