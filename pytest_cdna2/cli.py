"""``cdna2`` console script: convert checkpoints, build and verify goldens, bisect a failure, list devices.

Exit codes: 0 success; 1 a check ran and failed (``goldens verify`` found a bad file, ``bisect`` a wrong output); 2 bad
input (missing folders, an empty path, bad arguments, an existing store without ``--regen``, a user engine that raises
or is not on ``--device``), always with one ``cdna2: error:`` line.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pytest_cdna2 import devices, goldens

__all__ = ["main", "build_parser"]


class _Fail(Exception):
    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _path(option: str) -> Callable[[str], str]:
    """An argparse type refusing an empty path, which would quietly mean the current folder (as the pytest options
    refuse it): one ``cdna2: error:`` line naming ``option``."""
    def check(text: str) -> str:
        if not text.strip():
            raise _Fail(f"{option}='': empty: expected a path (write . for the current folder)")
        return text

    return check


def _existing_dir(path: str, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise _Fail(f"{what} {p} is not a folder")
    return p


def cmd_convert(args: argparse.Namespace) -> int:
    """transformers ``save_pretrained`` V4 checkpoint -> official layout (the engine does the work)."""
    import cdna2_engine

    src = _existing_dir(args.hf, "--hf")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _Fail(f"--out {out} is a file; choose a new folder")
    if out.exists() and any(out.iterdir()):
        raise _Fail(f"--out {out} exists and is not empty; choose a new folder")
    cdna2_engine.convert_hf_checkpoint(str(src), str(out))
    print(f"converted {src} -> {out}")
    return 0


def _steps(text: str) -> list[int]:
    """--steps N or N,N,...: counts (argparse prints the ArgumentTypeError as a usage error)."""
    try:
        steps = [int(n) for n in text.split(",")]
    except ValueError:
        steps = [-1]
    if min(steps) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count N or counts N,N,... (one per prompt)")
    return steps


def _count(text: str) -> int:
    """A count >= 0 (argparse prints the ArgumentTypeError as a usage error)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count >= 0")
    return int(text)


def cmd_goldens_build(args: argparse.Namespace) -> int:
    """Compute goldens with the reference engine (float64 by default) or ``--engine`` on ``--device`` into ``--out``."""
    model = _existing_dir(args.model, "--model")
    steps = args.steps
    if min(steps) < 1:
        raise _Fail(f"--steps must be >= 1, got {','.join(map(str, steps))}")
    prompts = goldens.load_prompts(args.prompts) if args.prompts else None
    store = goldens.build_goldens(
        model, args.out, prompts, steps if len(steps) > 1 else steps[0], dtype=args.dtype, backend=args.backend,
        engine=args.engine, device=_one_device(args.device), regen=args.regen, tap_prompts=args.tap_prompts,
        progress=not args.quiet,
    )
    files = ", ".join(store.manifest["files"])
    print(f"wrote {len(store.prompts)} prompts x {store.steps_text} steps to {store.path} ({files})")
    return 0


def cmd_goldens_verify(args: argparse.Namespace) -> int:
    """Verify every checksum and the contents of a store (and its model, with ``--model``, whose config also
    bounds the recorded selections)."""
    sha = config = None
    if args.model:  # its identity and config, read without loading it (V4-Flash would fill ~160 GB of host memory)
        from cdna2_engine.checkpoint import checkpoint_sha256, shard_files
        from cdna2_engine.config import Config

        model = _existing_dir(args.model, "--model")
        config = Config.load(model)  # a folder without config.json or weights is no checkpoint: its one line
        shard_files(model)
        sha = checkpoint_sha256(model, cached=False)  # verify: every byte, now
    try:
        store = goldens.GoldenStore.open(args.dir, expected_model_sha256=sha, config=config)
    except goldens.GoldenError as e:
        if not Path(args.dir, goldens.MANIFEST).is_file():
            raise _Fail(str(e)) from None
        raise _Fail(str(e), code=1) from None
    print(f"ok: {store.path}: {len(store.manifest['files'])} files verified, {len(store.prompts)} prompts, "
          f"model sha256 {store.model_sha256}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """Every device torch sees, as the pytest header shows them."""
    for d in devices.list_devices():
        print(d.line())
    return 0


def _one_device(spec: str) -> str:
    """--device as ``--cdna2-device`` reads it (cpu, N or cuda:N), one device; any other torch device string
    (cuda, mps, xpu:0: a user engine's accelerator) passes as torch reads it."""
    import pytest
    import torch

    try:
        found = devices.parse_device_spec(spec, option="--device")
    except pytest.UsageError as e:
        try:
            torch.device(spec)
        except (RuntimeError, ValueError):
            raise _Fail(str(e)) from None
        if re.fullmatch(r"(cuda:)?\d+", spec.strip()):  # --cdna2-device's own form (cuda:7 without a GPU 7): its error
            raise _Fail(str(e)) from None
        from pytest_cdna2.engines import has_device

        if not has_device(torch.device(spec)):
            raise _Fail(f"--device={spec}: this host has no such device (cpu, N or cuda:N for its GPUs)") from None
        return spec
    if len(found) != 1:
        raise _Fail(f"--device={spec}: bisect runs on one device: cpu, N or cuda:N")
    return found[0]


def cmd_bisect(args: argparse.Namespace) -> int:
    """Name the first failing prompt's drifting layer/sub-block and, on triton, the culprit kernel."""
    from pytest_cdna2.bisect import bisect_run

    device = _one_device(args.device)
    lines = bisect_run(_existing_dir(args.model, "--model"), _existing_dir(args.goldens, "--goldens"),
                       backend=args.backend, dtype=args.dtype, device=device, engine=args.engine,
                       prompts=args.prompt or None, tolerance=args.tolerance)
    print("\n".join(lines))
    return 1 if any(" FAIL " in f" {ln}" for ln in lines) else 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="cdna2", description="pytest-cdna2 tools: checkpoints, goldens, devices")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="convert a transformers V4 checkpoint to the official layout")
    c.add_argument("--hf", required=True, metavar="SRC", type=_path("--hf"), help="transformers save_pretrained folder")
    c.add_argument("--out", required=True, metavar="DST", type=_path("--out"),
                   help="new folder for the official layout")
    c.set_defaults(func=cmd_convert)

    bi = sub.add_parser("bisect", help="name where an engine first drifts from the goldens")
    bi.add_argument("--model", required=True, metavar="DIR", type=_path("--model"),
                    help="checkpoint folder (official layout)")
    bi.add_argument("--goldens", required=True, metavar="DIR", type=_path("--goldens"),
                    help="golden store of that model")
    bi.add_argument("--backend", default="reference", choices=("reference", "triton"))
    bi.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    bi.add_argument("--device", default="cpu",
                    help="one device: cpu, N or cuda:N as --cdna2-device, or another torch device name")
    bi.add_argument("--engine", default="bundled", help="bundled or module:factory")
    bi.add_argument("--prompt", action="append", metavar="NAME", help="only these golden prompts (repeatable)")
    bi.add_argument("--tolerance", metavar="FILE", type=_path("--tolerance"),
                    help="tolerance profile TOML, as --cdna2-tolerance")
    bi.set_defaults(func=cmd_bisect)

    g = sub.add_parser("goldens", help="build or verify a golden store")
    gsub = g.add_subparsers(dest="goldens_command", required=True, metavar="ACTION")
    b = gsub.add_parser("build", help="compute goldens with the reference engine (or --engine)")
    b.add_argument("--model", required=True, metavar="DIR", type=_path("--model"),
                   help="checkpoint folder (official layout)")
    b.add_argument("--out", required=True, metavar="DIR", type=_path("--out"), help="golden store folder to create")
    b.add_argument("--prompts", metavar="FILE", type=_path("--prompts"),
                   help="JSON list of strings or of token-id lists, or one prompt per line")
    b.add_argument("--steps", default=[32], type=_steps, metavar="N[,N...]",
                   help="greedy steps per prompt (default 32); a list gives the first prompts theirs, the last repeats")
    b.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                   help="the engine's dtype (default float64; passed when its factory takes dtype)")
    b.add_argument("--engine", default="bundled",
                   help="bundled (the float64 reference) or module:factory: an engine you trust that holds the model")
    b.add_argument("--device", default="cpu",
                   help="one device: cpu, N or cuda:N as --cdna2-device, or another torch device name")
    b.add_argument("--backend", default="reference", choices=("reference", "triton"), help=argparse.SUPPRESS)
    b.add_argument("--tap-prompts", type=_count, metavar="K", default=4,
                   help="record per-layer taps for the first K prompts only (default 4, as the bundled store: taps "
                        "are the bulk of a store, gigabytes a prompt at V4-Flash's size; bisect reads any prompt's)")
    b.add_argument("--regen", action="store_true", help="replace an existing store at --out")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_goldens_build)
    v = gsub.add_parser("verify", help="check every checksum of a golden store")
    v.add_argument("dir", metavar="DIR", type=_path("DIR"))
    v.add_argument("--model", metavar="DIR", type=_path("--model"),
                   help="also check the store was built for this checkpoint")
    v.set_defaults(func=cmd_goldens_verify)

    i = sub.add_parser("info", help="list devices (name, arch, wave size, memory, runtime)")
    i.set_defaults(func=cmd_info)
    return p


def _engine_code(spec: str) -> list[Path]:
    """Where a user engine `spec` (module:factory) keeps its code: the top-level package (or module) of the
    spec's module and of the factory's own module (a factory imported from another module)."""
    name, _, attr = spec.partition(":")
    factory = getattr(sys.modules.get(name), attr.split(".")[0], None)
    places = []
    for mod in {name, getattr(factory, "__module__", None) or name}:
        top = sys.modules.get(mod.split(".")[0])
        file = getattr(top, "__file__", None)
        if file:
            places.append(Path(file).parent if Path(file).name == "__init__.py" else Path(file))
    return places


def _raised_by(e: BaseException, spec: str) -> bool:
    """Whether a frame of e's traceback runs code of the user engine `spec`."""
    places = _engine_code(spec)
    tb = e.__traceback__
    while tb is not None:
        code = Path(tb.tb_frame.f_code.co_filename)
        if any(code == p or p in code.parents for p in places):
            return True
        tb = tb.tb_next
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cdna2`` script; returns the exit code."""
    args = None
    try:
        args = build_parser().parse_args(argv)  # an empty path raises _Fail here
        return int(args.func(args))
    except _Fail as e:
        print(f"cdna2: error: {e}", file=sys.stderr)
        return e.code
    except Exception as e:
        engine = getattr(args, "engine", "bundled")
        if engine != "bundled" and _raised_by(e, engine):  # a user engine's own error: named, no traceback
            message = " ".join(str(e).split())
            print(f"cdna2: error: --engine={engine} raised {type(e).__name__}{': ' if message else ''}{message}",
                  file=sys.stderr)
            return 2
        if isinstance(e, (goldens.GoldenError, ValueError, LookupError)):  # LookupError: --engine
            print(f"cdna2: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, OSError):  # a path that is a file, a folder that cannot be made: one line naming it
            where = f"{e.filename}: " if e.filename else ""
            print(f"cdna2: error: {where}{e.strerror or e}", file=sys.stderr)
            return 2
        raise  # a bug (ours, or the bundled engine's): its traceback


if __name__ == "__main__":
    sys.exit(main())
