"""Checkpoint reading (engine/checkpoint.py, engine/config.py, load_model).

Every bad input is built from a good official-layout checkpoint (FP8 + UE8M0 128x128 scales, MXFP4 routed
experts) copied into tmp_path, and must give one `CheckpointError` / `ConfigError` line that names the
file and the key. Good variants of the layout (shards, float or `.weight_scale_inv` scales, unquantized
linears) must load to the same weights and logits, and packed weights must stay packed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cdna2_engine import CheckpointError, ConfigError, checkpoint, load_model
from cdna2_engine.checkpoint import INDEX_FILE, convert_hf_checkpoint, read_checkpoint
from cdna2_engine.config import QUANTIZATION_CONFIG
from cdna2_engine.ops import QWeight

from tiny_configs import make_checkpoint, make_config

IDS = torch.tensor([[5, 17, 3, 88, 42, 0, 96, 11, 23, 7]])
ST = "model.safetensors"


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """The smallest config (two CSA layers): one official-layout model.safetensors, never modified."""
    return make_checkpoint(tmp_path_factory.mktemp("good"), make_config("csa-only"), seed=3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The same model as `good`, written as shards with model.safetensors.index.json."""
    return make_checkpoint(tmp_path_factory.mktemp("sharded"), make_config("csa-only"), seed=3, shard_bytes=40_000)


@pytest.fixture(scope="module")
def good_logits(good) -> torch.Tensor:
    return load_model(good).forward(IDS)


@pytest.fixture
def ck(good, tmp_path) -> Path:
    """A private copy of the good checkpoint, to corrupt."""
    return Path(shutil.copytree(good, tmp_path / "ckpt"))


@pytest.fixture
def shards(sharded, tmp_path) -> Path:
    return Path(shutil.copytree(sharded, tmp_path / "shards"))


def edit_tensors(folder: Path, fn) -> Path:
    """Rewrite folder/model.safetensors after `fn` mutates its {key: tensor} dict; returns the file."""
    path = folder / ST
    sd = load_file(str(path))
    fn(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
    return path


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))
    return path


_DELETE = object()


def one_line(excinfo: pytest.ExceptionInfo, *parts) -> str:
    """The message is a single line and names every one of `parts` (file, key, ...)."""
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    for p in parts:
        assert str(p) in msg, f"{p!r} not named in {msg!r}"
    return msg


def set_byte(t: torch.Tensor, value: int, index=(0, 0)) -> torch.Tensor:
    t = t.clone()
    t.view(torch.uint8)[index] = value
    return t


def linear_scales(sd: dict) -> list[str]:
    return [k for k in sd if k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in sd]


def same_weights(a: dict, b: dict) -> None:
    """Bit-identical weights as read: same keys, same kind, same stored bytes and scale bytes."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, QWeight):
            assert isinstance(y, QWeight) and x.kind == y.kind, k
            assert x.data.dtype == y.data.dtype and torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8)), k
            assert (x.scale is None) == (y.scale is None), k
            if x.scale is not None:
                assert x.scale.dtype == y.scale.dtype == torch.float8_e8m0fnu, k
                assert torch.equal(x.scale.view(torch.uint8), y.scale.view(torch.uint8)), k
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), k


# ------------------------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", [
    "norm.weight",  # bf16
    "layers.1.hc_ffn_fn",  # fp32 hyper-connection
    "layers.0.attn.wq_b.weight",  # fp8 (its scale deleted too)
    "layers.1.ffn.experts.7.w3.weight",  # mxfp4 (its scale deleted too)
    "layers.0.attn.indexer.weights_proj.weight",  # bf16 linear
])
def test_missing_key(ck, key):
    def drop(sd):
        del sd[key]
        sd.pop(key.removesuffix(".weight") + ".scale", None)

    edit_tensors(ck, drop)
    with pytest.raises(CheckpointError, match=f"missing key {re.escape(key)}") as e:
        read_checkpoint(ck)
    one_line(e, ck, key)


def test_missing_scale_of_fp8_weight(ck):
    key = "layers.1.attn.wo_b.weight"
    path = edit_tensors(ck, lambda sd: sd.pop("layers.1.attn.wo_b.scale"))
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn but has no \.scale") as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("key", ["layers.0.attn.extra.weight", "layers.2.attn_norm.weight", "lm_head.bias"])
def test_unexpected_key(ck, key):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(key, torch.ones(96, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=f"unexpected key {re.escape(key)} \\(1 in all\\)") as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("extra, of", [
    ("layers.1.attn.wo_b.weight_scale_inv", "layers.1.attn.wo_b.scale"),  # both scale names
    ("model.embed_tokens.weight", "embed.weight"),  # a transformers name beside the official one
    ("model.layers.0.input_layernorm.weight", "layers.0.attn_norm.weight"),
])
def test_two_keys_for_one_tensor_are_refused(ck, extra, of):
    """Which of the two was loaded depended on set order (PYTHONHASHSEED); neither may be guessed."""
    path = edit_tensors(ck, lambda sd: sd.__setitem__(extra, torch.zeros_like(sd[of])))
    with pytest.raises(CheckpointError, match="are both .*: delete one of them") as e:
        read_checkpoint(ck)
    one_line(e, path, extra, of)


def test_mtp_keys_are_ignored(ck, good):
    """Multi-token-prediction weights of the official release are not part of the decoder: skipped."""
    edit_tensors(ck, lambda sd: sd.__setitem__("mtp.0.norm.weight", torch.ones(96, dtype=torch.bfloat16)))
    same_weights(read_checkpoint(ck)[1], read_checkpoint(good)[1])


# ------------------------------------------------------------------------------------------- shape and dtype


@pytest.mark.parametrize("key, new, match", [
    ("norm.weight", lambda t: t[:95], r"has shape \(95,\), config implies \(96,\)"),
    ("layers.0.hc_attn_fn", lambda t: t.T, r"has shape \(384, 24\), config implies \(24, 384\)"),
    ("embed.weight", lambda t: t[:, :64], r"has shape \(97, 64\), config implies \(97, 96\)"),
    ("layers.0.attn.wq_a.weight", lambda t: t[:, :95], r"has shape \(48, 95\), fp8 of logical \(48, 96\)"),
    ("layers.0.ffn.experts.2.w1.weight", lambda t: t[:32], r"has shape \(32, 48\), mxfp4 of logical \(64, 96\)"),
])
def test_wrong_shape(ck, key, new, match):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(key, new(sd[key])))
    with pytest.raises(CheckpointError, match=match) as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("key, dtype, match", [
    ("layers.0.attn_norm.weight", torch.int32, r"has dtype torch\.int32, expected torch\.bfloat16"),
    ("hc_head_fn", torch.float64, r"has dtype torch\.float64, expected torch\.float32: save it as one of "
                                  r"float32, bfloat16, float16"),
    ("layers.1.ffn.gate.bias", torch.int64, r"has dtype torch\.int64, expected torch\.float32"),
    ("layers.1.attn.wkv.weight", torch.int32, r"has dtype torch\.int32 beside a scale"),
])
def test_wrong_dtype(ck, key, dtype, match):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(key, sd[key].to(dtype)))
    with pytest.raises(CheckpointError, match=match) as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_tensors_stored_in_half_precision_are_upcast(ck, dtype):
    """bf16/fp16 -> fp32 is exact, so a checkpoint saved in bf16 (transformers' save_pretrained of a bf16 model)
    loads; the engine holds these tensors in float32."""
    keys = ["hc_head_fn", "layers.0.hc_attn_base", "layers.1.hc_ffn_scale", "layers.1.attn.attn_sink",
            "layers.0.attn.compressor.ape", "layers.1.ffn.gate.bias"]
    stored = {}

    def lower(sd):
        for k in keys:
            sd[k] = stored[k] = sd[k].to(dtype)

    edit_tensors(ck, lower)
    w = read_checkpoint(ck)[1]
    for k in keys:
        assert w[k].dtype == torch.float32 and torch.equal(w[k], stored[k].float()), k


@pytest.mark.parametrize("key, value", [
    ("layers.0.attn.q_norm.weight", float("nan")),  # bf16 norm
    ("layers.1.hc_attn_fn", float("inf")),  # fp32 hyper-connection
    ("hc_head_base", float("-inf")),
    ("head.weight", float("nan")),  # bf16 linear
])
def test_non_finite_values(ck, key, value):
    def poison(sd):
        t = sd[key].clone()
        t.view(-1)[t.numel() // 2] = value
        sd[key] = t

    path = edit_tensors(ck, poison)
    with pytest.raises(CheckpointError, match="has non-finite values") as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("value", [-1, 99])
def test_hash_routing_table_names_only_existing_experts(tmp_path, value):
    """tid2eid entries are expert ids: one outside 0..n_routed_experts-1 is refused at load, not an index error
    in the first forward."""
    ck = make_checkpoint(tmp_path / "hash", make_config("csa-only", num_hash_layers=1), seed=5)
    read_checkpoint(ck)  # as made, it loads
    keys = []

    def poison(sd):
        keys.append(next(k for k in sd if k.endswith("gate.tid2eid")))
        t = sd[keys[0]].clone()
        t.view(-1)[0] = value
        sd[keys[0]] = t

    path = edit_tensors(ck, poison)
    with pytest.raises(CheckpointError, match="holds expert ids outside 0..") as e:
        read_checkpoint(ck)
    one_line(e, path, keys[0])


def test_hash_routing_table_rows_may_repeat_an_expert(tmp_path):
    """A row naming one expert twice loads as stored (the forward weights each slot): not refused, not changed."""
    ck = make_checkpoint(tmp_path / "hash", make_config("csa-only", num_hash_layers=1), seed=5)
    key = "layers.0.ffn.gate.tid2eid"

    def repeat(sd):
        t = sd[key].clone()
        t[5, 1], t[7, 2] = t[5, 0], t[7, 0]
        sd[key] = t

    edit_tensors(ck, repeat)
    t = read_checkpoint(ck)[1][key]
    assert t[5, 1] == t[5, 0] and t[7, 2] == t[7, 0]


# ------------------------------------------------------------------------------------------- stacked experts


@pytest.fixture(scope="module")
def stacked(tmp_path_factory) -> Path:
    """The `good` model's dense weights with transformers' stacked experts: per layer gate_up_proj [E, 2I, D]
    (w1 rows, then w3) and down_proj [E, D, I]."""
    cfg = make_config("csa-only")
    sd = checkpoint.random_dense_state(cfg, seed=3)
    for i in range(cfg.num_hidden_layers):
        p = [f"layers.{i}.ffn.experts.{e}." for e in range(cfg.n_routed_experts)]
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(q + "w1.weight"), sd.pop(q + "w3.weight")]) for q in p])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([sd.pop(q + "w2.weight") for q in p])
    folder = tmp_path_factory.mktemp("stacked")
    checkpoint.write_checkpoint(folder, cfg, sd)
    return folder


def test_stacked_experts_load_as_per_expert(stacked, tmp_path):
    cfg = make_config("csa-only")
    checkpoint.write_checkpoint(tmp_path / "per-expert", cfg, checkpoint.random_dense_state(cfg, seed=3))
    same_weights(read_checkpoint(stacked)[1], read_checkpoint(tmp_path / "per-expert")[1])


@pytest.mark.parametrize("key, new, got", [
    ("gate_up_proj", lambda t: t[:7], (7, 128, 96)),  # fewer experts: was an IndexError
    ("gate_up_proj", lambda t: torch.cat([t, t[:1]]), (9, 128, 96)),  # more: the 9th was dropped
    ("gate_up_proj", lambda t: torch.cat([t, t[:, :64]], 1), (8, 192, 96)),  # 3I rows: the last I were dropped
    ("down_proj", lambda t: torch.cat([t, t[:1]]), (9, 96, 64)),
])
def test_stacked_experts_of_wrong_shape(stacked, tmp_path, key, new, got):
    key = f"model.layers.1.mlp.experts.{key}"
    want = (8, 128, 96) if key.endswith("gate_up_proj") else (8, 96, 64)
    folder = Path(shutil.copytree(stacked, tmp_path / "st"))
    path = edit_tensors(folder, lambda sd: sd.__setitem__(key, new(sd[key])))
    with pytest.raises(CheckpointError, match="the config.json does not match these weights") as e:
        read_checkpoint(folder)
    one_line(e, path, key, f"has shape {got}, config implies {want}")


# ------------------------------------------------------------------------------------------- quantized storage


@pytest.mark.parametrize("scale, shape, want", [
    ("layers.0.attn.wq_a.scale", (1, 2), r"scale grid of fp8 weight layers\.0\.attn\.wq_a\.weight \(48, 96\) must "
                                         r"be \(1, 1\)"),
    ("layers.0.attn.indexer.wq_b.scale", (1, 1), r"must be \(3, 1\)"),
    ("layers.1.ffn.experts.3.w2.scale", (96, 1), r"scale grid of mxfp4 weight layers\.1\.ffn\.experts\.3\.w2\.weight "
                                                 r"\(96, 64\) must be \(96, 2\)"),
    ("layers.0.ffn.experts.0.w1.scale", (3, 64), r"must be \(64, 3\)"),
])
def test_scale_grid_does_not_fit(ck, scale, shape, want):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(scale, torch.full(shape, 127, dtype=torch.uint8)
                                                      .view(torch.float8_e8m0fnu)))
    with pytest.raises(CheckpointError, match=want) as e:
        read_checkpoint(ck)
    one_line(e, path, scale)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_code(ck, code):
    key = "layers.1.attn.wo_a.weight"
    path = edit_tensors(ck, lambda sd: sd.__setitem__(key, set_byte(sd[key], code, (3, 5))))
    with pytest.raises(CheckpointError, match="has NaN FP8 codes") as e:
        read_checkpoint(ck)
    one_line(e, path, key)


@pytest.mark.parametrize("scale", ["layers.0.attn.wkv.scale", "layers.1.ffn.experts.5.w1.scale",
                                   "layers.0.ffn.shared_experts.w2.scale"])
def test_ue8m0_nan_scale_byte(ck, scale):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(scale, set_byte(sd[scale], 0xFF)))
    with pytest.raises(CheckpointError, match=r"NaN \(0xFF\) UE8M0 scales") as e:
        read_checkpoint(ck)
    one_line(e, path, scale)


@pytest.mark.parametrize("factor, match", [
    (1.5, "not powers of two"),
    (0.0, "non-positive or non-finite"),
    (-1.0, "non-positive or non-finite"),
    (float("nan"), "non-positive or non-finite"),
    (float("inf"), "non-positive or non-finite"),
])
def test_float_scales_must_be_positive_powers_of_two(ck, factor, match):
    scale = "layers.1.ffn.experts.6.w2.scale"

    def to_float(sd):
        s = sd[scale].float()
        s[10, 1] *= factor
        sd[scale] = s

    path = edit_tensors(ck, to_float)
    with pytest.raises(CheckpointError, match=match) as e:
        read_checkpoint(ck)
    one_line(e, path, scale)


def test_float_scale_outside_ue8m0_range_is_refused(ck):
    scale = "layers.0.attn.wq_a.scale"
    path = edit_tensors(ck, lambda sd: sd.__setitem__(scale, torch.full((1, 1), 2.0 ** -135)))
    with pytest.raises(CheckpointError, match=scale) as e:
        read_checkpoint(ck)
    one_line(e, path, scale)


# ------------------------------------------------------------------------------------------- files


@pytest.mark.parametrize("keep", [0.5, 0.9, 100, 5, 0])
def test_truncated_safetensors(ck, keep):
    path = ck / ST
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError, match="unreadable safetensors .*truncated or corrupt") as e:
        read_checkpoint(ck)
    one_line(e, path)


def test_truncated_shard(shards):
    path = sorted(shards.glob("*.safetensors"))[1]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="unreadable safetensors") as e:
        read_checkpoint(shards)
    one_line(e, path)


def test_shard_listed_in_index_is_missing(shards):
    path = sorted(shards.glob("*.safetensors"))[2]
    path.unlink()
    with pytest.raises(CheckpointError, match=f"listed in {re.escape(INDEX_FILE)} but missing") as e:
        read_checkpoint(shards)
    one_line(e, path)


def test_index_names_key_not_in_its_shard(shards):
    index = shards / INDEX_FILE
    d = json.loads(index.read_text())
    wm = d["weight_map"]
    key = "layers.1.ffn_norm.weight"
    other = next(f for f in sorted(set(wm.values())) if f != wm[key])
    wm[key] = other
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=f"key {re.escape(key)} listed in .* is not in that shard") as e:
        read_checkpoint(shards)
    one_line(e, shards / other, key)


def test_index_names_key_in_no_shard(shards):
    index = shards / INDEX_FILE
    d = json.loads(index.read_text())
    shard = d["weight_map"]["norm.weight"]
    d["weight_map"]["layers.0.attn.ghost.weight"] = shard
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="is not in that shard") as e:
        read_checkpoint(shards)
    one_line(e, shards / shard, "layers.0.attn.ghost.weight")


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}'])
def test_index_not_an_index(shards, text):
    (shards / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match="not a safetensors index") as e:
        read_checkpoint(shards)
    one_line(e, shards / INDEX_FILE)


def test_index_not_utf8(shards):
    (shards / INDEX_FILE).write_bytes(b'\xff\xfe{"weight_map": {}}')
    with pytest.raises(CheckpointError, match="not UTF-8 text .*regenerate it as UTF-8 JSON") as e:
        read_checkpoint(shards)
    one_line(e, shards / INDEX_FILE)


@pytest.mark.parametrize("text", ["[]", '{"weight_map": {"norm.weight": 3}}', '{"weight_map": []}'])
def test_index_of_wrong_json_types(shards, text):
    (shards / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match="not a safetensors index") as e:
        read_checkpoint(shards)
    one_line(e, shards / INDEX_FILE)


def test_key_in_two_files_is_refused(ck):
    """A stale extra file beside model.safetensors must not silently replace weights."""
    save_file({"norm.weight": torch.full((96,), 7.0, dtype=torch.bfloat16)}, str(ck / "zz-stale.safetensors"))
    with pytest.raises(CheckpointError, match="norm.weight") as e:
        read_checkpoint(ck)
    one_line(e, "zz-stale.safetensors", "norm.weight")


def test_folder_without_safetensors(ck):
    (ck / ST).unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files") as e:
        read_checkpoint(ck)
    one_line(e, ck)


@pytest.mark.parametrize("where", ["file", "missing"])
def test_path_that_is_not_a_folder(ck, where):
    path = ck / ST if where == "file" else ck / "no-such-dir"
    with pytest.raises(CheckpointError, match="not a folder") as e:
        load_model(path)
    one_line(e, path)


def test_model_safetensors_beside_an_index_of_other_shards_is_refused(shards, good):
    """transformers reads a folder's model.safetensors before its index: the two readers would load different
    weights, so a leftover of either is named."""
    shutil.copy(good / ST, shards / ST)
    with pytest.raises(CheckpointError, match=f"holds model.safetensors beside {re.escape(INDEX_FILE)}, which lists "
                                              "other files: delete the one that is stale") as e:
        load_model(shards)
    one_line(e, shards)


@pytest.mark.parametrize("name", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/x.safetensors", ".",
                                  "weights.bin"])
def test_index_shards_are_file_names_beside_it(shards, name):
    """A shard outside the folder would load unhashed by checkpoint_sha256 (goldens would still match a changed
    model); a subfolder's or a non-safetensors name is refused alike."""
    index = shards / INDEX_FILE
    d = json.loads(index.read_text())
    d["weight_map"][next(iter(d["weight_map"]))] = name
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="is not a .safetensors file name beside the index") as e:
        load_model(shards)
    one_line(e, index, repr(name))


def _rewrite_header(path: Path, fn) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(fn(json.loads(data[8:8 + n]))).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n:])


@pytest.mark.parametrize("corrupt", [
    lambda h: {k: (dict(v, data_offsets=None) if k != "__metadata__" else v) for k, v in h.items()},
    lambda h: {k: {kk: vv for kk, vv in v.items() if kk != "data_offsets"} for k, v in h.items()},
    lambda h: list(h),
    lambda h: {k: (dict(v, data_offsets=[5, 1]) if k != "__metadata__" else v) for k, v in h.items()},
])
def test_header_that_is_json_but_not_a_safetensors_header(ck, corrupt):
    """The load's memory check reads the headers before the reader (`weight_bytes`): a header of the wrong JSON
    shape is a CheckpointError there (the check leaves the naming to the reader), not a TypeError from inside it."""
    path = ck / ST
    _rewrite_header(path, corrupt)
    with pytest.raises(CheckpointError, match="unreadable safetensors header: the file is truncated or corrupt") as e:
        checkpoint.weight_bytes(ck)
    one_line(e, path)
    with pytest.raises(CheckpointError, match="unreadable safetensors .*: the file is truncated or corrupt") as e:
        load_model(ck)
    one_line(e, path)


def test_a_shard_that_is_not_a_regular_file(ck):
    """A FIFO named like a shard (the header read would wait on it forever) or a folder."""
    os.mkfifo(ck / "zz.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file") as e:
        load_model(ck)
    one_line(e, ck / "zz.safetensors")
    (ck / "zz.safetensors").unlink()
    (ck / "zz.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_model(ck)


def test_a_broken_link_without_an_index(ck, tmp_path):
    (ck / ST).rename(tmp_path / "moved.safetensors")
    (ck / ST).symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(CheckpointError, match="a broken link: copy the shard$") as e:
        load_model(ck)
    one_line(e, ck / ST)


def test_unreadable_files_say_permission(ck, shards, monkeypatch):
    """Permission denied is named with its fix for config.json, the index and a shard (root reads anything, so the
    denial is simulated where the reader asks)."""
    real_read, real_access = Path.read_text, os.access

    def deny(names):
        monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "no"))
                            if p.name in names else real_read(p, *a, **k))

    deny({"config.json"})
    with pytest.raises(ConfigError, match="permission denied: make it readable") as e:
        load_model(ck)
    one_line(e, ck / "config.json", "chmod a+r")
    deny({INDEX_FILE})
    with pytest.raises(CheckpointError, match="permission denied: make it readable") as e:
        load_model(shards)
    one_line(e, shards / INDEX_FILE)
    monkeypatch.setattr(Path, "read_text", real_read)
    monkeypatch.setattr(checkpoint.os, "access", lambda p, mode: Path(p).name != ST and real_access(p, mode))
    with pytest.raises(CheckpointError, match="permission denied: make it readable") as e:
        load_model(ck)
    one_line(e, ck / ST)


def test_config_json_that_is_a_folder(ck):
    (ck / "config.json").unlink()
    (ck / "config.json").mkdir()
    with pytest.raises(ConfigError, match="a folder where a file belongs") as e:
        load_model(ck)
    one_line(e, ck / "config.json")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.bool])
def test_scale_of_a_non_float_dtype(ck, dtype):
    """An exponent byte stored as uint8 (128 meaning 2^1) would read as the value 128 (2^7)."""
    scale = "layers.0.attn.wq_a.scale"
    path = edit_tensors(ck, lambda sd: sd.__setitem__(scale, sd[scale].view(torch.uint8).to(dtype)))
    with pytest.raises(CheckpointError, match=f"has dtype {dtype}: store UE8M0 scales as float8_e8m0fnu") as e:
        load_model(ck)
    one_line(e, path, scale)


@pytest.mark.parametrize("scale, byte, ok", [
    ("layers.0.attn.wq_a.scale", 127 + 119, True),  # FP8: 448 x 2^119 < 2^128
    ("layers.0.attn.wq_a.scale", 127 + 120, False),
    ("layers.1.ffn.experts.6.w2.scale", 127 + 125, True),  # MXFP4: 6 x 2^125 < 2^128
    ("layers.1.ffn.experts.6.w2.scale", 127 + 126, False),
])
def test_a_scale_that_overflows_float32(ck, scale, byte, ok):
    path = edit_tensors(ck, lambda sd: sd.__setitem__(scale, set_byte(sd[scale], byte)))
    if ok:
        read_checkpoint(ck)
        return
    with pytest.raises(CheckpointError, match=f"a scale of 2\\^{byte - 127}: times the largest .* overflows "
                                              "float32") as e:
        read_checkpoint(ck)
    one_line(e, path, scale)


# ------------------------------------------------------------------------------------------- config.json


def test_config_missing(ck):
    (ck / "config.json").unlink()
    with pytest.raises(ConfigError, match="not found") as e:
        read_checkpoint(ck)
    one_line(e, ck / "config.json")


def test_config_not_json(ck):
    (ck / "config.json").write_text('{"vocab_size": 97,')
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_model(ck)
    one_line(e, ck / "config.json")


@pytest.mark.parametrize("field", ["hidden_size", "compress_ratios", "num_experts_per_tok"])
def test_config_missing_required_field(ck, field):
    path = edit_config(ck, **{field: _DELETE})
    with pytest.raises(ConfigError, match=f"missing field\\(s\\) \\['{field}'\\]") as e:
        read_checkpoint(ck)
    one_line(e, path, field)


@pytest.mark.parametrize("changes, match, field", [
    (dict(compress_ratios=[4]), "compress_ratios has 1 entries for 2 layers", "compress_ratios"),
    (dict(compress_ratios=[4, 7]), r"must be 0, 4 or 128 \(integers\), got \[7\]", "compress_ratios"),
    (dict(compress_ratios=[4, 4.0]), r"must be 0, 4 or 128 \(integers\), got \[4.0\]", "compress_ratios"),
    (dict(hidden_size=100), "must be multiples of 32", "hidden_size"),
    (dict(moe_intermediate_size=40), "must be multiples of 32", "moe_intermediate_size"),
    (dict(num_hash_layers=3), "num_hash_layers 3 outside 0..2", "num_hash_layers"),
    (dict(scoring_func="relu"), "scoring_func 'relu'", "scoring_func"),
    (dict(index_topk=0), r"field index_topk must be >= 1, got 0", "index_topk"),
    (dict(num_hash_layers=-1, mlp_layer_types=_DELETE), r"field num_hash_layers must be >= 0, got -1",
     "num_hash_layers"),
    (dict(sliding_window=-3), "must be >= 1", "sliding_window"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps, rope_theta, compress_rope_theta and routed_scaling_factor must be > 0",
     "rms_norm_eps"),
    (dict(routed_scaling_factor=-1.5), "compress_rope_theta and routed_scaling_factor must be > 0",
     "routed_scaling_factor"),
    (dict(routed_scaling_factor=math.nan), r"field\(s\) \['routed_scaling_factor'\] must be finite numbers",
     "routed_scaling_factor"),
    (dict(hc_eps=math.inf), r"field\(s\) \['hc_eps'\] must be finite numbers", "hc_eps"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings True is not supported: V4 has its own lm_head",
     "tie_word_embeddings"),
    (dict(rope_scaling="yarn"), "field rope_scaling must be an object or null", "rope_scaling"),
    (dict(rope_scaling={"type": "yarn"}), "rope_scaling \\(yarn\\) needs a positive number factor", "rope_scaling"),
    (dict(rope_scaling={"type": "llama3", "factor": 8}), "rope_scaling type 'llama3' is not supported",
     "rope_scaling"),
    (dict(rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": "abc"}),
     "rope_scaling \\(yarn\\) beta_fast must be a number \\(finite\\), got 'abc'", "rope_scaling"),
    (dict(rope_scaling={"type": "yarn", "factor": math.nan, "original_max_position_embeddings": 64}),
     "rope_scaling \\(yarn\\) needs a positive number factor, got nan", "rope_scaling"),
    (dict(rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                        "attention_factor": 1.3}), "attention_factor 1.3 is not supported: .* use 1.0", "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported: V4's experts use silu", "hidden_act"),
    (dict(mlp_layer_types=["moe", "hash_moe"], num_hash_layers=_DELETE), "the hash_moe layers must come first",
     "mlp_layer_types"),
    (dict(mlp_layer_types=["moe", "dense"], num_hash_layers=_DELETE), "entries must be hash_moe or moe",
     "mlp_layer_types"),
    (dict(rope_scaling=None, rope_parameters={"compress": {"rope_type": "yarn", "factor": 16,
                                                           "original_max_position_embeddings": 64}}),
     "rope_parameters has compress without its other half: give both", "rope_parameters"),
    (dict(rope_scaling=None, rope_parameters={"main": {"rope_theta": 1e4}, "compress": {}}),
     "rope_parameters.compress has no rope_theta: .* write the compressed layers'", "rope_parameters"),
    (dict(rope_scaling=None, rope_parameters={"main": {"rope_type": "yarn", "factor": 4}, "compress": {
        "rope_theta": 1.6e5}}), "rope_parameters.main is 'yarn': V4 scales only the compressed", "rope_parameters"),
    (dict(mlp_layer_types=["hash_moe"]), "mlp_layer_types has 1 entries for 2 layers", "mlp_layer_types"),
    (dict(rope_scaling=None, rope_parameters={"main": {"rope_theta": 1e4}, "compress": {
        "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "rope_theta": 1.6e5}}),
     r"rope_parameters.compress \(yarn\) has no attention_factor: .* write \"attention_factor\": 1.0",
     "rope_parameters"),
    (dict(quantization_config={"quant_method": "int4"}), "quant_method 'int4' is not supported",
     "quantization_config"),
    (dict(quantization_config=dict(QUANTIZATION_CONFIG, weight_block_size=[64, 64])),
     r"quantization_config weight_block_size \[64, 64\] is not supported: this engine reads \[128, 128\]",
     "quantization_config"),
    (dict(quantization_config=dict(QUANTIZATION_CONFIG, fmt="e5m2")), "fmt 'e5m2' is not supported.* 'e4m3'",
     "quantization_config"),
    (dict(quantization_config=dict(QUANTIZATION_CONFIG, scale_fmt="float")), "scale_fmt 'float' .* 'ue8m0'",
     "quantization_config"),
    (dict(quantization_config=dict(QUANTIZATION_CONFIG, expert_dtype="int4")), "expert_dtype 'int4' .* 'fp4' or 'fp8'",
     "quantization_config"),
    (dict(quantization_config={"quant_method": "fp8"}, expert_dtype="int4"),  # V4's top-level place for it
     "quantization_config expert_dtype 'int4' is not supported", "expert_dtype"),
    (dict(mlp_layer_types=5, num_hash_layers=_DELETE), "field mlp_layer_types must be a list, got 5",
     "mlp_layer_types"),
    (dict(rope_parameters={"main": 5, "compress": {"rope_theta": 1e4}}),
     "field rope_parameters.main must be an object, got 5", "rope_parameters"),
    (dict(partial_rotary_factor="x", qk_rope_head_dim=_DELETE), "field partial_rotary_factor must be a number",
     "partial_rotary_factor"),
])
def test_config_inconsistent(ck, changes, match, field):
    path = edit_config(ck, **changes)
    with pytest.raises(ConfigError, match=match) as e:
        read_checkpoint(ck)
    one_line(e, path, field)


def test_config_without_num_hash_layers_names_the_default_it_took(ck):
    """Without num_hash_layers (or with mlp_layer_types null) transformers makes the first 3 layers hash-routed, and
    so does the engine: a checkpoint without their tables then says why it wanted them."""
    edit_config(ck, num_hash_layers=_DELETE, mlp_layer_types=None)
    with pytest.raises(CheckpointError, match=r"missing key layers.0.ffn.gate.tid2eid: .*num_hash_layers, 3 when "
                                              r"config.json leaves it out.*set it to the model's count, 0 for none"):
        read_checkpoint(ck)


@pytest.mark.parametrize("changes, key", [
    (dict(num_hidden_layers=1), "layers.1."),  # layer 1's tensors are left over
    (dict(hidden_size=128), "embed.weight"),
    (dict(n_routed_experts=4), "layers.0.ffn.gate.weight"),
    (dict(compress_ratios=[4, 128]), "layers.1.attn.compressor.ape"),
    (dict(vocab_size=98), "embed.weight"),
])
def test_config_of_another_model(ck, changes, key):
    edit_config(ck, **changes)
    with pytest.raises(CheckpointError, match="the config.json does not match these weights") as e:
        load_model(ck)
    one_line(e, ck / ST, key)


@pytest.mark.parametrize("quant", [{"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128, 128]},
                                   dict(QUANTIZATION_CONFIG, expert_dtype=_DELETE)])
def test_config_quantization_keys_may_be_absent(ck, good, quant):
    """Absent keys mean the official values; V4 keeps expert_dtype beside quantization_config, not in it."""
    edit_config(ck, quantization_config={k: v for k, v in quant.items() if v is not _DELETE}, expert_dtype="fp4")
    same_weights(read_checkpoint(ck)[1], read_checkpoint(good)[1])


def test_config_not_utf8(ck):
    (ck / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not UTF-8 text .*save it as UTF-8 JSON") as e:
        read_checkpoint(ck)
    one_line(e, ck / "config.json")


def test_config_not_an_object(ck):
    (ck / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        read_checkpoint(ck)
    one_line(e, ck / "config.json")


@pytest.mark.parametrize("field, value", [("hidden_size", "96"), ("num_hidden_layers", None), ("compress_ratios", 4)])
def test_config_field_of_wrong_type(ck, field, value):
    path = edit_config(ck, **{field: value})
    with pytest.raises(ConfigError) as e:
        read_checkpoint(ck)
    one_line(e, path, field)


def test_config_unknown_layer_type(ck):
    path = edit_config(ck, compress_ratios=_DELETE, layer_types=["compressed_sparse_attention", "full_attention"])
    with pytest.raises(ConfigError) as e:
        read_checkpoint(ck)
    one_line(e, path, "layer_types", "full_attention")


def test_config_more_experts_per_token_than_experts(ck):
    path = edit_config(ck, num_experts_per_tok=9)
    with pytest.raises(ConfigError) as e:
        read_checkpoint(ck)
    one_line(e, path, "num_experts_per_tok")


# ------------------------------------------------------------------------------------------- good layouts


def test_sharded_checkpoint_loads_bit_identical(good, sharded, good_logits):
    assert (sharded / INDEX_FILE).exists() and not (sharded / ST).exists()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    same_weights(read_checkpoint(sharded)[1], read_checkpoint(good)[1])
    assert torch.equal(load_model(sharded).forward(IDS), good_logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_float_power_of_two_scales_equal_ue8m0(ck, good, dtype):
    def to_float(sd):
        for k in linear_scales(sd):
            sd[k] = sd[k].to(dtype)

    path = edit_tensors(ck, to_float)
    assert load_file(str(path))["layers.0.attn.wq_a.scale"].dtype == dtype
    same_weights(read_checkpoint(ck)[1], read_checkpoint(good)[1])


def test_weight_scale_inv_name_accepted(ck, good, good_logits):
    def rename(sd):
        for k in linear_scales(sd):
            sd[k.removesuffix(".scale") + ".weight_scale_inv"] = sd.pop(k)

    path = edit_tensors(ck, rename)
    assert not linear_scales(load_file(str(path)))
    same_weights(read_checkpoint(ck)[1], read_checkpoint(good)[1])
    assert torch.equal(load_model(ck).forward(IDS), good_logits)


def fp8_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent FP8 block dequant: e4m3 codes times the 128x128 UE8M0 scale (torch's own casts)."""
    n, k = w.shape
    full = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return w.float() * full


@pytest.mark.parametrize("key", ["layers.0.attn.wq_a.weight", "layers.1.ffn.shared_experts.w2.weight",
                                 "layers.1.attn.indexer.wq_b.weight"])
def test_unquantized_linear_without_scale_accepted(ck, good_logits, key):
    scale = key.removesuffix(".weight") + ".scale"

    def dense(sd):
        sd[key] = fp8_dequant(sd[key], sd.pop(scale)).to(torch.bfloat16)  # e4m3 * 2^k is exact in bf16

    edit_tensors(ck, dense)
    w = read_checkpoint(ck)[1][key]
    assert isinstance(w, QWeight) and w.kind == "dense" and w.scale is None and w.data.dtype == torch.bfloat16
    # float32 logits, the same weights by another path (the sums' order differs): the float32 profile's 1e-5
    # (DESIGN.md section 5)
    torch.testing.assert_close(load_model(ck).forward(IDS), good_logits, rtol=1e-5, atol=1e-5)


def test_routed_experts_of_mixed_storage(ck):
    key = "layers.0.ffn.experts.1.w1.weight"

    def one_dense(sd):
        sd.pop("layers.0.ffn.experts.1.w1.scale")
        sd[key] = torch.zeros(64, 96, dtype=torch.bfloat16)

    path = edit_tensors(ck, one_dense)
    with pytest.raises(CheckpointError) as e:
        load_model(ck)
    one_line(e, path, key)


def test_resident_weights_stay_packed(good, sharded):
    """Every FP8 and MXFP4 linear is held as its one-byte codes and one-byte UE8M0 scales (a dequantized copy,
    or scales widened to float, would show here whatever its share of the bytes), and the model holds about the
    file's bytes: within 10%, which the tiny checkpoints' float tensors held at another width stay well inside
    (0.97 measured), while one linear family held dequantized at 2 bytes a code would exceed it (the FP8 linears
    alone are ~20% of the bytes)."""
    for folder in (good, sharded):
        model = load_model(folder)
        held = list(model.w.values()) + [q for e in model.experts for q in e.values()]
        packed = [q for q in held if isinstance(q, QWeight) and q.kind in ("fp8", "mxfp4")]
        assert {q.kind for q in packed} == {"fp8", "mxfp4"}
        assert all(q.data.element_size() == 1 and q.scale.element_size() == 1 for q in packed)
        file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        resident = model.weight_bytes()
        assert abs(resident - file_bytes) <= 0.10 * file_bytes, (folder, resident, file_bytes)


def test_packed_weights_are_not_dequantized(good):
    w = read_checkpoint(good)[1]
    assert w["layers.0.attn.wq_a.weight"].data.dtype == torch.float8_e4m3fn
    assert w["layers.0.ffn.experts.0.w1.weight"].data.dtype == torch.int8
    assert tuple(w["layers.0.ffn.experts.0.w1.weight"].data.shape) == (64, 48)


# ------------------------------------------------------------------------------------------- load_model arguments


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="float8"), "unknown dtype 'float8'"),
    (dict(dtype="fp8"), "unknown dtype 'fp8'"),
    (dict(backend="cuda-graphs"), "unknown backend 'cuda-graphs'"),
    (dict(device="cuda"), "torch sees no GPU: use device='cpu'"),
    (dict(device="cuda:1", dtype="float32"), "torch sees no GPU"),
])
def test_load_model_bad_arguments(good, monkeypatch, kwargs, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=match) as e:
        load_model(good, **kwargs)
    one_line(e)


def test_load_model_gpu_index_past_the_last_gpu(good, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device cuda:9: torch sees 2 GPU\(s\), so use cuda:0 to cuda:1") as e:
        load_model(good, device="cuda:9")
    one_line(e)


@pytest.mark.parametrize("alias, dtype", [("fp32", torch.float32), ("float", torch.float32), ("fp16", torch.float16),
                                          ("half", torch.float16), ("fp64", torch.float64), ("double", torch.float64)])
def test_load_model_dtype_aliases(good, alias, dtype):
    assert load_model(good, dtype=alias).dtype == dtype


@pytest.mark.parametrize("given, want", [("attention", ["attention"]), ("attention, topk", ["attention", "topk"]),
                                         (["attention"], ["attention"])])
def test_reference_ops_given_as_a_string(good, monkeypatch, given, want):
    """A str is one name or a comma list, as env CDNA2_REFERENCE_OPS is read, never a list of its characters."""
    pytest.importorskip("triton")
    monkeypatch.delenv("CDNA2_REFERENCE_OPS", raising=False)
    ops = load_model(good, backend="triton", reference_ops=given).ops
    assert list(ops.reference_ops) == want
    assert ops.attention.__module__.endswith("reference") and ops.linear.__module__.endswith("triton")


@pytest.mark.parametrize("given, env, where", [(["linaer"], "", "in reference_ops"),
                                               ("linear,bogus", "linear", "in reference_ops"),
                                               (None, "linear,bogus", "in env CDNA2_REFERENCE_OPS")])
def test_unknown_reference_op_says_where_it_came_from(good, monkeypatch, given, env, where):
    monkeypatch.setenv("CDNA2_REFERENCE_OPS", env)
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['(linaer|bogus)'\] " + where) as e:
        load_model(good, reference_ops=given)
    one_line(e)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_load_model_non_float_torch_dtype(good, dtype):
    with pytest.raises(ValueError, match="dtype") as e:
        load_model(good, dtype=dtype)
    one_line(e)


# ------------------------------------------------------------------------------------------- conversion


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_convert_refuses_non_empty_destination(good, tmp_path):
    dst = tmp_path / "out"
    (dst / "sub").mkdir(parents=True)
    (dst / "notes.txt").write_text("keep me")
    (dst / "sub" / "model.safetensors").write_bytes(b"old")
    before = snapshot(dst)
    with pytest.raises(CheckpointError, match="exists and is not empty") as e:
        convert_hf_checkpoint(good, dst)
    one_line(e, dst)
    assert snapshot(dst) == before


def test_convert_refuses_destination_that_is_a_file(good, tmp_path):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"keep")
    with pytest.raises(CheckpointError) as e:
        convert_hf_checkpoint(good, dst)
    one_line(e, dst)
    assert dst.read_bytes() == b"keep"


def test_convert_of_already_quantized_checkpoint(good, tmp_path):
    """An official FP8/MXFP4 source is refused in one line that names it, and nothing is written."""
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match="is already quantized: this folder is in the official layout") as e:
        convert_hf_checkpoint(good, dst)
    assert "\n" not in str(e.value) and str(good) in str(e.value)
    assert not dst.exists() or not any(dst.iterdir())


# ------------------------------------------------------------------------------------------- reading cost


class _CountingOpen:
    """safetensors' safe_open, counting the bytes of every tensor (or slice of one) handed out."""

    def __init__(self, real):
        self.real, self.read = real, 0

    def __call__(self, *args, **kwargs):
        counter, handle = self, self.real(*args, **kwargs)

        class Slice:
            def __init__(self, s):
                self.s = s

            def get_shape(self):
                return self.s.get_shape()

            def __getitem__(self, index):
                t = self.s[index]
                counter.read += t.nbytes
                return t

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, key):
                return Slice(handle.get_slice(key))

            def get_tensor(self, key):
                t = handle.get_tensor(key)
                counter.read += t.nbytes
                return t

        return Handle()


@pytest.mark.parametrize("layout", ["good", "sharded", "stacked"])
def test_reading_reads_each_stored_byte_once(layout, request, monkeypatch):
    """A transformers folder's stacked experts are read one expert's part at a time: reading the whole
    [E, 2I, D] tensor for each of its E experts read V4-Flash's 256-expert layers 512 times over."""
    folder = request.getfixturevalue(layout)
    stored = sum(t.nbytes for f in folder.glob("*.safetensors") for t in load_file(str(f)).values())
    counting = _CountingOpen(checkpoint.safe_open)
    monkeypatch.setattr(checkpoint, "safe_open", counting)
    read_checkpoint(folder)
    assert counting.read == stored, f"read {counting.read} bytes of {stored} stored"


def test_stream_holds_one_tensor_at_a_time(good):
    """stream_checkpoint hands tensors out one by one and keeps none: a checker of a 160 GB checkpoint holds
    what it keeps itself. Every value's tensors are dead once the consumer drops it (weak references)."""
    import weakref

    alive, most, n = [], 0, 0
    for _, value in checkpoint.stream_checkpoint(good):
        parts = [value.data, value.scale] if isinstance(value, QWeight) else [value]
        alive = [r for r in alive if r() is not None] + [weakref.ref(t) for t in parts if t is not None]
        most, n = max(most, len(alive)), n + 1
        del value, parts
    # 3: a weight and its scale, and the reader's local still naming the tensor before them until it resumes
    assert n > 50 and most <= 3, f"{most} tensors alive at once over {n} values"


def test_a_model_larger_than_the_device_is_refused_before_loading(good, tmp_path, monkeypatch):
    """The bundled engine holds every weight on one device: V4-Flash (~160 GB) on one GPU ran out of memory after
    minutes of copying. The bytes of the tensors it loads (an MTP shard beside them left out, as the reader leaves
    its keys) against the device's free memory, here made one byte too small, then just enough."""
    import cdna2_engine

    folder = Path(shutil.copytree(good, tmp_path / "m"))
    stored = load_file(str(folder / ST))
    save_file({"mtp.0.w": torch.zeros(1000, 1000)}, str(folder / "mtp.safetensors"))
    need = sum(t.nbytes for t in stored.values())
    assert checkpoint.weight_bytes(folder) == need
    monkeypatch.setattr(cdna2_engine, "_free_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=rf"its weights take {need / 1e3:.1f} KB and the host has "
                                         rf"{(need - 1) / 1e3:.1f} KB available: the bundled engine holds a model "
                                         "on one device") as e:
        load_model(folder)
    one_line(e, folder, "--cdna2-engine")
    monkeypatch.setattr(cdna2_engine, "_free_bytes", lambda device: need)
    load_model(folder)


def test_free_host_memory_is_read_in_bytes():
    """MemAvailable (kB in /proc/meminfo) in bytes: at least the free pages (sysconf) unless a container's cgroup
    limit lowers it, at most the physical memory."""
    import os

    import cdna2_engine

    free = cdna2_engine._free_bytes(torch.device("cpu"))
    if free is None:
        pytest.skip("no /proc/meminfo here")
    page = os.sysconf("SC_PAGE_SIZE")
    limited = Path("/sys/fs/cgroup/memory.max").is_file() and \
        Path("/sys/fs/cgroup/memory.max").read_text().strip() != "max"
    assert free <= os.sysconf("SC_PHYS_PAGES") * page
    assert limited or free >= os.sysconf("SC_AVPHYS_PAGES") * page // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_free_bytes_counts_blocks_torch_cached_gpu():
    """A model dropped before the next loads (the token tier's kernel search, test_devices_agree) leaves its
    blocks in torch's caching allocator, which the driver does not count as free: they are free to the next."""
    import cdna2_engine

    dev, gib = torch.device("cuda", torch.cuda.current_device()), 1 << 30
    x = torch.empty(gib, dtype=torch.uint8, device=dev)
    live = torch.empty(gib, dtype=torch.uint8, device=dev)  # held: not free to anyone
    del x  # 1 GiB now cached by the allocator, not returned to the driver
    driver = torch.cuda.mem_get_info(dev)[0]
    assert driver + gib <= cdna2_engine._free_bytes(dev) < driver + 2 * gib
    del live


def test_a_missing_key_is_found_before_any_tensor_is_read(ck, monkeypatch):
    """The last layer's shared expert gone: named before a byte of the tensors ahead of it is read (a 160 GB
    stream would otherwise fail after reading up to it)."""
    key = "layers.1.ffn.shared_experts.w2.weight"
    edit_tensors(ck, lambda sd: sd.pop(key))
    counting = _CountingOpen(checkpoint.safe_open)
    monkeypatch.setattr(checkpoint, "safe_open", counting)
    with pytest.raises(CheckpointError, match=f"missing key {re.escape(key)}"):
        read_checkpoint(ck)
    assert counting.read == 0


def _age(folder: Path, seconds: float) -> None:
    """Backdate every file: the hash cache keeps no hash of a file written in the last 2 s (racy timestamps)."""
    t = time.time() - seconds
    for p in folder.iterdir():
        os.utime(p, (t, t))


def test_checkpoint_hash_is_cached_by_file_stamps(tmp_path, monkeypatch):
    """A second hash of unchanged files is read from the cache (V4-Flash: minutes a session); a file rewritten
    (new mtime) is hashed again; cached=False (goldens verify) always reads every byte; a fresh file is not
    cached at all (it could change again within its timestamp's granularity)."""
    monkeypatch.setenv("CDNA2_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_checkpoint(tmp_path / "m", make_config("csa-only"), seed=3)
    fresh = checkpoint.checkpoint_sha256(folder)
    assert not (tmp_path / "cache").exists()  # files written just now: not kept
    _age(folder, 60.0)
    true = checkpoint.checkpoint_sha256(folder)
    assert true == fresh and len(list((tmp_path / "cache").iterdir())) == 1
    reads, sha256 = [], hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: reads.append(a) or sha256(*a))
    assert checkpoint.checkpoint_sha256(folder) == true and len(reads) == 1  # the key's hash only: no file read
    assert checkpoint.checkpoint_sha256(folder, cached=False) == true and len(reads) == 3  # key + the files' hash
    cfg = folder / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    _age(folder, 30.0)  # a new mtime, however old
    changed = checkpoint.checkpoint_sha256(folder)
    assert changed != true and changed == checkpoint.checkpoint_sha256(folder, cached=False)


def test_checkpoint_hash_sees_an_in_place_edit_whose_mtime_was_put_back(tmp_path, monkeypatch):
    """One byte rewritten at the same size with the old mtime restored (rsync --inplace -t, touch -r) still
    changes the file's ctime: hashed again, not served from the cache. A kept hash that went wrong is replaced by
    the next cached=False hash (goldens verify)."""
    monkeypatch.setenv("CDNA2_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_checkpoint(tmp_path / "m", make_config("csa-only"), seed=3)
    _age(folder, 60.0)
    true = checkpoint.checkpoint_sha256(folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    st, raw = shard.stat(), bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # the last tensor byte
    with open(shard, "r+b") as f:
        f.write(raw)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    edited = checkpoint.checkpoint_sha256(folder)
    assert edited != true and edited == checkpoint.checkpoint_sha256(folder, cached=False)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.read_text().strip() == edited]
    entry.write_text("0" * 64 + "\n")  # a kept hash gone wrong
    assert checkpoint.checkpoint_sha256(folder, cached=False) == edited
    assert checkpoint.checkpoint_sha256(folder) == edited


def test_a_hash_cache_that_cannot_be_written_is_said(tmp_path, monkeypatch):
    """CDNA2_CACHE_DIR naming a file: no hash was kept and nothing said so (V4-Flash re-hashed ~160 GB a run)."""
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("CDNA2_CACHE_DIR", str(tmp_path / "not-a-folder"))
    folder = make_checkpoint(tmp_path / "m", make_config("csa-only"), seed=3)
    _age(folder, 60.0)
    with pytest.warns(checkpoint.CheckpointCacheWarning,
                      match=r"not-a-folder: the checkpoint hash cannot be kept there \(.*\), so each run hashes the "
                            "weights again: point CDNA2_CACHE_DIR at a writable folder"):
        checkpoint.checkpoint_sha256(folder)
