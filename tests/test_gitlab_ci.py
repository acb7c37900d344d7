""".gitlab-ci.yml, the merge gate users adopt: each job's JUnit report holds that job's tests only.

GitLab hands every job the artifacts of all jobs in earlier stages unless `dependencies` says otherwise, and a
job's `artifacts:reports:junit` glob picks up whatever matches in its folder: a later tier job (and the report
job) uploaded the earlier tiers' XML again as its own report, so the pipeline's test report counted the weight
tests five times."""

from __future__ import annotations

import fnmatch
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL = {"stages", "variables", "default", "include", "workflow", "image", "services", "cache", "before_script",
          "after_script"}


def _pipeline():
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(ROOT, ".gitlab-ci.yml"), encoding="utf-8") as f:
        ci = yaml.safe_load(f)
    jobs = {name: job for name, job in ci.items() if name not in GLOBAL and not name.startswith(".")}
    return ci, jobs


def _junit_written(job) -> list[str]:
    return re.findall(r"--junitxml=(\S+)", " ".join(job.get("script", [])))


def test_each_junit_report_holds_only_its_own_job():
    ci, jobs = _pipeline()
    stages = ci["stages"]
    default = ci.get("default", {})
    checked = 0
    for name, job in jobs.items():
        artifacts = job.get("artifacts", default.get("artifacts", {}))
        globs = (artifacts.get("reports") or {}).get("junit") or []
        globs = [globs] if isinstance(globs, str) else globs
        if not globs:
            continue
        earlier = [n for n, j in jobs.items() if stages.index(j["stage"]) < stages.index(job["stage"])]
        downloaded = job.get("dependencies", earlier)
        others = [f for n in downloaded for f in _junit_written(jobs[n])]
        caught = sorted({f for f in others for g in globs if fnmatch.fnmatch(f, g)})
        assert not caught, f"job {name}: its JUnit report {globs} re-uploads {caught} from earlier jobs"
        checked += 1
    assert checked >= 4  # weight, kernel, token, perf


def test_the_tier_jobs_write_junit_and_the_report_job_collects_them():
    ci, jobs = _pipeline()
    for name in ("weight", "kernel", "token", "perf"):
        assert _junit_written(jobs[name]) == [f"{name}.xml"], name
    report = jobs["report"]
    assert report.get("when") == "always"
    earlier = [n for n, j in jobs.items() if j["stage"] != "report"]
    assert set(report.get("dependencies", earlier)) >= {"weight", "kernel", "token", "perf"}


def test_the_gate_installs_beside_the_images_torch_and_pins_its_lint():
    """The tier jobs keep the ROCm image's torch and Triton (README: `.[suite]`/`.[dev]` could add PyPI's triton
    beside an older pytorch-triton-rocm) and install what the suite and the reports need; lint runs the ruff
    the dev extra pins, so a new ruff release cannot fail the gate on unchanged code."""
    ci, jobs = _pipeline()
    install = " ".join(ci["default"]["before_script"])
    assert "pip install -e . ml-dtypes pytest-benchmark allure-pytest" in install and "[" not in install
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pin = re.search(r'"(ruff==[\d.]+)"', f.read()).group(1)
    assert " ".join(jobs["lint"]["before_script"]) == f"pip install {pin}"
