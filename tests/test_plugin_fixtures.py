"""The fixtures with a fake user engine (--cdna2-engine=module:factory) and a real golden store."""

from __future__ import annotations

import json

import pytest
import test_plugin_fake_engine as fake
import torch
from test_plugin_fake_engine import make_model, write_fake_model
from test_plugin_fake_engine import run_inprocess as run

from pytest_cdna2 import plugin
from pytest_cdna2.goldens import DEFAULT_PROMPTS, GoldenStore, build_goldens, sha256_file

ENGINE = "--cdna2-engine=test_plugin_fake_engine:make_model"

TOKEN_TEST = """
from pytest_cdna2.compare import assert_logits_close

def test_teacher_forced(cdna2_engine, cdna2_golden, cdna2_tolerance, cdna2_record):
    for p in cdna2_golden.prompts:
        ids = cdna2_golden.input_ids(p.name)[None]
        m = assert_logits_close(cdna2_engine.forward(ids)[0], cdna2_golden.teacher_logits(p.name),
                                limits=cdna2_tolerance.token, what=f"prompt {p.name}")
        cdna2_record("kl_max", m.kl_max, cdna2_tolerance.token.kl_max, what=p.name)

def test_second(cdna2_golden):
    assert cdna2_golden.steps == 4
"""


@pytest.fixture
def store(pytester):
    """Model A at ./a, model B at ./b, goldens of A at ./goldens."""
    a = write_fake_model(pytester.path / "a", seed=1)
    write_fake_model(pytester.path / "b", seed=2)
    build_goldens(a, pytester.path / "goldens", [b"hello", b"def f("], 4, model=make_model(str(a)), progress=False)
    pytester.makepyfile(TOKEN_TEST)
    return pytester.path / "goldens"


def test_engine_is_loaded_once_on_the_device_with_the_backend(pytester):
    folder = write_fake_model(pytester.path / "m", seed=0)
    pytester.makepyfile(
        """
        import torch
        def test_one(cdna2_engine, cdna2_device):
            assert cdna2_device == torch.device("cpu") and cdna2_engine.device == cdna2_device
        def test_two(cdna2_engine):
            assert cdna2_engine.config.vocab_size == 260
        """
    )
    before = len(fake.LOADS)
    run(pytester, ENGINE, "--cdna2-model=m", "--cdna2-backend=triton").assert_outcomes(passed=2)
    assert fake.LOADS[before:] == [(str(folder), "cpu", "triton")]


def test_goldens_of_the_model_pass(pytester, store):
    r = run(pytester, ENGINE, "--cdna2-model=a", "--cdna2-goldens=goldens")
    r.assert_outcomes(passed=2)
    # these goldens were recorded by the engine under test: the header says it is judged against itself
    r.stdout.fnmatch_lines(["cdna2 goldens: */goldens (recorded by test_plugin_fake_engine in float64: the engine "
                            "under test, judged against itself)  tolerance: *"])
    r = run(pytester, "--cdna2-goldens=goldens", "--co")  # the bundled engine: another engine's goldens
    r.stdout.fnmatch_lines(["cdna2 goldens: */goldens (recorded by test_plugin_fake_engine in float64)  tolerance: *"])


def test_goldens_of_another_model_are_refused_and_stop_the_run(pytester, store):
    r = run(pytester, ENGINE, "--cdna2-model=b", "--cdna2-goldens=goldens")
    r.assert_outcomes(errors=1)  # the second test never runs
    sha_a = make_model(str(pytester.path / "a")).checkpoint_sha256()
    sha_b = make_model(str(pytester.path / "b")).checkpoint_sha256()
    r.stdout.fnmatch_lines([
        f"*cdna2: goldens at */goldens are for model sha256 {sha_a}, but the model under test has sha256 {sha_b}*",
        "*Interrupted: cdna2: goldens at*",
    ])


def test_goldens_of_another_model_size_stop_the_run_before_its_first_test(pytester):
    """Only --cdna2-model given (V4-Flash's config here): the bundled goldens are the tiny model's, which its
    config.json shows at collection, before any test runs or engine loads; a run selecting no test that reads the
    goldens (the weight tier alone) goes on."""
    folder = write_fake_model(pytester.path / "flash", seed=1)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 129280, "num_hidden_layers": 43}))
    pytester.makepyfile(TOKEN_TEST + "\ndef test_plain():\n    pass\n")
    before = len(fake.LOADS)
    r = run(pytester, ENGINE, "--cdna2-model=flash")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and fake.LOADS[before:] == []
    r.stderr.fnmatch_lines(["ERROR: cdna2: the bundled goldens (the bundled tiny model's) were recorded from a model "
                            "with vocab_size 256 and 4 layers, but --cdna2-model */flash has vocab_size 129280 and 43 "
                            "layers: pass --cdna2-goldens DIR with goldens built for it*"])
    run(pytester, ENGINE, "--cdna2-model=flash", "-k", "plain").assert_outcomes(passed=1)
    assert run(pytester, ENGINE, "--cdna2-model=flash", "--collect-only").ret == pytest.ExitCode.OK  # lists them


@pytest.mark.parametrize("changes", [{"vocab_size": 256, "num_hidden_layers": 43},  # V4-Flash vs V4-Pro: same vocab
                                     {"vocab_size": 129280, "num_hidden_layers": 4}])
def test_goldens_differing_in_vocab_or_layers_alone_are_refused(pytester, changes):
    folder = write_fake_model(pytester.path / "other", seed=1)
    (folder / "config.json").write_text(json.dumps(changes))
    pytester.makepyfile(TOKEN_TEST)
    r = run(pytester, ENGINE, "--cdna2-model=other")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: cdna2: the bundled goldens * but --cdna2-model */other has vocab_size "
                            f"{changes['vocab_size']} and {changes['num_hidden_layers']} layers*"])


def test_the_golden_fixture_refuses_another_models_goldens_itself(pytester):
    """Under xdist the workers collect and the collection-time check is skipped there: the cdna2_golden fixture
    stops the run with the same line before its full open (here the collection check is skipped as in a worker)."""
    folder = write_fake_model(pytester.path / "flash", seed=1)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 129280, "num_hidden_layers": 43}))
    pytester.makepyfile("def test_golden(cdna2_golden):\n    pass\n")
    pytester.makeconftest("def pytest_configure(config):\n    config.workerinput = {}\n")
    r = run(pytester, ENGINE, "--cdna2-model=flash")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: the bundled goldens (the bundled tiny model's) were recorded *"])


def test_regen_is_not_refused_for_another_model_size(pytester, real_store):
    """--cdna2-regen-goldens rebuilds a store for the model under test: its old size is no reason to refuse."""
    from tiny_configs import make_checkpoint, make_config

    make_checkpoint(pytester.path / "c", make_config("mixed", vocab_size=300), seed=3)  # 4 layers, not 2
    r = run(pytester, "--cdna2-model=c", "--cdna2-goldens=goldens", "--cdna2-regen-goldens")
    r.stdout.fnmatch_lines(["*cdna2: goldens were rewritten at */goldens*"])


def test_one_flipped_byte_stops_the_run_with_a_checksum_message(pytester, store):
    f = store / "greedy.safetensors"
    want = sha256_file(f)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    r = run(pytester, ENGINE, "--cdna2-model=a", "--cdna2-goldens=goldens")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines([f"*golden file {f}: sha256 {sha256_file(f)} does not match manifest.json's {want}*"])


@pytest.fixture
def real_store(pytester):
    """Two real official-layout checkpoints (a, b) and goldens of a: regeneration runs the bundled float64
    reference, whatever engine is under test, so it needs a checkpoint that engine reads."""
    from tiny_configs import make_checkpoint, make_config

    cfg = make_config("csa-only", vocab_size=300)
    a = make_checkpoint(pytester.path / "a", cfg, seed=1)
    make_checkpoint(pytester.path / "b", cfg, seed=2)
    build_goldens(a, pytester.path / "goldens", [b"hello", [299, 7, 280, 1]], 4, progress=False)  # text, token ids
    pytester.makepyfile(TOKEN_TEST)
    return pytester.path / "goldens"


def test_regen_rewrites_and_fails_the_run_then_the_next_run_passes(pytester, real_store):
    from cdna2_engine.checkpoint import checkpoint_sha256

    r = run(pytester, "--cdna2-model=b", "--cdna2-goldens=goldens", "--cdna2-regen-goldens")
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.assert_outcomes(errors=2)
    r.stdout.fnmatch_lines([
        "*cdna2: goldens were rewritten at */goldens (2 prompts, 4 steps); this run fails on purpose: "
        "rerun without --cdna2-regen-goldens",
        "*goldens were rewritten at */goldens: the run fails; rerun without --cdna2-regen-goldens",
    ])
    manifest = json.loads((real_store / "manifest.json").read_text())
    assert manifest["model_sha256"] == checkpoint_sha256(pytester.path / "b")
    assert manifest["dtype"] == "float64" and manifest["backend"] == "reference"
    assert manifest["tolerance_profile"] == "default"  # as `cdna2 goldens build` (and build_goldens) record it
    assert [p["tokens"] for p in manifest["prompts"]] == [list(b"hello"), [299, 7, 280, 1]]  # prompts kept
    assert [p["text"] for p in manifest["prompts"]] == ["hello", ""]  # and a byte-level prompt's text
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".goldens")) == []
    run(pytester, "--cdna2-model=b", "--cdna2-goldens=goldens").assert_outcomes(passed=2)


def test_regen_uses_the_reference_not_the_engine_under_test(pytester, store):
    """A user engine's model folder that the bundled reference cannot read: regen refuses, one line."""
    r = run(pytester, ENGINE, "--cdna2-model=a", "--cdna2-goldens=goldens", "--cdna2-regen-goldens")
    assert r.ret != 0
    r.stdout.fnmatch_lines(["*cdna2: regenerating goldens (bundled float64 reference) failed: *"])


def test_regen_into_a_new_folder_uses_the_default_prompts(pytester, real_store):
    run(pytester, "--cdna2-model=a", "--cdna2-goldens=fresh", "--cdna2-regen-goldens")
    fresh = GoldenStore.open(pytester.path / "fresh")
    assert (fresh.steps, len(fresh.prompts)) == (32, len(DEFAULT_PROMPTS))


def test_missing_bundled_model_names_the_path(pytester, monkeypatch):
    monkeypatch.setattr(plugin, "DEFAULT_MODEL", pytester.path / "no" / "model")
    pytester.makepyfile("def test_x(cdna2_engine): pass\ndef test_y(cdna2_engine): pass")
    r = run(pytester)
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines([
        f"*cdna2: model not found at {pytester.path / 'no' / 'model'}: the bundled model ships only with a source "
        "checkout (git clone, then `pip install -e .`), not in the wheel; pass --cdna2-model=DIR*"
    ])


def test_missing_bundled_goldens_say_they_come_with_a_source_checkout(pytester, monkeypatch):
    """A wheel install has no goldens/ folder: the message says where the bundled store comes from."""
    monkeypatch.setattr(plugin, "DEFAULT_GOLDENS", pytester.path / "no" / "goldens")
    write_fake_model(pytester.path / "m")
    pytester.makepyfile("def test_x(cdna2_golden): pass")
    r = run(pytester, ENGINE, "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines([f"*cdna2: golden store not found at {pytester.path / 'no' / 'goldens'}: the bundled "
                            "goldens ship only with a source checkout (git clone, then `pip install -e .`), not in "
                            "the wheel; pass --cdna2-goldens=DIR*"])


def test_unimportable_engine_factory(pytester):
    write_fake_model(pytester.path / "m")
    pytester.makepyfile("def test_x(cdna2_engine): pass")
    r = run(pytester, "--cdna2-engine=no_such_module_xyz:make", "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*cdna2: --cdna2-engine=no_such_module_xyz:make: cannot import 'no_such_module_xyz'*"])
    r = run(pytester, "--cdna2-engine=test_plugin_fake_engine:nope", "--cdna2-model=m")
    r.stdout.fnmatch_lines(["*'test_plugin_fake_engine' has no callable 'nope'*"])
    r = run(pytester, "--cdna2-engine=os.path:join", "--cdna2-model=m")  # callable, but not a factory
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["cdna2: --cdna2-engine=os.path:join: join(a, *p) cannot be called as factory(path, "
                            "device=..., backend=...*"])  # (fnmatch reads [...] as a class)
    assert "Traceback" not in r.stdout.str() and "TypeError" not in r.stdout.str()


def test_an_engine_module_that_fails_at_import_stops_the_run_in_one_line(pytester):
    """Not only a missing module: one that raises at import (a syntax error, an error of its own) is its author's
    to fix, named in one line, and stops the run instead of failing every test with the same traceback."""
    write_fake_model(pytester.path / "m")
    pytester.makepyfile(broken_syntax="def f(:\n", broken_raise="raise RuntimeError('no GPU driver')\n")
    pytester.makepyfile("def test_x(cdna2_engine): pass\ndef test_y(cdna2_engine): pass")
    for module, why in (("broken_syntax", "SyntaxError: *"), ("broken_raise", "RuntimeError: no GPU driver")):
        r = run(pytester, f"--cdna2-engine={module}:f", "--cdna2-model=m", "-p", "no:cacheprovider")
        r.assert_outcomes(errors=1)
        r.stdout.fnmatch_lines([f"*Interrupted: cdna2: --cdna2-engine={module}:f: importing '{module}' raised {why}*"])
        assert "Traceback" not in r.stdout.str()


def test_a_factory_that_returns_no_model_stops_the_run_in_one_line(pytester):
    """A factory returning None (a forgotten return) or an object without the Model API fails once, naming what
    it returned and what is missing, instead of an AttributeError in every test."""
    write_fake_model(pytester.path / "m")
    pytester.makepyfile(factories="def none(path, device='cpu', backend='reference'):\n    return None\n"
                                  "def half(path, device='cpu', backend='reference'):\n"
                                  "    class M:\n        def forward(self, ids): return ids\n    return M()\n")
    pytester.makepyfile("def test_x(cdna2_engine): pass\ndef test_y(cdna2_engine): pass")
    r = run(pytester, "--cdna2-engine=factories:none", "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: --cdna2-engine=factories:none returned NoneType, not a model: it "
                            "has no forward, generate, device, config.vocab_size, config.num_hidden_layers (the "
                            "README's Model API; attributes, not dict keys)*"])
    r = run(pytester, "--cdna2-engine=factories:half", "--cdna2-model=m")
    r.stdout.fnmatch_lines(["*returned M, not a model: it has no generate, device, config.vocab_size, "
                            "config.num_hidden_layers (the README's Model API; attributes, not dict keys)*"])


@pytest.mark.parametrize("fault", [None, "bogus"])
def test_the_bundled_fault_engine_refuses_a_bad_fault_in_one_line(pytester, monkeypatch, fault):
    """cdna2_engine.faults:load_faulty is the bundled engine's: its ValueError (CDNA2_FAULT unset or unknown)
    names the fix, so it is one line, as with the bundled engine itself."""
    if fault is None:
        monkeypatch.delenv("CDNA2_FAULT", raising=False)
    else:
        monkeypatch.setenv("CDNA2_FAULT", fault)
    pytester.makepyfile("def test_x(cdna2_engine): pass")
    r = run(pytester, "--cdna2-engine=cdna2_engine.faults:load_faulty")
    r.assert_outcomes(errors=1)
    want = "CDNA2_FAULT is not set: name the fault" if fault is None else "unknown fault 'bogus': choose from"
    r.stdout.fnmatch_lines([f"*Interrupted: cdna2: {want}*"])
    assert "Traceback" not in r.stdout.str()


def test_a_corrupt_checkpoint_for_the_bundled_engine_is_one_line(pytester):
    """The bundled engine's CheckpointError already names the file and the fix: no traceback, no chained repeat."""
    (pytester.path / "m").mkdir()
    (pytester.path / "m" / "config.json").write_text("{")
    pytester.makepyfile("def test_x(cdna2_engine): pass")
    r = run(pytester, "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: */m/config.json: *"])
    out = r.stdout.str()
    assert "Traceback" not in out and "During handling" not in out and "def cdna2_engine" not in out


def test_a_model_that_fails_to_load_stops_the_run(pytester):
    (pytester.path / "m").mkdir()  # no fake.json: the factory raises FileNotFoundError
    (pytester.path / "m" / "config.json").write_text("{}")
    pytester.makepyfile("def test_x(cdna2_engine): pass\ndef test_y(cdna2_engine): pass")
    r = run(pytester, ENGINE, "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: loading */m (test_plugin_fake_engine:make_model) failed: "
                            "FileNotFoundError*"])


@pytest.mark.parametrize("args, itself", [
    ((), False),  # float32 against the float64 reference's goldens: the design
    (("--cdna2-dtype=float64",), True),  # the reference in float64: the computation that made them
    (("--cdna2-dtype=float64", "--cdna2-backend=triton"), False),
    (("--cdna2-dtype=float64", "--cdna2-engine=cdna2_engine.faults:load_faulty"), False),
])
def test_the_header_says_when_the_bundled_goldens_judge_their_own_computation(pytester, args, itself):
    pytester.makepyfile("def test_x():\n    pass\n")
    r = run(pytester, "--co", *args)
    tail = ": the engine under test, judged against itself)" if itself else ")"
    r.stdout.fnmatch_lines([f"cdna2 goldens: */goldens (recorded by cdna2_engine in float64{tail}  tolerance: *"])


def test_a_user_engines_broken_config_json_stops_the_golden_fixture_in_one_line(pytester, store):
    """An engine whose config lacks V4's fields has the folder's config.json bound the goldens' selections: a broken
    one is the reader's one line, not a traceback in every token test."""
    (pytester.path / "a" / "config.json").write_text("{")
    r = run(pytester, ENGINE, "--cdna2-model=a", "--cdna2-goldens=goldens")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: */a/config.json: *"])
    assert "Traceback" not in r.stdout.str()


def test_engine_members_must_be_there_and_callable():
    from types import SimpleNamespace as NS

    from pytest_cdna2.engines import engine_missing

    config = NS(vocab_size=8, num_hidden_layers=2)
    good = NS(forward=len, generate=len, device="cpu", config=config)
    assert engine_missing(good) == [] and engine_missing(good, also=("trace",)) == ["trace"]
    assert engine_missing(NS(**{**vars(good), "generate": 5, "trace": None}), also=("trace",)) == ["generate", "trace"]
    assert engine_missing(NS(**{**vars(good), "config": {"vocab_size": 8, "num_hidden_layers": 2}})) == \
        ["config.vocab_size", "config.num_hidden_layers"]  # the tiers read attributes


def on_gpu0(path: str, *, device: str = "cpu", backend: str = "reference", dtype=None):
    """A user engine that puts itself on cuda:0 whatever device it is given."""
    model = make_model(path, device=device, backend=backend)
    model.device = torch.device("cuda:0")
    return model


def test_an_engine_on_a_device_other_than_asked_or_absent_is_refused(monkeypatch):
    from types import SimpleNamespace as NS

    from pytest_cdna2.engines import check_engine

    config = NS(vocab_size=8, num_hidden_layers=2)
    engine = NS(forward=len, generate=len, device=torch.device("cuda:1"), config=config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_engine(engine, "e", device="cuda:1")
    check_engine(engine, "e", device="cuda")  # torch's current GPU: either index
    check_engine(NS(**{**vars(engine), "device": "cpu"}), "e", device="cpu")
    with pytest.raises(ValueError, match=r"^e returned an engine on cuda:1, not on cuda:0, the device the factory is "
                                         r"given: load it there$"):
        check_engine(engine, "e", device="cuda:0")
    with pytest.raises(ValueError, match=r"^e returned an engine on cuda:1, not on cpu"):
        check_engine(engine, "e", device="cpu")
    with pytest.raises(ValueError, match=r"^e returned an engine on cuda:2 \(asked for cuda:0\), which this host does "
                                         r"not have: load it on the device the factory is given$"):
        check_engine(NS(**{**vars(engine), "device": "cuda:2"}), "e", device="cuda:0")
    with pytest.raises(ValueError, match=r"^e returned an engine whose device 'gpu0' is not a torch device$"):
        check_engine(NS(**{**vars(engine), "device": "gpu0"}), "e")


def test_an_engine_on_a_gpu_the_host_lacks_stops_the_run_in_one_line(pytester, monkeypatch):
    """It crashed in every test with torch's 'Torch not compiled with CUDA enabled'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    write_fake_model(pytester.path / "m", seed=1)
    pytester.makepyfile("import torch\ndef test_x(cdna2_engine):\n    torch.zeros(1, device=cdna2_engine.device)\n")
    r = run(pytester, "--cdna2-engine=test_plugin_fixtures:on_gpu0", "--cdna2-model=m")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: --cdna2-engine=test_plugin_fixtures:on_gpu0 returned an engine on "
                            "cuda:0 (asked for cpu), which this host does not have: load it on the device the factory "
                            "is given*"])
    assert "Traceback" not in r.stdout.str()


def make_model_without_dtype(path: str, *, device: str = "cpu", backend: str = "reference"):
    """A factory that takes no dtype: its engine runs in float64 (the fake model's .dtype) whatever the session."""
    from test_plugin_fake_engine import make_model

    return make_model(path, device=device, backend=backend)


def test_an_engine_whose_factory_takes_no_dtype_must_run_in_the_profiles_dtype(pytester, tmp_path):
    """--cdna2-dtype could not reach it, but its limits were still that dtype's profile (bfloat16's by default on a
    GPU: a float32 engine judged at bf16 limits, silently): the run stops naming the dtype to pass, and goes on
    with it."""
    from test_plugin_fake_engine import write_fake_model

    folder = write_fake_model(tmp_path / "m", seed=1)
    pytester.makepyfile("def test_x(cdna2_engine): pass")
    engine = "--cdna2-engine=test_plugin_fixtures:make_model_without_dtype"
    r = run(pytester, engine, f"--cdna2-model={folder}")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*Interrupted: cdna2: --cdna2-engine=test_plugin_fixtures:make_model_without_dtype runs "
                            "in float64 (its .dtype; the factory takes no dtype) and the tolerance profile is "
                            "float32's: pass --cdna2-dtype=float64*"])
    run(pytester, engine, f"--cdna2-model={folder}", "--cdna2-dtype=float64").assert_outcomes(passed=1)


def make_half_model_without_dtype(path: str, *, device: str = "cpu", backend: str = "reference"):
    model = make_model_without_dtype(path, device=device, backend=backend)
    model.dtype = torch.float16
    return model


def test_an_engine_in_a_dtype_without_a_profile_is_told_what_to_do(pytester, tmp_path):
    """float16 has no derived profile, so --cdna2-dtype=float16 (refused) is not the advice."""
    from test_plugin_fake_engine import write_fake_model

    folder = write_fake_model(tmp_path / "m", seed=1)
    pytester.makepyfile("def test_x(cdna2_engine): pass")
    r = run(pytester, "--cdna2-engine=test_plugin_fixtures:make_half_model_without_dtype", f"--cdna2-model={folder}")
    r.assert_outcomes(errors=1)
    r.stdout.fnmatch_lines(["*runs in float16 (its .dtype; the factory takes no dtype) and the tolerance profile is "
                            "float32's: no profile is derived for float16: let the factory take dtype=, or pass "
                            "--cdna2-tolerance=FILE with limits for it*"])
