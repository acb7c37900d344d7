#!/usr/bin/env bash
# Every number in bench/results/h200.json, from the repo root on the GPU machine (H200, ~5 minutes):
# the kernels (checked against float64 first, then a tile sweep, bench_kernels.py), then the flash slice
# (graph decode checked against eager decode and the backend against the reference first, bench_slice.py),
# and the read ceiling by launch size (probe_read.py: what a read-only launch of the kernels' byte counts reaches),
# merged into one file. Copies land in $OUT when it is set (the device tool's output folder).
# --slice-only reruns the slice and merges it into the kernels' existing h200.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
[ "${1:-}" = "--slice-only" ] || python3 bench/bench_kernels.py --sweep --out bench/results
python3 bench/bench_slice.py --steps 16 --profile --out bench/results/h200_slice.json
[ "${1:-}" = "--slice-only" ] || python3 bench/probe_read.py --out bench/results
python3 - <<'PY'
import json
kernels = json.load(open("bench/results/h200.json"))
sl = json.load(open("bench/results/h200_slice.json"))
keys = ("slice_decode_ms_per_token", "slice_floor_ms_per_token", "hf_slice_decode_ms_per_token", "speedup_vs_hf",
        "moe_decode_frac", "moe_decode_us_per_token", "slice_eager_decode_ms_per_token", "vs_reference_f32_rel_max",
        "vs_reference_bf16_forced_kl_max", "vs_float64_f32_triton_rel_max", "vs_float64_f32_reference_rel_max")
kernels.update({k: sl[k] for k in keys}, slice_copy_TBps=sl["copy_TBps"], command="bash bench/reproduce_h200.sh")
kernels.update({k: sl[k] for k in sl if k.startswith(("hf_grouped_mm", "speedup_vs_hf_grouped"))})  # transformers' default experts
try:  # fraction of copy a read-only launch of N MB reaches (--slice-only merges the committed probe_read.json)
    best = json.load(open("bench/results/probe_read.json"))["best"]
    kernels["read_ceiling_frac_by_MB"] = {str(r["MB"]): r["frac"] for r in best}
except FileNotFoundError:
    pass
json.dump(kernels, open("bench/results/h200.json", "w"), indent=1)
print({k: kernels[k] for k in ("copy_TBps", "mxfp4_gemv_m1_frac", "fp8_linear_m1_frac") + keys})
PY
if [ -n "${OUT:-}" ]; then
  cp bench/results/h200.json bench/results/h200_slice.json "$OUT"/
  [ ! -f bench/results/probe_read.json ] || cp bench/results/probe_read.json "$OUT"/
fi
