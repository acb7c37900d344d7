"""Parametrizes the suite over the golden store's prompts (names read from its manifest at collection;
the store itself is verified by the cdna2_golden fixture before any test uses it)."""

from __future__ import annotations

import json

import pytest

from pytest_cdna2.fixtures import SETTINGS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "golden_prompt" not in metafunc.fixturenames:
        return
    settings = metafunc.config.stash[SETTINGS]
    try:
        manifest = json.loads((settings.goldens / "manifest.json").read_text())
        names = [p["name"] for p in manifest["prompts"]]
    except (OSError, ValueError, KeyError, TypeError):
        names = ["(goldens unreadable)"]  # the cdna2_golden fixture then fails with the reason
    metafunc.parametrize("golden_prompt", names)
