"""Bisection names the first drifting tap (layer and sub-block) and, on the triton backend, the kernel
whose switch back to its reference removes the failure."""

from __future__ import annotations

import pytest
import torch

import cdna2_engine
import cdna2_engine.ops.triton as tri
from cdna2_engine.ops import OP_NAMES, reference
from pytest_cdna2.bisect import BLOCKS, first_drift, tap_order
from pytest_cdna2.cli import main
from pytest_cdna2.goldens import build_goldens

from tiny_configs import make_checkpoint, make_config


def test_tap_order_is_forward_order():
    names = ["1.ffn", "0.attn", "1.attn_in", "0.ffn_out", "10.attn", "0.attn_in", "x", "2.bogus"]
    assert tap_order(names) == ["0.attn_in", "0.attn", "0.ffn_out", "1.attn_in", "1.ffn", "10.attn"]


def test_first_drift_names_the_earliest_tap_over_its_limit():
    g = torch.Generator().manual_seed(0)
    expected = {n: torch.randn(5, 8, generator=g) for n in ("0.attn_in", "0.attn_out", "0.attn", "1.ffn_out")}
    actual = {n: t.clone() for n, t in expected.items()}
    actual["0.attn"] += 1.0  # later taps inherit the error; the first one over names the block
    actual["1.ffn_out"] += 1.0
    d = first_drift(actual, expected, 1e-3)
    assert (d.tap, d.layer, d.block) == ("0.attn", 0, BLOCKS["attn"]) and d.rel > 1e-3
    assert "first drift at layer 0 hyper-connection (post-attention mix)" in str(d)
    assert first_drift(expected, expected, 1e-12) is None


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("bisect")
    cfg = make_config("csa-only", vocab_size=256)
    model = make_checkpoint(root / "model", cfg, seed=4)
    build_goldens(model, root / "goldens", [b"abc" * 6, b"xyz" * 5], 3, progress=False)
    return model, root / "goldens"


def test_cli_bisect_passes_a_correct_engine(small, capsys):
    model, goldens = small
    assert main(["bisect", "--model", str(model), "--goldens", str(goldens)]) == 0
    assert capsys.readouterr().out.splitlines() == ["p00: ok", "p01: ok"]


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "p99"], "no prompt 'p99' (have: p00, p01)"),
    (["--engine", "no_such_module_xyz:make"], "--engine=no_such_module_xyz:make: cannot import 'no_such_module_xyz'"),
    (["--engine", "os.path:join"], "--engine=os.path:join: join(a, *p) cannot be called as factory(path"),
])
def test_cli_bisect_bad_names_are_one_line(small, capsys, extra, message):
    model, goldens = small
    assert main(["bisect", "--model", str(model), "--goldens", str(goldens), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cdna2: error: ") and message in err, err


def test_cli_bisect_names_the_broken_kernel(small, capsys, monkeypatch):
    """Every triton op replaced by its reference except a broken rms_norm (epsilon 100x too large)."""
    model, goldens = small
    for op in OP_NAMES:
        monkeypatch.setattr(tri, op, getattr(reference, op), raising=False)
    monkeypatch.setattr(tri, "rms_norm", lambda x, w, eps: reference.rms_norm(x, w, eps * 1e5))
    loads = []
    load_model = cdna2_engine.load_model
    monkeypatch.setattr(cdna2_engine, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    assert main(["bisect", "--model", str(model), "--goldens", str(goldens), "--backend", "triton"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("p00: FAIL prompt p00:")
    assert "first drift at layer 0" in out and "(taps of prompt p00, the golden's selections forced)" in out
    assert "kernel: rms_norm (switching it back to the reference removes the failure)" in out
    assert len(loads) == 1  # the search switches the one model's ops (a model per op: two V4-Flash on one GPU)


def test_reference_ops_switch_the_ops_for_a_block(small):
    model = cdna2_engine.load_model(small[0], backend="triton")
    assert model.ops.rms_norm is tri.rms_norm and model.rope_main.ops is model.ops
    with model.reference_ops(["rms_norm", "rope"]) as m:
        assert m is model and m.ops.rms_norm is reference.rms_norm and m.ops.rope is reference.rope
        assert m.ops.linear is tri.linear and m.rope_c.ops is m.ops and m.ops.reference_ops == ("rms_norm", "rope")
    assert model.ops.rms_norm is tri.rms_norm and model.rope_c.ops is model.ops and not model.ops.reference_ops
    with pytest.raises(ValueError, match="unknown op"), model.reference_ops(["rms_nrm"]):
        pass
    assert model.ops.rms_norm is tri.rms_norm


class _Untraced:
    """The bundled engine without trace (optional in the Model API) and with noisy logits, so prompts fail."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "trace":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def forward(self, ids):
        out = self.inner.forward(ids)
        return out + torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)


def untraced(path, *, device="cpu", backend="reference", dtype=None):
    import cdna2_engine

    return _Untraced(cdna2_engine.load_model(path, device=device, backend=backend, dtype=dtype))


def test_cli_bisect_without_trace_says_why_it_cannot_locate(small, capsys):
    """An engine without trace is judged on its logits; where it drifts cannot be named, and bisect says so."""
    model, goldens = small
    assert main(["bisect", "--model", str(model), "--goldens", str(goldens), "--engine", "test_bisect:untraced"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("p00: FAIL ") and out[1] == ("  no drift location: the engine has no trace(ids, taps=, "
                                                          "selections=) (the README's Model API)"), out


def test_cli_goldens_build_needs_trace(small, capsys, tmp_path):
    model, _ = small
    argv = ["goldens", "build", "--model", str(model), "--out", str(tmp_path / "g"), "--engine", "test_bisect:untraced"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine=test_bisect:untraced returned _Untraced, not a model: it has no trace " \
        "(the README's Model API" in err
    assert not (tmp_path / "g").exists()


class _NoConfig:
    config = None

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def no_config(path, *, device="cpu", backend="reference", dtype=None):
    import cdna2_engine

    return _NoConfig(cdna2_engine.load_model(path, device=device, backend=backend, dtype=dtype))


def test_cli_bisect_refuses_an_engine_without_the_model_api(small, capsys):
    model, goldens = small
    assert main(["bisect", "--model", str(model), "--goldens", str(goldens), "--engine", "test_bisect:no_config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it has no config.vocab_size, config.num_hidden_layers" in err, err


def raises_loading(path, *, device="cpu", backend="reference", dtype=None):
    raise RuntimeError("no such checkpoint format")


def raises_key(path, *, device="cpu", backend="reference", dtype=None):
    return {}["layers.0.attn.wq"]  # a KeyError, which the CLI's own one-line handlers catch too


def raises_missing(path, *, device="cpu", backend="reference", dtype=None):
    return open("/nonexistent/tokenizer.json")  # an OSError


reexported = raises_missing  # a factory that lives in another module than the spec names: see the test below


class _Broken:
    """The bundled engine whose forward and generate raise, or (short) whose logits lack the last vocabulary entry."""

    def __init__(self, inner, short):
        self.inner, self.short = inner, short

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, ids):
        if self.short:
            return self.inner.forward(ids)[..., :-1]
        raise RuntimeError("kernel launch failed")

    def generate(self, ids, n, selections=None):
        raise RuntimeError("kernel launch failed")


def raises_running(path, *, device="cpu", backend="reference", dtype=None, short=False):
    return _Broken(cdna2_engine.load_model(path, device=device, backend=backend, dtype=dtype), short)


def short_vocab(path, *, device="cpu", backend="reference", dtype=None):
    return raises_running(path, device=device, backend=backend, dtype=dtype, short=True)


def on_gpu0(path, *, device="cpu", backend="reference", dtype=None):
    model = cdna2_engine.load_model(path, device=device, backend=backend, dtype=dtype)
    model.device = torch.device("cuda:0")  # whatever it was given
    return model


@pytest.mark.parametrize("engine, message", [
    ("raises_loading", "raised RuntimeError: no such checkpoint format"),
    ("raises_running", "raised RuntimeError: kernel launch failed"),
    ("raises_key", "raised KeyError: 'layers.0.attn.wq'"),
    ("raises_missing", "raised FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/tokenizer.json'"),
    ("on_gpu0", "returned an engine on cuda:0 (asked for cpu), which this host does not have: load it on the device "
                "the factory is given"),
])
@pytest.mark.parametrize("command", ["bisect", "build"])
def test_cli_a_user_engine_that_raises_or_sits_elsewhere_is_one_line(small, capsys, tmp_path, monkeypatch, engine,
                                                                     message, command):
    """Bad input, not a traceback: the engine named, the exception's type and message (a device the host lacks
    crashed in torch: 'Torch not compiled with CUDA enabled'); nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, goldens = small
    argv = (["bisect", "--goldens", str(goldens)] if command == "bisect" else
            ["goldens", "build", "--out", str(tmp_path / "g"), "--steps", "1", "--quiet"])
    assert main(argv + ["--model", str(model), "--engine", f"test_bisect:{engine}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"cdna2: error: --engine=test_bisect:{engine} {message}\n", err
    assert not (tmp_path / "g").exists()


def test_cli_a_factory_imported_from_another_module_is_named_too(small, capsys, tmp_path, monkeypatch):
    """--engine reexp:factory where reexp.py only imports the factory from this module: the error is still the
    engine's (its traceback never enters reexp.py)."""
    (tmp_path / "reexp.py").write_text("from test_bisect import reexported as factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, goldens = small
    argv = ["bisect", "--model", str(model), "--goldens", str(goldens), "--engine", "reexp:factory"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("cdna2: error: --engine=reexp:factory raised FileNotFoundError:")


def test_cli_a_device_the_host_lacks_is_named_before_the_engine_loads(small, capsys, monkeypatch):
    """--device mps (or cuda) on a host without one: the option is wrong, not the engine that would load there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, goldens = small
    for dev in ("mps", "cuda"):
        argv = ["bisect", "--model", str(model), "--goldens", str(goldens), "--engine", "test_bisect:raises_loading",
                "--device", dev]
        assert main(argv) == 2
        assert capsys.readouterr().err == f"cdna2: error: --device={dev}: this host has no such device (cpu, N or " \
            "cuda:N for its GPUs)\n"


def test_cli_bisect_logits_of_another_shape_fail_the_check(small, capsys):
    """A wrong output (one vocabulary entry short) is a failed check naming the prompt, exit 1, not bad input."""
    model, goldens = small
    argv = ["bisect", "--model", str(model), "--goldens", str(goldens), "--engine", "test_bisect:short_vocab"]
    assert main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "p00: FAIL prompt p00: shapes differ: actual (1, 20, 255) vs expected (1, 20, 256)", out
