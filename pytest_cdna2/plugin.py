"""pytest-cdna2 plugin: options, markers, header, perf gating and the per-tier summary.

Options live in the ``cdna2`` group of ``pytest --help``; each also reads from an ini key of the same name
with underscores (``cdna2_device = 0`` in ``[tool.pytest.ini_options]``); the command line wins. Ini paths
are relative to the ini file, command-line paths to the current directory.

Perf gating (``report.PerfGate``): perf-marked tests are sorted last, after any other plugin's reordering, and
skipped, with the reason, unless the whole correctness suite passed in the same session: no test failed and no
file failed to collect, nothing was deselected or picked by node id (``file.py::test``), and each required tier
(weight, kernel, token, determinism, isa; with your own engine weight, token and determinism, since the kernel
and isa tiers check the bundled engine's ops) had passing tests. Tiers are read from markers only. On the CPU
perf is skipped. Under xdist the session is split over workers, so no worker can know that everything passed:
perf tests are skipped there with a reason saying to run them without ``-n``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_cdna2 import devices
from pytest_cdna2.engines import ENGINE_SPEC
from pytest_cdna2.fixtures import (  # noqa: F401  (fixtures are registered by being names of this module)
    REGENERATED,
    SETTINGS,
    Settings,
    cdna2_device,
    cdna2_devices,
    cdna2_engine,
    cdna2_golden,
    cdna2_record,
    cdna2_settings,
    cdna2_tolerance,
    store_model_mismatch,
)
from pytest_cdna2.goldens import BUNDLED_GOLDENS, GoldenError, read_manifest
from pytest_cdna2.report import TIERS, PerfGate, TierTally, tiers_of
from pytest_cdna2.tolerance import ToleranceError, load_profile

__all__ = ["BUNDLED", "DEFAULT_MODEL", "DEFAULT_GOLDENS", "MARKERS", "TIERS", "resolve_settings"]

BUNDLED = Path(__file__).resolve().parent.parent / "goldens" / "tiny-v4"
DEFAULT_MODEL = BUNDLED / "model"
DEFAULT_GOLDENS = BUNDLED_GOLDENS
BACKENDS = ("reference", "triton")
DTYPES = ("float32", "bfloat16", "float64")
MARKERS = {
    "weight": "weight tier: packed FP8/FP4 tensors decode identically in the engine and independent decoders",
    "kernel": "kernel tier: each op of the backend against float64 on random inputs",
    "token": "token tier: teacher-forced logits and greedy continuations against the goldens",
    "determinism": "determinism tier: repeat, batch, incremental and device-vs-device agreement",
    "isa": "isa tier: kernels compile for gfx90a and sm_90 without spills or LDS overflow",
    "perf": "perf tier: benchmarks, run only after every other test of the session passed",
}
_GATE = pytest.StashKey[PerfGate]()
_TALLY = pytest.StashKey[TierTally]()

# (option, ini type, metavar, help); each metavar is what README's option table shows
_OPTIONS = [
    ("device", "string", "cpu|N|N,M|all", "device(s): cpu, N (or cuda:N), N,M or all (default: first GPU, else "
     "cpu); xdist pins worker gwK to the K-th mod count"),
    ("model", "string", "DIR", "checkpoint folder holding config.json, official DeepSeek-V4 layout (default: the "
     "bundled tiny-v4)"),
    ("goldens", "string", "DIR", "golden store folder (default: the bundled tiny-v4 goldens)"),
    ("backend", "string", "reference|triton", "engine backend (default: reference)"),
    ("dtype", "string", "float32|bfloat16|float64", "activation dtype (default: float32 on the CPU, bfloat16 on a "
     "GPU); picks the matching derived tolerance profile"),
    ("tolerance", "string", "FILE", "tolerance profile TOML; its keys override the bundled profile for the dtype"),
    ("engine", "string", "bundled|module:factory", "bundled, or your own engine: factory(path, device=, backend=[, "
     "dtype=])"),
    ("regen-goldens", "bool", None, "rebuild the golden store named by --cdna2-goldens (required with it) with the "
     "float64 reference; fails the run that does it"),
    ("perf-on-cpu", "bool", None, "let perf tests run on the CPU (to exercise the gating; numbers mean nothing)"),
]
_KIND = {name: kind for name, kind, _, _ in _OPTIONS}
# what an empty value should have been (the device's own parser says it for --cdna2-device)
_EXPECTED = {"model": "a checkpoint folder (DIR)", "goldens": "a golden store folder (DIR)",
             "backend": f"one of {', '.join(BACKENDS)}", "dtype": f"one of {', '.join(DTYPES)}",
             "tolerance": "a tolerance profile (FILE)", "engine": "bundled or module:factory"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cdna2", "DeepSeek-V4 FP4/FP8 conformance (pytest-cdna2)")
    for name, kind, metavar, help_ in _OPTIONS:
        dest = "cdna2_" + name.replace("-", "_")
        if kind == "bool":
            group.addoption(f"--cdna2-{name}", action="store_true", default=None, dest=dest, help=help_)
        else:
            group.addoption(f"--cdna2-{name}", action="store", default=None, dest=dest, metavar=metavar,
                            help=help_)
        parser.addini(dest, help_, type=kind, default=False if kind == "bool" else None)


def _raw(config: pytest.Config, name: str) -> tuple[object, str]:
    """(value, source): the command line wins over the ini file; source is "cli", "ini" or "default". An empty
    string stays empty (it is an error, not the default)."""
    dest = "cdna2_" + name.replace("-", "_")
    value = config.getoption(dest)
    if value is not None:  # stripped as ini values are (a quoted "reference " was refused with an unseen space)
        return (value.strip() if isinstance(value, str) else value), "cli"
    try:
        ini = config.getini(dest)
    except (ValueError, pytest.UsageError) as e:  # pytest's message does not say what the key takes
        hint = "expected true or false" if _KIND[name] == "bool" else f'expected a string: {dest} = "VALUE"'
        raise pytest.UsageError(f"ini key {dest}: {e}; {hint}") from None
    if ini is None or ini is False:
        return None, "default"
    if _KIND[name] != "bool" and not isinstance(ini, str):  # a TOML list or number (pytest warns and passes it)
        raise pytest.UsageError(f'ini key {dest} in {config.inipath}: expected a string: {dest} = "VALUE", got '
                                f"{ini!r}")
    return (ini.strip() if isinstance(ini, str) else ini), "ini"  # `-o "key= value"` keeps the space


def _opt(config: pytest.Config, name: str) -> tuple[object, str]:
    """:func:`_raw`, refusing an empty value (``--cdna2-backend=``, ``cdna2_model =``): it must not quietly mean
    the default or the current folder."""
    value, source = _raw(config, name)
    if name in _EXPECTED and isinstance(value, str) and not value.strip():
        raise pytest.UsageError(f"--cdna2-{name}='': empty: expected {_EXPECTED[name]}, or leave it out for the "
                                "default")
    return value, source


def _path(config: pytest.Config, value: object, source: str) -> Path:
    p = Path(str(value)).expanduser()
    if not p.is_absolute():
        base = config.inipath.parent if source == "ini" and config.inipath else config.invocation_params.dir
        p = base / p
    return p.resolve()


def resolve_settings(config: pytest.Config) -> Settings:
    """Turn options into :class:`Settings`; any bad value is a ``pytest.UsageError`` naming where it was set
    (the option, or the ini key and file)."""
    try:
        return _resolve(config)
    except pytest.UsageError as e:
        m = re.match(r"--cdna2-([a-z-]+)", str(e))
        if not m or _raw(config, m.group(1))[1] != "ini":
            raise
        rest = str(e)[m.end():]  # "=VALUE: why", ": why" or " needs ..."
        key = "cdna2_" + m.group(1).replace("-", "_")
        overrides = [o for o in (config.getoption("override_ini", None) or []) if o.split("=", 1)[0].strip() == key]
        if overrides:  # `-o key=value` on the command line, not the ini file
            why = rest.partition(": ")[2] if rest.startswith("=") else rest.removeprefix(": ")
            raise pytest.UsageError(f"-o {overrides[-1]}: {why}") from None
        where = "ini key " + key
        if rest.startswith("="):
            value, _, why = rest[1:].partition(": ")
            where, rest = f"{where} = {value}", f": {why}"
        raise pytest.UsageError(f"{where} in {config.inipath}{rest}") from None


def _unknown_keys(config: pytest.Config) -> None:
    """A misspelt cdna2_* ini key (or -o key) is a usage error naming the closest one: pytest only warns, and the
    run went on with the default it meant to change (the first GPU instead of the CPU, say)."""
    import difflib

    known = sorted("cdna2_" + name.replace("-", "_") for name, *_ in _OPTIONS)
    given = [(o.split("=", 1)[0].strip(), f"-o {o}") for o in (config.getoption("override_ini", None) or [])]
    unknown = set(getattr(config, "_get_unknown_ini_keys", lambda: [])())  # pytest's warning's list (no public API)
    for key, _ in given:  # -o keys: unknown unless some plugin registered them (its cdna2x_* too)
        try:
            config.getini(key)
        except ValueError:
            unknown.add(key)
    given += [(k, f"ini key {k} in {config.inipath}") for k in sorted(unknown) if k not in dict(given)]
    for key, where in given:
        if key.startswith("cdna2") and key not in known and key in unknown:
            close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the keys are {', '.join(known)}"
            raise pytest.UsageError(f"{where}: not a pytest-cdna2 key: {hint}")


def _resolve(config: pytest.Config) -> Settings:
    _unknown_keys(config)
    dev_spec, _ = _opt(config, "device")
    selected = devices.parse_device_spec(None if dev_spec is None else str(dev_spec))
    device = devices.pick_for_worker(selected, devices.worker_index())

    model_v, model_src = _opt(config, "model")
    model = DEFAULT_MODEL if model_v is None else _path(config, model_v, model_src)
    if model_v is not None and not model.exists():
        raise pytest.UsageError(f"--cdna2-model: {model} does not exist")
    if model_v is not None and not model.is_dir():
        raise pytest.UsageError(f"--cdna2-model: {model} is not a folder: pass the checkpoint directory holding "
                                "config.json")
    gold_v, gold_src = _opt(config, "goldens")
    goldens = DEFAULT_GOLDENS if gold_v is None else _path(config, gold_v, gold_src)
    regen = bool(_opt(config, "regen-goldens")[0])
    if gold_v is not None and goldens.exists() and not goldens.is_dir():
        raise pytest.UsageError(f"--cdna2-goldens: {goldens} is a file, not a folder: pass the golden store's folder "
                                "(the one holding manifest.json)")
    if gold_v is not None and not goldens.exists() and not regen:
        raise pytest.UsageError(
            f"--cdna2-goldens: {goldens} does not exist (build it with `cdna2 goldens build` or "
            "--cdna2-regen-goldens)"
        )
    if regen and gold_v is None:
        raise pytest.UsageError(
            "--cdna2-regen-goldens needs --cdna2-goldens: name the store to rewrite (the bundled goldens are "
            "part of the package; rebuild them with `cdna2 goldens build --out DIR`)"
        )
    if regen and goldens == DEFAULT_GOLDENS:
        raise pytest.UsageError(
            f"--cdna2-regen-goldens: {goldens} is the golden store bundled with the package; refusing to rewrite "
            "it: name another folder with --cdna2-goldens"
        )
    distributed = config.getoption("tx", None) and config.getoption("dist", "no") != "no"  # xdist's own test
    if regen and (config.getoption("numprocesses", None) or distributed or hasattr(config, "workerinput")):
        raise pytest.UsageError("--cdna2-regen-goldens cannot run under xdist (-n, --tx): run it in one process")

    backend = str(_opt(config, "backend")[0] or "reference")
    if backend not in BACKENDS:
        raise pytest.UsageError(f"--cdna2-backend={backend}: expected one of {', '.join(BACKENDS)}")
    engine = str(_opt(config, "engine")[0] or "bundled")
    if engine != "bundled" and not ENGINE_SPEC.fullmatch(engine):
        raise pytest.UsageError(f"--cdna2-engine={engine}: expected bundled or module:factory")
    if backend == "triton" and engine == "bundled":
        _need_triton()
    if model_v is not None and engine == "bundled" and not (model / "config.json").is_file():
        raise pytest.UsageError(f"--cdna2-model: {model} has no config.json, so it is not a checkpoint: pass the "
                                "folder holding config.json and the *.safetensors (official DeepSeek-V4 layout)")

    from cdna2_engine.ops import OP_NAMES, split_names  # the kernel tier runs the bundled ops whatever the engine

    unknown = sorted(set(split_names(os.environ.get("CDNA2_REFERENCE_OPS", ""))) - set(OP_NAMES))
    if unknown:
        raise pytest.UsageError(f"env CDNA2_REFERENCE_OPS: unknown op(s) {unknown}: name ops from {list(OP_NAMES)} "
                                "(comma-separated), or unset it")

    dtype = str(_opt(config, "dtype")[0] or ("float32" if device == "cpu" else "bfloat16"))
    if dtype not in DTYPES:
        raise pytest.UsageError(f"--cdna2-dtype={dtype}: expected one of {', '.join(DTYPES)}")
    tol_v, tol_src = _opt(config, "tolerance")
    try:
        profile = load_profile(None if tol_v is None else _path(config, tol_v, tol_src), dtype=dtype)
    except ToleranceError as e:
        raise pytest.UsageError(f"--cdna2-tolerance: {e}") from None
    return Settings(tuple(selected), device, model, model_v is None, goldens, backend, engine, profile, regen,
                    bool(_opt(config, "perf-on-cpu")[0]), dtype, gold_v is None)


# the correctness tiers perf needs: the kernel and isa tiers check the bundled engine's ops and Triton kernels, so
# with your own engine (whose kernel tests skip) they do not apply
REQUIRED_TIERS = ("weight", "kernel", "token", "determinism", "isa")
REQUIRED_TIERS_OWN_ENGINE = ("weight", "token", "determinism")


@pytest.hookimpl(trylast=True)  # registers _PerfLast after the plugins that register theirs in pytest_configure
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    settings = resolve_settings(config)
    config.stash[SETTINGS] = settings
    config.stash[_GATE] = PerfGate(REQUIRED_TIERS if settings.engine == "bundled" else REQUIRED_TIERS_OWN_ENGINE)
    config.stash[_TALLY] = TierTally()
    config.pluginmanager.register(_Recorder(config.stash[_GATE], config.stash[_TALLY]), "cdna2-recorder")
    config.pluginmanager.register(_PerfLast(), "cdna2-perf-last")


def _need_triton() -> None:
    """The bundled engine's triton backend without (a recent enough) Triton: a usage error before any test, not a
    traceback in the first engine test, after the weight tier. The version is read from the module's own
    __init__.py, the files `import triton` would load (a source tree on PYTHONPATH, ROCm's pytorch-triton-rocm),
    without importing it: a C extension imported here and dropped by pytester's module snapshot crashed when
    imported again."""
    import importlib.util

    from cdna2_engine.ops import triton_check

    spec = importlib.util.find_spec("triton")
    found = None
    if spec is not None:
        try:
            m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", Path(spec.origin or "").read_text(
                encoding="utf-8"), re.M)
        except (OSError, UnicodeDecodeError):
            m = None
        if m is None:
            return  # no literal version to read: the engine's own check judges the imported module
        found = m.group(1)
    try:
        triton_check(found)
    except (RuntimeError, ValueError) as e:
        raise pytest.UsageError(f"--cdna2-backend=triton: {e}") from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash[SETTINGS]
    lines = [f"cdna2 device: {devices.describe(d).line()}" for d in s.devices]
    if len(s.devices) > 1:
        lines.append(f"cdna2: xdist workers pinned round-robin over {', '.join(s.devices)}")
    missing = "" if s.model.exists() else " (missing)"
    lines.append(f"cdna2 engine: {s.engine} backend={s.backend} model={s.model}{missing}")
    lines.append(f"cdna2 goldens: {s.goldens}{_recorded_by(s)}  tolerance: {s.tolerance.name} ({s.tolerance.path})")
    if os.environ.get("CDNA2_REFERENCE_OPS", "").strip():
        ops = _reference_ops(s)
        what = (f"runs {', '.join(ops)} on the reference (perf is skipped)" if ops else
                "changes nothing here (it acts on the bundled engine's triton backend)")
        lines.append(f"cdna2 env CDNA2_REFERENCE_OPS: the model {what}; the kernel tier checks every kernel")
    return lines


def _reference_ops(s: Settings) -> tuple[str, ...]:
    """The ops CDNA2_REFERENCE_OPS takes off their kernels for this session's engine (the bundled one's triton
    backend: elsewhere it changes nothing)."""
    from cdna2_engine.ops import split_names

    if s.engine != "bundled" or s.backend != "triton":
        return ()
    return tuple(split_names(os.environ.get("CDNA2_REFERENCE_OPS", "")))


def _recorded_by(s: Settings) -> str:
    """' (recorded by ENGINE in DTYPE)' from the store's manifest, and a warning when that engine is the one under
    test: goldens an engine made check it only against itself."""
    try:
        manifest = read_manifest(s.goldens)
        engine, dtype = str(manifest["versions"]["engine"]).split()[0], manifest["dtype"]
    except (GoldenError, KeyError, TypeError, IndexError, AttributeError):
        return ""
    if engine == "cdna2_engine":  # the bundled engine (its faults' loader too): the same backend and dtype only
        same = s.engine == "bundled" and (dtype, manifest.get("backend")) == (s.dtype, s.backend)
    else:
        same = s.engine.split(":")[0].split(".")[0] == engine
    return f" (recorded by {engine} in {dtype}{': the engine under test, judged against itself' if same else ''})"


def _is_perf(item: pytest.Item) -> bool:
    return item.get_closest_marker("perf") is not None


class _PerfLast:
    """Sorts weight-tier tests first and perf tests last (stable) after every other plugin's reordering (--ff,
    --nf, random orders): those wrap pytest_collection_modifyitems too, and a tryfirst wrapper registered after
    theirs is the outermost, so this sort runs last. Weight first, unless --ff or --nf put the tests to rerun
    first: a broken checkpoint stops the run in its reader's line before any engine loads it (V4-Flash: minutes,
    and ~160 GB). pytest_runtest_setup still refuses a perf test that some correctness test follows."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
        result = yield
        rerun_first = config.getoption("failedfirst", False) or config.getoption("newfirst", False)
        items.sort(key=lambda item: (_is_perf(item), not rerun_first and item.get_closest_marker("weight") is None))
        return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """Tag each report with the test's tier markers: reports carry keywords (folder names, parametrize ids), not
    markers, and the tag travels with the report from xdist workers."""
    report = yield
    report.cdna2_tiers = tiers_of(item)
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _is_perf(item):
        return
    s = item.config.stash[SETTINGS]
    gate = item.config.stash[_GATE]
    pending = [i.nodeid for i in item.session.items if not _is_perf(i) and i.nodeid not in gate.finished]
    reason = gate.skip_reason(device=s.device, xdist_worker=hasattr(item.config, "workerinput"),
                              perf_on_cpu=s.perf_on_cpu, pending=pending, reference_ops=_reference_ops(s))
    if reason:
        raise pytest.skip.Exception(reason, _use_item_location=True)  # -rs shows the test, not this line


class _Recorder:
    """Registered per session: sees every test and collection report (under xdist, the workers' too, in the
    controller) and every deselection."""

    def __init__(self, gate: PerfGate, tally: TierTally) -> None:
        self.gate, self.tally = gate, tally

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.gate.record(report)
        self.tally.add(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.gate.record_collect(report)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.gate.deselected += sum(not _is_perf(i) for i in items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.gate.picked = _picked_by_node_id(session)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Goldens recorded from another model stop the run before its first test when a selected test reads them
    (under xdist the cdna2_golden fixture stops it instead: workers collect, the controller does not)."""
    s = session.config.stash[SETTINGS]
    if s.regen or hasattr(session.config, "workerinput") or session.config.getoption("collectonly", False):
        return
    if any("cdna2_golden" in getattr(i, "fixturenames", ()) for i in session.items):
        problem = store_model_mismatch(s)
        if problem:
            raise pytest.UsageError(problem)


def _picked_by_node_id(session: pytest.Session) -> list[str]:
    """The command-line arguments naming tests (``file.py::test``, ``file.py::Class``) that selected correctness
    tests: pytest collects only the named tests and deselects nothing, so a few picked tests would otherwise pass
    for the suite. A perf test named by node id beside whole correctness files is no such pick; an argument whose
    file cannot be found (``--pyargs``) counts as one, and one whose file or a folder above it is also given whole
    does not (pytest then collects the whole file)."""
    config = session.config
    whole = [(config.invocation_params.dir / a).resolve() for a in config.args if "::" not in a]
    tests: dict[Path, list[list[str]]] = {}
    for i in session.items:
        if not _is_perf(i):
            tests.setdefault(Path(i.path).resolve(), []).append(i.nodeid.split("::")[1:])

    def names(arg: list[str], parts: list[str]) -> bool:  # `test_x` names every parametrization test_x[...]
        return len(parts) >= len(arg) and all(a in (p, p.split("[")[0]) for a, p in zip(arg, parts[:len(arg)],
                                                                                           strict=True))

    picked = []
    for arg in config.args:
        if "::" not in arg:
            continue
        file, *arg_parts = arg.split("::")
        path = (config.invocation_params.dir / file).resolve()
        if any(path == w or w in path.parents for w in whole):
            continue
        if not path.exists() or any(names(arg_parts, parts) for parts in tests.get(path, ())):
            picked.append(arg)
    return picked


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that regenerated goldens fails, and so does one asked to that selected no test reading them."""
    asked = session.config.stash[SETTINGS].regen if SETTINGS in session.config.stash else False
    asked = asked and not session.config.option.collectonly  # --co runs nothing, so it rewrites nothing either
    if (asked or REGENERATED in session.config.stash) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash[_TALLY].lines()
    regenerated = config.stash.get(REGENERATED, None)
    unused = config.stash[SETTINGS].regen and not regenerated and not config.option.collectonly
    if not lines and not regenerated and not unused:
        return
    terminalreporter.section("cdna2 summary")
    for line in lines:
        terminalreporter.write_line(line)
    if regenerated:
        terminalreporter.write_line(
            f"goldens were rewritten at {regenerated}: the run fails; rerun without --cdna2-regen-goldens",
            red=True,
        )
    elif unused:
        terminalreporter.write_line(
            "--cdna2-regen-goldens rewrote nothing: no selected test reads the goldens (select the token tier, "
            "-m token, and no -k that drops its tests: with no store yet, their one id is '(goldens to rebuild)'); "
            "the run fails",
            red=True,
        )

