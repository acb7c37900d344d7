"""Instructions per weight value in the inner loop of the one-token stream kernels, compiled offline (no GPU).

The kernels are compiled as a launch at V4-Flash decode shapes specializes them (pointers and integers that are
multiples of 16 carry tt.divisibility=16, integers equal to 1 become constants): without that the loads are not
vectorized and the loop is not the one the GPU runs. sm_90: the cubin disassembled by the nvdisasm shipped with
Triton (registers from its cuobjdump); gfx90a: the amdgcn text. The inner loop is the largest backward branch.
Printed per case: loop instructions per weight value (per thread), the global loads in the loop, where the loads
and the FMAs sit in the loop body (0 = its first instruction, 1 = the branch) and how many FMAs come before the
last load: with PREFETCH the next step's loads should all precede the current step's FMAs (0 before).

    python tools/sass_loop.py                          # the launch defaults (MOE_STREAM(_DOWN), FP8_STREAM)
    python tools/sass_loop.py PREFETCH=True PRMT=True  # constexpr (or num_warps) overrides where the kernel has
    python tools/sass_loop.py --dump /tmp/sass         # them (PRMT is sm_90 only); --dump writes each loop body
    python tools/sass_loop.py --only moe_mma_gate_up,moe_mma_down  # the tensor-core kernels (sm_90 only)
    python tools/sass_loop.py --only moe_mma_gate_up maxnreg=56      # under a register cap (a launch option)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import subprocess
import tempfile
import warnings
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cdna2_engine.ops.triton import FP8_STREAM, MOE_STREAM, MOE_STREAM_DOWN
from cdna2_engine.ops.triton import kernels as K

TARGETS = {"sm_90": GPUTarget("cuda", 90, 32), "gfx90a": GPUTarget("hip", "gfx90a", 64)}

# Runtime integer arguments at V4-Flash decode: MoE gate/up (D 4096 -> I 2048, uint32 words), down (2048 -> 4096),
# FP8 wq_b (1024 -> 32768, one row, no K split).
_MOE_UP_INTS = dict(I=2048, D=4096, stride_xt=4096, stride_we=2048 * 512, stride_wn=512, stride_se=2048 * 128,
                    stride_sn=128, stride_hp=2048)
_MOE_DOWN_INTS = dict(D=4096, I=2048, stride_hp=2048, stride_we=4096 * 256, stride_wn=256, stride_se=4096 * 64,
                      stride_sn=64, stride_cp=4096)
_FP8_INTS = dict(M=1, R=32768, K=1024, stride_xm=1024, stride_xg=1024, stride_wn=1024, stride_sn=8,
                 stride_ym=32768, stride_yg=32768, K_CHUNK=1024, stride_ps=32768)


def cases() -> dict[str, tuple]:
    """name -> (ISA spec name, runtime ints, constexprs beyond the spec's, num_warps, weight matrices per step)."""
    moe = {k: MOE_STREAM[k] for k in ("BLOCK_N", "GROUPS", "PREFETCH", "PRMT")}
    down = {**moe, **{k: MOE_STREAM_DOWN[k] for k in ("BLOCK_N", "GROUPS")}}
    fp8 = {k: FP8_STREAM[k] for k in ("BLOCK_N", "BLOCK_K", "UNROLL", "PREFETCH")}
    return {
        "moe_gate_up": ("moe_gate_up_stream", _MOE_UP_INTS, moe, MOE_STREAM["num_warps"], 2),
        "moe_down": ("moe_down_stream", _MOE_DOWN_INTS, down, MOE_STREAM_DOWN["num_warps"], 1),
        "fp8_stream": ("fp8_stream", _FP8_INTS, {**fp8, "UNIFORM": True, "SPLIT": 1}, FP8_STREAM["num_warps"], 1),
    }


# The one-token tensor-core MXFP4 kernels (inline PTX: sm_90 only): name -> (ISA spec, runtime ints, codes a warp's
# loop step covers: gate/up two 16 x 128 row tiles, down two 128-wide K tiles of one).
MMA_CASES = {"moe_mma_gate_up": ("moe_mma_gate_up", dict(I=2048, D=4096), 4096),
             "moe_mma_down": ("moe_mma_down", dict(D=4096, I=2048, TOPK=6), 4096)}


def compile_case(spec: str, ints: dict, const: dict, warps: int, target: GPUTarget):
    """Compile one ISA spec with the runtime specialization of `ints` and constexpr overrides `const`."""
    from pytest_cdna2.isa import with_defaults

    const = dict(const)
    maxnreg = const.pop("maxnreg", None)  # a register cap (launch option), not a constexpr
    _, fn, (sig, const0), _, _ = next(s for s in K.ISA_SPECS + K.ISA_SPECS_SM90 if s[0] == spec)
    sig, constexprs = with_defaults(fn, sig, const0)
    params = inspect.signature(fn.fn).parameters
    constexprs.update({k: v for k, v in const.items() if k in params})
    attrs = {}
    for i, name in enumerate(params):
        if name in constexprs:
            sig[name] = "constexpr"
        elif sig[name].startswith("*") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif ints.get(name) == 1:
            sig[name], constexprs[name] = "constexpr", 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target,
                           options={"num_warps": warps, "num_stages": MOE_STREAM["num_stages"],
                                    **({"maxnreg": maxnreg} if maxnreg else {})})
    return k, constexprs


def _sass(cubin: bytes) -> tuple[list[str], int]:
    """(SASS lines, registers per thread) of a cubin."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = lambda tool, *a: subprocess.run([str(tools / tool), *a, f.name], capture_output=True, text=True,
                                              check=True).stdout
        regs = int(re.search(r"REG:(\d+)", run("cuobjdump", "--dump-resource-usage")).group(1))
        return run("nvdisasm", "-c").splitlines(), regs


def inner_loop(lines: list[str], cuda: bool) -> list[str]:
    """Instructions of the largest loop (a label and a later branch back to it)."""
    label = re.compile(r"^(\.L\w+):" if cuda else r"^(\.LBB\w+):")
    branch = re.compile(r"BRA `?\(?(\.L\w+)" if cuda else r"s_cbranch_\w+\s+(\.LBB\w+)")
    instr = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;" if cuda
                       else r"^\s+([sv]_\w+|global_\w+|buffer_\w+|ds_\w+|flat_\w+)")
    seen, body, best = {}, [], []
    for line in lines:
        m = label.match(line)
        if m:
            seen[m.group(1)] = len(body)
        m = instr.match(line)
        if m:
            body.append(m.group(1) if cuda else line.strip())
            b = branch.search(line)
            if b and b.group(1) in seen and len(body) - seen[b.group(1)] > len(best):
                best = body[seen[b.group(1)]:]
    return best


def summarize(loop: list[str], values: float, cuda: bool) -> str:
    n = len(loop)
    if cuda:
        loads = [i for i, s in enumerate(loop) if re.search(r"\bLDG\b|LDG\.", s)]
        fmas = [i for i, s in enumerate(loop) if re.search(r"\bFFMA\b", s)]
        kinds = sorted({re.search(r"LDG[.\w]*", loop[i]).group(0) for i in loads})
        shared = sum(1 for s in loop if re.search(r"\b(LDS|STS|STSM|BAR|SHFL)\b", s))
        spills = sum(1 for s in loop if re.search(r"\b(LDL|STL)\b", s))
        hmma = sum(1 for s in loop if re.search(r"\bHMMA\b", s))
        extra = f"shared/sync/shfl={shared} spill ld/st={spills}" + (f" hmma={hmma}" if hmma else "")
    else:
        loads = [i for i, s in enumerate(loop) if s.startswith(("global_load", "buffer_load"))]
        fmas = [i for i, s in enumerate(loop) if re.match(r"v_(fma|fmac|mac|pk_fma|fma_mix)_f32", s)]
        kinds = sorted({loop[i].split()[0] for i in loads})
        valu = sum(1 for s in loop if s.startswith("v_"))
        extra = f"valu={valu} ({valu / values:.2f}/value)"
    pos = lambda idx: f"{idx[0] / n:.2f}..{idx[-1] / n:.2f}" if idx else "-"
    early = sum(1 for i in fmas if loads and i < loads[-1])
    return (f"{n:4d} instr {n / values:5.2f}/value  fma={len(fmas)} loads={len(loads)} {kinds}  "
            f"load pos {pos(loads)} fma pos {pos(fmas)} fma before last load={early}  {extra}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("overrides", nargs="*", help="NAME=VALUE constexpr (or num_warps) overrides")
    ap.add_argument("--dump", help="directory for each case's loop body")
    ap.add_argument("--only", help="comma-separated case names")
    args = ap.parse_args()
    over = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    for name, (spec, ints, const, warps, mats) in cases().items():
        if args.only and name not in args.only.split(","):
            continue
        const = {**const, **{k: v for k, v in over.items() if k != "num_warps"}}
        warps = over.get("num_warps", warps)
        for tname, target in TARGETS.items():
            cuda = target.backend == "cuda"
            c, s, i = dict(const, PRMT=const.get("PRMT", False) and cuda), spec, ints  # inline PTX: sm_90 only
            if "PREFETCH" in c and c["PREFETCH"] is None:
                c["PREFETCH"] = cuda  # the launch's default: on for CUDA, off for gfx90a
            if name == "fp8_stream":
                c["HW"] = cuda  # the E4M3 hardware conversion on sm_90, the bit decode on gfx90a
                if c.get("PREFETCH"):  # W as uint32 words
                    s, i = "fp8_stream_prefetch", {**ints, "stride_wn": ints["stride_wn"] // 4}
            k, cx = compile_case(s, i, c, warps, target)
            if cuda:
                lines, regs = _sass(k.asm["cubin"])
            else:
                lines = k.asm["amdgcn"].splitlines()
                regs = int(re.search(r"\.vgpr_count:\s+(\d+)", k.asm["amdgcn"]).group(1))
            loop = inner_loop(lines, cuda)
            per_step = (cx["BLOCK_N"] * cx["GROUPS"] * 32 * mats if name.startswith("moe")
                        else cx["BLOCK_N"] * cx["BLOCK_K"] * cx["UNROLL"])
            shown = {k: v for k, v in c.items() if k in cx}
            print(f"{name:11s} {tname:6s} warps={warps} regs={regs} {shown}\n"
                  f"    {summarize(loop, per_step / (warps * target.warp_size), cuda)}", flush=True)
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                Path(args.dump, f"{name}_{tname}.txt").write_text("\n".join(loop) + "\n")
    for name, (spec, ints, codes) in MMA_CASES.items():
        if args.only and name not in args.only.split(","):
            continue
        k, cx = compile_case(spec, ints, {k: v for k, v in over.items() if k != "num_warps"}, 1, TARGETS["sm_90"])
        lines, regs = _sass(k.asm["cubin"])
        loop = inner_loop(lines, True)
        print(f"{name:11s} sm_90  warps=1 regs={regs}\n    {summarize(loop, codes / 32, True)}", flush=True)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            Path(args.dump, f"{name}_sm_90.txt").write_text("\n".join(loop) + "\n")


if __name__ == "__main__":
    main()
