"""fp32 x against a bf16 W in three bf16 parts on the tensor cores (`matmul_kernel` PARTS=3, the head at a prefill
with every position's logits): each form's error per row against float64, on the flash slice's own head input (its
float32 triton prefill) and on random x, beside the reference's float32 GEMM and dense_mma. Also the slice's
logits per position against a float64 reference run, with the head as run and with an exact head: what the head
adds to bench_slice's float32 gate (99% of positions within 1e-5 of float64).

    python bench/probe_parts.py [--prompt 64] [--out DIR]
    python bench/probe_parts.py --bisect linear hc_pre ...   # the slice's prefill, one op from the reference
    python bench/probe_parts.py --patch tile_exact rms_norm swiglu   # one of linear's inner steps exact
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402
import bench_slice as S  # noqa: E402

from cdna2_engine.model import Model  # noqa: E402
from cdna2_engine.ops import get_ops  # noqa: E402
from cdna2_engine.ops import reference as ref_ops  # noqa: E402
from cdna2_engine.ops import triton as tri  # noqa: E402


def row_err(y: torch.Tensor, want: torch.Tensor) -> dict:
    e = (y.double() - want).norm(dim=-1) / want.norm(dim=-1)
    return {"max": e.max().item(), "median": e.median().item(), "within_1e-5": (e <= 1e-5).double().mean().item()}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--patch", nargs="*", default=[], help="tile_exact, rms_norm, swiglu: inside linear, one at a time")
    ap.add_argument("--bisect", nargs="*", default=[], help="ops to take from the reference, one at a time")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)  # results are written at the end: the folder must exist then
    dev = torch.device("cuda")
    cfg = S.Config(**S.FLASH)
    weights, _, _ = S.random_packed(cfg, dev)
    ops = get_ops("triton")
    seen = []
    real = ops.linear

    def linear(x, w, *args, **kw):
        if w.data.shape[0] == cfg.vocab_size:
            seen.append(x.detach().clone())
        return real(x, w, *args, **kw)

    ops.linear = linear
    ids = torch.randint(0, cfg.vocab_size, (1, a.prompt), device=dev, generator=torch.Generator(dev).manual_seed(1))
    f32 = Model(cfg, weights, device=dev, dtype=torch.float32, ops=ops)
    got = f32.forward(ids)
    del f32
    f64 = Model(cfg, weights, device=dev, dtype=torch.float64, ops=get_ops("reference"))
    gold = f64.forward(ids)
    del f64
    head = weights["head.weight"]
    hd = head.data if hasattr(head, "data") else head
    xh = seen[-1].reshape(-1, hd.shape[1])
    exact_head = (xh.double() @ hd.double().T).reshape(gold.shape)
    out = {"slice_as_run": row_err(got.reshape(-1, gold.shape[-1]), gold.reshape(-1, gold.shape[-1])),
           "slice_exact_head": row_err(exact_head.reshape(-1, gold.shape[-1]), gold.reshape(-1, gold.shape[-1])),
           "x_abs_mean": xh.abs().mean().item(), "x_mean": xh.mean().item(), "forms": {}}
    print(json.dumps(out, indent=1), flush=True)
    for op in a.bisect:  # the slice's float32 triton prefill with one op taken from the reference
        m = Model(cfg, weights, device=dev, dtype=torch.float32, ops=get_ops("triton", [op]))
        out[f"slice_reference_{op}"] = r = row_err(m.forward(ids).reshape(-1, gold.shape[-1]),
                                                   gold.reshape(-1, gold.shape[-1]))
        del m
        print("reference", op, r, flush=True)
    for patch in a.patch:  # one of linear's inner steps exact (float64) or taken from the reference
        saved = {n: getattr(tri, n) for n in ("_tile_matmul", "rms_norm", "swiglu")}
        if patch == "tile_exact":
            def exact(x, wd, sd, y):
                w = S.QWeight(wd.view(torch.float8_e4m3fn), sd.view(torch.float8_e8m0fnu), "fp8") if sd is not None \
                    else S.QWeight(wd, None, "dense")
                wf = ref_ops.dequantize(w, torch.float64).view(y.shape[1], y.shape[2], -1)
                y.copy_(torch.einsum("mgk,grk->mgr", x.double(), wf))
            tri._tile_matmul = exact
        else:
            setattr(tri, patch, getattr(ref_ops, patch))
        try:
            m = Model(cfg, weights, device=dev, dtype=torch.float32, ops=get_ops("triton"))
            out[f"slice_patch_{patch}"] = r = row_err(m.forward(ids).reshape(-1, gold.shape[-1]),
                                                      gold.reshape(-1, gold.shape[-1]))
            del m
        finally:
            for n, f in saved.items():
                setattr(tri, n, f)
        print("patch", patch, r, flush=True)
    if a.bisect or a.patch:
        with open(os.path.join(a.out, "probe_parts.json"), "w") as f:
            json.dump(out, f, indent=1)
        return
    xr = torch.randn(a.prompt, hd.shape[1], device=dev, generator=torch.Generator(dev).manual_seed(2))
    saved = dict(tri.FP8_DOT)
    wq = S.QWeight(hd, None, "dense")
    for xname, x in (("slice_x", xh), ("random_x", xr)):
        want = x.double() @ hd.double().T
        forms = {"reference_f32": lambda x=x: x @ hd.float().T,
                 "dense_mma_16rows": lambda x=x: tri._dense_mma(x[:16].contiguous(), hd, torch.float32)}
        for bk in (64, 32, 16):  # the kernel's parts smallest first (largest first, run 176: 3x further)
            forms[f"parts BK={bk}"] = lambda x=x, bk=bk: (tri.FP8_DOT.update(BLOCK_K=bk), tri.linear(x, wq))[1]
        for name, fn in forms.items():
            try:
                y = fn()
            finally:
                tri.FP8_DOT.clear()
                tri.FP8_DOT.update(saved)
            r = row_err(y, want[: y.shape[0]])
            if "parts" in name:
                tri.FP8_DOT.update(BLOCK_K=int(name.split("BK=")[1]))
                try:
                    ms = B.time_graph_ms(lambda x, w: tri.linear(x, w), [(x, wq)], replays=10)
                    r["us"] = round(ms * 1e3, 1)
                finally:
                    tri.FP8_DOT.clear()
                    tri.FP8_DOT.update(saved)
            out["forms"][f"{xname} {name}"] = r
            print(xname, name, r, flush=True)
    with open(os.path.join(a.out, "probe_parts.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
