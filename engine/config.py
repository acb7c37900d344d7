"""DeepSeek-V4 configuration: one dataclass whose fields are the official config.json names.

`Config.from_dict` reads the official names (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`) and also transformers' own (`layer_types`, `mlp_layer_types`, `partial_rotary_factor`,
`rope_parameters`), so a `save_pretrained` config.json loads too. `to_dict` writes the official names,
which transformers' DeepseekV4Config folds into its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

_RATIO_OF_TYPE = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "expert_dtype": "fp4",
}
# what this engine reads of each quantization_config key (absent: the official value above); FP8 experts load too,
# the stored dtype deciding each weight's format
QUANTIZATION_ACCEPTED = {"fmt": ["e4m3"], "scale_fmt": ["ue8m0"], "weight_block_size": [[128, 128]],
                         "expert_dtype": ["fp4", "fp8"]}

# V4-Flash's dimensions in four layers, one of each kind (a hash-routed sliding layer, CSA, HCA, CSA): the slice
# bench/bench_slice.py times and the ISA tier's recorded launches (pytest_cdna2/isa.py) are made at.
FLASH_SLICE = dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, head_dim=512,
                   qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2048,
                   n_routed_experts=256, num_experts_per_tok=6, compress_ratios=[0, 4, 128, 4], num_hash_layers=1,
                   sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
                   rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                 "beta_fast": 32, "beta_slow": 1})


def readable(e: OSError) -> str:
    """An OSError while reading a checkpoint's file as what to do about it."""
    if isinstance(e, PermissionError):
        return "permission denied: make it readable (chmod a+r)"
    if isinstance(e, IsADirectoryError):
        return "a folder where a file belongs: replace it with the file"
    return f"unreadable ({e.strerror or e}): check the file"


class ConfigError(ValueError):
    """A config.json that is missing a field or disagrees with itself."""


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    compress_ratios: list[int]
    num_hash_layers: int = 0
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    quantization_config: dict | None = field(default_factory=lambda: dict(QUANTIZATION_CONFIG))

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str, "list[int]": list}.get(str(f.type))
            if want and (not isinstance(v, want) or isinstance(v, bool)):
                raise ConfigError(f"config: field {f.name} must be {f.type}, got {v!r}")
        may_be_zero = ("num_hash_layers", "n_shared_experts", "hc_sinkhorn_iters")
        small = [f"{f.name} must be >= {int(f.name not in may_be_zero)}, got {getattr(self, f.name)}"
                 for f in fields(self) if str(f.type) == "int" and getattr(self, f.name) < (f.name not in may_be_zero)]
        if small:
            raise ConfigError(f"config: field {'; '.join(small)}")
        odd = [f.name for f in fields(self) if str(f.type) == "float" and not math.isfinite(getattr(self, f.name))]
        if odd:
            raise ConfigError(f"config: field(s) {odd} must be finite numbers, got "
                              f"{[getattr(self, n) for n in odd]}")
        if not (self.rms_norm_eps > 0 and self.hc_eps >= 0 and self.rope_theta > 0 and self.compress_rope_theta > 0
                and self.swiglu_limit >= 0 and self.routed_scaling_factor > 0):
            raise ConfigError("config: rms_norm_eps, rope_theta, compress_rope_theta and routed_scaling_factor must "
                              "be > 0, hc_eps and swiglu_limit >= 0")
        for name in ("rope_scaling", "quantization_config"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ConfigError(f"config: field {name} must be an object or null, got {getattr(self, name)!r}")
        rs = self.rope_scaling or {}
        kind = rs.get("rope_type", rs.get("type"))
        if rs and kind not in ("yarn", "default", None):  # anything else would be read as no scaling
            raise ConfigError(f"config: rope_scaling type {kind!r} is not supported: V4 uses yarn")
        if kind == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if isinstance(rs.get(key), bool) or not isinstance(rs.get(key), (int, float)) or not \
                        0 < rs[key] < math.inf:
                    raise ConfigError(f"config: rope_scaling (yarn) needs a positive number {key}, got "
                                      f"{rs.get(key)!r}")
            for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                if key in rs and (isinstance(rs[key], bool) or not isinstance(rs[key], (int, float))
                                  or not math.isfinite(rs[key])):
                    raise ConfigError(f"config: rope_scaling (yarn) {key} must be a number (finite), got {rs[key]!r}")
            if rs.get("attention_factor", 1.0) != 1.0:  # transformers multiplies cos/sin by it
                raise ConfigError(f"config: rope_scaling (yarn) attention_factor {rs['attention_factor']!r} is not "
                                  "supported: V4 applies no YaRN attention factor (DeepSeek's reference); use 1.0")
        q = self.quantization_config or {}
        method = q.get("quant_method", "fp8")
        if method != "fp8":
            raise ConfigError(f"config: quantization_config quant_method {method!r} is not supported: the official "
                              f"V4 layout is fp8 (with MXFP4 experts)")
        for key, ok in QUANTIZATION_ACCEPTED.items():
            got = q.get(key, QUANTIZATION_CONFIG[key])
            if (list(got) if isinstance(got, tuple) else got) not in ok:
                raise ConfigError(f"config: quantization_config {key} {got!r} is not supported: this engine reads "
                                  f"{' or '.join(map(repr, ok))} (FP8 e4m3 with UE8M0 128x128 block scales, MXFP4 or "
                                  "FP8 experts)")
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ConfigError(f"config: compress_ratios has {len(self.compress_ratios)} entries for {n} layers")
        self.compress_ratios = list(self.compress_ratios[:n])
        bad = [r for r in self.compress_ratios if type(r) is not int or r not in (0, 4, 128)]
        if bad:
            raise ConfigError(f"config: compress_ratios entries must be 0, 4 or 128 (integers), got {bad}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ConfigError(f"config: scoring_func {self.scoring_func!r} is not sqrtsoftplus, sigmoid or softmax")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError("config: num_attention_heads * head_dim must divide into o_groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError("config: qk_rope_head_dim must be even and <= head_dim and index_head_dim")
        if self.hidden_size % 32 or self.moe_intermediate_size % 32:
            raise ConfigError("config: hidden_size and moe_intermediate_size must be multiples of 32 (MXFP4 groups)")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError(f"config: num_experts_per_tok {self.num_experts_per_tok} outside 1..n_routed_experts")
        if not 0 <= self.num_hash_layers <= n:
            raise ConfigError(f"config: num_hash_layers {self.num_hash_layers} outside 0..{n}")

    @property
    def layer_types(self) -> list[str]:
        inv = {v: k for k, v in _RATIO_OF_TYPE.items()}
        return [inv[r] for r in self.compress_ratios]

    def is_hash_layer(self, i: int) -> bool:
        return i < self.num_hash_layers

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> Config:
        """A config from official or transformers names. Optional fields it lacks take the defaults above,
        V4-Flash's values except rope_scaling (none), as transformers' DeepseekV4Config fills them in (the
        dataclass's num_hash_layers 0 aside: a config.json without it or mlp_layer_types gets transformers' 3):
        a partial config.json loads, so it must name every field where the model differs."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: not a JSON object: expected {{\"hidden_size\": ..., ...}}")
        d = dict(d)
        bad_types = [t for t in d.get("layer_types") or [] if t not in _RATIO_OF_TYPE]
        if bad_types:
            raise ConfigError(f"{source}: layer_types entries {bad_types} unknown: use {sorted(_RATIO_OF_TYPE)}")
        if "compress_ratios" not in d and "layer_types" in d:
            d["compress_ratios"] = [_RATIO_OF_TYPE[t] for t in d["layer_types"]]
        for key, kind, what in (("layer_types", list, "a list"), ("mlp_layer_types", list, "a list"),
                                ("rope_parameters", dict, "an object"), ("partial_rotary_factor", (int, float),
                                                                         "a number")):
            if d.get(key) is not None and (not isinstance(d[key], kind) or isinstance(d[key], bool)):
                raise ConfigError(f"{source}: field {key} must be {what}, got {d[key]!r}")
        if d.get("expert_dtype") is not None and isinstance(d.get("quantization_config"), dict):
            d["quantization_config"] = {"expert_dtype": d["expert_dtype"], **d["quantization_config"]}  # V4's place
        if d.get("tie_word_embeddings"):
            raise ConfigError(f"{source}: tie_word_embeddings {d['tie_word_embeddings']!r} is not supported: V4 has "
                              "its own lm_head (transformers would tie it to the embedding); set it to false")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {d['hidden_act']!r} is not supported: V4's experts use silu "
                              "(SwiGLU)")
        mlp = d.get("mlp_layer_types")
        if mlp is not None:
            n = d.get("num_hidden_layers")
            if isinstance(n, int) and not isinstance(n, bool):  # else the field's own check names it
                if len(mlp) < n:
                    raise ConfigError(f"{source}: mlp_layer_types has {len(mlp)} entries for {n} layers")
                mlp = mlp[:n]  # transformers keeps n
            if any(t not in ("hash_moe", "moe") for t in mlp):
                raise ConfigError(f"{source}: mlp_layer_types entries must be hash_moe or moe, got {mlp!r}")
            n_hash = mlp.count("hash_moe")
            if mlp[:n_hash] != ["hash_moe"] * n_hash:
                raise ConfigError(f"{source}: mlp_layer_types {mlp!r}: the hash_moe layers must come first (V4 routes "
                                  "its first num_hash_layers layers by token id)")
            d["num_hash_layers"] = n_hash  # it wins over a legacy num_hash_layers, as in transformers
        if "num_hash_layers" not in d and isinstance(d.get("num_hidden_layers"), int) and d["num_hidden_layers"] > 0:
            d["num_hash_layers"] = min(3, d["num_hidden_layers"])  # transformers' default_num_hash_layers
        if "qk_rope_head_dim" not in d and d.get("partial_rotary_factor") and "head_dim" in d:
            d["qk_rope_head_dim"] = int(d["head_dim"] * d["partial_rotary_factor"])
        rp = d.get("rope_parameters") or {}
        for part in ("main", "compress"):
            if rp.get(part) is not None and not isinstance(rp[part], dict):
                raise ConfigError(f"{source}: field rope_parameters.{part} must be an object, got {rp[part]!r}")
        if d.get("rope_scaling") is None:  # with rope_scaling, transformers reads rope_parameters not at all
            cls._read_rope_parameters(d, rp, source)
        names = {f.name for f in fields(cls)}
        required = [f.name for f in fields(cls) if _required(f)]
        missing = [n for n in required if n not in d]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {missing}: add them (official DeepSeek-V4 names)")
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except ConfigError as e:
            raise ConfigError(f"{source}: {str(e).removeprefix('config: ')}") from None

    @staticmethod
    def _read_rope_parameters(d: dict, rp: dict, source: str) -> None:
        """rope_parameters into d's rope_scaling and thetas as transformers reads them: nested main and compress
        (their thetas win over the top-level ones), or flat (the compressed layers' YaRN); forms it would read
        otherwise than DeepSeek's V4, or that it reads oddly, are refused."""
        main, comp = rp.get("main"), rp.get("compress")
        if isinstance(main, dict) != isinstance(comp, dict):
            raise ConfigError(f"{source}: rope_parameters has {'compress' if isinstance(comp, dict) else 'main'} "
                              "without its other half: give both main and compress (transformers reads one alone "
                              "as no scaling)")
        if isinstance(comp, dict):
            if main.get("rope_type", main.get("type")) not in (None, "default"):
                raise ConfigError(f"{source}: rope_parameters.main is {main.get('rope_type', main.get('type'))!r}: V4 "
                                  "scales only the compressed layers' RoPE (compress), the sliding ones' stays default")
            if "rope_theta" not in comp:
                raise ConfigError(f"{source}: rope_parameters.compress has no rope_theta: transformers would take "
                                  "rope_theta's; write the compressed layers' (V4-Flash: 160000)")
            if comp.get("rope_type", comp.get("type")) == "yarn" and "attention_factor" not in comp:
                raise ConfigError(f"{source}: rope_parameters.compress (yarn) has no attention_factor: transformers "
                                  "would apply YaRN's derived one, DeepSeek's V4 none; write \"attention_factor\": 1.0")
            d["compress_rope_theta"] = comp["rope_theta"]
            if main.get("rope_theta") is not None:
                d["rope_theta"] = main["rope_theta"]
        elif rp.get("rope_type", rp.get("type")) not in (None, "default"):
            comp = {k: v for k, v in rp.items() if k != "rope_theta"}  # flat: at compress_rope_theta, as transformers
        if isinstance(comp, dict) and comp.get("rope_type", comp.get("type")) == "yarn":
            d["rope_scaling"] = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}

    @classmethod
    def load(cls, path: str | Path) -> Config:
        """config.json of a checkpoint folder (or that file); missing fields default as in `from_dict`."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}): save it as UTF-8 JSON") from None
        except FileNotFoundError:
            raise ConfigError(f"{file}: not found: a checkpoint folder needs its config.json") from None
        except OSError as e:
            raise ConfigError(f"{file}: {readable(e)}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw, source=str(file))

    def to_dict(self) -> dict:
        """Official DeepSeek-V4 names, plus what transformers needs to pick its class."""
        d = asdict(self)
        d.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
                 tie_word_embeddings=False, norm_topk_prob=True, hidden_act="silu")
        if d["quantization_config"] is None:
            del d["quantization_config"]
        if d["rope_scaling"] is None:
            del d["rope_scaling"]
        return d

    def save(self, path: str | Path) -> None:
        Path(path, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def rope_inv_freq(cfg: Config, compressed: bool) -> torch.Tensor:
    """Inverse frequencies (float64) of the interleaved RoPE pairs, [qk_rope_head_dim / 2].

    Sliding layers use plain RoPE at rope_theta; compressed layers (CSA/HCA, their compressors and the
    indexer) use compress_rope_theta with YaRN when rope_scaling says so. As in DeepSeek's reference, the
    YaRN attention factor (mscale) is not applied to cos/sin.
    """
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compressed else cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if not compressed or not rs or rs.get("rope_type", rs.get("type")) != "yarn":
        return inv
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency pairs)
    return inv / factor * (1 - extrapolate) + inv * extrapolate
