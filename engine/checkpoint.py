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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import formats
from .config import Config
from .ops import QWeight

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as DeepSeek-V4: one line naming file, key and fix."""


@dataclass(frozen=True)
class Spec:
    name: str  # official key, e.g. layers.0.attn.wq_a.weight
    hf: str  # transformers name (experts: the stacked parameter it is part of)
    shape: tuple[int, ...]
    kind: str  # fp8 | mxfp4 | bf16 | fp32 | int32


def tensor_specs(cfg: Config) -> list[Spec]:
    """Every tensor of the official layout for `cfg`, in a stable order."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    s = [
        Spec("embed.weight", "model.embed_tokens.weight", (cfg.vocab_size, D), "bf16"),
        Spec("head.weight", "lm_head.weight", (cfg.vocab_size, D), "bf16"),
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
                Spec(ix + "weights_proj.weight", hx + "scorer.weights_proj.weight", (Hi, D), "bf16"),
            ]
            s += _compressor_specs(ix + "compressor.", hx, ratio, Di, D)
        f, hf = o + "ffn.", h + "mlp."
        s.append(Spec(f + "gate.weight", hf + "gate.weight", (E, D), "bf16"))
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
        Spec(o + "wkv.weight", h + "kv_proj.weight", (c, D), "bf16"),
        Spec(o + "wgate.weight", h + "gate_proj.weight", (c, D), "bf16"),
        Spec(o + "norm.weight", h + "kv_norm.weight", (d,), "bf16"),
    ]


_DTYPES = {"bf16": (torch.bfloat16, torch.float32, torch.float16, torch.float64), "fp32": (torch.float32,),
           "int32": (torch.int32, torch.int64)}
_DENSE = (torch.bfloat16, torch.float32, torch.float16, torch.float64)


# ----------------------------------------------------------------------------------------------- reading


class _Files:
    """Lazy access to one safetensors file or a sharded set, key -> file; memory-mapped by safetensors."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e}): regenerate it") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder}: no *.safetensors files: point at a checkpoint folder")
            weight_map = None
        self.handles, self.where = {}, {}
        for name in files:
            path = folder / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in {INDEX_FILE} but missing: copy the shard or fix the index")
            try:
                h = safe_open(str(path), framework="pt")
                keys = list(h.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: unreadable safetensors ({e}): the file is truncated or corrupt") from None
            self.handles[name] = h
            for k in keys:
                self.where[k] = name
        if weight_map is not None:
            for k, f in weight_map.items():
                if self.where.get(k) != f:
                    raise CheckpointError(f"{folder / f}: key {k} listed in {INDEX_FILE} is not in that shard")

    def keys(self) -> set[str]:
        return set(self.where)

    def get(self, key: str) -> torch.Tensor:
        name = self.where[key]
        try:
            return self.handles[name].get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.folder / name}: key {key} unreadable ({e}): the file is corrupt") from None

    def file_of(self, key: str) -> Path:
        return self.folder / self.where[key]


def read_checkpoint(path: str | Path, cfg: Config | None = None) -> tuple[Config, dict[str, object]]:
    """Read a checkpoint folder (official or transformers layout, one file or shards) into
    {official key: QWeight | Tensor}: linears as QWeight (packed stays packed), the rest as tensors.
    Validates every key, shape, dtype, scale grid and finiteness against the config."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder: pass the checkpoint directory holding config.json")
    cfg = cfg or Config.load(folder)
    files = _Files(folder)
    keys = files.keys()
    specs = tensor_specs(cfg)
    if any(k.startswith("model.") for k in keys) or "lm_head.weight" in keys:
        return cfg, _read_hf(files, specs, cfg)
    out: dict[str, object] = {}
    expected = set()
    for sp in specs:
        expected.add(sp.name)
        if sp.kind in ("fp8", "mxfp4"):
            scale_key = _scale_key(sp.name, keys)
            if scale_key:
                expected.add(scale_key)
            out[sp.name] = _read_linear(files, sp, scale_key)
        else:
            out[sp.name] = _read_plain(files, sp)
    unexpected = sorted(k for k in keys - expected if not k.startswith("mtp."))
    if unexpected:
        k = unexpected[0]
        raise CheckpointError(
            f"{files.file_of(k)}: unexpected key {k} ({len(unexpected)} in all): the config.json does not match "
            f"these weights (check num_hidden_layers, compress_ratios, num_hash_layers, n_routed_experts)")
    return cfg, out


def _scale_key(name: str, keys: set[str]) -> str | None:
    base = name.removesuffix(".weight")
    for cand in (base + ".scale", base + ".weight_scale_inv"):
        if cand in keys:
            return cand
    return None


def _need(files: _Files, key: str) -> torch.Tensor:
    if key not in files.where:
        raise CheckpointError(f"{files.folder}: missing key {key}: the checkpoint is incomplete or its config.json "
                              "describes another model")
    return files.get(key)


def _check_finite(files: _Files, key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and t.dtype.itemsize > 1 and not torch.isfinite(t).all():
        raise CheckpointError(f"{files.file_of(key)}: key {key} has non-finite values: the weights are corrupt")


def _read_plain(files: _Files, sp: Spec) -> torch.Tensor:
    t = _need(files, sp.name)
    if tuple(t.shape) != sp.shape:
        raise CheckpointError(f"{files.file_of(sp.name)}: key {sp.name} has shape {tuple(t.shape)}, config implies "
                              f"{sp.shape}: the config.json does not match these weights")
    if t.dtype not in _DTYPES[sp.kind]:
        raise CheckpointError(f"{files.file_of(sp.name)}: key {sp.name} has dtype {t.dtype}, expected "
                              f"{_DTYPES[sp.kind][0]}")
    _check_finite(files, sp.name, t)
    return t


def _read_linear(files: _Files, sp: Spec, scale_key: str | None) -> QWeight:
    t = _need(files, sp.name)
    where = files.file_of(sp.name)
    n, k = sp.shape
    if scale_key is None:  # unquantized linears are accepted too
        if t.dtype not in _DENSE:
            raise CheckpointError(f"{where}: key {sp.name} is {t.dtype} but has no .scale: add its scale tensor")
        if tuple(t.shape) != sp.shape:
            raise CheckpointError(f"{where}: key {sp.name} has shape {tuple(t.shape)}, config implies {sp.shape}")
        _check_finite(files, sp.name, t)
        return QWeight(t, None, "dense")
    scale = files.get(scale_key)
    if scale.dtype != torch.float8_e8m0fnu:
        scale = scale.float()
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise CheckpointError(f"{files.file_of(scale_key)}: key {scale_key} has non-positive or non-finite scales")
        mant, _ = torch.frexp(scale)
        if (mant != 0.5).any():
            raise CheckpointError(f"{files.file_of(scale_key)}: key {scale_key} has scales that are not powers of two "
                                  "(UE8M0 expected)")
        scale = scale.to(torch.float8_e8m0fnu)
    elif (scale.view(torch.uint8) == 255).any():
        raise CheckpointError(f"{files.file_of(scale_key)}: key {scale_key} has NaN (0xFF) UE8M0 scales")
    if t.dtype == torch.float8_e4m3fn:
        kind, want_w, want_s = "fp8", (n, k), (math.ceil(n / 128), math.ceil(k / 128))
    elif t.dtype in (torch.int8, torch.uint8):
        kind, want_w, want_s = "mxfp4", (n, k // 2), (n, k // 32)
        t = t.view(torch.int8)
    else:
        raise CheckpointError(f"{where}: key {sp.name} has dtype {t.dtype} beside a scale: expected float8_e4m3fn "
                              "(FP8) or int8 (packed MXFP4)")
    if tuple(t.shape) != want_w:
        raise CheckpointError(f"{where}: key {sp.name} has shape {tuple(t.shape)}, {kind} of logical {sp.shape} "
                              f"stores {want_w}: the config.json does not match these weights")
    if tuple(scale.shape) != want_s:
        raise CheckpointError(f"{files.file_of(scale_key)}: key {scale_key} has shape {tuple(scale.shape)}, the "
                              f"scale grid of {kind} weight {sp.name} {sp.shape} must be {want_s}")
    if kind == "fp8" and torch.isnan(t.float()).any():
        raise CheckpointError(f"{where}: key {sp.name} has NaN FP8 codes: the weights are corrupt")
    return QWeight(t, scale, kind)


def _read_hf(files: _Files, specs: list[Spec], cfg: Config) -> dict[str, object]:
    """transformers' layout: rename, split the stacked experts; weights stay as stored (dense)."""
    out: dict[str, object] = {}
    stacked: dict[str, torch.Tensor] = {}
    I = cfg.moe_intermediate_size
    for sp in specs:
        if ".experts." in sp.name and ".shared_experts." not in sp.name:
            if sp.hf not in stacked:
                stacked[sp.hf] = _need(files, sp.hf)
            e, w = sp.name.split(".experts.")[1].split(".")[:2]
            full = stacked[sp.hf][int(e)]
            part = {"w1": full[:I], "w3": full[I:], "w2": full}[w]
            if tuple(part.shape) != sp.shape:
                raise CheckpointError(f"{files.file_of(sp.hf)}: key {sp.hf} gives {tuple(part.shape)} for {sp.name}, "
                                      f"config implies {sp.shape}")
            out[sp.name] = QWeight(part, None, "dense")
            continue
        t = _need(files, sp.hf)
        if sp.kind == "int32":
            t = t.to(torch.int32)
        if tuple(t.shape) != sp.shape:
            raise CheckpointError(f"{files.file_of(sp.hf)}: key {sp.hf} has shape {tuple(t.shape)}, config implies "
                                  f"{sp.shape}")
        _check_finite(files, sp.hf, t)
        out[sp.name] = QWeight(t, None, "dense") if sp.kind in ("fp8", "mxfp4") else t
    return out


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
    cfg.save(folder)
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
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: exists and is not empty: choose a new output folder")
    cfg, weights = read_checkpoint(src)
    dense = {k: (v.data if isinstance(v, QWeight) else v) for k, v in weights.items()}
    write_checkpoint(dst, cfg, quantize_state(cfg, dense))
    return dst


def checkpoint_sha256(path: str | Path) -> str:
    """One hash over config.json and every safetensors file, in name order (identifies a model)."""
    folder = Path(path)
    h = hashlib.sha256()
    for p in sorted([folder / "config.json", *folder.glob("*.safetensors")]):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()

