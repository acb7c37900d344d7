"""The plugin's options: listed in --help, readable from ini, bad values are usage errors."""

from __future__ import annotations

import pytest
from test_plugin_fake_engine import FAST
from test_plugin_fake_engine import run_inprocess as run

from pytest_cdna2 import plugin
from pytest_cdna2.tolerance import load_profile

ENGINE = "--cdna2-engine=test_plugin_fake_engine:make_model"
OPTIONS = ["device", "model", "goldens", "backend", "tolerance", "engine", "regen-goldens", "perf-on-cpu"]


def test_help_lists_every_option_and_ini_key(pytester):
    r = run(pytester, "--help")
    r.stdout.fnmatch_lines(["DeepSeek-V4 FP4/FP8 conformance (pytest-cdna2):"])
    out = r.stdout.str()
    for name in OPTIONS:
        assert f"--cdna2-{name}" in out
        assert f"cdna2_{name.replace('-', '_')} (" in out  # the ini key with its type


def test_markers_are_registered(pytester):
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.weight
        @pytest.mark.kernel
        @pytest.mark.token
        @pytest.mark.determinism
        @pytest.mark.isa
        def test_x(): pass
        """
    )
    run(pytester, ).assert_outcomes(passed=1)
    r = run(pytester, "--markers")
    r.stdout.fnmatch_lines(["@pytest.mark.perf: perf tier: *only after every other test*"])


def test_header_shows_device_engine_goldens(pytester):
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-device=cpu")
    r.stdout.fnmatch_lines([
        "cdna2 device: cpu (*threads, torch *)",
        "cdna2 engine: bundled backend=reference model=*",
        "cdna2 goldens: * tolerance: float32-derived (*tolerance_default.toml)",
    ])


SHOW = """
def test_show(cdna2_settings, cdna2_tolerance):
    s = cdna2_settings
    print("SETTINGS", s.backend, s.engine, s.model.name, s.goldens.name, cdna2_tolerance.token.kl_max, s.regen,
          s.perf_on_cpu)
"""


def test_ini_options_and_cli_wins(pytester):
    (pytester.path / "mymodel").mkdir()
    (pytester.path / "mymodel" / "config.json").write_text("{}")
    (pytester.path / "mygoldens").mkdir()
    (pytester.path / "tol.toml").write_text("[token]\nkl_max = 0.25\n")
    pytester.makeini(
        """
        [pytest]
        cdna2_device = cpu
        cdna2_backend = triton
        cdna2_engine = test_plugin_fake_engine:make_model
        cdna2_model = mymodel
        cdna2_goldens = mygoldens
        cdna2_tolerance = tol.toml
        cdna2_perf_on_cpu = true
        """
    )
    pytester.makepyfile(SHOW)
    r = run(pytester, "-s")
    r.stdout.fnmatch_lines(["*SETTINGS triton test_plugin_fake_engine:make_model mymodel mygoldens 0.25 False True"])
    r = run(pytester, "-s", "--cdna2-backend=reference", "--cdna2-engine=bundled")
    r.stdout.fnmatch_lines(["*SETTINGS reference bundled mymodel mygoldens 0.25 False True"])


def test_ini_paths_are_relative_to_the_ini_file(pytester, monkeypatch):
    (pytester.path / "m").mkdir()
    (pytester.path / "m" / "config.json").write_text("{}")
    pytester.makeini("[pytest]\ncdna2_model = m\n")
    pytester.makepyfile(SHOW)
    sub = pytester.mkdir("sub")
    monkeypatch.chdir(sub)
    r = run(pytester, "-s", str(pytester.path))
    r.stdout.fnmatch_lines(["*SETTINGS reference bundled m goldens *"])


def test_defaults_point_at_the_bundled_model(pytester):
    pytester.makepyfile(SHOW)
    r = run(pytester, "-s")
    r.stdout.fnmatch_lines([f"*SETTINGS reference bundled model goldens {load_profile().token.kl_max} False False"])
    assert plugin.DEFAULT_MODEL.parts[-3:] == ("goldens", "tiny-v4", "model")
    assert plugin.DEFAULT_GOLDENS.parts[-3:] == ("goldens", "tiny-v4", "goldens")


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (["--cdna2-backend=cuda"], "", "*--cdna2-backend=cuda: expected one of reference, triton*"),
        ([], "cdna2_backend = rocm", "*ini key cdna2_backend = rocm in *.ini: expected one of reference, triton*"),
        ([], "cdna2_model = nowhere", "*ini key cdna2_model in *.ini: */nowhere does not exist*"),
        (["--cdna2-engine=not a spec"], "", "*--cdna2-engine=not a spec: expected bundled or module:factory*"),
        (["--cdna2-model=nowhere"], "", "*--cdna2-model: */nowhere does not exist*"),
        (["--cdna2-goldens=nowhere"], "", "*--cdna2-goldens: */nowhere does not exist (build it with*"),
        (["--cdna2-device=gpu"], "", "*--cdna2-device='gpu': expected cpu, N (or cuda:N), N,M or all*"),
        (["--cdna2-device="], "", "*--cdna2-device='': empty: expected cpu, N (or cuda:N), N,M or all*"),
        ([], "cdna2_device =", "*ini key cdna2_device = '' in *.ini: empty: expected cpu, N (or cuda:N), N,M or all*"),
        (["--cdna2-backend="], "", "*--cdna2-backend='': empty: expected one of reference, triton, or leave it out*"),
        ([], "cdna2_backend =", "*ini key cdna2_backend = '' in *.ini: empty: expected one of reference, triton*"),
        (["--cdna2-dtype="], "", "*--cdna2-dtype='': empty: expected one of float32, bfloat16, float64*"),
        (["--cdna2-engine="], "", "*--cdna2-engine='': empty: expected bundled or module:factory*"),
        (["--cdna2-model="], "", "*--cdna2-model='': empty: expected a checkpoint folder (DIR)*"),
        (["--cdna2-goldens="], "", "*--cdna2-goldens='': empty: expected a golden store folder (DIR)*"),
        (["--cdna2-tolerance="], "", "*--cdna2-tolerance='': empty: expected a tolerance profile (FILE)*"),
        (["--cdna2-model=."], "", "*--cdna2-model: * has no config.json, so it is not a checkpoint: pass the folder "
         "holding config.json*"),
        (["--cdna2-goldens=t.toml"], "", "*--cdna2-goldens: */t.toml is a file, not a folder: pass the golden*"),
        ([], "cdna2_regen_goldens = true", "ini key cdna2_regen_goldens in *.ini needs --cdna2-goldens: name the "
         "store to rewrite*"),
        (["--cdna2-tolerance=t.toml"], "", "*--cdna2-tolerance: */t.toml: [[]token] kl: unknown key*"),
        (["--cdna2-regen-goldens", "--cdna2-goldens=new", "-n", "2"], "",
         "*--cdna2-regen-goldens cannot run under xdist*"),
        (["--cdna2-regen-goldens", "--cdna2-goldens=new", "--dist=load", "--tx=2*popen"], "",  # no -n, same
         "*--cdna2-regen-goldens cannot run under xdist (-n, --tx): run it in one process*"),
        (["--cdna2-regen-goldens"], "", "*--cdna2-regen-goldens needs --cdna2-goldens: name the store to rewrite*"),
        ([], "cdna2_perf_on_cpu = maybe", "*ini key cdna2_perf_on_cpu: *'maybe'*; expected true or false"),
        (["--cdna2-model=t.toml"], "", "*--cdna2-model: */t.toml is not a folder: pass the checkpoint directory*"),
        (["--cdna2-tolerance=."], "", "*--cdna2-tolerance: *: cannot read the tolerance profile: Is a directory"),
        (["-o", "cdna2_backend=Triton"], "", "-o cdna2_backend=Triton: expected one of reference, triton"),
        (["-o", "cdna2_model="], "", "-o cdna2_model=: empty: expected a checkpoint folder (DIR)*"),
    ],
)
def test_bad_values_are_usage_errors(pytester, args, ini, message):
    (pytester.path / "t.toml").write_text("[token]\nkl = 1\n")
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_x(): pass")
    # run() passes --cdna2-device=cpu, which would win over an ini device
    r = pytester.runpytest_inprocess(*FAST, *args) if "cdna2_device" in ini else run(pytester, *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_an_override_is_named_as_typed_not_blamed_on_the_ini_file(pytester):
    """`-o key=value` is the command line: the error quotes it, not an ini file that has no such key."""
    pytester.makeini("[pytest]\n")
    pytester.makepyfile("def test_x(): pass")
    r = pytester.runpytest_inprocess(*FAST, "-o", "cdna2_device=7")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: -o cdna2_device=7: GPU 7 does not exist (available: cpu*"])
    assert ".ini" not in r.stderr.str()


def test_ini_values_are_stripped(pytester):
    """`-o "cdna2_dtype= float64"` (a space after =, as an ini file allows) means float64, not a bad dtype."""
    pytester.makepyfile("def test_x(cdna2_settings):\n    print('DTYPE', cdna2_settings.dtype)\n")
    r = run(pytester, "-s", "-o", "cdna2_dtype= float64 ")
    assert r.ret == pytest.ExitCode.OK
    r.stdout.fnmatch_lines(["*DTYPE float64"])


@pytest.mark.parametrize("value", ["bogus", "linear,atention"])
def test_unknown_reference_ops_are_a_usage_error(pytester, monkeypatch, value):
    """CDNA2_REFERENCE_OPS names ops of the bundled engine, which the kernel tier runs whatever engine is under
    test: a typo stops the run before collection in one line (it raised in every kernel test's setup)."""
    monkeypatch.setenv("CDNA2_REFERENCE_OPS", value)
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    bad = ["bogus"] if value == "bogus" else ["atention"]
    assert f"ERROR: env CDNA2_REFERENCE_OPS: unknown op(s) {bad}: name ops from ['linear', " in r.stderr.str()
    assert "Traceback" not in r.stderr.str() + r.stdout.str()


def test_regen_may_target_a_new_goldens_folder_but_a_run_that_rewrote_nothing_fails(pytester):
    """The option is accepted for a new folder; with no selected test reading the goldens nothing is rewritten,
    and the run says so and fails (it would otherwise pass as if the goldens were rebuilt)."""
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-regen-goldens", "--cdna2-goldens=new")
    r.assert_outcomes(passed=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*--cdna2-regen-goldens rewrote nothing: no selected test reads the goldens*"])
    assert not (pytester.path / "new").exists()


def test_regen_under_collect_only_does_not_complain(pytester):
    """--co runs no test, so "rewrote nothing" is expected there, not a failure."""
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-regen-goldens", "--cdna2-goldens=new", "--co")
    assert r.ret == pytest.ExitCode.OK
    assert "rewrote nothing" not in r.stdout.str()


@pytest.mark.skipif(pytest.version_tuple < (9,), reason="native TOML types in [tool.pytest] arrived in pytest 9")
def test_a_toml_number_for_a_string_key_says_to_quote_it(pytester):
    pytester.makepyprojecttoml("[tool.pytest]\ncdna2_device = 0\n")
    pytester.makepyfile("def test_x(): pass")
    r = pytester.runpytest_inprocess(*FAST)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: ini key cdna2_device: *expects a string, got int: 0; expected a string: "
                            'cdna2_device = "VALUE"'])
    assert "true or false" not in r.stderr.str()


def test_a_toml_list_for_a_string_key_says_to_quote_it(pytester):
    """[tool.pytest.ini_options] hands a TOML list to a string key (pytest only warns): it was read as the path
    "['a', 'b']"."""
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ncdna2_model = ["a", "b"]\n')
    pytester.makepyfile("def test_x(): pass")
    r = pytester.runpytest_inprocess(*FAST, "-W", "ignore::pytest.PytestRemovedIn10Warning")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: ini key cdna2_model in *pyproject.toml: expected a string: "
                            "cdna2_model = \"VALUE\", got [[]'a', 'b'[]]"])


def test_help_shows_the_readme_forms(pytester):
    """The metavars are README's (DIR, FILE, the choices), and --cdna2-regen-goldens says it needs --cdna2-goldens."""
    out = " ".join(run(pytester, "--help").stdout.str().split())
    for form in ("--cdna2-device=cpu|N|N,M|all", "--cdna2-model=DIR", "--cdna2-goldens=DIR", "--cdna2-tolerance=FILE",
                 "--cdna2-backend=reference|triton", "--cdna2-dtype=float32|bfloat16|float64",
                 "--cdna2-engine=bundled|module:factory"):
        assert form in out
    assert "--cdna2-regen-goldens rebuild the golden store named by --cdna2-goldens (required with it)" in out


def test_regen_refuses_the_bundled_goldens(pytester):
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-regen-goldens", f"--cdna2-goldens={plugin.DEFAULT_GOLDENS}")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --cdna2-regen-goldens: * is the golden store bundled with the package; "
                            "refusing to rewrite it*"])


def test_the_triton_backend_without_triton_is_a_usage_error(pytester, monkeypatch):
    """It was a traceback in the first engine test, after the weight tier had run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-backend=triton")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: --cdna2-backend=triton: the triton backend needs Triton >= " in r.stderr.str()
    assert "which is not installed: pip install" in r.stderr.str() and "Traceback" not in r.stderr.str()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert run(pytester, "--cdna2-backend=triton").ret == pytest.ExitCode.OK


@pytest.mark.parametrize("ini, where, hint", [
    ("[pytest]\ncdna2_devcie = cpu\n", "ini key cdna2_devcie in *", "did you mean cdna2_device?"),
    ("[pytest]\ncdna2_perf-on-cpu = true\n", "ini key cdna2_perf-on-cpu in *", "did you mean cdna2_perf_on_cpu?"),
])
def test_a_misspelt_ini_key_is_a_usage_error(pytester, ini, where, hint):
    """pytest only warned, and the run went on with the default the key meant to change."""
    pytester.makeini(ini)
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: {where}: not a pytest-cdna2 key: {hint}"])


def test_a_misspelt_override_is_a_usage_error(pytester):
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "-o", "cdna2_backedn=triton")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: -o cdna2_backedn=triton: not a pytest-cdna2 key: did you mean cdna2_backend?"])


def test_command_line_values_are_stripped_as_ini_values_are(pytester):
    """--cdna2-backend="reference " was refused, its message showing no space."""
    pytester.makepyfile("def test_x(cdna2_settings):\n    print('BACKEND', repr(cdna2_settings.backend))\n")
    r = run(pytester, "-s", "--cdna2-backend=reference ")
    assert r.ret == pytest.ExitCode.OK
    r.stdout.fnmatch_lines(["*BACKEND 'reference'"])


def test_another_plugins_cdna2x_key_passes_both_ways(pytester):
    """Only unknown keys are refused: one another plugin registers passes from the ini file and from -o alike."""
    pytester.makeconftest("def pytest_addoption(parser):\n    parser.addini('cdna2x_mode', 'another plugin')\n")
    pytester.makepyfile("def test_x(): pass")
    assert run(pytester, "-o", "cdna2x_mode=1").ret == pytest.ExitCode.OK
    pytester.makeini("[pytest]\ncdna2x_mode = 1\n")
    assert run(pytester).ret == pytest.ExitCode.OK


@pytest.mark.parametrize("version, ok", [("3.9.0", True), ("3.9.0+rocm7.1", True), ("2.1.0", False)])
def test_the_triton_version_is_read_from_the_module_it_would_import(pytester, monkeypatch, tmp_path, version, ok):
    """A source tree on the path or ROCm's pytorch-triton-rocm: the version in the triton/__init__.py that import
    would load (no distribution metadata needed), too old refused in one line."""
    import importlib.util
    from types import SimpleNamespace

    init = tmp_path / "triton" / "__init__.py"
    init.parent.mkdir()
    init.write_text(f"__version__ = '{version}'\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace(origin=str(init)) if name == "triton" else real(name, *a))
    pytester.makepyfile("def test_x(): pass")
    r = run(pytester, "--cdna2-backend=triton")
    assert r.ret == (pytest.ExitCode.OK if ok else pytest.ExitCode.USAGE_ERROR)
    if not ok:
        assert f"ERROR: --cdna2-backend=triton: the triton backend needs Triton >= 3.5, found {version}" in \
            r.stderr.str()
