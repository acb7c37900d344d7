"""Tolerance profiles: the limits every tier checks against, read from TOML.

Limits live in a file, not in test code, so that a team can tighten or relax a gate with a reviewed change
and the goldens' manifest can name the profile they were built for. A user's profile only needs the keys it
changes; the rest come from the bundled ``tolerance_default.toml``. Any unknown section or key, or a value
of the wrong kind, is a one-line :class:`ToleranceError` naming the file and the key: a typo must never
silently fall back to a default.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "DEFAULT_PROFILE",
    "ToleranceError",
    "TokenLimits",
    "KernelLimits",
    "DeterminismLimits",
    "Profile",
    "load_profile",
    "with_limits",
]

DEFAULT_PROFILE = Path(__file__).with_name("tolerance_default.toml")  # float32 / float64 engines
BF16_PROFILE = Path(__file__).with_name("tolerance_bf16.toml")  # bfloat16 / float16 engines


class ToleranceError(ValueError):
    """A profile that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class TokenLimits:
    """Token tier: teacher-forced logits and greedy continuations against the goldens."""

    kl_max: float
    cosine_min: float
    max_abs: float
    top1_min: float
    topk: int
    tie_margin_router: float  # per kind: router scores round far less than indexer scores in bf16
    tie_margin_indexer: float
    tap_rtol_fro: float

    @property
    def tie_margins(self) -> dict[str, float]:
        """{kind: tie margin} as `compare.selection_diff` takes them."""
        return {"router": self.tie_margin_router, "indexer": self.tie_margin_indexer}


@dataclass(frozen=True)
class KernelLimits:
    """Kernel tier: relative Frobenius error against float64, by operand dtype."""

    rtol_fro_float64: float
    rtol_fro_float32: float
    rtol_fro_float16: float
    rtol_fro_bfloat16: float

    def rtol_for(self, dtype: torch.dtype) -> float:
        """The limit for operands of ``dtype`` (fp8/fp4 weights are judged at their bf16 compute dtype)."""
        name = str(dtype).removeprefix("torch.")
        if name.startswith("float8") or name.startswith("float4"):
            name = "bfloat16"
        try:
            return float(getattr(self, f"rtol_fro_{name}"))
        except AttributeError:
            raise KeyError(f"no kernel tolerance for dtype {dtype}") from None


@dataclass(frozen=True)
class DeterminismLimits:
    """Determinism tier: largest allowed difference between runs that should agree (0 = bit-identical)."""

    repeat_max_abs: float
    batch_max_abs: float
    incremental_max_abs: float
    device_max_abs: float


@dataclass(frozen=True)
class Profile:
    """A loaded profile: its name, the file(s) it came from, and one limits object per tier."""

    name: str
    path: str
    token: TokenLimits
    kernel: KernelLimits
    determinism: DeterminismLimits


_SECTIONS: dict[str, type] = {"token": TokenLimits, "kernel": KernelLimits, "determinism": DeterminismLimits}
# Keys whose value is a fraction in [0, 1]; "topk" is an integer >= 1; every other value is a float >= 0.
_FRACTIONS = {"cosine_min", "top1_min"}
_INTEGERS = {"topk"}


def _check_value(path: Path, section: str, key: str, value: Any) -> float | int:
    where = f"{path}: [{section}] {key}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToleranceError(f"{where}: expected a number, got {value!r}")
    if key in _INTEGERS:
        if not isinstance(value, int) or value < 1:
            raise ToleranceError(f"{where}: expected an integer >= 1, got {value!r}")
        return value
    if not math.isfinite(value) or value < 0:
        raise ToleranceError(f"{where}: expected a finite number >= 0, got {value!r}")
    if key in _FRACTIONS and value > 1:
        raise ToleranceError(f"{where}: expected a fraction in [0, 1], got {value!r}")
    return float(value)


def _read(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ToleranceError(f"{path}: tolerance profile not found") from None
    except OSError as e:  # a folder, no permission: the reason without the traceback
        raise ToleranceError(f"{path}: cannot read the tolerance profile: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ToleranceError(f"{path}: not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ToleranceError(f"{path}: not valid TOML: {e}") from None


def _apply(path: Path, data: dict[str, Any], base: dict[str, dict[str, Any]]) -> str | None:
    """Validate ``data`` and merge it into ``base`` in place; return its ``name`` if it has one."""
    name = None
    for section, table in data.items():
        if section == "name":
            if not isinstance(table, str) or not table:
                raise ToleranceError(f"{path}: name: expected a non-empty string, got {table!r}")
            name = table
            continue
        if section not in _SECTIONS:
            known = ", ".join(["name"] + [f"[{s}]" for s in _SECTIONS])
            raise ToleranceError(f"{path}: unknown key {section!r} (known: {known})")
        if not isinstance(table, dict):
            raise ToleranceError(f"{path}: {section}: expected a [{section}] table")
        allowed = {f.name for f in fields(_SECTIONS[section])}
        for key, value in table.items():
            if key == "tie_margin" and section == "token":
                raise ToleranceError(f"{path}: [token] tie_margin: split in two since 2026-12-07: set "
                                     "tie_margin_router and tie_margin_indexer")
            if key not in allowed:
                raise ToleranceError(
                    f"{path}: [{section}] {key}: unknown key (known: {', '.join(sorted(allowed))})"
                )
            base.setdefault(section, {})[key] = _check_value(path, section, key, value)
    return name


def load_profile(path: str | Path | None = None, dtype: str = "float32") -> Profile:
    """The bundled profile for the engine's activation ``dtype`` (derived for float32 or bf16), overridden
    key by key by ``path`` when given."""
    base = BF16_PROFILE if dtype in ("bfloat16", "float16") else DEFAULT_PROFILE
    merged: dict[str, dict[str, Any]] = {}
    name = _apply(base, _read(base), merged) or "default"
    for section, cls in _SECTIONS.items():  # the bundled file itself must be complete
        missing = {f.name for f in fields(cls)} - set(merged.get(section, {}))
        if missing:
            raise ToleranceError(f"{base}: [{section}] missing keys: {', '.join(sorted(missing))}")
    source = str(base)
    if path is not None:
        path = Path(path)
        user_name = _apply(path, _read(path), merged)
        name = user_name or path.stem
        source = str(path)
    tiers = {s: cls(**merged[s]) for s, cls in _SECTIONS.items()}
    return Profile(name=name, path=source, **tiers)


def with_limits(profile: Profile, **tiers: dict[str, Any]) -> Profile:
    """A copy of ``profile`` with some limits changed, e.g. ``with_limits(p, token={"kl_max": 1e-2})``."""
    changed = {s: replace(getattr(profile, s), **v) for s, v in tiers.items()}
    return replace(profile, **changed)
