"""Read and write DeepSeek-V4 checkpoints: the official layout (FP8 e4m3 + UE8M0 128x128 scales, routed
experts in MXFP4) and transformers' `save_pretrained` layout.

`tensor_specs(cfg)` is the single list of every tensor a config implies (official name, transformers name,
logical shape, storage kind); reading validates against it, writing and conversion produce from it, so
the three cannot drift apart. Every bad input is one `CheckpointError` line naming the file and the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import formats
from .config import QUANTIZATION_CONFIG, Config, readable
from .ops import QWeight

INDEX_FILE = "model.safetensors.index.json"


class CheckpointCacheWarning(UserWarning):
    """The checkpoint hash could not be kept (filter it by this class under -W error)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as DeepSeek-V4: one line naming file, key and fix."""


@dataclass(frozen=True)
class Spec:
    name: str  # official key, e.g. layers.0.attn.wq_a.weight
    hf: str  # transformers name (experts: the stacked parameter it is part of)
    shape: tuple[int, ...]
    kind: str  # fp8 | mxfp4 | bf16 | fp32 | int32
    linear: bool = False  # a matmul weight (held as QWeight), whatever its storage kind


def tensor_specs(cfg: Config) -> list[Spec]:
    """Every tensor of the official layout for `cfg`, in a stable order."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    s = [
        Spec("embed.weight", "model.embed_tokens.weight", (cfg.vocab_size, D), "bf16"),
        Spec("head.weight", "lm_head.weight", (cfg.vocab_size, D), "bf16", True),
        Spec("norm.weight", "model.norm.weight", (D,), "bf16"),
        Spec("hc_head_fn", "model.hc_head.hc_fn", (hc, hc * D), "fp32"),
        Spec("hc_head_base", "model.hc_head.hc_base", (hc,), "fp32"),
        Spec("hc_head_scale", "model.hc_head.hc_scale", (1,), "fp32"),
    ]
    for i in range(cfg.num_hidden_layers):
        o, h = f"layers.{i}.", f"model.layers.{i}."
        s += [
            Spec(o + "attn_norm.weight", h + "input_layernorm.weight", (D,), "bf16"),
            Spec(o + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,), "bf16"),
        ]
        for blk, hblk in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
            s += [
                Spec(f"{o}hc_{blk}_fn", f"{h}{hblk}.fn", (mix, hc * D), "fp32"),
                Spec(f"{o}hc_{blk}_base", f"{h}{hblk}.base", (mix,), "fp32"),
                Spec(f"{o}hc_{blk}_scale", f"{h}{hblk}.scale", (3,), "fp32"),
            ]
        a, ha = o + "attn.", h + "self_attn."
        s += [
            Spec(a + "wq_a.weight", ha + "q_a_proj.weight", (cfg.q_lora_rank, D), "fp8"),
            Spec(a + "q_norm.weight", ha + "q_a_norm.weight", (cfg.q_lora_rank,), "bf16"),
            Spec(a + "wq_b.weight", ha + "q_b_proj.weight", (H * hd, cfg.q_lora_rank), "fp8"),
            Spec(a + "wkv.weight", ha + "kv_proj.weight", (hd, D), "fp8"),
            Spec(a + "kv_norm.weight", ha + "kv_norm.weight", (hd,), "bf16"),
            Spec(a + "wo_a.weight", ha + "o_a_proj.weight", (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
                 "fp8"),
            Spec(a + "wo_b.weight", ha + "o_b_proj.weight", (D, cfg.o_groups * cfg.o_lora_rank), "fp8"),
            Spec(a + "attn_sink", ha + "sinks", (H,), "fp32"),
        ]
        ratio = cfg.compress_ratios[i]
        if ratio:
            s += _compressor_specs(a + "compressor.", ha + "compressor.", ratio, hd, D)
        if ratio == 4:
            ix, hx = a + "indexer.", ha + "compressor.indexer."
            Hi, Di = cfg.index_n_heads, cfg.index_head_dim
            s += [
                Spec(ix + "wq_b.weight", hx + "q_b_proj.weight", (Hi * Di, cfg.q_lora_rank), "fp8"),
                Spec(ix + "weights_proj.weight", hx + "scorer.weights_proj.weight", (Hi, D), "bf16", True),
            ]
            s += _compressor_specs(ix + "compressor.", hx, ratio, Di, D)
        f, hf = o + "ffn.", h + "mlp."
        s.append(Spec(f + "gate.weight", hf + "gate.weight", (E, D), "bf16", True))
        if cfg.is_hash_layer(i):
            s.append(Spec(f + "gate.tid2eid", hf + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int32"))
        else:
            s.append(Spec(f + "gate.bias", hf + "gate.e_score_correction_bias", (E,), "fp32"))
        for e in range(E):
            s += [
                Spec(f"{f}experts.{e}.w1.weight", hf + "experts.gate_up_proj", (I, D), "mxfp4"),
                Spec(f"{f}experts.{e}.w2.weight", hf + "experts.down_proj", (D, I), "mxfp4"),
                Spec(f"{f}experts.{e}.w3.weight", hf + "experts.gate_up_proj", (I, D), "mxfp4"),
            ]
        Is = I * cfg.n_shared_experts
        s += [
            Spec(f + "shared_experts.w1.weight", hf + "shared_experts.gate_proj.weight", (Is, D), "fp8"),
            Spec(f + "shared_experts.w2.weight", hf + "shared_experts.down_proj.weight", (D, Is), "fp8"),
            Spec(f + "shared_experts.w3.weight", hf + "shared_experts.up_proj.weight", (Is, D), "fp8"),
        ]
    return s


def _compressor_specs(o: str, h: str, ratio: int, d: int, D: int) -> list[Spec]:
    c = 2 * d if ratio == 4 else d  # CSA's overlapping windows carry two series (Ca, Cb)
    return [
        Spec(o + "ape", h + "position_bias", (ratio, c), "fp32"),
        Spec(o + "wkv.weight", h + "kv_proj.weight", (c, D), "bf16", True),
        Spec(o + "wgate.weight", h + "gate_proj.weight", (c, D), "bf16", True),
        Spec(o + "norm.weight", h + "kv_norm.weight", (d,), "bf16"),
    ]


# accepted stored dtypes per kind, the wanted one first; fp32 tensors stored in bf16/fp16 are upcast (exact)
_DTYPES = {"bf16": (torch.bfloat16, torch.float32, torch.float16, torch.float64),
           "fp32": (torch.float32, torch.bfloat16, torch.float16), "int32": (torch.int32, torch.int64)}
_DENSE = (torch.bfloat16, torch.float32, torch.float16, torch.float64)


# ----------------------------------------------------------------------------------------------- reading


def _index(folder: Path) -> tuple[list[str], dict[str, str] | None]:
    """(shard file names, the index's key -> file map or None): the index's files when there is one, else every
    *.safetensors in the folder. An index's shards are file names beside it (what the checkpoint hash covers), and
    a model.safetensors it does not list is refused (transformers would read that one instead)."""
    index = folder / INDEX_FILE
    if not index.exists():
        try:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        except OSError as e:
            raise CheckpointError(f"{folder}: {readable(e)}") from None
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files: point at a checkpoint folder")
        return files, None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map keys to shard file names")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index}: not UTF-8 text ({e.reason} at byte {e.start}): regenerate it as "
                              "UTF-8 JSON") from None
    except OSError as e:
        raise CheckpointError(f"{index}: {readable(e)}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e}): regenerate it") from None
    files = sorted(set(weight_map.values()))
    odd = [f for f in files if Path(f).name != f or f in (".", "..") or not f.endswith(".safetensors")]
    if odd:
        raise CheckpointError(f"{index}: shard {odd[0]!r} is not a .safetensors file name beside the index: keep "
                              "the shards in the checkpoint folder and list them by name")
    if (folder / "model.safetensors").exists() and "model.safetensors" not in files:
        raise CheckpointError(f"{folder}: holds model.safetensors beside {INDEX_FILE}, which lists other files: "
                              "delete the one that is stale")
    return files, weight_map


def _shard(path: Path, listed: bool) -> Path:
    """path, a readable regular file (a missing shard, a folder, a FIFO or an unreadable file named as such)."""
    if not path.exists():
        where = f"listed in {INDEX_FILE} but missing" if listed else "a broken link"
        raise CheckpointError(f"{path}: {where}: copy the shard{' or fix the index' if listed else ''}")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file: a shard must be a safetensors file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"{path}: permission denied: make it readable (chmod a+r)")
    return path


def shard_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, as the reader finds them (its index's, else every one in the folder)."""
    return [Path(path) / name for name in _index(Path(path))[0]]


def weight_bytes(path: str | Path) -> int:
    """Bytes of the tensors the reader loads (every key but MTP's), from the files' headers: no tensor is read."""
    total = 0
    files, weight_map = _index(Path(path))
    for name in files:
        shard = _shard(Path(path) / name, weight_map is not None)
        corrupt = CheckpointError(f"{shard}: unreadable safetensors header: the file is truncated or corrupt")
        try:
            with open(shard, "rb") as f:  # safetensors: u64 header length, then a JSON header
                n = int.from_bytes(f.read(8), "little")
                if n > 100_000_000:  # safetensors' own bound: a corrupt length must not read a whole shard
                    raise corrupt
                header = json.loads(f.read(n))
            spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__" and not k.startswith("mtp.")]
            if not all(isinstance(o, list) and len(o) == 2 and all(type(b) is int for b in o) and 0 <= o[0] <= o[1]
                       for o in spans):
                raise corrupt
        except OSError as e:
            raise CheckpointError(f"{shard}: {readable(e)}") from None
        except (ValueError, TypeError, KeyError, AttributeError):  # JSON that is not a header (or not JSON)
            raise corrupt from None
        total += sum(o[1] - o[0] for o in spans)
    return total


class _Files:
    """Lazy access to one safetensors file or a sharded set, key -> file; memory-mapped by safetensors."""

    def __init__(self, folder: Path):
        self.folder = folder
        files, weight_map = _index(folder)
        self.handles, self.where = {}, {}
        self.names: dict[str, tuple[str, object]] = {}  # official name -> (file key, stacked slice)
        self.on_read: Callable[[str, str, torch.Tensor], None] | None = None  # (name, file key, tensor as stored)
        for name in files:
            path = _shard(folder / name, weight_map is not None)
            try:
                h = safe_open(str(path), framework="pt")
                keys = list(h.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: unreadable safetensors ({e}): the file is truncated or corrupt") \
                    from None
            self.handles[name] = h
            for k in keys:
                if k in self.where:
                    raise CheckpointError(f"{path}: key {k} also in {self.where[k]}: remove the duplicate file")
                self.where[k] = name
        if weight_map is not None:
            for k, f in weight_map.items():
                if self.where.get(k) != f:
                    raise CheckpointError(f"{folder / f}: key {k} listed in {INDEX_FILE} is not in that shard")

    def keys(self) -> set[str]:
        return set(self.where)

    def get(self, key: str, part: tuple[int, slice | None] | None = None) -> torch.Tensor:
        """The tensor at `key`, or the part (expert e, rows) of a stacked one: only its bytes are read."""
        name = self.where[key]
        try:
            if part is None:
                return self.handles[name].get_tensor(key)
            e, rows = part
            stacked = self.handles[name].get_slice(key)
            return stacked[e] if rows is None else stacked[e, rows]
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.folder / name}: key {key} unreadable ({e}): the file is corrupt") from None

    def file_of(self, key: str) -> Path:
        return self.folder / self.where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape, read from the header (no data)."""
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())


# transformers' renaming of official keys (its conversion_mapping for deepseek_v4), in order. A
# `save_pretrained` folder holds keys at any stage of it (5.23 writes a half-reversed mix such as
# `head.weight` beside `model.embed_tokens.weight`), so every file key is pushed through these rules and
# then looked up among the transformers names of tensor_specs.
_HF_RULES = [(re.compile(a), b) for a, b in [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _hf_name(key: str) -> str:
    k = key.removeprefix("model.")
    for pat, rep in _HF_RULES:
        k = pat.sub(rep, k)
    return k


def _resolve(files: _Files, specs: list[Spec], cfg: Config) -> dict[str, tuple[str, object]]:
    """{official name: (file key, slice of a stacked tensor or None)} for every key found in the files.
    Scale keys (.scale, .weight_scale_inv) resolve to '<official base>.scale'. Two keys for one tensor (an
    official and a transformers name, .scale and .weight_scale_inv) are refused: either could be the stale one."""
    official = {sp.name for sp in specs}
    by_hf = {sp.hf.removeprefix("model."): sp.name for sp in specs if ".experts." not in sp.name
             or ".shared_experts." in sp.name}
    out: dict[str, tuple[str, object]] = {}
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    keys = files.keys()

    def put(name: str, key: str, part: object = None) -> None:
        if name in out and out[name][0] != key:
            other = out[name][0]
            raise CheckpointError(f"{files.file_of(key)}: key {key} and key {other} (in {files.file_of(other).name}) "
                                  f"are both {name}: delete one of them")
        out[name] = (key, part)

    for key in sorted(keys):
        base, suffix = key, ""
        for s in (".weight_scale_inv", ".scale"):
            if key.endswith(s) and key.removesuffix(s) + ".weight" in keys:  # not hc's `attn_hc.scale`
                base, suffix = key.removesuffix(s) + ".weight", ".scale"
        bare = base.removeprefix("model.")
        if bare in official:
            name = bare
        else:
            h = _hf_name(bare)
            if m := _EXPERT.match(h):
                name = f"layers.{m[1]}.ffn.experts.{m[2]}.{m[3]}.weight"
            elif (m := _STACKED.match(h)) and not suffix:
                gate_up = m[2] == "gate_up_proj"
                want, dims = ((E, 2 * I, D), "n_routed_experts, 2 * moe_intermediate_size, hidden_size") if gate_up \
                    else ((E, D, I), "n_routed_experts, hidden_size, moe_intermediate_size")
                if files.shape(key) != want:
                    raise CheckpointError(f"{files.file_of(key)}: key {key} has shape {files.shape(key)}, config "
                                          f"implies {want} ({dims}): the config.json does not match these weights")
                for e in range(E):
                    for w, sl in ({"w1": slice(0, I), "w3": slice(I, 2 * I)} if gate_up else {"w2": None}).items():
                        put(f"layers.{m[1]}.ffn.experts.{e}.{w}.weight", key, (e, sl))
                continue
            else:
                name = by_hf.get(h, key)  # unknown keys stay as they are and are reported as unexpected
        put(name.removesuffix(".weight") + ".scale" if suffix else name, key)
    return out


def read_checkpoint(path: str | Path, cfg: Config | None = None) -> tuple[Config, dict[str, object]]:
    """Read a checkpoint folder (official or transformers layout, one file or shards) into
    {official key: QWeight | Tensor}: linears as QWeight (packed stays packed), the rest as tensors.
    Validates every key, shape, dtype, scale grid and finiteness against the config."""
    cfg = cfg or Config.load(_folder(path))
    return cfg, dict(stream_checkpoint(path, cfg))


def stream_checkpoint(path: str | Path, cfg: Config | None = None,
                      on_read: Callable[[str, str, torch.Tensor], None] | None = None) -> Iterator[tuple[str, object]]:
    """(official key, QWeight | Tensor) one at a time, validated as `read_checkpoint` validates them, so a
    checker can visit a 160 GB checkpoint holding one tensor at a time; `on_read(official key, file key, tensor)`
    sees each tensor as stored (before a scale is converted or a check raises): a second checker needs no second
    read. Missing keys are found before any tensor is read; a tensor's shape, dtype and values when it is read; the
    experts' common storage and keys the config does not imply after the last (a shape mismatch names the tensor
    and both shapes, which says more)."""
    folder = _folder(path)
    cfg = cfg or Config.load(folder)
    files = _Files(folder)
    files.on_read = on_read
    specs = tensor_specs(cfg)
    files.names = _resolve(files, specs, cfg)
    expected = {sp.name for sp in specs}
    for sp in specs:
        _need_name(files, sp.name)
        if sp.kind in ("fp8", "mxfp4"):
            expected.add(sp.name.removesuffix(".weight") + ".scale")
    storage: dict[str, tuple] = {}  # routed experts' (kind, dtype, shape), checked alike below
    for sp in specs:
        if sp.kind in ("fp8", "mxfp4"):
            scale_key = sp.name.removesuffix(".weight") + ".scale"
            value = _read_linear(files, sp, scale_key if scale_key in files.names else None)
            storage[sp.name] = (value.kind, value.data.dtype, tuple(value.data.shape))
        else:
            t = _read_plain(files, sp)
            if sp.kind == "int32":  # checked before the cast: an int64 id past 2^31 must not wrap into range
                _check_tid2eid(files, sp.name, t, cfg.n_routed_experts)
                t = t.to(torch.int32)
            value = QWeight(t, None, "dense") if sp.linear else t
        yield sp.name, value
    _check_experts_uniform(files, storage, cfg)
    unexpected = sorted(n for n in set(files.names) - expected if not files.names[n][0].startswith("mtp."))
    if unexpected:
        k = files.names[unexpected[0]][0]
        raise CheckpointError(
            f"{files.file_of(k)}: unexpected key {k} ({len(unexpected)} in all): the config.json does not match "
            f"these weights (check num_hidden_layers, compress_ratios, num_hash_layers, n_routed_experts)")


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder: pass the checkpoint directory holding config.json")
    return folder


def _check_tid2eid(files: _Files, name: str, t: torch.Tensor, n_experts: int) -> None:
    """A hash layer's table [vocab, k] names existing experts. A row may repeat one (the forward sums per slot,
    as for any routing); whether V4-Flash's table has repeats is not known here, so they are not refused."""
    if t.numel() and not 0 <= int(t.min()) <= int(t.max()) < n_experts:
        raise CheckpointError(f"{_where(files, name)} holds expert ids outside 0..{n_experts - 1}: the weights are "
                              "corrupt or config.json's n_routed_experts is wrong")


def _check_experts_uniform(files: _Files, storage: dict[str, tuple], cfg: Config) -> None:
    """All routed experts of a projection must share storage: they are stacked into one tensor."""
    for i in range(cfg.num_hidden_layers):
        for w in ("w1", "w2", "w3"):
            names = [f"layers.{i}.ffn.experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts)]
            first = storage[names[0]]
            for n in names[1:]:
                if storage[n] != first:
                    raise CheckpointError(f"{_where(files, n)} is stored as {storage[n][0]} {storage[n][1]} but "
                                          f"{names[0]} as {first[0]} {first[1]}: store all experts alike")


def _need_name(files: _Files, name: str) -> None:
    if name not in files.names:
        hint = " (num_hash_layers, 3 when config.json leaves it out, as in transformers, makes the first layers " \
            "route by token id: set it to the model's count, 0 for none)" if name.endswith(".tid2eid") else ""
        raise CheckpointError(f"{files.folder}: missing key {name}: the checkpoint is incomplete or its config.json "
                              f"describes another model{hint}")


def _need(files: _Files, name: str) -> torch.Tensor:
    _need_name(files, name)
    key, part = files.names[name]
    t = files.get(key, part)
    if files.on_read is not None:
        files.on_read(name, key, t)
    return t


def _where(files: _Files, name: str) -> str:
    key = files.names[name][0]
    return f"{files.file_of(key)}: key {key}"


def _check_finite(files: _Files, name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and t.dtype.itemsize > 1 and not torch.isfinite(t).all():
        raise CheckpointError(f"{_where(files, name)} has non-finite values: the weights are corrupt")


def _read_plain(files: _Files, sp: Spec) -> torch.Tensor:
    t = _need(files, sp.name)
    if tuple(t.shape) != sp.shape:
        raise CheckpointError(f"{_where(files, sp.name)} has shape {tuple(t.shape)}, config implies {sp.shape}: "
                              "the config.json does not match these weights")
    ok = _DTYPES[sp.kind]
    if t.dtype not in ok:
        raise CheckpointError(f"{_where(files, sp.name)} has dtype {t.dtype}, expected {ok[0]}: save it as one of "
                              f"{', '.join(str(d).removeprefix('torch.') for d in ok)}")
    _check_finite(files, sp.name, t)
    return t.float() if sp.kind == "fp32" else t


def stored_shapes(kind: str, shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(weight, scale) shapes the official layout stores for a linear of logical [n, k]: FP8 codes [n, k] with a
    UE8M0 scale per 128 x 128 block; MXFP4 two E2M1 codes a byte [n, k / 2] with a UE8M0 scale per 32."""
    n, k = shape
    if kind == "fp8":
        return (n, k), (math.ceil(n / 128), math.ceil(k / 128))
    return (n, k // 2), (n, k // 32)


def _read_linear(files: _Files, sp: Spec, scale_key: str | None) -> QWeight:
    t = _need(files, sp.name)
    where = _where(files, sp.name)
    n, k = sp.shape
    if scale_key is None:  # unquantized linears are accepted too
        if t.dtype not in _DENSE:
            raise CheckpointError(f"{where} is {t.dtype} but has no .scale: add its scale tensor")
        if tuple(t.shape) != sp.shape:
            raise CheckpointError(f"{where} has shape {tuple(t.shape)}, config implies {sp.shape}")
        _check_finite(files, sp.name, t)
        return QWeight(t, None, "dense")
    scale, swhere = _need(files, scale_key), _where(files, scale_key)
    if scale.dtype != torch.float8_e8m0fnu:
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise CheckpointError(f"{swhere} has dtype {scale.dtype}: store UE8M0 scales as float8_e8m0fnu (or as "
                                  "power-of-two floats)")
        scale = scale.float()
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise CheckpointError(f"{swhere} has non-positive or non-finite scales: the scales are corrupt")
        if (torch.frexp(scale).mantissa != 0.5).any():
            raise CheckpointError(f"{swhere} has scales that are not powers of two: UE8M0 expected")
        if (scale < 2.0**-127).any() or (scale > 2.0**127).any():
            raise CheckpointError(f"{swhere} has scales outside the UE8M0 range 2^-127..2^127")
        scale = scale.to(torch.float8_e8m0fnu)
    elif (scale.view(torch.uint8) == 255).any():
        raise CheckpointError(f"{swhere} has NaN (0xFF) UE8M0 scales: the scales are corrupt")
    if t.dtype == torch.float8_e4m3fn:
        kind = "fp8"
    elif t.dtype in (torch.int8, torch.uint8):
        kind = "mxfp4"
        t = t.view(torch.int8)
    else:
        raise CheckpointError(f"{where} has dtype {t.dtype} beside a scale: expected float8_e4m3fn (FP8) or int8 "
                              "(packed MXFP4)")
    want_w, want_s = stored_shapes(kind, sp.shape)
    if tuple(t.shape) != want_w:
        raise CheckpointError(f"{where} has shape {tuple(t.shape)}, {kind} of logical {sp.shape} stores {want_w}: "
                              "the config.json does not match these weights")
    if tuple(scale.shape) != want_s:
        raise CheckpointError(f"{swhere} has shape {tuple(scale.shape)}: the scale grid of {kind} weight "
                              f"{sp.name} {sp.shape} must be {want_s}")
    if kind == "fp8" and torch.isnan(t.float()).any():
        raise CheckpointError(f"{where} has NaN FP8 codes: the weights are corrupt")
    top = int(scale.view(torch.uint8).max()) - 127 if scale.numel() else 0
    if top > (119 if kind == "fp8" else 125):  # 2^top x the largest code (448 or 6) would overflow float32
        raise CheckpointError(f"{swhere} has a scale of 2^{top}: times the largest {kind} code it overflows "
                              "float32: the scales are corrupt")
    return QWeight(t, scale, kind)


# ----------------------------------------------------------------------------------------------- writing


def quantize_state(cfg: Config, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official-layout tensors from dense weights {official name: tensor}: FP8 + UE8M0 128x128 blocks for
    attention and shared-expert linears, MXFP4 for routed experts, the stored dtypes for the rest."""
    out = {}
    for sp in tensor_specs(cfg):
        t = dense[sp.name]
        if sp.kind == "fp8":
            out[sp.name], out[sp.name.removesuffix(".weight") + ".scale"] = formats.fp8_block_quantize(t.float())
        elif sp.kind == "mxfp4":
            out[sp.name], out[sp.name.removesuffix(".weight") + ".scale"] = formats.mxfp4_quantize(t.float())
        else:
            out[sp.name] = t.to({"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}[sp.kind])
    return out


def write_checkpoint(folder: str | Path, cfg: Config, tensors: dict[str, torch.Tensor],
                     shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (one file, or shards with an index when shard_bytes is set)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    quantized = any(v.dtype == torch.float8_e4m3fn for v in tensors.values())
    replace(cfg, quantization_config=dict(QUANTIZATION_CONFIG) if quantized else None).save(folder)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if not shard_bytes:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nb = v.numel() * v.element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def random_dense_state(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random V4 in float32 with scales that keep activations O(1) (tests and training start)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sp in tensor_specs(cfg):
        n = sp.name
        if sp.kind == "int32":  # tid2eid: distinct experts per token
            out[n] = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: sp.shape[1]]
                                  for _ in range(sp.shape[0])]).to(torch.int32)
        elif n.endswith("norm.weight"):
            out[n] = 1 + 0.1 * torch.randn(sp.shape, generator=g)
        elif n.endswith("_scale"):
            out[n] = 0.5 + torch.rand(sp.shape, generator=g)
        elif n.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
            out[n] = 0.5 * torch.randn(sp.shape, generator=g)
        elif n.endswith("_fn"):
            out[n] = torch.randn(sp.shape, generator=g) / math.sqrt(sp.shape[1])
        elif n == "embed.weight":
            out[n] = torch.randn(sp.shape, generator=g)
        else:
            out[n] = torch.randn(sp.shape, generator=g) / math.sqrt(sp.shape[-1])
    return out


# ----------------------------------------------------------------------------------------------- conversion


def convert_hf_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A transformers `save_pretrained` DeepSeek-V4 (fp32/bf16) into the official FP8/MXFP4 layout."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst}: exists and is not empty (or not a folder): choose a new output folder")
    cfg, weights = read_checkpoint(src)
    packed = [k for k, v in weights.items() if isinstance(v, QWeight) and v.kind != "dense"]
    if packed:
        raise CheckpointError(f"{src}: key {packed[0]} is already quantized: this folder is in the official "
                              "layout already, no conversion needed")
    dense = {k: (v.data if isinstance(v, QWeight) else v) for k, v in weights.items()}
    write_checkpoint(dst, cfg, quantize_state(cfg, dense))
    return dst


def checkpoint_sha256(path: str | Path, *, cached: bool = True) -> str:
    """One hash over config.json and every safetensors file, in name order (identifies a model). `cached`: reuse
    the hash computed last time for the same files (path, size, mtime, ctime, inode and device of each, as git's
    index judges a file unchanged: ctime moves on any write, even one whose mtime is put back), kept in
    `hash_cache_dir()`: hashing V4-Flash's ~160 GB takes minutes a session. `cached=False` reads every byte and
    refreshes the kept hash."""
    folder = Path(path)
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")])
    stamp = _stamp(folder, files)
    entry = hash_cache_dir() / (hashlib.sha256(stamp.encode()).hexdigest() + ".sha256")
    if cached:
        try:
            known = entry.read_text(encoding="ascii").strip()
            if re.fullmatch(r"[0-9a-f]{64}", known):
                return known
        except (OSError, UnicodeDecodeError):
            pass
    start = time.time_ns()
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    digest = h.hexdigest()
    settled = all(p.stat().st_mtime_ns < start - 2_000_000_000 for p in files)  # a file written in the last 2 s
    # could be written again within its timestamp's granularity and keep its stamp ("racy git"): not kept
    if settled and stamp == _stamp(folder, files):
        try:  # only when no file changed while it was read; a cache that cannot be written costs a rehash
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest + "\n", encoding="ascii")
            tmp.replace(entry)
        except OSError as e:  # every later run re-reads every byte (minutes for V4-Flash): say so
            warnings.warn(f"{entry.parent}: the checkpoint hash cannot be kept there ({e.strerror or e}), so each run "
                          "hashes the weights again: point CDNA2_CACHE_DIR at a writable folder",
                          CheckpointCacheWarning, stacklevel=2)
    return digest


def _stamp(folder: Path, files: list[Path]) -> str:
    """The folder and each file's name, size, mtime, ctime, inode and device: what the hash cache is keyed by."""
    return json.dumps([str(folder.resolve())] + [[p.name, (st := p.stat()).st_size, st.st_mtime_ns, st.st_ctime_ns,
                                                  st.st_ino, st.st_dev] for p in files])


def hash_cache_dir() -> Path:
    """Where checkpoint hashes are kept: $CDNA2_CACHE_DIR, else $XDG_CACHE_HOME/pytest-cdna2 (~/.cache)."""
    if os.environ.get("CDNA2_CACHE_DIR"):
        return Path(os.environ["CDNA2_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-cdna2"
