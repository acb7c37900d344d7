"""The weight tier's pass (pytest_cdna2/weights.py): it finds each kind of bad packed tensor by name, and it
holds one tensor at a time, which is what lets the tier check V4-Flash's ~160 GB on an ordinary host."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from cdna2_engine import checkpoint
from cdna2_engine.checkpoint import CheckpointError
from pytest_cdna2 import weights
from pytest_cdna2.weights import FP8, MXFP4, SCALES, scan_checkpoint, scan_weights

from tiny_configs import make_checkpoint, make_config

pytest.importorskip("ml_dtypes", reason="the pass's independent decoder")  # in the dev extra: CI has it
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("scan"), make_config("mixed"), seed=5, shard_bytes=60_000)


SCANS = pytest.mark.parametrize("scan_fn", [scan_weights, scan_checkpoint])  # the files read directly; the reader


@SCANS
def test_a_good_checkpoint_has_no_problems(model, scan_fn):
    """Every packed tensor is visited and one of each stored shape decoded both ways."""
    sd = {k: v for f in model.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    packed = [(sd[k].dtype, sd[k].shape, sd[k.removesuffix(".weight") + ".scale"].shape) for k in sd
              if k.endswith(".weight") and k.removesuffix(".weight") + ".scale" in sd]
    kinds = Counter(FP8 if dtype == torch.float8_e4m3fn else MXFP4 for dtype, _, _ in set(packed))
    scan = scan_fn(model, CPU)
    assert scan.problems == {}
    assert scan.tensors == len(packed) > 60 and scan.decoded == kinds and kinds[FP8] > 3 and kinds[MXFP4] == 2


def _edit(model, tmp_path, fn):
    import shutil

    folder = shutil.copytree(model, tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        sd = load_file(str(f))
        if fn(sd):
            save_file(sd, str(f), metadata={"format": "pt"})
    return folder


NAN_KEY = "layers.2.ffn.experts.3.w2.scale"


def _with_nan_scale(model, tmp_path):
    def nan(sd):
        if NAN_KEY in sd:
            sd[NAN_KEY].view(torch.uint8)[1, 0] = 255
            return True

    return _edit(model, tmp_path, nan)


def test_a_nan_scale_is_named(model, tmp_path):
    scan = scan_weights(_with_nan_scale(model, tmp_path), CPU)
    assert scan.problems == {SCALES: [f"{NAN_KEY.removesuffix('.scale')}.weight: 1 NaN (0xFF) scales"]}


@SCANS
@pytest.mark.parametrize("kind, decoder", [(FP8, "fp8_block_dequantize"), (MXFP4, "mxfp4_dequantize")])
def test_a_decoder_one_bit_off_is_named(model, monkeypatch, kind, decoder, scan_fn):
    """The engine's decoder with every scale read one exponent high (2x) fails on every shape of its format."""
    real = getattr(weights.formats, decoder)
    monkeypatch.setattr(weights.formats, decoder, lambda w, s, dtype: real(w, s, dtype=dtype) * 2)
    scan = scan_fn(model, CPU)
    assert set(scan.problems) == {kind} and len(scan.problems[kind]) == scan.decoded[kind]
    assert f"{kind.upper()} decode differs at" in scan.problems[kind][0]


def _watched_open(seen):
    """safe_open as the pass uses it, calling seen(key, tensor) on every tensor read."""
    real_open = weights.safe_open

    class Watched:
        def __init__(self, *a, **k):
            self.h = real_open(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_tensor(self, key):
            t = self.h.get_tensor(key)
            seen(key, t)
            return t

    return Watched


@pytest.mark.parametrize("through", ["files", "reader"])
def test_the_pass_holds_one_tensor_at_a_time(model, monkeypatch, through):
    """Tensors read from the files die when the pass moves on (weak references), read directly or by the reader
    (the suite's path for the official layout): a list of them all would need V4-Flash's ~160 GB of host memory."""
    alive, most = [], [0]

    def seen(key, t):
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(t)]
        most[0] = max(most[0], len(alive))

    if through == "files":
        monkeypatch.setattr(weights, "safe_open", _watched_open(seen))
        scan = scan_weights(model, CPU)
    else:
        get = checkpoint._Files.get

        def watched(self, key, part=None):
            t = get(self, key, part)
            seen(key, t)
            return t

        monkeypatch.setattr(checkpoint._Files, "get", watched)
        scan = scan_checkpoint(model, CPU)
    # a constant, whatever the checkpoint's size: the tensor before and its scale, still bound in the pass's loop
    # while the next two are read (4), and through the reader one more; a scan that kept what it read: 261
    assert scan.tensors > 60 and most[0] <= {"files": 4, "reader": 5}[through], \
        f"{most[0]} tensors alive at once over {scan.tensors}"


@SCANS
def test_a_scale_stored_in_float_is_named(model, tmp_path, scan_fn):
    """The reader takes power-of-two float scales; the official layout stores UE8M0 bytes, which this tier holds
    the checkpoint to (and the tensor is not decoded: read as bytes, its scales would be wrong for that reason)."""
    key = "layers.0.attn.wq_a.scale"

    def to_float(sd):
        if key in sd:
            sd[key] = sd[key].float()
            return True

    scan = scan_fn(_edit(model, tmp_path, to_float), CPU)
    assert scan.problems == {SCALES: [f"{key.removesuffix('.scale')}.weight: scale dtype torch.float32, expected "
                                      "float8_e8m0fnu"]}


@pytest.mark.parametrize("prefix", ["", "model."])
def test_the_reader_pass_reads_each_stored_tensor_once(model, monkeypatch, tmp_path, prefix):
    """Through the reader, the weight tier reads the checkpoint once (V4-Flash: ~160 GB from disk, not twice),
    also when its keys are stored under other names (a `model.` prefix, which the reader strips: a review found
    every packed tensor read and counted twice)."""
    if prefix:
        model = _edit(model, tmp_path, lambda sd: [sd.update({prefix + k: sd.pop(k)}) for k in list(sd)] or True)
        (model / "model.safetensors.index.json").unlink(missing_ok=True)  # it names the keys without the prefix
    reads, get = Counter(), checkpoint._Files.get
    monkeypatch.setattr(checkpoint._Files, "get", lambda self, key, part=None: reads.update([key]) or
                        get(self, key, part))
    # the files are opened again for the keys the reader skips (none here): headers only
    monkeypatch.setattr(weights, "safe_open", _watched_open(lambda key, t: reads.update([key])))
    scan = scan_checkpoint(model, CPU)
    stored = {k for f in model.glob("*.safetensors") for k in load_file(str(f))}
    assert scan.tensors == 130 and set(reads) == stored and max(reads.values()) == 1, reads.most_common(3)


def test_packed_tensors_the_engine_does_not_read_are_checked_too(model, tmp_path):
    """V4-Flash's multi-token-prediction layers (`mtp.*`, not used by the engine, skipped by its reader) are
    still scanned: a NaN scale there is named."""
    def add_mtp(sd):
        if "layers.0.attn.wq_a.weight" in sd:
            sd["mtp.0.attn.wq_a.weight"] = sd["layers.0.attn.wq_a.weight"].clone()
            sd["mtp.0.attn.wq_a.scale"] = sd["layers.0.attn.wq_a.scale"].clone()
            sd["mtp.0.attn.wq_a.scale"].view(torch.uint8)[0, 0] = 255
            return True

    folder = _edit(model, tmp_path, add_mtp)
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)  # the index would not list the new keys
    scan = scan_checkpoint(folder, CPU)
    assert scan.problems == {SCALES: ["mtp.0.attn.wq_a.weight: 1 NaN (0xFF) scales"]}


def test_the_reader_pass_stops_at_a_nan_scale_in_one_line(model, tmp_path):
    """In the official layout the reader refuses a NaN UE8M0 scale, as loading would: one line naming it."""
    with pytest.raises(CheckpointError, match=f"key {NAN_KEY} has NaN \\(0xFF\\) UE8M0 scales"):
        scan_checkpoint(_with_nan_scale(model, tmp_path), CPU)
