"""The golden store: reference outputs of one model, checksummed, read-only during a run.

A store is a folder with ``manifest.json`` and safetensors files (DESIGN.md section 3)::

    manifest.json           format, model sha256, prompts (text, token ids), steps, seed, backend, dtype,
                            versions, tolerance profile name, and {file name: sha256} for every tensor file
    teacher.safetensors     "<p>.input_ids" [Tf] and "<p>.logits" [Tf, V]: teacher-forced over the prompt
                            followed by the greedy continuation (Tf = len(prompt) + steps - 1)
    greedy.safetensors      "<p>.tokens" [steps], "<p>.logits" [steps, V]: free-running greedy decode
    taps.safetensors        "<p>.<layer>.attn" / "<p>.<layer>.ffn" [Tf, hc, D]: per-layer hidden states
    selections.safetensors  "<p>.<layer>.<router|indexer>.indices" [Tf, k], ".margin" [Tf] and, where the engine
                            records them, ".ranked" [Tf, r] (its best r entries, -1 for none) and ".scores"
                            [Tf, r] (their selection scores, -inf for none)

Verification happens at open: every file's sha256 is checked before any test reads a tensor (hashing a
20 MB store takes milliseconds, and a corrupt golden must stop the run before it can pass or fail a test
for the wrong reason). Tensors are then loaded lazily, one key at a time, and cached.

Writing goes through :class:`GoldenWriter`: into a temporary sibling folder, then renamed into place, so a
reader sees the old store or the new one, never half of one; an existing store is replaced only with
``regen=True``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pytest_cdna2.engines import check_engine, load_engine

__all__ = [
    "FORMAT",
    "MANIFEST",
    "DEFAULT_PROMPTS",
    "GoldenError",
    "GoldenPrompt",
    "GoldenSelection",
    "GoldenStore",
    "GoldenWriter",
    "BUNDLED_GOLDENS",
    "read_manifest",
    "greedy_mismatch",
    "sha256_file",
    "encode_prompt",
    "decode_tokens",
    "load_prompts",
    "build_goldens",
]

FORMAT = 1
MANIFEST = "manifest.json"
# The store shipped with the package (the bundled tiny model's): never rewritten in place, by pytest or the CLI.
BUNDLED_GOLDENS = Path(__file__).resolve().parent.parent / "goldens" / "tiny-v4" / "goldens"
_BUILD_HINT = "rebuild with `cdna2 goldens build --model MODEL --out DIR` or `pytest --cdna2-regen-goldens`"
# the files a store may list; teacher and greedy always, taps and selections when the build recorded any
GOLDEN_FILES = ("teacher.safetensors", "greedy.safetensors", "taps.safetensors", "selections.safetensors")
_SELECTION_KEY = re.compile(r"(\d+)\.(router|indexer)\.(indices|margin|ranked|scores)")


class GoldenError(Exception):
    """A golden store that cannot be trusted or used; the message names the file and the fix."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def encode_prompt(text: bytes | str | Sequence[int], vocab_size: int | None = None) -> torch.Tensor:
    """Token ids as a LongTensor [T]: a list of ids as given (a real model's tokenizer made them: byte-level ids
    are arbitrary tokens in V4-Flash's vocabulary), else byte-level (token = byte value; str encoded as UTF-8)."""
    if isinstance(text, (list, tuple)):
        if not text or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in text):
            raise ValueError("a token-id prompt must be a non-empty list of token ids >= 0")
        if vocab_size is not None and max(text) >= vocab_size:
            raise ValueError(f"token id {max(text)} is outside the model's vocabulary of {vocab_size}")
        return torch.tensor(list(text), dtype=torch.long)
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:
        raise ValueError("empty prompt")
    if vocab_size is not None and vocab_size < 256:
        raise ValueError(f"byte-level prompts need a vocabulary of >= 256 tokens, the model has {vocab_size}")
    return torch.tensor(list(data), dtype=torch.long)


def decode_tokens(tokens: Iterable[int]) -> str:
    """Byte-level ids back to text for humans; ids >= 256 (special tokens) show as ``<id>``."""
    out, buf = [], bytearray()
    for t in tokens:
        t = int(t)
        if t < 256:
            buf.append(t)
        else:
            out.append(buf.decode("utf-8", "replace") + f"<{t}>")
            buf = bytearray()
    return "".join(out) + buf.decode("utf-8", "replace")


# Default prompts: Python-like and English text (what the bundled model is trained on), four of them
# longer than any sliding window the tiny model uses, so the compressed-KV paths are exercised.
_LONG = (
    b"import os\nimport sys\n\n\ndef main(argv=None):\n    \"\"\"Parse the arguments and run.\"\"\"\n"
    b"    if argv is None:\n        argv = sys.argv[1:]\n    for name in argv:\n        path = os.path.join"
    b"(os.getcwd(), name)\n        if not os.path.exists(path):\n            print(f\"missing: {path}\", "
    b"file=sys.stderr)\n            return 1\n        with open(path, encoding=\"utf-8\") as f:\n"
    b"            for lineno, line in enumerate(f, 1):\n                if line.strip().startswith(\"#\"):\n"
    b"                    continue\n                print(lineno, line.rstrip())\n    return 0\n"
)
DEFAULT_PROMPTS: tuple[bytes, ...] = (
    b"def __init__(self, ",
    b"import os\nimport sys\n",
    b"class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self):\n",
    b"    for i in range(len(",
    b"if __name__ == \"__main__\":\n    ",
    b"    raise ValueError(\"",
    b"The quick brown fox jumps over the lazy dog. ",
    b"    return self.",
    b"from collections import ",
    b"        except KeyError:\n            ",
    b"def _check_arg(name, value):\n    if not isinstance(value, int):\n        raise TypeError(",
    b"# Copyright (c) Python Software Foundation.\n",
    _LONG,
    _LONG[::-1].swapcase(),
    b"\n".join(_LONG.splitlines()[3:] + _LONG.splitlines()[:3]),
    _LONG.replace(b"    ", b"\t") + b"\n\nif __name__ == \"__main__\":\n\tsys.exit(main())\n",
)


def load_prompts(path: str | Path) -> list[bytes | list[int]]:
    """Prompts from a file: ``.json`` is a list of strings or of token-id lists (what your tokenizer made);
    anything else is one prompt per non-empty line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GoldenError(f"prompts file {path}: {e.strerror or e}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise GoldenError(f"prompts file {path}: not valid JSON: {e}") from None
        def ids(p: object) -> bool:
            return isinstance(p, list) and bool(p) and all(type(t) is int and t >= 0 for t in p)

        if not isinstance(data, list) or not all((isinstance(p, str) and p) or ids(p) for p in data):
            raise GoldenError(f"prompts file {path}: expected a JSON list of non-empty strings or of non-empty "
                              "token-id lists ([[1, 2, 3], ...])")
        prompts = [p.encode("utf-8") if isinstance(p, str) else p for p in data]
    else:
        prompts = [line for line in raw.splitlines() if line.strip()]
    if not prompts:
        raise GoldenError(f"prompts file {path}: no prompts")
    return prompts


@dataclass(frozen=True)
class GoldenPrompt:
    """One prompt of a store: its name (key prefix), text and token ids (prompt only)."""

    name: str
    text: bytes
    tokens: tuple[int, ...]

    def input_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The prompt as a ``[1, T]`` LongTensor, ready for ``Model.forward``/``generate``."""
        return torch.tensor([list(self.tokens)], dtype=torch.long, device=device)


class GoldenSelection(NamedTuple):
    """A recorded sparse selection: top-k ``indices`` [T, k], k-th/(k+1)-th score ``margin`` [T] and, in stores
    built since 2026-12-07, the best entries ``ranked`` [T, r] with their selection ``scores`` [T, r]: with them,
    a flip passes only when the engine's picks are a top-k of those scores within the tie margin."""

    indices: torch.Tensor
    margin: torch.Tensor
    ranked: torch.Tensor | None = None
    scores: torch.Tensor | None = None


_LOGITS_RULE = ("a float64 run makes float64 logits, any other run one dtype at least as precise as its own, not "
                "float64 (a bf16 run float32, say), in both files")


def _logits_hold(logits: torch.Tensor, glog: torch.Tensor, dtype: str) -> bool:
    """Both logit tensors of one floating dtype, float64 exactly for a float64 run (whose greedy check is the
    tightest) and otherwise at least as precise as the run (a bf16 run's engine returns float32 logits): logits
    rewritten in a lower precision, or a float64 store's manifest relabelled, are refused."""
    run = getattr(torch, dtype, None)
    if not (isinstance(run, torch.dtype) and run.is_floating_point and logits.dtype == glog.dtype
            and logits.dtype.is_floating_point):
        return False
    wide = torch.float64
    return (logits.dtype == wide) == (run == wide) and torch.finfo(logits.dtype).eps <= torch.finfo(run).eps


class GoldenStore:
    """A verified, read-only golden store; tensors load lazily. Use :meth:`open`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self._keys: dict[str, set[str]] = {}

    # -- opening and verification -------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, expected_model_sha256: str | None = None, config: Any = None) -> GoldenStore:
        """Read the manifest (:func:`read_manifest`), check it is for ``expected_model_sha256`` (when given), verify
        every file's hash, then the contents (:meth:`check_contents`; ``config``, the model's, bounds the recorded
        selections)."""
        path = Path(path)
        mpath = path / MANIFEST
        manifest = read_manifest(path)
        have = manifest["model_sha256"]
        if expected_model_sha256 is not None and have is None:
            raise GoldenError(
                f"{mpath}: model_sha256 is null, so these goldens cannot be tied to the model under test "
                f"(sha256 {expected_model_sha256}); {_BUILD_HINT}"
            )
        if expected_model_sha256 is not None and have != expected_model_sha256:
            raise GoldenError(
                f"goldens at {path} are for model sha256 {have}, but the model under test has sha256 "
                f"{expected_model_sha256}: use the goldens built for this model, or {_BUILD_HINT}"
            )
        store = cls(path, manifest)
        store.verify()
        store.check_contents(config)
        return store

    def verify(self) -> None:
        """Hash every file the manifest lists and refuse a missing file or a checksum mismatch; refuse a store that
        lists other files than golden ones, or holds golden files (or any .safetensors) its manifest does not list
        (one dropped from the manifest would go unchecked). Other files (a README, .DS_Store) are left alone here;
        a rebuild still refuses them, since it replaces the folder."""
        mpath, files = self.path / MANIFEST, self.manifest["files"]
        unknown = sorted(set(files) - set(GOLDEN_FILES))
        missing = [f for f in GOLDEN_FILES[:2] if f not in files]
        if unknown or missing:
            what = f"lists {', '.join(unknown)}, not golden files" if unknown else f"does not list {missing[0]}"
            raise GoldenError(f"{mpath} {what} (a store holds {', '.join(GOLDEN_FILES)}); {_BUILD_HINT}")
        unlisted = sorted(f.name for f in self.path.iterdir() if f.name not in files
                          and (f.name in GOLDEN_FILES or f.suffix == ".safetensors"))  # a README may sit beside
        if unlisted:
            raise GoldenError(f"{self.path} holds golden files its {MANIFEST} does not list "
                              f"({', '.join(unlisted)}): move them out, or {_BUILD_HINT}")
        for name, want in files.items():
            f = self.path / name
            if Path(name).name != name or not f.is_file():
                raise GoldenError(f"golden file {f} listed in {MANIFEST} is missing; {_BUILD_HINT}")
            got = sha256_file(f)
            if got != want:
                raise GoldenError(
                    f"golden file {f}: sha256 {got} does not match {MANIFEST}'s {want}; the file was changed "
                    f"or corrupted: restore it, or {_BUILD_HINT}"
                )

    def check_contents(self, config: Any = None) -> None:
        """Every prompt's teacher and greedy tensors are there, shaped, made by the manifest's run (`_logits_hold`),
        finite, in the vocabulary and consistent with each other (the teacher input is the prompt then the greedy
        continuation, and the greedy logits are the teacher logits at those positions); no file holds a tensor the
        manifest's prompts do not account for; taps and selections are checked too (:meth:`_check_taps`,
        :meth:`_check_selections`). A store whose files match their hashes but not each other is one GoldenError at
        open, not a traceback in every test or a failure blamed on the engine."""
        mpath = self.path / MANIFEST
        names = [p["name"] for p in self.manifest["prompts"]]  # at least one (`read_manifest`)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise GoldenError(f"{mpath}: prompt names repeat ({', '.join(dup)}); {_BUILD_HINT}")
        self._check_keys(names)
        steps = self.manifest.get("steps", 0)
        per_prompt = steps if isinstance(steps, list) else [steps] * len(names)
        vocab = self.manifest.get("vocab_size")
        dtype = self.manifest["dtype"]
        for i, p in enumerate(self.manifest["prompts"]):
            name, prompt = p["name"], p["tokens"]
            ids, logits = self.input_ids(name), self.teacher_logits(name)
            toks, glog = self.greedy_tokens(name), self.greedy_logits(name)
            v = vocab or logits.shape[-1]
            want_steps = per_prompt[i] if i < len(per_prompt) else None
            if any(t.dtype != torch.int64 or t.dim() != 1 for t in (ids, toks)):
                problem = "token ids must be 1-D int64"
            elif any(t.numel() and (t.min() < 0 or t.max() >= v) for t in (ids, toks)):
                problem = f"a token id outside the vocabulary 0..{v - 1}"
            elif want_steps is not None and toks.numel() != want_steps:
                problem = f"{toks.numel()} greedy tokens, the manifest says {want_steps} steps"
            elif ids[: len(prompt)].tolist() != prompt or not torch.equal(ids[len(prompt):], toks[:-1]):
                problem = "the teacher input is not the prompt followed by the greedy continuation"
            elif tuple(logits.shape) != (ids.numel(), v) or tuple(glog.shape) != (toks.numel(), v):
                problem = (f"logits of shape {tuple(logits.shape)} and {tuple(glog.shape)}, expected "
                           f"{(ids.numel(), v)} and {(toks.numel(), v)}")
            elif not _logits_hold(logits, glog, dtype):
                problem = (f"logits of dtype {logits.dtype} and {glog.dtype} from the manifest's {dtype} run: "
                           f"{_LOGITS_RULE}")
            elif not (torch.isfinite(logits).all() and torch.isfinite(glog).all()):
                problem = "non-finite logits"
            else:
                problem = greedy_mismatch(logits[len(prompt) - 1:], glog, dtype)
            if problem:
                raise GoldenError(f"{self.path}: prompt {name}: {problem}; {_BUILD_HINT}")
        lengths = {n: self.input_ids(n).numel() for n in names}
        self._check_taps(names, lengths)
        self._check_selections(lengths, config)

    def _check_keys(self, names: list[str]) -> None:
        """Every tensor key of every file names a prompt of the manifest and a tensor the store holds: dropping a
        prompt from the manifest must not leave its tensors behind unchecked."""
        listed = set(names)
        forms = {"teacher.safetensors": re.compile(r"input_ids|logits"),
                 "greedy.safetensors": re.compile(r"tokens|logits"),
                 "taps.safetensors": re.compile(r".+"),  # an engine's own tap names (bisect orders the bundled one's)
                 "selections.safetensors": _SELECTION_KEY}
        for file in self.manifest["files"]:
            keys = [k.partition(".") for k in self.keys(file)]
            orphans = sorted({n for n, _, _ in keys if n not in listed})
            odd = sorted(f"{n}.{rest}" for n, _, rest in keys if n in listed and not forms[file].fullmatch(rest))
            if orphans or odd:
                what = (f"tensors of prompts {MANIFEST} does not list ({', '.join(orphans[:5])})" if orphans else
                        f"unexpected tensors ({', '.join(odd[:5])})")
                raise GoldenError(f"{self.path / file}: {what}; {_BUILD_HINT}")

    def _check_taps(self, names: list[str], lengths: dict[str, int]) -> None:
        """Taps (float, [Tf, ...], finite) for the first tap_prompts prompts (all when unset), the same taps each:
        a NaN golden tap would make every engine tap look "within limits". Read once, not kept."""
        if "taps.safetensors" not in self.manifest["files"]:
            return
        per: dict[str, set[str]] = {}
        with self._reader("taps.safetensors") as read:
            for key in self.keys("taps.safetensors"):
                name, _, tap = key.partition(".")
                per.setdefault(name, set()).add(tap)
                t = read(key)
                if not t.is_floating_point() or t.dim() < 1 or t.shape[0] != lengths[name]:
                    problem = f"{tuple(t.shape)} {t.dtype}, expected a float tensor of {lengths[name]} rows"
                elif not torch.isfinite(t).all():
                    problem = "non-finite values"
                else:
                    continue
                raise GoldenError(f"{self.path / 'taps.safetensors'}: tap {key}: {problem}; {_BUILD_HINT}")
        k = self.manifest.get("tap_prompts")
        want = names[:k] if isinstance(k, int) else names
        have = [n for n in names if n in per]
        if have != want or len({frozenset(per[n]) for n in have}) > 1:
            raise GoldenError(f"{self.path / 'taps.safetensors'}: taps for prompts {', '.join(have) or 'none'}, "
                              f"expected the same taps for {', '.join(want)} (tap_prompts {k}); {_BUILD_HINT}")

    def _check_selections(self, lengths: dict[str, int], config: Any) -> None:
        """Every selection has indices (int64 [Tf, k]) and margins (float [Tf], >= 0, inf for no competitor), on a
        layer of the model; with the model's ``config``, router picks are expert ids and indexer picks are
        compressed entries closed at their position (or -1), so forcing them cannot fail inside the engine."""
        if "selections.safetensors" not in self.manifest["files"]:
            return
        file = "selections.safetensors"
        layers = getattr(config, "num_hidden_layers", None) or self.manifest.get("num_hidden_layers")
        experts = getattr(config, "n_routed_experts", None)
        ratios = getattr(config, "compress_ratios", None)
        with self._reader(file) as read:
            for key in sorted(self.keys(file)):
                name, _, rest = key.partition(".")
                layer_s, kind, part = _SELECTION_KEY.fullmatch(rest).groups()
                have = self.keys(file)
                if part != "indices":
                    owner = key.removesuffix(part) + "indices"
                    if owner not in have:
                        raise GoldenError(f"{self.path / file}: {key} has no {owner}; {_BUILD_HINT}")
                    continue
                layer, base = int(layer_s), key.removesuffix(".indices")
                if base + ".margin" not in have:
                    raise GoldenError(f"{self.path / file}: {base}.indices has no {base}.margin; {_BUILD_HINT}")
                idx, margin = read(key), read(base + ".margin")
                ranked = read(base + ".ranked") if base + ".ranked" in have else None
                scores = read(base + ".scores") if base + ".scores" in have else None
                rows = lengths[name]
                ratio = ratios[layer] if ratios is not None and layer < len(ratios) else None
                fits = ranked is not None and idx.dim() == 2 and ranked.dim() == 2 and ranked.shape[0] == idx.shape[0]
                picks = torch.cat([idx, ranked.to(idx.dtype)], 1) if fits else idx  # same bounds, -1 aside
                if layers is not None and layer >= layers:
                    problem = f"layer {layer}, the model has {layers}"
                elif idx.dtype != torch.int64 or idx.dim() != 2 or idx.shape[0] != rows:
                    problem = f"indices {tuple(idx.shape)} {idx.dtype}, expected int64 [{rows}, k]"
                elif not margin.is_floating_point() or tuple(margin.shape) != (rows,) or not (margin >= 0).all():
                    problem = f"margins {tuple(margin.shape)} {margin.dtype}, expected {rows} floats >= 0 (inf: none)"
                elif (ranked is None) != (scores is None):
                    problem = "ranked without scores" if scores is None else "scores without ranked"
                elif ranked is not None and (ranked.dtype != torch.int64 or ranked.dim() != 2 or ranked.shape[0] != rows
                                             or (ranked.numel() and ranked.min() < -1)):
                    problem = f"ranked {tuple(ranked.shape)} {ranked.dtype}, expected int64 [{rows}, r] (-1: none)"
                elif scores is not None and (not scores.is_floating_point() or scores.shape != ranked.shape
                                             or scores.isnan().any() or scores.isposinf().any()):
                    problem = f"scores {tuple(scores.shape)} {scores.dtype}, expected floats (no NaN, +inf) like ranked"
                elif kind == "router" and idx.numel() and (idx.min() < 0 or (experts and picks.max() >= experts)):
                    problem = f"expert ids {idx.min()}..{picks.max()}, the model has {experts or 'ids from 0'}"
                elif kind == "indexer" and ratio == 0:
                    problem = "an indexer selection on a layer without compressed attention"
                elif kind == "indexer" and idx.numel() and idx.min() < -1:
                    problem = f"entry {idx.min()} (picks are entries, or -1 for none)"
                elif kind == "indexer" and ratio and not ((picks == -1) | (picks < _closed(rows, ratio))).all():
                    problem = f"entries not yet closed at their position (ratio {ratio})"
                elif ranked is not None and idx.dim() == 2 and (band := _band_problem(idx, margin, ranked, scores)):
                    problem = band
                else:
                    continue
                raise GoldenError(f"{self.path / file}: prompt {name}: {layer_s}.{kind}: {problem}; {_BUILD_HINT}")

    # -- manifest views -------------------------------------------------------------------------------------
    @property
    def model_sha256(self) -> str | None:
        """The sha256 of the checkpoint the goldens were computed from."""
        return self.manifest["model_sha256"]

    @property
    def steps(self) -> int:
        """Greedy steps recorded per prompt (the most, when prompts differ)."""
        steps = self.manifest.get("steps", 0)
        return int(max(steps) if isinstance(steps, list) else steps)

    @property
    def steps_text(self) -> str:
        """The steps as a message gives them: "32", or per prompt "128,128,32" where prompts differ."""
        steps = self.manifest.get("steps", 0)
        return ",".join(map(str, steps)) if isinstance(steps, list) and len(set(steps)) > 1 else str(self.steps)

    @property
    def prompts(self) -> list[GoldenPrompt]:
        """Every prompt, in manifest order."""
        return [
            GoldenPrompt(p["name"], bytes(p["tokens"]) if max(p["tokens"]) < 256 else b"", tuple(p["tokens"]))
            for p in self.manifest["prompts"]
        ]

    def prompt(self, name: str) -> GoldenPrompt:
        """One prompt by name (``p00`` ...)."""
        for p in self.prompts:
            if p.name == name:
                return p
        names = ", ".join(p.name for p in self.prompts)
        raise GoldenError(f"{self.path}: no prompt {name!r} (have: {names})")

    # -- tensors --------------------------------------------------------------------------------------------
    def keys(self, file: str) -> set[str]:
        """Tensor keys of one file of the store."""
        if file not in self._keys:
            from safetensors import safe_open

            with _readable(self._file(file)):
                with safe_open(self._file(file), framework="pt") as f:
                    self._keys[file] = set(f.keys())
        return self._keys[file]

    def _file(self, file: str) -> Path:
        if file not in self.manifest["files"]:
            listed = ", ".join(sorted(self.manifest["files"])) or "none"
            raise GoldenError(
                f"{self.path}: no file {file!r} in {MANIFEST} (files: {listed}); {_BUILD_HINT}"
            )
        return self.path / file

    def tensor(self, file: str, key: str) -> torch.Tensor:
        """One tensor, loaded on first use and cached (the store is read-only during a run)."""
        if (file, key) not in self._cache:
            from safetensors import safe_open

            if key not in self.keys(file):
                raise GoldenError(
                    f"{self.path / file}: no tensor {key!r}: the store is incomplete or older than this "
                    f"check: {_BUILD_HINT}"
                )
            with _readable(self._file(file)):
                with safe_open(self._file(file), framework="pt") as f:
                    self._cache[(file, key)] = f.get_tensor(key)
        return self._cache[(file, key)]

    @contextlib.contextmanager
    def _reader(self, file: str) -> Iterator[Any]:
        """`read(key)` of one file opened once, without caching (the checks at open read taps and selections once:
        a file opened per tensor doubled the bundled store's open time)."""
        from safetensors import safe_open

        with _readable(self._file(file)), safe_open(self._file(file), framework="pt") as f:
            yield f.get_tensor

    def input_ids(self, prompt: str) -> torch.Tensor:
        """Teacher-forced sequence [Tf]: the prompt then the greedy continuation without its last token."""
        return self.tensor("teacher.safetensors", f"{prompt}.input_ids")

    def teacher_logits(self, prompt: str) -> torch.Tensor:
        """Teacher-forced logits [Tf, V] over :meth:`input_ids`."""
        return self.tensor("teacher.safetensors", f"{prompt}.logits")

    def greedy_tokens(self, prompt: str) -> torch.Tensor:
        """Greedy continuation [steps]."""
        return self.tensor("greedy.safetensors", f"{prompt}.tokens")

    def greedy_logits(self, prompt: str) -> torch.Tensor:
        """Logits [steps, V] that chose each greedy token."""
        return self.tensor("greedy.safetensors", f"{prompt}.logits")

    def taps(self, prompt: str) -> dict[str, torch.Tensor]:
        """Per-layer hidden states {"L.attn_in" ... "L.ffn": [Tf, ...]} in forward order ({} for a prompt
        recorded without taps: see the manifest's tap_prompts)."""
        from pytest_cdna2.bisect import tap_order

        if "taps.safetensors" not in self.manifest["files"]:  # built without taps (--tap-prompts 0)
            return {}
        pre = f"{prompt}."
        names = tap_order(k[len(pre):] for k in self.keys("taps.safetensors") if k.startswith(pre))
        return {n: self.tensor("taps.safetensors", pre + n) for n in names}

    def selections(self, prompt: str) -> dict[tuple[int, str], GoldenSelection]:
        """Recorded sparse selections {(layer, "router"|"indexer"): GoldenSelection} ({} for a store built by an
        engine that records none)."""
        if "selections.safetensors" not in self.manifest["files"]:
            return {}
        pre, out = f"{prompt}.", {}
        for k in self.keys("selections.safetensors"):
            if k.startswith(pre) and k.endswith(".indices"):
                layer, kind = k[len(pre):-len(".indices")].split(".")
                base = k[: -len(".indices")]
                part = {n: self.tensor("selections.safetensors", f"{base}.{n}")
                        for n in ("indices", "margin", "ranked", "scores")
                        if f"{base}.{n}" in self.keys("selections.safetensors")}
                out[(int(layer), kind)] = GoldenSelection(**part)
        return dict(sorted(out.items()))


# A prompt's greedy logits (the engine's incremental decode) against its teacher-forced logits at the same
# positions (one prefill over prompt + continuation). float64 goldens: they agree to 2.7e-14 of the logits' scale
# (the bundled store, 2026-12-03), so 1e-9 flags a decode that disagrees with its prefill (the bundled goldens of
# 2026-12-02, d5b8e20, differed by up to 3.6 on 6 of 16 prompts). Other dtypes: the bundled tolerance profile's
# prefill-vs-incremental-decode limit for that dtype (tolerance_default.toml / tolerance_bf16.toml).
GREEDY_VS_TEACHER_RTOL_FLOAT64 = 1e-9


@functools.cache
def _decode_limit(dtype: str) -> float:
    """The bundled profile's prefill-vs-decode limit for dtype (read once, not once a prompt)."""
    from pytest_cdna2.tolerance import load_profile

    return load_profile(dtype=dtype).determinism.incremental_max_abs


def greedy_mismatch(teacher: torch.Tensor, greedy: torch.Tensor, dtype: str) -> str | None:
    """Why greedy logits [S, V] do not match the teacher-forced logits [S, V] at their positions, or None."""
    diff = (teacher.double() - greedy.double()).abs().max(dim=-1).values
    if dtype.removeprefix("torch.") == "float64":
        limit = GREEDY_VS_TEACHER_RTOL_FLOAT64 * max(1.0, teacher.abs().max().item())
    else:
        limit = _decode_limit(dtype.removeprefix("torch."))
    bad = (diff > limit).nonzero()
    if not len(bad):
        return None
    step = int(bad[0])
    return (f"greedy logits differ from the teacher-forced logits by {diff[step].item():.3g} at step {step} "
            f"(limit {limit:.3g}): the engine's incremental decode disagrees with its own prefill")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A store's manifest, its shape checked (no hashes, no tensors): what the suite reads at collection to name
    the prompts, and the first step of :meth:`GoldenStore.open`. Anything wrong is one GoldenError naming the
    file."""
    path = Path(path)
    mpath = path / MANIFEST
    if path.exists() and not path.is_dir():
        raise GoldenError(f"golden store {path} is a file, not a folder: pass the store's folder")
    if not path.is_dir():
        raise GoldenError(f"golden store {path} does not exist; {_BUILD_HINT}")
    if not mpath.is_file():
        raise GoldenError(f"no {MANIFEST} in {path}: not a golden store; {_BUILD_HINT}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(f"{mpath}: not valid JSON ({e}); {_BUILD_HINT}") from None
    except OSError as e:
        raise GoldenError(f"{mpath}: cannot read it ({e.strerror or e})") from None
    if not isinstance(manifest, dict):
        raise GoldenError(f"{mpath}: a JSON {type(manifest).__name__}, not a golden manifest (an object with format, "
                          f"model_sha256, prompts, files); {_BUILD_HINT}")
    for key in ("format", "model_sha256", "prompts", "files"):
        if key not in manifest:
            raise GoldenError(f"{mpath}: missing key {key!r}; {_BUILD_HINT}")
    if manifest["format"] != FORMAT:
        raise GoldenError(
            f"{mpath}: format {manifest['format']!r}, this pytest-cdna2 reads format {FORMAT}; {_BUILD_HINT}"
        )
    _check_layout(manifest, mpath)
    return manifest


def _band_problem(idx: torch.Tensor, margin: torch.Tensor, ranked: torch.Tensor, scores: torch.Tensor) -> str | None:
    """What makes a selection's ranking unfit to judge flips by (None: fit): the near-tie band is read from it,
    so ranked entries that do not start with the picks, repeat, or carry scores out of order, or a margin that
    is not the k-th minus (k+1)-th score, would excuse the wrong flips."""
    k, r = idx.shape[1], ranked.shape[1]
    if r < k:
        return f"ranked {r} entries, fewer than the {k} picks"
    srt = ranked.sort(-1).values
    if ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any():
        return "ranked entries repeated within a position"
    if ((ranked == -1) != (scores == float("-inf"))).any():
        return "ranked -1 (none) and -inf scores at different places"
    if (scores[:, 1:] > scores[:, :-1]).any():
        return "scores not in descending order"
    if not torch.equal(ranked[:, :k].sort(-1).values, idx.sort(-1).values):
        return "ranked entries that do not start with the picks"
    if r > k:
        gap = (scores[:, k - 1] - scores[:, k]).double().nan_to_num(nan=math.inf, posinf=math.inf)
        m = margin.double()
        finite = torch.isfinite(gap) & torch.isfinite(m)
        if (torch.isfinite(gap) != torch.isfinite(m)).any() or \
                ((gap - m).abs()[finite] > 1e-4 + 1e-3 * gap.abs()[finite]).any():
            return "margins that are not the k-th minus the (k+1)-th ranked score"
    return None


def _closed(rows: int, ratio: int) -> torch.Tensor:
    """[rows, 1]: how many compressed entries are closed at each position of a prefill (entry j covers positions
    j*ratio .. (j+1)*ratio - 1, visible from the last of them on: the engine's rule)."""
    return ((torch.arange(rows) + 1) // ratio)[:, None]


def _check_layout(manifest: dict, mpath: Path) -> None:
    """The manifest's shape, checked once at open so a hand-edited or foreign one is one GoldenError, not a
    KeyError deep in a test: files {name: sha256} (at least one), prompts [{name, tokens: [int, ...]}], steps, and
    the dtype of the logits."""
    files, prompts, steps = manifest["files"], manifest["prompts"], manifest.get("steps", 0)
    if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
        raise GoldenError(f"{mpath}: 'files' must map each file name to its sha256; {_BUILD_HINT}")
    if not isinstance(prompts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("tokens"), list)
        and p["tokens"] and all(isinstance(t, int) and t >= 0 for t in p["tokens"]) for p in prompts
    ):
        raise GoldenError(f"{mpath}: 'prompts' must be a list of {{name, tokens: [token ids]}}; {_BUILD_HINT}")
    if not prompts:  # read before collection too: the suite would parametrize over nothing and pass
        raise GoldenError(f"{mpath}: no prompts, so the token tier would check nothing; {_BUILD_HINT}")
    for key in ("vocab_size", "num_hidden_layers"):
        if key in manifest and (type(manifest[key]) is not int or manifest[key] < 1):
            raise GoldenError(f"{mpath}: {key!r} must be a positive integer, got {manifest[key]!r}; {_BUILD_HINT}")
    if not all(isinstance(n, int) and n >= 0 for n in (steps if isinstance(steps, list) else [steps])):
        raise GoldenError(f"{mpath}: 'steps' must be a count or a list of counts; {_BUILD_HINT}")
    dtype = getattr(torch, str(manifest.get("dtype")), None)
    if not isinstance(manifest.get("dtype"), str) or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise GoldenError(f"{mpath}: 'dtype' must name the logits' floating dtype (float64, float32, bfloat16), got "
                          f"{manifest.get('dtype')!r}; {_BUILD_HINT}")


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """safetensors' own errors on a file that passed its checksum (rewritten with a matching manifest) as one
    GoldenError naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        raise GoldenError(f"{path}: unreadable safetensors ({e}); restore it, or {_BUILD_HINT}") from None


class GoldenWriter:
    """Write a store atomically: files go to a temporary sibling folder, renamed into place on success.

    ::

        with GoldenWriter(out_dir, regen=False) as w:
            w.write("teacher.safetensors", {"p00.logits": logits})
            w.manifest.update(model_sha256=sha, prompts=[...])

    An existing non-empty ``out_dir`` is refused unless ``regen=True`` and it is a golden store (holds a
    manifest); then it is swapped out only after the new store is complete. ``verify`` (the temporary folder)
    runs before the rename: a store it refuses is never put in place. On an exception nothing at ``out_dir``
    changes.
    """

    def __init__(self, out_dir: str | Path, *, regen: bool = False,
                 verify: Callable[[Path], object] | None = None) -> None:
        self.out = Path(out_dir).resolve()  # `.` too: the temporary folder goes beside it, never inside
        self.regen = regen
        self.verify = verify
        if self.out.exists() and not self.out.is_dir():
            raise GoldenError(f"{self.out} exists and is not a folder")
        base = next((p for p in self.out.parents if p.exists()), self.out)  # where it and its temporary folder go
        why = "not a folder" if not base.is_dir() else "" if os.access(base, os.W_OK | os.X_OK) else "not writable"
        if why:  # before the slow part
            raise GoldenError(f"{self.out} cannot be written: {base} is {why}; pass another folder")
        if self.out.is_dir() and any(self.out.iterdir()) and not (self.out / MANIFEST).is_file():
            raise GoldenError(  # regen replaces the whole folder: never one that holds something else
                f"{self.out} is not empty and has no {MANIFEST}, so it is not a golden store; refusing to "
                f"replace it: pass a new or empty folder"
            )
        if self.out.resolve() == BUNDLED_GOLDENS:  # first: --regen is refused for it too, so do not suggest it
            raise GoldenError(
                f"{self.out} is the golden store bundled with pytest-cdna2; refusing to rewrite it: build into "
                f"another folder and pass it with --cdna2-goldens"
            )
        if self.out.is_dir() and any(self.out.iterdir()) and not regen:
            self._refuse_unlisted(self.out)  # first: --regen would refuse these too, so do not suggest it
            raise GoldenError(
                f"goldens already exist at {self.out}; refusing to overwrite them: pass --regen "
                f"(`cdna2 goldens build`) or --cdna2-regen-goldens (pytest) to rewrite them"
            )
        if regen and self.out.is_dir():
            self._refuse_unlisted(self.out)
        self.manifest: dict[str, Any] = {"format": FORMAT}
        self._files: dict[str, str] = {}
        self._tmp: Path | None = None

    def _refuse_unlisted(self, folder: Path) -> None:
        """A rebuild deletes the old store's folder: refuse one holding anything besides its manifest and the
        files that lists (checked before the slow part and again, on the moved-away folder, right before
        deleting it, for a file dropped in meanwhile)."""
        try:
            files = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("files", {})
        except (OSError, ValueError, AttributeError):
            files = {}
        listed = {MANIFEST, *(files if isinstance(files, dict) else {})}
        extra = sorted(f.name for f in folder.iterdir() if f.name not in listed)
        if extra:
            raise GoldenError(f"{self.out} holds files its {MANIFEST} does not list ({', '.join(extra)}); regen "
                              f"replaces the whole folder, so move them out first")

    def __enter__(self) -> GoldenWriter:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self

    def write(self, filename: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one safetensors file (each tensor copied to the CPU, contiguous: safetensors refuses tensors
        that share memory, as an engine's picks may with its ranking)."""
        from safetensors.torch import save_file

        if self._tmp is None:
            raise RuntimeError("GoldenWriter.write outside its `with` block")
        if Path(filename).name != filename or filename == MANIFEST:
            raise ValueError(f"bad golden file name {filename!r}")
        path = self._tmp / filename
        save_file({k: v.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
                   for k, v in tensors.items()}, str(path))
        self._files[filename] = sha256_file(path)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._tmp is not None
        if exc_type is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            return
        try:
            self._commit(self._tmp)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise

    def _commit(self, tmp: Path) -> None:
        self.manifest["files"] = dict(sorted(self._files.items()))
        mpath = tmp / MANIFEST
        mpath.write_text(json.dumps(self.manifest, indent=1, sort_keys=False) + "\n", encoding="utf-8")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, and its files 0600: goldens are shared read-only
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if self.verify is not None:
            self.verify(tmp)
        if self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()
        if not self.out.exists():
            os.replace(tmp, self.out)
            return
        if not self.regen:  # someone wrote it meanwhile
            raise GoldenError(f"goldens appeared at {self.out} while writing; refusing to overwrite them")
        old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
        old.rmdir()
        os.replace(self.out, old)
        try:
            self._refuse_unlisted(old)  # moved away, nothing more can land in it through out's path
            os.replace(tmp, self.out)
        except BaseException:
            os.replace(old, self.out)
            raise
        shutil.rmtree(old, ignore_errors=True)


def _versions(model: Any) -> dict[str, str | None]:
    def ver(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    top = type(model).__module__.split(".")[0]
    engine = getattr(sys.modules.get(top), "__version__", None) or (
        ver("pytest-cdna2") if top == "cdna2_engine" else None
    )
    return {"torch": torch.__version__, "triton": ver("triton"), "engine": f"{top} {engine or '?'}",
            "pytest_cdna2": ver("pytest-cdna2"), "python": sys.version.split()[0]}


def model_identity(model: Any, model_dir: str | Path | None, config: bool = True) -> tuple[str | None, Any]:
    """(sha256, config) a store is tied to and bounded by: the engine's own when it names them; else, for an
    official-layout folder (config.json), the folder's sha256 as the bundled engine names it and, with `config`,
    its config (V4's fields bound the recorded selections: another implementation's config may lack them). None
    where neither is known (an engine's own checkpoint format)."""
    official = model_dir is not None and (Path(model_dir) / "config.json").is_file()
    sha = model.checkpoint_sha256() if hasattr(model, "checkpoint_sha256") else None
    cfg = getattr(model, "config", None)
    if official and sha is None:
        from cdna2_engine.checkpoint import checkpoint_sha256

        sha = checkpoint_sha256(model_dir)
    if official and config and not hasattr(cfg, "compress_ratios"):
        from cdna2_engine.config import Config

        cfg = Config.load(Path(model_dir))
    return sha, cfg


def build_goldens(
    model_dir: str | Path | None,
    out_dir: str | Path,
    prompts: Sequence[bytes | str | Sequence[int]] | None = None,
    steps: int | Sequence[int] = 32,
    *,
    dtype: torch.dtype | str = torch.float64,
    backend: str = "reference",
    model: Any = None,
    engine: str = "bundled",
    device: str = "cpu",
    regen: bool = False,
    tolerance_profile: str = "default",
    seed: int = 0,
    taps: bool = True,
    tap_prompts: int | None = 4,
    progress: bool = True,
) -> GoldenStore:
    """Compute goldens with the reference engine and write them atomically; returns the opened store.

    Per prompt: greedy ``generate`` for ``steps`` tokens (tokens + logits), then one teacher-forced
    ``trace`` over prompt + continuation for logits, per-layer taps and sparse selections with margins.
    ``model`` skips loading (a model already loaded); else ``engine`` (``bundled``: ``cdna2_engine.load_model``,
    or ``module:factory``) loads ``model_dir`` on ``device`` with ``backend`` and, when its factory takes one,
    ``dtype``: V4-Flash's goldens need an engine that holds it (float64 on the CPU would take days).
    """
    from tqdm import tqdm

    per_prompt = [steps] if isinstance(steps, int) else list(steps)
    if not per_prompt or min(per_prompt) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"unknown floating dtype {dtype!r}")
    verified: list[GoldenStore] = []  # opened (hashed, checked) once, in the temporary folder before the rename
    writer = GoldenWriter(out_dir, regen=regen,  # refuses an existing store before the slow part
                          verify=lambda tmp: verified.append(GoldenStore.open(tmp, expected_model_sha256=sha,
                                                                              config=cfg)))
    if model is None:  # dtype a name, as pytest passes it
        model = load_engine(engine, model_dir, device=device, backend=backend, dtype=str(dtype).removeprefix("torch."),
                            also=("trace",))
    else:
        check_engine(model, "the engine given", also=("trace",))
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not prompts:
        raise ValueError("no prompts")
    per_prompt = (per_prompt + per_prompt[-1:] * len(prompts))[: len(prompts)]  # the last value repeats
    cfg = model.config
    vocab, layers = int(cfg.vocab_size), int(cfg.num_hidden_layers)
    if not taps:
        tap_names: tuple[str, ...] = ()
    elif hasattr(model, "tap_names"):  # the bundled engine's sub-block taps, so bisect can name the block
        tap_names = tuple(model.tap_names())
    else:
        tap_names = tuple(f"{i}.{k}" for i in range(layers) for k in ("attn", "ffn"))
    device = getattr(model, "device", "cpu")
    run = str(getattr(model, "dtype", dtype)).removeprefix("torch.")  # the run's dtype, as the manifest names it
    sha = model_identity(model, model_dir, config=False)[0]
    torch.manual_seed(seed)

    width = len(str(len(prompts) - 1))
    names = [f"p{i:0{max(2, width)}d}" for i in range(len(prompts))]
    encoded, limit = [], getattr(cfg, "max_position_embeddings", None)
    for name, text, n in zip(names, prompts, per_prompt, strict=True):  # every prompt before any compute
        try:
            ids = encode_prompt(text, vocab)
        except ValueError as e:
            raise ValueError(f"prompt {name}: {e}") from None
        if limit is not None and len(ids) + n > int(limit):
            raise ValueError(f"prompt {name}: {len(ids)} tokens + {n} steps exceed the model's "
                             f"max_position_embeddings {int(limit)}: lower the steps (--steps)")
        encoded.append(ids)

    teacher: dict[str, torch.Tensor] = {}
    greedy: dict[str, torch.Tensor] = {}
    tapd: dict[str, torch.Tensor] = {}
    sels: dict[str, torch.Tensor] = {}
    entries = []
    with writer, torch.no_grad():
        for i, text in enumerate(tqdm(prompts, desc="goldens", unit="prompt", disable=not progress)):
            name, ids = names[i], encoded[i]
            gen = model.generate(ids[None].to(device), per_prompt[i])
            toks = gen.tokens[0].detach().cpu().long()
            seq = torch.cat([ids, toks[:-1]])
            tapped = tap_names if tap_prompts is None or i < tap_prompts else ()
            tr = model.trace(seq[None].to(device), taps=tapped)
            problem = greedy_mismatch(tr.logits[0][len(ids) - 1:].cpu(), gen.logits[0].cpu(),
                                      run)
            if problem:  # nothing is written: the goldens would contradict themselves
                other = type(model).__module__.split(".")[0] != "cdna2_engine"  # the bundled engine: a real bug
                hint = " (float64's limit is 1e-9: an engine that keeps float32 parts in a float64 run fails it, so " \
                    "build with --dtype float32)" if other and run == "float64" else ""
                raise GoldenError(f"prompt {name}: {problem}; fix the engine before building goldens from it{hint}")
            if not (torch.isfinite(tr.logits).all() and torch.isfinite(gen.logits).all()):
                raise GoldenError(f"prompt {name}: the engine returned non-finite logits: fix the engine or its "
                                  "checkpoint before building goldens from it")
            if not _logits_hold(tr.logits[0], gen.logits[0], run):  # the store would be refused at every load
                raise GoldenError(f"prompt {name}: the engine returned logits of dtype {tr.logits.dtype} (trace) and "
                                  f"{gen.logits.dtype} (generate) from a {run} run: {_LOGITS_RULE}")
            teacher[f"{name}.input_ids"] = seq
            teacher[f"{name}.logits"] = tr.logits[0]
            greedy[f"{name}.tokens"] = toks
            greedy[f"{name}.logits"] = gen.logits[0]
            for tap in tapped:
                tapd[f"{name}.{tap}"] = tr.taps[tap][0].float()  # float32: taps gate at ~1e-3, half the bytes
            for (layer, kind), sel in (getattr(tr, "selections", None) or {}).items():
                sels[f"{name}.{layer}.{kind}.indices"] = sel.indices[0].long()
                margin = sel.margin if sel.margin is not None else torch.full(sel.indices.shape[:2], math.inf)
                sels[f"{name}.{layer}.{kind}.margin"] = margin[0]
                if getattr(sel, "ranked", None) is not None and getattr(sel, "scores", None) is not None:
                    sels[f"{name}.{layer}.{kind}.ranked"] = sel.ranked[0].long()
                    sels[f"{name}.{layer}.{kind}.scores"] = sel.scores[0]
            raw = text.encode("utf-8") if isinstance(text, str) else b"" if isinstance(text, (list, tuple)) \
                else bytes(text)
            entries.append({"name": name, "text": raw.decode("utf-8", "replace"), "tokens": ids.tolist(),
                            "seed": seed, "continuation": toks.tolist()})
        writer.write("teacher.safetensors", teacher)
        writer.write("greedy.safetensors", greedy)
        if tapd:
            writer.write("taps.safetensors", tapd)
        if sels:
            writer.write("selections.safetensors", sels)
        writer.manifest.update(
            model_sha256=sha,
            model_dir=str(model_dir) if model_dir is not None else None,
            backend=backend,
            dtype=run,
            device=str(device),
            steps=per_prompt,
            seed=seed,
            vocab_size=vocab,
            num_hidden_layers=layers,
            tolerance_profile=tolerance_profile,
            tap_prompts=tap_prompts,
            versions=_versions(model),
            prompts=entries,
        )
    return GoldenStore(writer.out, verified[0].manifest)  # the same files, renamed (`.` may be a new folder now)

