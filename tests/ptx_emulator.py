"""The inline PTX of the tensor-core kernels (engine/ops/triton/kernels/mma.py) run in Triton's interpreter.

Triton's interpreter refuses inline assembly. `emulate` (installed with `installed`) executes the few straight-line
PTX instructions those kernels use, written from the PTX ISA, so the kernels run on the CPU: every
[32 W] tensor they build from `%laneid` / `%tid.x` holds one element a thread, and element i is thread i of the
program (lane i % 32 of warp i // 32). Warp-wide instructions act on each warp's 32 consecutive elements:
- mma.sync m16n8k16 row.col bf16 -> f32 (PTX ISA "Matrix Fragments for mma.m16n8k16", bf16): lane 4g + t holds
  A (row g + 8 (j & 1), columns 2t + 8 (j >> 1) + h) in register j, half h; B (rows 2t + 8 j + h, column g) in
  register j, half h; C/D (row g + 8 (j >> 1), column 2t + (j & 1)) in register j. Products and sums in float64,
  rounded once to fp32 (the hardware's own fp32 accumulation differs in the last bits);
- shfl.sync.bfly: lane l reads lane l ^ b;
- ld.global(.nc)(.L1::..).v4.u32: 16 bytes at the address (16-byte aligned); prmt (with sign replication), shl,
  and, fma.rn.bf16x2 (bf16 values are exact in fp32; rounded back to bf16 by round-to-nearest-even).
What it cannot show: the interpreter runs a program's whole-tensor operations in order, so a missing barrier, a
cached (.nc) load of data written earlier in the same launch, or a launch's num_warps that does not give the
[32 W] tensors one element a thread all pass here (tests check the last from the launch arguments); the GPU
tests cover them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter as ti

_LOAD = re.compile(r"ld\.global(\.nc)?(\.L1::\w+)?\.v4\.u32")


class _Call:
    def __init__(self, results: list[ti.TensorHandle]):
        self._results = results

    def get_result(self, i: int) -> ti.TensorHandle:
        return self._results[i]


def _u32(a: np.ndarray) -> np.ndarray:
    """A 32-bit register's bits (any 4-byte dtype viewed; narrower integers widened)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype.itemsize == 4 else a.astype(np.int64).astype(np.uint32)


def _bf16_halves(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A word's (low, high) bf16 halves as float64 (bf16 bits are the top 16 of an fp32)."""
    lo = ((w & 0xFFFF).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    hi = (w & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def _to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bits (round to nearest even; values here are exact)."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint32) & 0xFFFF


def _mma(a: list[np.ndarray], b: list[np.ndarray], c: list[np.ndarray]) -> list[np.ndarray]:
    n = a[0].size
    w = n // 32
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    am = np.zeros((w, 16, 16))
    bm = np.zeros((w, 16, 8))
    cm = np.zeros((w, 16, 8))
    for j in range(4):
        for h, half in enumerate(_bf16_halves(a[j].reshape(w, 32))):
            am[:, g + 8 * (j & 1), 2 * t + 8 * (j >> 1) + h] = half
        cm[:, g + 8 * (j >> 1), 2 * t + (j & 1)] = c[j].reshape(w, 32).view(np.float32)
    for j in range(2):
        for h, half in enumerate(_bf16_halves(b[j].reshape(w, 32))):
            bm[:, 2 * t + 8 * j + h, g] = half
    d = (am @ bm + cm).astype(np.float32)
    return [d[:, g + 8 * (j >> 1), 2 * t + (j & 1)].reshape(n).view(np.uint32) for j in range(4)]


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:  # replicate the picked byte's sign bit
            byte = np.where(byte & 0x80, 0xFF, 0).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def _value(tok: str, regs: dict[str, np.ndarray], n: int) -> np.ndarray:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    return np.full(n, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)


def run_block(asm: str, regs: dict[str, np.ndarray], n: int) -> None:
    """Execute the straight-line block on regs (name -> uint32 [n]), writing its destinations in place."""
    for ins in asm.replace("{", " ").replace("}", " ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, _, rest = ins.partition(" ")
        ops = [o.strip() for o in re.split(r",(?![^\[]*\])", rest)]
        if op == "mov.u32" and ops[1] in ("%laneid", "%tid.x"):
            tid = np.arange(n, dtype=np.uint32)
            regs[ops[0]] = tid % 32 if ops[1] == "%laneid" else tid
        elif op == "mov.b32":
            regs[ops[0]] = _value(ops[1], regs, n)
        elif _LOAD.fullmatch(op):
            addr = regs[ops[4].strip("[]")].astype(np.uint64)
            assert (addr % 16 == 0).all(), f"ptx_emulator: {op} from addresses not 16-byte aligned"
            for i in range(4):
                regs[ops[i]] = ti._interpreter.load(addr + np.uint64(4 * i), np.ones(n, dtype=bool),
                                                    np.zeros(n, dtype=np.uint32), np.dtype(np.uint32))
        elif op == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
            d = _mma([regs[o] for o in ops[4:8]], [regs[o] for o in ops[8:10]], [regs[o] for o in ops[10:14]])
            for o, v in zip(ops[:4], d, strict=True):
                regs[o] = v
        elif op == "shfl.sync.bfly.b32":
            lanes = np.arange(n)
            src = (lanes // 32) * 32 + ((lanes % 32) ^ int(ops[2], 0))
            regs[ops[0]] = regs[ops[1]][src]
        elif op == "fma.rn.bf16x2":
            (a_lo, a_hi), (b_lo, b_hi), (c_lo, c_hi) = (_bf16_halves(_value(o, regs, n)) for o in ops[1:4])
            regs[ops[0]] = _to_bf16_bits(a_lo * b_lo + c_lo) | (_to_bf16_bits(a_hi * b_hi + c_hi) << 16)
        elif op == "prmt.b32":
            regs[ops[0]] = _prmt(_value(ops[1], regs, n), _value(ops[2], regs, n), int(ops[3], 0))
        elif op == "shl.b32":
            regs[ops[0]] = (_value(ops[1], regs, n).astype(np.uint64) << int(ops[2], 0)).astype(np.uint32)
        elif op == "and.b32":
            regs[ops[0]] = _value(ops[1], regs, n) & _value(ops[2], regs, n)
        else:
            raise NotImplementedError(f"ptx_emulator: no reading of {op!r} (in {asm!r})")


def emulate(self, asm, constraints, values, types, is_pure, pack):  # noqa: ARG001 - the builder's signature
    """InterpreterBuilder.create_inline_asm: operands $0.. are the outputs, then the inputs (a digit constraint: an
    input tied to that output, as mma's accumulators)."""
    if pack != 1:
        raise NotImplementedError("ptx_emulator: pack=1 only (one element a thread)")
    cons = constraints.split(",")
    n_out = sum(c.startswith("=") for c in cons)
    n = max(v.data.size for v in values)
    regs = {}
    for i, v in enumerate(values):
        data = np.broadcast_to(v.data, (n,))
        regs[f"${n_out + i}"] = data.astype(np.uint64) if cons[n_out + i] == "l" else _u32(data)
    run_block(asm, regs, n)
    out = []
    for i, ty in enumerate(types):
        scalar = ty.scalar if hasattr(ty, "scalar") else ty
        bits = regs[f"${i}"].astype(np.uint32)
        data = bits.view(np.float32) if scalar == tl.float32 else bits.view(np.int32) if scalar == tl.int32 else bits
        out.append(ti.TensorHandle(data.reshape(values[0].data.shape if values[0].data.size == n else (n,)),
                                   scalar))
    return _Call(out)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The interpreter runs the kernels' inline PTX through `emulate` while inside."""
    mp = pytest.MonkeyPatch()
    mp.setattr(ti.InterpreterBuilder, "create_inline_asm", emulate)
    try:
        yield
    finally:
        mp.undo()
