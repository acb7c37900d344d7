"""The ``cdna2`` console script: subcommands, exit codes, one-line errors (the engine is the fake one)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from test_plugin_fake_engine import make_model, write_fake_model

import cdna2_engine
from pytest_cdna2.cli import main
from pytest_cdna2.goldens import GoldenStore


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """cdna2_engine.load_model -> the fake engine; returns a fake checkpoint folder."""
    monkeypatch.setattr(cdna2_engine, "load_model", make_model)
    return write_fake_model(tmp_path / "model", seed=3)


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cdna2: error: "), err
    return err


def test_info_lists_devices(capsys):
    assert main(["info"]) == 0
    assert capsys.readouterr().out.startswith("cpu (")


@pytest.mark.parametrize("argv", [[], ["goldens"], ["goldens", "build", "--model", "m"], ["convert", "--hf", "x"],
                                  ["goldens", "build", "--model", "m", "--out", "o", "--steps", "many"],
                                  ["goldens", "build", "--model", "m", "--out", "o", "--tap-prompts", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    assert "usage: cdna2" in capsys.readouterr().err


def test_goldens_build_then_verify(fake_engine, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["hello", "import os"]))
    out = tmp_path / "g"
    argv = ["goldens", "build", "--model", str(fake_engine), "--out", str(out), "--prompts", str(prompts),
            "--steps", "3", "--quiet"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(f"wrote 2 prompts x 3 steps to {out} (")
    store = GoldenStore.open(out, expected_model_sha256=make_model(str(fake_engine)).checkpoint_sha256())
    assert store.manifest["dtype"] == "float64" and store.manifest["backend"] == "reference"

    assert main(argv) == 2  # never overwrites silently
    assert "goldens already exist at" in _err(capsys)
    assert main(argv + ["--regen"]) == 0
    capsys.readouterr()

    assert main(["goldens", "verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {out}: 4 files verified, 2 prompts, model sha256 ")


def test_goldens_build_with_an_engine_on_a_device(tmp_path, capsys):
    """--engine module:factory and --device: goldens from an engine that holds the model (the bundled float64
    reference on the CPU would take days for V4-Flash); the manifest names the engine. A bad --engine is one line
    and writes nothing."""
    import test_plugin_fake_engine as fake

    model, out = write_fake_model(tmp_path / "m", seed=3), tmp_path / "g"
    before = len(fake.LOADS)
    argv = ["goldens", "build", "--model", str(model), "--out", str(out), "--steps", "2", "--quiet",
            "--engine", "test_plugin_fake_engine:make_model", "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0
    assert fake.LOADS[before:] == [(str(model), "cpu", "reference")]
    store = GoldenStore.open(out, expected_model_sha256=make_model(str(model)).checkpoint_sha256())
    assert store.manifest["versions"]["engine"].startswith("test_plugin_fake_engine ")
    capsys.readouterr()

    bad = ["goldens", "build", "--model", str(model), "--out", str(tmp_path / "g2"), "--engine", "nope:make"]
    assert main(bad) == 2
    assert "--engine=nope:make: cannot import 'nope'" in _err(capsys) and not (tmp_path / "g2").exists()
    assert main(bad[:-2] + ["--device", "cuda:7"]) == 2  # --cdna2-device's reading and message
    assert "--device" in _err(capsys) and not (tmp_path / "g2").exists()


class _Unnamed:
    """An engine that names no checkpoint sha256 (the Model API does not ask for one)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "checkpoint_sha256":
            raise AttributeError(name)
        return getattr(self.inner, name)


def make_unnamed(path: str, *, device: str = "cpu", backend: str = "reference", dtype: str | None = None):
    assert isinstance(dtype, str), f"dtype passed as {dtype!r}, not a name as pytest and bisect pass it"
    return _Unnamed(make_model(path, device=device, backend=backend))


def test_goldens_of_an_engine_without_a_sha_name_the_folder(tmp_path, capsys):
    """The store is tied to an official-layout folder by its sha256 when the engine names none, so `verify
    --model` accepts it; dtype reaches the factory as a name."""
    from cdna2_engine.checkpoint import checkpoint_sha256

    model = write_fake_model(tmp_path / "m", seed=3)
    (model / "config.json").write_text("{}")
    out = tmp_path / "g"
    assert main(["goldens", "build", "--model", str(model), "--out", str(out), "--steps", "2", "--quiet",
                 "--engine", "test_cli:make_unnamed"]) == 0
    assert GoldenStore.open(out).manifest["model_sha256"] == checkpoint_sha256(model)


def test_goldens_verify_against_a_model_loads_no_weights(tmp_path, capsys, monkeypatch):
    """--model is checked by its files' sha256 and its config.json (the recorded selections' bounds), as the
    bundled engine that built the store names it, without loading it: V4-Flash would take ~160 GB of memory."""
    import cdna2_engine

    from tiny_configs import make_checkpoint, make_config

    cfg = make_config("csa-only", vocab_size=256)  # byte-level prompts
    model, other = make_checkpoint(tmp_path / "m", cfg, seed=1), make_checkpoint(tmp_path / "o", cfg, seed=2)
    out = tmp_path / "g"
    assert main(["goldens", "build", "--model", str(model), "--out", str(out), "--steps", "2", "--quiet"]) == 0
    capsys.readouterr()
    store = GoldenStore.open(out)  # taps, the bulk of a store, for the first 4 of the 16 default prompts only
    assert [bool(store.taps(p.name)) for p in store.prompts] == [True] * 4 + [False] * 12

    def no_load(*a, **k):
        raise AssertionError("verify loaded the model")

    monkeypatch.setattr(cdna2_engine, "load_model", no_load)
    assert main(["goldens", "verify", str(out), "--model", str(model)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {out}: ")
    assert main(["goldens", "verify", str(out), "--model", str(other)]) == 1
    assert "but the model under test has sha256" in _err(capsys)
    (other / "model.safetensors").unlink()  # config.json alone: no checkpoint, not a mismatch
    assert main(["goldens", "verify", str(out), "--model", str(other)]) == 2
    assert "no *.safetensors files: point at a checkpoint folder" in _err(capsys)
    (other / "config.json").unlink()
    assert main(["goldens", "verify", str(out), "--model", str(other)]) == 2
    assert "config.json" in _err(capsys)


def test_goldens_verify_flipped_byte_exits_1(fake_engine, tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["goldens", "build", "--model", str(fake_engine), "--out", str(out), "--steps", "1", "--quiet"]) == 0
    f = out / "teacher.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    assert main(["goldens", "verify", str(out)]) == 1
    assert f"golden file {f}: sha256 " in _err(capsys)


def test_bad_input_exits_2_with_one_line(fake_engine, tmp_path, capsys):
    assert main(["goldens", "build", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "g")]) == 2
    assert f"--model {tmp_path / 'nope'} is not a folder" in _err(capsys)
    try:  # a bad --steps may be caught by argparse (SystemExit) or by the command (return value)
        code = main(["goldens", "build", "--model", str(fake_engine), "--out", str(tmp_path / "g"), "--steps", "0"])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--steps" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text("{")
    argv = ["goldens", "build", "--model", str(fake_engine), "--out", str(tmp_path / "g"), "--prompts", str(bad)]
    assert main(argv) == 2
    assert "not valid JSON" in _err(capsys)
    assert main(["goldens", "verify", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _err(capsys)
    assert main(["convert", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "--hf" in _err(capsys)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    (tmp_path / "hf").mkdir()
    assert main(["convert", "--hf", str(tmp_path / "hf"), "--out", str(a_file)]) == 2
    assert f"--out {a_file} is a file" in _err(capsys)
    argv = ["goldens", "build", "--model", str(fake_engine), "--out", str(a_file / "sub"), "--quiet"]
    assert main(argv) == 2  # the folder cannot be made: an OSError named in one line, not a traceback
    assert str(a_file) in _err(capsys)
    assert a_file.read_text() == ""


def test_convert_calls_the_engine(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(cdna2_engine, "convert_hf_checkpoint", lambda src, dst: calls.append((src, dst)))
    (tmp_path / "hf").mkdir()
    assert main(["convert", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "off")]) == 0
    assert calls == [(str(tmp_path / "hf"), str(tmp_path / "off"))]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["convert", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in _err(capsys)


@pytest.mark.skipif(shutil.which("cdna2") is None, reason="console script not installed (pip install -e .)")
def test_console_script_is_installed():
    r = subprocess.run(["cdna2", "goldens"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "usage: cdna2 goldens" in r.stderr


def test_bisect_device_takes_the_forms_of_cdna2_device(monkeypatch, tmp_path, capsys):
    """`--device 1` and `--device cuda:1` name the same GPU, as `--cdna2-device` reads them; a list or a typo is one
    line."""
    import pytest_cdna2.bisect as bisect
    from pytest_cdna2 import devices

    seen = []
    monkeypatch.setattr(bisect, "bisect_run", lambda *a, device, **k: seen.append(device) or [])
    monkeypatch.setattr(devices, "_gpu_count", lambda: 2)
    argv = ["bisect", "--model", str(tmp_path), "--goldens", str(tmp_path), "--device"]
    for spec in ("cpu", "1", "cuda:1"):
        assert main(argv + [spec]) == 0
    assert seen == ["cpu", "cuda:1", "cuda:1"]
    assert main(argv + ["0,1"]) == 2
    assert "--device=0,1: bisect runs on one device: cpu, N or cuda:N" in _err(capsys)
    assert main(argv + ["gpu"]) == 2
    assert "--device='gpu': expected cpu, N (or cuda:N), N,M or all" in _err(capsys)
    import pytest_cdna2.engines as engines

    monkeypatch.setattr(engines, "has_device", lambda dev: True)  # a host that has them (test_bisect: one lacking)
    for spec in ("mps", "xpu:0", "cuda"):  # another accelerator's torch name, for a user engine: as torch reads it
        assert main(argv + [spec]) == 0
    assert seen[-3:] == ["mps", "xpu:0", "cuda"]
    for spec in ("7", "cuda:7"):  # --cdna2-device's forms keep its message, which lists the devices
        assert main(argv + [spec]) == 2
        assert f"--device={spec}: GPU 7 does not exist (available: cpu; GPUs: " in _err(capsys)


def test_bisect_engine_takes_the_form_of_cdna2_engine(tmp_path, capsys):
    argv = ["bisect", "--model", str(tmp_path), "--goldens", str(tmp_path), "--device", "cpu", "--engine"]
    for spec in ("os", "os:", ":f"):
        assert main(argv + [spec]) == 2
        assert f"--engine={spec}: expected bundled or module:factory" in _err(capsys)


def test_goldens_build_refuses_steps_past_the_model_positions_before_writing(tmp_path, capsys):
    out = tmp_path / "g"
    from pytest_cdna2.plugin import DEFAULT_MODEL

    argv = ["goldens", "build", "--model", str(DEFAULT_MODEL), "--out", str(out), "--steps", "99999", "--quiet"]
    assert main(argv) == 2
    err = _err(capsys)
    assert "prompt p00: " in err and " tokens + 99999 steps exceed the model's max_position_embeddings 4096: lower " \
        "the steps (--steps)" in err
    assert not out.exists()


def test_goldens_build_into_the_current_folder(fake_engine, tmp_path, monkeypatch, capsys):
    """`--out .` is the folder it names, its temporary folder beside it (it was made inside, and a build of minutes
    ended refusing the folder it had just filled); a folder that cannot take the store is refused before the engine
    loads."""
    import test_plugin_fake_engine as fake

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["goldens", "build", "--model", str(fake_engine), "--out", ".", "--steps", "2", "--quiet"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(f"wrote 16 prompts x 2 steps to {here} (")
    assert GoldenStore.open(here).steps == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["here", "model"]
    monkeypatch.chdir(here)  # the empty folder was swapped for the store, as any --out is: a shell there does `cd .`
    assert main(argv + ["--regen"]) == 0  # the current folder's store replaced, nothing left beside it
    assert GoldenStore.open(here).steps == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["here", "model"]
    capsys.readouterr()

    before = len(fake.LOADS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "other")
    assert main(argv) == 2
    assert f"{tmp_path / 'other'} is not empty and has no manifest.json" in _err(capsys)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(argv[:5] + [str(a_file / "sub")]) == 2
    assert f"{a_file / 'sub'} cannot be written: {a_file} is not a folder; pass another folder" in _err(capsys)
    assert len(fake.LOADS) == before and (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("argv, option", [
    (["goldens", "verify", ""], "DIR"),
    (["goldens", "verify", "G", "--model", ""], "--model"),
    (["goldens", "build", "--model", "", "--out", "o"], "--model"),
    (["goldens", "build", "--model", "m", "--out", ""], "--out"),
    (["goldens", "build", "--model", "m", "--out", "o", "--prompts", ""], "--prompts"),
    (["bisect", "--model", "", "--goldens", "G"], "--model"),
    (["bisect", "--model", "m", "--goldens", ""], "--goldens"),
    (["bisect", "--model", "m", "--goldens", "G", "--tolerance", ""], "--tolerance"),
    (["convert", "--hf", "", "--out", "o"], "--hf"),
    (["convert", "--hf", "h", "--out", ""], "--out"),
])
def test_an_empty_path_is_refused_not_the_current_folder(argv, option, tmp_path, monkeypatch, capsys):
    """As the pytest options: '' never quietly means `.` (a golden store, a checkpoint there, or a default)."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert f"cdna2: error: {option}='': empty: expected a path (write . for the current folder)" in _err(capsys)
    assert list(tmp_path.iterdir()) == []
