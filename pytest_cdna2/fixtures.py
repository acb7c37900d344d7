"""The suite's fixtures: device, engine, goldens, tolerance profile, metric recording.

Thin on purpose: each resolves the session's :class:`Settings` (made by the plugin from the options) and
hands the real work to ``devices``, ``goldens``, ``tolerance`` and ``report``. Setup problems that make
every later test meaningless (no model, a corrupt golden) fail the test that met them and stop the session.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

from pytest_cdna2 import report
from pytest_cdna2.engines import check_engine, resolve_factory, takes_dtype
from pytest_cdna2.goldens import (
    DEFAULT_PROMPTS,
    MANIFEST,
    GoldenError,
    GoldenStore,
    build_goldens,
    model_identity,
    read_manifest,
)
from pytest_cdna2.tolerance import Profile

__all__ = [
    "Settings",
    "SETTINGS",
    "regenerate_goldens",
    "cdna2_settings",
    "cdna2_device",
    "cdna2_devices",
    "cdna2_engine",
    "cdna2_golden",
    "cdna2_tolerance",
    "cdna2_record",
]


@dataclass(frozen=True)
class Settings:
    """What the options resolved to for this session (or this xdist worker)."""

    devices: tuple[str, ...]  # every selected device
    device: str  # this process's device (an xdist worker's pin)
    model: Path
    model_is_default: bool
    goldens: Path
    backend: str
    engine: str  # "bundled" or "module:factory"
    tolerance: Profile
    regen: bool
    perf_on_cpu: bool
    dtype: str = "float32"  # the engine's activation dtype (passed to factories that take `dtype`)
    goldens_is_default: bool = False


# the wheel carries only the packages and their TOML profiles: goldens/ (model and goldens, 13 MB) does not ship
_SOURCE_ONLY = "only with a source checkout (git clone, then `pip install -e .`), not in the wheel"
SETTINGS = pytest.StashKey[Settings]()
REGENERATED = pytest.StashKey[str]()


def _settings(config: pytest.Config) -> Settings:
    return config.stash[SETTINGS]


def _stop(request: pytest.FixtureRequest, message: str) -> NoReturn:
    """Fail this setup with a one-line message and stop the session after it."""
    request.session.shouldstop = message
    raise pytest.fail.Exception(message, pytrace=False) from None  # called in `except`: no chained repeat


def _as_text(entry: dict) -> bytes | list[int]:
    """An old manifest's prompt as build_goldens takes it: its text where that encodes to its tokens (byte-level
    ids), else the token ids (a tokenizer made them; the text would be lost either way)."""
    tokens, text = list(entry["tokens"]), entry.get("text")
    if isinstance(text, str) and text and list(text.encode("utf-8")) == tokens:
        return text.encode("utf-8")
    return tokens


def regenerate_goldens(settings: Settings) -> GoldenStore:
    """Rebuild the goldens with the float64 reference on the CPU, keeping the old prompts and steps."""
    prompts: list[bytes | list[int]] = list(DEFAULT_PROMPTS)
    steps: int | list[int] = 32
    tap_prompts = 4  # a new store: taps for the first 4 prompts, as `cdna2 goldens build`
    manifest = settings.goldens / MANIFEST
    if manifest.exists():  # unverified on purpose: only its prompts and steps are reused
        try:
            old = json.loads(manifest.read_text(encoding="utf-8"))
            # token ids (any vocabulary), or the text where it gives those ids, so the manifest keeps it
            prompts = [_as_text(p) for p in old["prompts"]] or prompts
            steps = old.get("steps", steps)
            steps = [int(n) for n in steps] if isinstance(steps, list) else int(steps)
            tap_prompts = old.get("tap_prompts")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GoldenError(f"{manifest}: cannot reuse its prompts ({type(e).__name__}: {e}); remove the "
                              "folder to rebuild with the default prompts") from None
    import cdna2_engine  # the goldens are the bundled float64 reference's, whatever engine is under test

    model = cdna2_engine.load_model(settings.model, device="cpu", backend="reference", dtype=torch.float64)
    # recorded as `cdna2 goldens build` records it: float64 reference outputs do not depend on the run's profile
    return build_goldens(settings.model, settings.goldens, prompts, steps, model=model, regen=True,
                         tap_prompts=tap_prompts, progress=False)


@pytest.fixture(scope="session")
def cdna2_settings(pytestconfig: pytest.Config) -> Settings:
    """The resolved ``--cdna2-*`` options.

    Example::

        def test_backend(cdna2_settings):
            assert cdna2_settings.backend in ("reference", "triton")
    """
    return _settings(pytestconfig)


@pytest.fixture(scope="session")
def cdna2_device(pytestconfig: pytest.Config) -> torch.device:
    """This session's device (under xdist: this worker's pinned GCD).

    Example::

        def test_matmul(cdna2_device):
            x = torch.randn(64, 64, device=cdna2_device)
    """
    device = torch.device(_settings(pytestconfig).device)
    if device.type == "cuda":  # pin: kernels launched on "cuda" without an index land on this GCD too
        torch.cuda.set_device(device)
    return device


@pytest.fixture(scope="session")
def cdna2_devices(pytestconfig: pytest.Config) -> list[torch.device]:
    """Every device ``--cdna2-device`` selected, for device-vs-device checks.

    Example::

        def test_gcds_agree(cdna2_devices):
            if len(cdna2_devices) < 2:
                pytest.skip("needs --cdna2-device=N,M")
    """
    return [torch.device(d) for d in _settings(pytestconfig).devices]


@pytest.fixture(scope="session")
def cdna2_tolerance(pytestconfig: pytest.Config) -> Profile:
    """The tolerance profile (bundled default, overridden by ``--cdna2-tolerance=FILE``).

    Example::

        def test_logits(cdna2_tolerance, ...):
            assert_logits_close(out, ref, limits=cdna2_tolerance.token, what="prompt p00")
    """
    return _settings(pytestconfig).tolerance


@pytest.fixture(scope="session")
def cdna2_engine(request: pytest.FixtureRequest) -> Any:
    """The model under test, loaded once per session on :func:`cdna2_device` with ``--cdna2-backend``.

    Example::

        def test_prefill(cdna2_engine):
            logits = cdna2_engine.forward(torch.tensor([[104, 105]], device=cdna2_engine.device))
    """
    s = _settings(request.config)
    request.getfixturevalue("cdna2_device")  # pins the GPU first
    if not s.model.exists():
        hint = f"the bundled model ships {_SOURCE_ONLY}; " if s.model_is_default else ""
        _stop(request, f"cdna2: model not found at {s.model}: {hint}pass --cdna2-model=DIR")
    try:
        factory = resolve_factory(s.engine)
    except LookupError as e:
        _stop(request, f"cdna2: {e}")
    try:
        model = factory(str(s.model), device=s.device, backend=s.backend,
                        **({"dtype": s.dtype} if takes_dtype(factory) else {}))
    except Exception as e:  # keep the traceback for the engine's author, but stop: nothing can pass now
        ours = s.engine == "bundled" or s.engine.startswith("cdna2_engine.")  # the bundled engine or its faults
        if ours and isinstance(e, ValueError):  # CheckpointError, ConfigError, a bad CDNA2_FAULT: one line that
            _stop(request, f"cdna2: {e}")  # names the file or setting and the fix
        request.session.shouldstop = f"cdna2: loading {s.model} ({s.engine}) failed: {type(e).__name__}: {e}"
        raise
    try:
        check_engine(model, f"--cdna2-engine={s.engine}", device=s.device)
    except ValueError as e:
        _stop(request, f"cdna2: {e}")
    runs = str(getattr(model, "dtype", s.dtype)).removeprefix("torch.")
    if not takes_dtype(factory) and runs != s.dtype:  # the limits are the session dtype's profile
        from pytest_cdna2.plugin import DTYPES

        fix = f"pass --cdna2-dtype={runs}" if runs in DTYPES else (
            f"no profile is derived for {runs}: let the factory take dtype=, or pass --cdna2-tolerance=FILE with "
            "limits for it")
        _stop(request, f"cdna2: --cdna2-engine={s.engine} runs in {runs} (its .dtype; the factory takes no dtype) "
                       f"and the tolerance profile is {s.dtype}'s: {fix}")
    return model


@pytest.fixture(scope="session")
def cdna2_golden(request: pytest.FixtureRequest) -> GoldenStore:
    """The golden store, every checksum verified and checked against the model under test; lazy tensors.

    With ``--cdna2-regen-goldens`` it is rebuilt first and the test fails (rerun without the flag).

    Example::

        def test_p00(cdna2_engine, cdna2_golden, cdna2_tolerance):
            ids = cdna2_golden.input_ids("p00")[None]
            assert_logits_close(cdna2_engine.forward(ids)[0], cdna2_golden.teacher_logits("p00"),
                                limits=cdna2_tolerance.token, what="prompt p00")
    """
    s = _settings(request.config)
    if s.regen:
        try:
            store = regenerate_goldens(s)
        except (GoldenError, OSError, LookupError, ValueError) as e:  # ValueError: CheckpointError, ConfigError
            _stop(request, f"cdna2: regenerating goldens (bundled float64 reference) failed: {e}")
        request.config.stash[REGENERATED] = str(store.path)
        pytest.fail(
            f"cdna2: goldens were rewritten at {store.path} ({len(store.prompts)} prompts, "
            f"{store.steps_text} steps); this run fails on purpose: rerun without --cdna2-regen-goldens",
            pytrace=False,
        )
    if s.goldens_is_default and not s.goldens.exists():
        _stop(request, f"cdna2: golden store not found at {s.goldens}: the bundled goldens ship {_SOURCE_ONLY}; pass "
                       "--cdna2-goldens=DIR")
    mismatch = store_model_mismatch(s)
    if mismatch:
        _stop(request, mismatch)
    model = request.getfixturevalue("cdna2_engine")
    try:
        sha, config = model_identity(model, s.model)
        return GoldenStore.open(s.goldens, expected_model_sha256=sha, config=config)
    except (GoldenError, ValueError) as e:  # ValueError: a ConfigError of the folder's config.json
        _stop(request, f"cdna2: {e}")


def store_model_mismatch(s: Settings) -> str | None:
    """The store's manifest against --cdna2-model's config.json (vocab size, layers), two small files read at
    collection (plugin) and again before the store's full open: goldens of another model (the bundled tiny
    model's, when only --cdna2-model was given) otherwise showed only after the tiers before the token tier, an
    engine load and a sha256 of the whole checkpoint, or, for an engine without checkpoint_sha256, as a shape
    error in every token test. None when they agree or cannot be read here (the full open names what is wrong)."""
    try:
        manifest = read_manifest(s.goldens)
        cfg = json.loads((s.model / "config.json").read_text(encoding="utf-8"))
        have = (int(manifest["vocab_size"]), int(manifest["num_hidden_layers"]))
        want = (int(cfg["vocab_size"]), int(cfg["num_hidden_layers"]))
    except (GoldenError, OSError, ValueError, KeyError, TypeError):
        return None
    if have == want:
        return None
    which = "the bundled goldens (the bundled tiny model's)" if s.goldens_is_default else f"goldens at {s.goldens}"
    return (f"cdna2: {which} were recorded from a model with vocab_size {have[0]} and {have[1]} layers, but "
            f"--cdna2-model {s.model} has vocab_size {want[0]} and {want[1]} layers: pass --cdna2-goldens DIR with "
            f"goldens built for it (`cdna2 goldens build --model {s.model} --out DIR`)")


@pytest.fixture
def cdna2_record(request: pytest.FixtureRequest) -> Iterator[Callable[..., bool]]:
    """Record a metric against its limit for the summary, JUnit XML and Allure (a CSV attachment).

    The recorder returns whether the value is within its limit; it does not fail the test by itself.

    Example::

        def test_kl(cdna2_record, cdna2_tolerance):
            m = logit_metrics(out, ref)
            cdna2_record("kl_max", m.kl_max, cdna2_tolerance.token.kl_max, what="prompt p00")
            cdna2_record("top1", m.top1_agreement, 1.0, higher_is_better=True)
    """

    def record(
        metric: str, value: float, limit: float, *, higher_is_better: bool = False, what: str = ""
    ) -> bool:
        return report.record_metric(request.node, metric, value, limit, higher_is_better=higher_is_better,
                                    what=what)

    yield record
    report.attach_to_allure(request.node)
