"""Perf gating and the per-tier terminal summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_plugin_fake_engine import FAST
from test_plugin_fake_engine import run_inprocess as run

TESTS = """
import pytest

@pytest.mark.perf
def test_bench():
    print("PERF RAN")

@pytest.mark.token
@pytest.mark.parametrize("ok", [True, {ok2}])
def test_tokens(ok, cdna2_record):
    cdna2_record("kl_max", 1e-4 if ok else 2e-2, 1e-3, what="prompt p00")
    cdna2_record("top1", 1.0 if ok else 0.5, 1.0, higher_is_better=True)
    assert ok

@pytest.mark.kernel
def test_kernel(cdna2_record):
    cdna2_record("rel_fro", 3e-6, 1e-5)

@pytest.mark.weight
def test_weight():
    pass

@pytest.mark.determinism
def test_determinism():
    pass

@pytest.mark.isa
def test_isa():
    pass

def test_untiered():
    pass
"""


def test_perf_runs_last_when_everything_passed(pytester):
    pytester.makepyfile(TESTS.format(ok2=True))
    r = run(pytester, "--cdna2-perf-on-cpu", "-v", "-s")
    r.assert_outcomes(passed=8)
    lines = [line for line in r.outlines if "::" in line and ("PASSED" in line or "PERF RAN" in line)]
    assert "test_bench" in lines[-1]  # defined first in the file, run last


def test_weight_tier_runs_first(pytester):
    """Defined fourth in the file, the weight test runs first: a broken checkpoint stops the run before the
    token tier loads an engine from it."""
    pytester.makepyfile(TESTS.format(ok2=True))
    r = run(pytester, "--cdna2-perf-on-cpu", "-v")
    ran = [line.split("::")[1].split()[0] for line in r.outlines if "::" in line and " PASSED" in line]
    assert ran[0] == "test_weight" and ran[1:3] == ["test_tokens[True0]", "test_tokens[True1]"], ran


def test_ff_keeps_the_failed_test_first(pytester):
    """--ff (and --nf) put the tests to rerun first; the weight-first sort leaves that order alone."""
    pytester.makepyfile(TESTS.format(ok2=False))
    run(pytester, "--cdna2-perf-on-cpu")  # test_tokens[False] fails: the cache records it
    r = run(pytester, "--cdna2-perf-on-cpu", "--ff", "-v")
    ran = [line.split("::")[1].split()[0] for line in r.outlines if "::" in line and ("PASSED" in line or
                                                                                      "FAILED" in line)]
    assert ran[0] == "test_tokens[False]" and "test_weight" in ran[1:], ran


def test_perf_skipped_naming_the_failed_tests(pytester):
    pytester.makepyfile(TESTS.format(ok2=False))
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(passed=6, failed=1, skipped=1)
    r.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] *cdna2 perf: skipped because 1 correctness test(s) failed: "
        "test_perf_skipped_naming_the_failed_tests.py::test_tokens[[]False[]]"
    ])
    assert "PERF RAN" not in r.stdout.str()


def test_perf_alone_is_not_gated_by_nothing(pytester):
    """`-m perf` deselects the correctness tiers: perf must not run ungated."""
    pytester.makepyfile(TESTS.format(ok2=True))
    r = run(pytester, "--cdna2-perf-on-cpu", "-m", "perf", "-rs")
    r.assert_outcomes(skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: 7 correctness test(s) deselected (-k, -m, --lf, --sw); no passing weight, "
                            "kernel, token, determinism, isa test in this session: perf runs only after the whole "
                            "suite passed in the same run*"])
    assert "PERF RAN" not in r.stdout.str()


@pytest.mark.parametrize("disabled", [False, True])
def test_suite_perf_tests_pass_with_benchmarks_disabled(pytester, monkeypatch, disabled):
    """suite/test_perf.py under pytest-benchmark's --benchmark-disable (often in addopts): each runs once, untimed,
    and passes (its reading of the median crashed both on a green suite). Timed, each records tokens per second."""
    tiers = TESTS.format(ok2=True).replace('@pytest.mark.perf\ndef test_bench():\n    print("PERF RAN")\n', "")
    pytester.makepyfile(test_tiers=tiers, test_perf=(Path(__file__).parents[1] / "suite" / "test_perf.py").read_text())
    pytester.makeconftest("""
        import pytest, torch, types

        class Engine:
            config, device, calls = types.SimpleNamespace(vocab_size=11), torch.device("cpu"), []
            def generate(self, ids, n):
                self.calls.append(("generate", ids.shape, n))
            def forward(self, ids):
                self.calls.append(("forward", ids.shape))

        @pytest.fixture(scope="session")
        def cdna2_engine():
            return Engine()

        def pytest_sessionfinish(session):
            print("CALLS", len(Engine.calls))
    """)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # in an xdist worker pytest-benchmark disables itself
    args = ["-p", "no:hypothesispytest", "--cdna2-device=cpu", "--cdna2-perf-on-cpu", "-s", "--benchmark-json=b.json"]
    r = pytester.runpytest_inprocess(*args, *(["--benchmark-disable"] if disabled else []))
    r.assert_outcomes(passed=9)
    r.stdout.fnmatch_lines(["*CALLS 2" if disabled else "*CALLS 22"])  # once each, or 1 warm-up + 10 rounds each
    if not disabled:
        import json

        info = [b["extra_info"] for b in json.loads((pytester.path / "b.json").read_text())["benchmarks"]]
        assert sorted(k for i in info for k in i) == ["tokens_per_s", "tokens_per_s_incl_prefill"]


def test_perf_skipped_on_cpu(pytester):
    pytester.makepyfile(TESTS.format(ok2=True))
    r = run(pytester, "--cdna2-device=cpu", "-rs")
    r.assert_outcomes(passed=7, skipped=1)
    r.stdout.fnmatch_lines([
        "SKIPPED [[]1[]] test_perf_skipped_on_cpu.py:*: cdna2 perf: the device is the CPU; perf numbers need a GPU "
        "(--cdna2-device=N)"
    ])


def test_a_setup_error_also_gates_perf(pytester):
    pytester.makepyfile(
        """
        import pytest
        @pytest.fixture
        def broken():
            raise RuntimeError("no")
        def test_needs(broken):
            pass
        @pytest.mark.perf
        def test_bench():
            pass
        """
    )
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(errors=1, skipped=1)
    r.stdout.fnmatch_lines(["*correctness test(s) failed: test_a_setup_error_also_gates_perf.py::test_needs; no "
                            "passing weight, kernel, token, determinism, isa test in this session*"])


def test_tiers_come_from_markers_not_keywords(pytester):
    """A folder named perf/ and parametrize ids "kernel"/"perf" are keywords, not tiers: an unmarked failing test
    in perf/ still blocks perf, and a test with the id "kernel" is not a passing kernel test."""
    pytester.makepyfile(TESTS.format(ok2=True).replace("@pytest.mark.kernel\n", ""))
    pytester.mkpydir("perf")
    (pytester.path / "perf" / "test_in_perf_folder.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('x', ['kernel', 'perf'])\n"
        "def test_named(x):\n    assert x != 'perf'\n"
    )
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(passed=8, failed=1, skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: skipped because 1 correctness test(s) failed: "
                            "perf/test_in_perf_folder.py::test_named[[]perf[]]; no passing kernel test in this "
                            "session*"])
    (pytester.path / "perf" / "test_in_perf_folder.py").write_text(
        "import pytest\n@pytest.mark.parametrize('x', ['kernel'])\ndef test_named(x):\n    pass\n")
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(passed=8, skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: no passing kernel test in this session*"])


def test_a_collection_error_gates_perf(pytester):
    """With --continue-on-collection-errors the tests of a broken module never run: perf must not either."""
    pytester.makepyfile(TESTS.format(ok2=True))
    pytester.makepyfile(test_broken="import pytest\npytestmark = pytest.mark.token\nraise ImportError('broken')\n")
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", "--continue-on-collection-errors")
    r.assert_outcomes(passed=7, skipped=1, errors=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: skipped because 1 collection error(s) hid tests: test_broken.py*"])
    assert "PERF RAN" not in r.stdout.str()


def test_a_selection_of_correctness_tests_does_not_open_the_gate(pytester):
    """One passing test per tier picked with -k is not the suite: any deselected correctness test keeps perf
    skipped, and every required tier (determinism and isa too) needs a passing test."""
    pytester.makepyfile(TESTS.format(ok2=True))
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", "-k", "weight or kernel or tokens or bench or isa")
    r.assert_outcomes(passed=5, skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: 2 correctness test(s) deselected (-k, -m, --lf, --sw); no passing "
                            "determinism test in this session*"])
    pytester.makepyfile(TESTS.format(ok2=True).replace("@pytest.mark.isa\n", ""))
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(passed=7, skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: no passing isa test in this session*"])


def test_correctness_tests_picked_by_node_id_do_not_open_the_gate(pytester):
    """`pytest file.py::test_a file.py::test_b ...` collects only the named tests: nothing is deselected, so one
    passing test per tier picked by node id opened the gate like -k would have. Whole files still do, and a perf
    test picked by node id beside them."""
    pytester.makepyfile(TESTS.format(ok2=True))
    name = "test_correctness_tests_picked_by_node_id_do_not_open_the_gate.py"
    picks = [f"{name}::{t}" for t in ("test_weight", "test_kernel", "test_tokens", "test_determinism", "test_isa",
                                      "test_bench")]
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", *picks)
    r.assert_outcomes(passed=6, skipped=1)
    r.stdout.fnmatch_lines([f"*cdna2 perf: correctness tests picked by node id ({name}::test_weight, "
                            f"{name}::test_kernel, {name}::test_tokens, {name}::test_determinism, {name}::test_isa), "
                            "not whole files: perf runs only after the whole suite passed*"])
    assert "PERF RAN" not in r.stdout.str()
    perf = pytester.makepyfile(test_bench_only="import pytest\n@pytest.mark.perf\ndef test_alone():\n    pass\n")
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", name, f"{perf.name}::test_alone")
    r.assert_outcomes(passed=9)
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", f"{name}::test_weight", name)  # the file whole as well
    r.assert_outcomes(passed=8)
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", f"{name}::test_weight", ".")  # a folder above it
    r.assert_outcomes(passed=9)


def test_the_skip_reason_lists_everything_that_is_missing(pytester):
    """README: "A skipped perf test's reason lists everything that is missing". `-m perf` on the CPU said only
    that the device is the CPU, and a failed test hid the deselections: fixing the one named left the next."""
    pytester.makepyfile(TESTS.format(ok2=False))
    r = run(pytester, "-rs", "-m", "perf or token")
    r.assert_outcomes(passed=1, failed=1, skipped=1)
    r.stdout.fnmatch_lines(["SKIPPED *cdna2 perf: skipped because 1 correctness test(s) failed: "
                            "*::test_tokens[[]False[]]; the device is the CPU; perf numbers need a GPU "
                            "(--cdna2-device=N); 5 correctness test(s) deselected (-k, -m, --lf, --sw); no passing "
                            "weight, kernel, determinism, isa test in this session: perf runs only after the whole "
                            "suite passed in the same run*"])


def test_your_own_engine_needs_no_kernel_or_isa_tier(pytester):
    """The kernel tier skips for your engine (it checks the bundled engine's ops) and the isa tier compiles the
    bundled kernels: perf then needs weight, token and determinism only."""
    pytester.makepyfile(TESTS.format(ok2=True).replace("@pytest.mark.kernel\n", "").replace("@pytest.mark.isa\n", ""))
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs", "--cdna2-engine=test_plugin_fake_engine:make_model")
    r.assert_outcomes(passed=8)
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")  # the bundled engine: both required
    r.stdout.fnmatch_lines(["*cdna2 perf: no passing kernel, isa test in this session*"])


def test_perf_sorts_last_after_failed_first(pytester):
    """--ff (the cache plugin's reordering, a tryfirst wrapper) must not put perf before the correctness tests."""
    pytester.makepyfile(TESTS.format(ok2=True).replace('print("PERF RAN")', 'assert not PERF_FAILS'))
    pytester.makeconftest("import builtins\nbuiltins.PERF_FAILS = True\n")
    run(pytester, "-p", "cacheprovider", "--cdna2-perf-on-cpu").assert_outcomes(passed=7, failed=1)
    pytester.makeconftest("import builtins\nbuiltins.PERF_FAILS = False\n")
    r = run(pytester, "-p", "cacheprovider", "--cdna2-perf-on-cpu", "--ff", "-v")
    r.assert_outcomes(passed=8)
    lines = [line for line in r.outlines if "::" in line and "PASSED" in line]
    assert "test_bench" in lines[-1], lines


def test_perf_refuses_to_run_before_a_correctness_test(pytester):
    """A plugin that reorders after collection (here at session start, outside every modifyitems wrapper) cannot
    make perf run before correctness tests: the gate names the tests still to run."""
    pytester.makepyfile(TESTS.format(ok2=True))
    pytester.makeconftest(
        """
        import pytest

        class PerfFirst:
            @pytest.hookimpl(wrapper=True, tryfirst=True)
            def pytest_collection_modifyitems(self, items):
                result = yield
                items.sort(key=lambda item: item.get_closest_marker("perf") is None)
                return result

        def pytest_sessionstart(session):
            session.config.pluginmanager.register(PerfFirst())
        """
    )
    r = run(pytester, "--cdna2-perf-on-cpu", "-rs")
    r.assert_outcomes(passed=7, skipped=1)
    r.stdout.fnmatch_lines(["*cdna2 perf: 7 correctness test(s) not run yet (ordered after perf): "
                            "test_perf_refuses_to_run_before_a_correctness_test.py::test_weight, *"])


def test_terminal_summary_counts_setup_and_teardown_failures_as_errors(pytester):
    """As pytest's own summary: a test whose fixture raises errored, it did not fail; one whose call failed
    and whose teardown raised too counts once, as failed."""
    pytester.makepyfile("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("no model")

        @pytest.fixture
        def bad_teardown():
            yield
            raise RuntimeError("cleanup")

        @pytest.mark.weight
        def test_a(broken):
            pass

        @pytest.mark.weight
        def test_b(bad_teardown):
            pass

        @pytest.mark.weight
        def test_c(bad_teardown):
            assert False

        @pytest.mark.weight
        def test_d():
            pass
        """)
    r = run(pytester)
    r.assert_outcomes(passed=2, failed=1, errors=3)
    r.stdout.fnmatch_lines(["weight       1 passed, 1 failed, 0 skipped, 2 errors"])


def test_terminal_summary_per_tier_with_worst_metric(pytester):
    pytester.makepyfile(TESTS.format(ok2=False))
    r = run(pytester, "--cdna2-perf-on-cpu")
    r.stdout.fnmatch_lines([
        "*cdna2 summary*",
        "kernel       1 passed, 0 failed, 0 skipped",
        "    worst rel_fro 3.000e-06 (limit <= 1.000e-05, ok) in *::test_kernel",
        "token        1 passed, 1 failed, 0 skipped",
        "    worst kl_max 2.000e-02 (limit <= 1.000e-03, FAIL) in *::test_tokens[[]False[]] [[]prompt p00[]]",
        "    worst top1 5.000e-01 (limit >= 1.000e+00, FAIL) in *::test_tokens[[]False[]]",
        "perf         0 passed, 0 failed, 1 skipped",
        "    cdna2 perf: skipped because 1 correctness test(s) failed: *",
    ])


def test_no_summary_without_tiered_tests(pytester):
    pytester.makepyfile("def test_x(): pass")
    assert "cdna2 summary" not in run(pytester).stdout.str()


def test_metrics_land_in_junit_xml_as_json(pytester):
    """Each metric is a cdna2_metric property whose value strict JSON parses (an infinite limit, as the token tier
    records for near-tie flips, as the string "inf"), and the summary reads the same values back."""
    import json
    import xml.etree.ElementTree as ET

    pytester.makepyfile(TESTS.format(ok2=True))
    pytester.makepyfile(test_inf="def test_flips(cdna2_record):\n    cdna2_record('flips', 3, float('inf'))\n")
    r = run(pytester, "--junitxml=out.xml")
    r.assert_outcomes(passed=8, skipped=1)

    def strict(text):
        raise ValueError(f"not JSON: {text}")

    props = [json.loads(p.get("value"), parse_constant=strict)
             for p in ET.parse(pytester.path / "out.xml").iter("property") if p.get("name") == "cdna2_metric"]
    assert {"metric": "kl_max", "value": 0.0001, "limit": 0.001, "op": "<=", "what": "prompt p00", "ok": True} in props
    assert {"metric": "flips", "value": 3.0, "limit": "inf", "op": "<=", "what": "", "ok": True} in props
    assert float("inf") == float(next(p["limit"] for p in props if p["metric"] == "flips"))


@pytest.mark.skipif("xdist" not in sys.modules and not __import__("importlib").util.find_spec("xdist"),
                    reason="needs pytest-xdist")
def test_under_xdist_perf_skips_and_summary_collects_worker_metrics(pytester, monkeypatch):
    pytester.makepyfile(TESTS.format(ok2=True))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    r = pytester.runpytest_subprocess("-n", "1", "--cdna2-device=cpu", "--cdna2-perf-on-cpu", "-rs", *FAST)
    r.assert_outcomes(passed=7, skipped=1)
    r.stdout.fnmatch_lines([
        "token        2 passed, 0 failed, 0 skipped",
        "    worst kl_max 1.000e-04 (limit <= 1.000e-03, ok) in *",
        "*cdna2 perf: gated on the whole session, which xdist splits over workers; run the suite without -n*",
    ])


def test_metrics_are_attached_to_allure_as_csv(pytester):
    pytest.importorskip("allure")
    pytester.makepyfile(TESTS.format(ok2=True))
    run(pytester, "--alluredir=allure").assert_outcomes(passed=7, skipped=1)
    csvs = [p.read_text() for p in (pytester.path / "allure").glob("*-attachment.csv")]
    assert len(csvs) == 3  # test_tokens x2 and test_kernel
    assert "metric,value,op,limit,ok,what\nrel_fro,3e-06,<=,1e-05,True,\n" in csvs


def test_summary_limits_keep_the_digits_that_matter():
    """cosine_min's limit 0.999999999 printed as 1.000e+00 read as "cosine must be 1"; limits print in as few
    digits (4 at least) as tell them apart, and values to the same digits (1.000e+00 against 9.99999999e-01 hid how
    close a cosine was to its limit)."""
    from pytest_cdna2.report import Metric

    line = Metric("t::x", "cosine_min", 0.9999999992, 0.999999999, ">=", "").line()
    assert line.startswith("cosine_min 9.999999992e-01 (limit >= 9.99999999e-01, ok)")
    line = Metric("t::x", "cosine_min", 0.99999999, 0.999999999, ">=", "").line()
    assert line.startswith("cosine_min 9.99999990e-01 (limit >= 9.99999999e-01, FAIL)")
    line = Metric("t::x", "cosine_min", 0.9999999989, 0.999999999, ">=", "").line()  # read apart from its limit
    assert line.startswith("cosine_min 9.999999989e-01 (limit >= 9.99999999e-01, FAIL)")
    assert Metric("t::x", "kl_max", 2.5e-2, float("inf"), "<=", "").line().startswith("kl_max 2.500e-02 (limit <= inf")
    line = Metric("t::x", "cosine_min", 0.9999999999999999, 1.0, ">=", "").line()  # one ulp under
    assert line.startswith("cosine_min 9.999999999999999e-01 (limit >= 1.000e+00, FAIL)"), line
    line = Metric("t::x", "kl_max", 2.1e-2, 1e-3, "<=", "").line()
    assert line.startswith("kl_max 2.100e-02 (limit <= 1.000e-03, FAIL)")


def test_missing_isa_tier_names_triton_when_it_is_not_installed(monkeypatch):
    """Without Triton the isa tier skips, so perf can never run: the skip reason says why and how to fix it."""
    import importlib.util

    from pytest_cdna2.report import PerfGate

    gate = PerfGate(("isa",))
    kw = dict(device="cuda:0", xdist_worker=False, perf_on_cpu=False)
    assert "Triton, not installed" not in gate.skip_reason(**kw)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert "no passing isa test in this session (the isa tier compiles with Triton, not installed: pip install -e " \
           "'.[suite]')" in gate.skip_reason(**kw)


def test_reference_ops_block_perf():
    """A model with ops switched to the reference (CDNA2_REFERENCE_OPS) is not what perf should time."""
    from pytest_cdna2.report import PerfGate

    kw = dict(device="cuda:0", xdist_worker=False, perf_on_cpu=False)
    assert PerfGate(()).skip_reason(**kw) is None
    assert "CDNA2_REFERENCE_OPS runs attention, linear on the reference; perf times the kernels: unset it" in \
        PerfGate(()).skip_reason(**kw, reference_ops=("attention", "linear"))
