"""fp32 x against FP8 W on the prefill tile: `linear` as routed, matmul_kernel with FOLD on and off, and cuBLAS's
float32 on the dequantized weight, each row against float64, at the slice's FP8 shapes and 64 rows (NOTES run 180;
1fb2c32's kernel, timed there as "old", gave FOLD off's bits)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as B  # noqa: E402

from cdna2_engine.ops.triton import kernels as K  # noqa: E402


def main():
    out = {}
    for name, k, r in (("wq_b", 1024, 32768), ("wo_b", 8192, 4096), ("wq_a|wkv", 4096, 1536)):
        w = B.fp8_weight(r, k)
        x = torch.randn(64, 1, k, device="cuda")
        want = x[:, 0].double() @ B.ref.dequantize(w, torch.float64).T
        wd, sd = w.data.view(torch.uint8), w.scale.view(torch.uint8)
        grid = (r // 128, 1, 1)
        res = {}
        for form in ("linear", "fold", "nofold"):
            y = torch.full((64, 1, r), float("nan"), device="cuda")
            if form == "linear":
                y = B.tri.linear(x[:, 0], w).view(64, 1, r)
            else:
                K.matmul_kernel[grid](x, wd, sd, y, 64, r, k, x.stride(0), x.stride(1), wd.stride(0), sd.stride(0),
                                      y.stride(0), y.stride(1), BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=True,
                                      FOLD=form == "fold", num_warps=8, num_stages=3)
            e = (y[:, 0].double() - want).norm(dim=1) / want.norm(dim=1)
            res[form] = [e.max().item(), e.median().item()]
        y = x[:, 0] @ B.ref.dequantize(w, torch.float32).T
        e = (y.double() - want).norm(dim=1) / want.norm(dim=1)
        res["cublas_f32"] = [e.max().item(), e.median().item()]
        print(name, res, flush=True)
        out[name] = res
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_tile_f32.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
