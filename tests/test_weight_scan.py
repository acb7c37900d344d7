"""The weight tier's pass (pytest_cdna2/weights.py): it finds each kind of bad packed tensor by name, and it
holds one tensor at a time, which is what lets the tier check V4-Flash's ~160 GB on an ordinary host."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from pytest_cdna2 import weights
from pytest_cdna2.weights import FP8, MXFP4, SCALES, scan_weights

from tiny_configs import make_checkpoint, make_config

pytest.importorskip("ml_dtypes", reason="the pass's independent decoder")  # in the dev extra: CI has it
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("scan"), make_config("mixed"), seed=5, shard_bytes=60_000)


def test_a_good_checkpoint_has_no_problems(model):
    """Every packed tensor is visited and one of each stored shape decoded both ways."""
    sd = {k: v for f in model.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    packed = [(sd[k].dtype, sd[k].shape, sd[k.removesuffix(".weight") + ".scale"].shape) for k in sd
              if k.endswith(".weight") and k.removesuffix(".weight") + ".scale" in sd]
    kinds = Counter(FP8 if dtype == torch.float8_e4m3fn else MXFP4 for dtype, _, _ in set(packed))
    scan = scan_weights(model, CPU)
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


def test_a_nan_scale_is_named(model, tmp_path):
    key = "layers.2.ffn.experts.3.w2.scale"

    def nan(sd):
        if key in sd:
            sd[key].view(torch.uint8)[1, 0] = 255
            return True

    scan = scan_weights(_edit(model, tmp_path, nan), CPU)
    assert scan.problems == {SCALES: [f"{key.removesuffix('.scale')}.weight: 1 NaN (0xFF) scales"]}


@pytest.mark.parametrize("kind, decoder", [(FP8, "fp8_block_dequantize"), (MXFP4, "mxfp4_dequantize")])
def test_a_decoder_one_bit_off_is_named(model, monkeypatch, kind, decoder):
    """The engine's decoder with every scale read one exponent high (2x) fails on every shape of its format."""
    real = getattr(weights.formats, decoder)
    monkeypatch.setattr(weights.formats, decoder, lambda w, s, dtype: real(w, s, dtype=dtype) * 2)
    scan = scan_weights(model, CPU)
    assert set(scan.problems) == {kind} and len(scan.problems[kind]) == scan.decoded[kind]
    assert f"{kind.upper()} decode differs at" in scan.problems[kind][0]


def test_the_pass_holds_one_tensor_at_a_time(model, monkeypatch):
    """Tensors read from the files die when the pass moves on (weak references): a list of them all would
    need V4-Flash's ~160 GB of host memory."""
    real_open, alive, most = weights.safe_open, [], [0]

    class Counting:
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
            alive[:] = [r for r in alive if r() is not None] + [weakref.ref(t)]
            most[0] = max(most[0], len(alive))
            return t

    monkeypatch.setattr(weights, "safe_open", Counting)
    scan = scan_weights(model, CPU)
    # 4: the tensor before and its scale, still bound in the pass's loop while the next two are read
    assert scan.tensors > 60 and most[0] <= 4, f"{most[0]} tensors alive at once over {scan.tensors}"


def test_a_scale_stored_in_float_is_named(model, tmp_path):
    """The reader takes power-of-two float scales; the official layout stores UE8M0 bytes, which this tier holds
    the checkpoint to (and the tensor is not decoded: read as bytes, its scales would be wrong for that reason)."""
    key = "layers.0.attn.wq_a.scale"

    def to_float(sd):
        if key in sd:
            sd[key] = sd[key].float()
            return True

    scan = scan_weights(_edit(model, tmp_path, to_float), CPU)
    assert scan.problems == {SCALES: [f"{key.removesuffix('.scale')}.weight: scale dtype torch.float32, expected "
                                      "float8_e8m0fnu"]}
