"""How an engine is named, loaded and checked: `bundled` or `module:factory`, called as
factory(path, device=..., backend=...[, dtype=...]), and the README's Model API asked of what it returns. One
place for the pytest fixture, `cdna2 bisect` and `cdna2 goldens build`."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

ENGINE_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")  # module:factory, as --cdna2-engine takes it
# what the tiers use of any engine (the README's Model API); trace is optional for the tiers
ENGINE_MEMBERS = ("forward", "generate", "device", "config.vocab_size", "config.num_hidden_layers")
_CALLED = ("forward", "generate", "trace")


def engine_missing(model: Any, also: tuple[str, ...] = ()) -> list[str]:
    """The Model API members `model` lacks (methods must be callable), of ENGINE_MEMBERS and `also`."""
    missing = []
    for name in ENGINE_MEMBERS + also:
        obj = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None or (name in _CALLED and not callable(obj)):
            missing.append(name)
    return missing


def resolve_factory(spec: str, option: str = "--cdna2-engine") -> Callable[..., Any]:
    """``bundled`` -> ``cdna2_engine.load_model``; ``pkg.mod:factory`` -> that callable (errors name ``option``,
    the flag the user typed)."""
    if spec == "bundled":
        import cdna2_engine as bundled

        return bundled.load_model
    if not ENGINE_SPEC.fullmatch(spec):
        raise LookupError(f"{option}={spec}: expected bundled or module:factory")
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise LookupError(f"{option}={spec}: cannot import {module!r}: {e}") from None
    except Exception as e:  # the module itself fails (SyntaxError, an error raised at import): its author's to fix
        raise LookupError(f"{option}={spec}: importing {module!r} raised {type(e).__name__}: {e}") from None
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise LookupError(f"{option}={spec}: {module!r} has no callable {attr!r}")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return obj
    try:
        sig.bind("MODEL_DIR", device="cpu", backend="reference")
    except TypeError:
        raise LookupError(f"{option}={spec}: {attr}{sig} cannot be called as factory(path, device=..., "
                          f"backend=...[, dtype=...])") from None
    return obj


def takes_dtype(factory: Callable[..., Any]) -> bool:
    """Whether an engine factory accepts ``dtype=`` (the bundled one does; a user's may not)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "dtype" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def has_device(dev: Any) -> bool:
    """Whether this host has torch device `dev` (a device type torch cannot ask about counts as there)."""
    import torch

    if dev.type == "cuda":  # also ROCm
        return torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    available = getattr(getattr(torch, dev.type, None), "is_available", None)
    return bool(available()) if callable(available) else True


def check_engine(model: Any, what: str, also: tuple[str, ...] = (), device: str | None = None) -> None:
    """ValueError naming what `model` (loaded by `what`) lacks of the Model API and `also`, or a `model.device`
    this host does not have or other than `device`, the one the factory was given."""
    import torch

    missing = engine_missing(model, also)
    if missing:
        raise ValueError(f"{what} returned {type(model).__name__}, not a model: it has no {', '.join(missing)} (the "
                         "README's Model API; attributes, not dict keys)")
    try:
        dev = torch.device(model.device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{what} returned an engine whose device {model.device!r} is not a torch device") from None
    asked = f" (asked for {device})" if device is not None else ""
    if not has_device(dev):
        raise ValueError(f"{what} returned an engine on {dev}{asked}, which this host does not have: load it on the "
                         "device the factory is given")
    want = torch.device(device) if device is not None else dev
    if dev.type != want.type or (None not in (dev.index, want.index) and dev.index != want.index):
        raise ValueError(f"{what} returned an engine on {dev}, not on {want}, the device the factory is given: load "
                         "it there")


def load_engine(spec: str, path: Any, *, device: str, backend: str, dtype: str, option: str = "--engine",
                also: tuple[str, ...] = (), **extra: Any) -> Any:
    """`spec`'s factory called on `path` (dtype, a name, passed when the factory takes it; `extra` passed as
    given), its result checked: LookupError for a bad spec, ValueError for a result without the Model API."""
    factory = resolve_factory(spec, option=option)
    kw = {"dtype": dtype} if takes_dtype(factory) else {}
    model = factory(str(path), device=device, backend=backend, **kw, **extra)
    check_engine(model, f"{option}={spec}", also, device=device)
    return model
