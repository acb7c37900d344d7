"""The ISA tier under several Triton releases, no GPU needed: each release installed into a cache folder
(`pip install --no-deps --target`) and every kernel compiled ahead of time for gfx90a and sm_90 in a subprocess
(one process holds one triton). Register allocation differs between releases (NOTES run 100: a kernel that fit
in 220 VGPRs with 3.9 spilled with 3.6), and the oldest release the kernels compile with is the engine's
MIN_TRITON; this is how both were checked, with each release's own compile errors. Both sets of the tier: the
kernels' specs and the V4-Flash slice's recorded launches (pytest_cdna2/isa.py).

    python tools/isa_versions.py 3.5.1 3.6.0 3.9.0 [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AUDIT = """
import json
import triton
from pytest_cdna2 import isa
audits = isa.audit_all() + isa.audit_launches(isa.GFX90A) + isa.audit_launches(isa.SM90)
rows = [{"name": a.name, "target": a.target, "ok": a.compiled and not a.violations(),
         "why": ("; ".join(a.violations()) or a.error)[:300]} for a in audits]
print(json.dumps({"triton": triton.__version__, "audits": rows}))
"""


def audit(version: str, cache: Path) -> dict:
    """The audit rows of every kernel under Triton `version` (installed into cache/version first if needed)."""
    target = cache / version
    if not (target / "triton").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"triton=={version}"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    run = subprocess.run([sys.executable, "-c", AUDIT], env=env, capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"Triton {version}: the audit itself failed: {last}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+", help="Triton releases, e.g. 3.5.1 3.6.0")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytest_cdna2" / "triton")
    a = ap.parse_args()
    failed = False
    for v in a.versions:
        d = audit(v, a.cache)
        bad = [r for r in d["audits"] if not r["ok"]]
        print(f"Triton {d['triton']}: {len(d['audits']) - len(bad)} of {len(d['audits'])} kernel builds clean")
        by_why: dict[str, list[str]] = {}
        for r in bad:
            by_why.setdefault(r["why"], []).append(f"{r['name']} {r['target']}")
        for why, builds in by_why.items():
            print(f"  {', '.join(builds) if len(builds) <= 4 else f'{len(builds)} builds'}: {why}")
        failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
