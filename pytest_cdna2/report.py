"""Session bookkeeping behind the hooks: recorded metrics, the perf gate, and the per-tier summary.

Metrics travel as ``item.user_properties`` entries ``("cdna2_metric", JSON)``: pytest copies them into
every report, xdist ships them from the workers to the controller, and JUnit XML writes them out as
``<property>`` elements, so the summary works the same in every mode. The value is strict JSON
(``{"metric", "value", "limit", "op", "what", "ok"}``, non-finite numbers as the strings "inf", "-inf", "nan"),
so a JUnit consumer parses it with any JSON reader.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = [
    "TIERS",
    "METRIC_PROPERTY",
    "tiers_of",
    "record_metric",
    "metrics_csv",
    "attach_to_allure",
    "Metric",
    "PerfGate",
    "TierTally",
]

TIERS = ("weight", "kernel", "token", "determinism", "isa", "perf")
METRIC_PROPERTY = "cdna2_metric"


def record_metric(
    item: pytest.Item,
    metric: str,
    value: float,
    limit: float,
    *,
    higher_is_better: bool = False,
    what: str = "",
) -> bool:
    """Append one metric to ``item.user_properties``; returns whether it is within its limit."""
    value, limit = float(value), float(limit)
    ok = value >= limit if higher_is_better else value <= limit
    fields = {"metric": metric, "value": _number(value), "limit": _number(limit),
              "op": ">=" if higher_is_better else "<=", "what": what, "ok": bool(ok)}
    item.user_properties.append((METRIC_PROPERTY, json.dumps(fields, allow_nan=False)))
    return bool(ok)


def _number(v: float) -> float | str:
    """v, or "inf"/"-inf"/"nan" (JSON has no such numbers; float() reads the strings back)."""
    return v if math.isfinite(v) else str(v)


def _short(v: float) -> str:
    """A limit in as few digits (4 at least) as tell it apart: cosine_min's 0.999999999 is not 1.000e+00."""
    full = float(f"{v:.12e}")
    return next((f"{v:.{d}e}" for d in range(3, 12) if float(f"{v:.{d}e}") == full), f"{v:.12e}")


def _beside(v: float, limit: float) -> str:
    """A value in the limit's digits at least, and more until it reads apart from a limit it differs from (a
    cosine just under 0.999999999 printed as 1.000e+00, or as the limit itself)."""
    if not (math.isfinite(v) and math.isfinite(limit)):
        return f"{v:.3e}"
    d = max(3, len(_short(limit).split("e")[0].split(".")[-1]))
    while d < 17 and v != limit and f"{v:.{d}e}" == f"{limit:.{d}e}":  # 17 digits tell any two doubles apart
        d += 1
    return f"{v:.{d}e}"


@dataclass(frozen=True)
class Metric:
    """One recorded metric, as read back from a report."""

    nodeid: str
    metric: str
    value: float
    limit: float
    op: str
    what: str

    @property
    def ok(self) -> bool:
        """Within the limit (NaN never is)."""
        return self.value >= self.limit if self.op == ">=" else self.value <= self.limit

    def worse_than(self, other: Metric) -> bool:
        """Further from (or beyond) the limit than ``other``: higher for ``<=`` limits, lower for ``>=``."""
        if math.isnan(self.value):
            return not math.isnan(other.value)
        if math.isnan(other.value):
            return False
        return self.value < other.value if self.op == ">=" else self.value > other.value

    def line(self) -> str:
        """``kl_max 2.100e-02 (limit <= 1.000e-03, FAIL) in <nodeid> [what]``."""
        verdict = "ok" if self.ok else "FAIL"
        where = f" [{self.what}]" if self.what else ""
        limit = _short(self.limit)
        return (
            f"{self.metric} {_beside(self.value, self.limit)} (limit {self.op} {limit}, {verdict}) "
            f"in {self.nodeid}{where}"
        )


def metrics_of(nodeid: str, user_properties: Iterable[Any]) -> list[Metric]:
    """The cdna2 metrics among a report's user properties."""
    out = []
    for prop in user_properties:
        if len(prop) == 2 and prop[0] == METRIC_PROPERTY and isinstance(prop[1], str):
            d = json.loads(prop[1])
            out.append(Metric(nodeid, d["metric"], float(d["value"]), float(d["limit"]), d["op"], d["what"]))
    return out


def metrics_csv(metrics: Iterable[Metric]) -> str:
    """The metrics as CSV (metric, value, op, limit, ok, what) for reports."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["metric", "value", "op", "limit", "ok", "what"])
    for m in metrics:
        w.writerow([m.metric, repr(m.value), m.op, repr(m.limit), m.ok, m.what])
    return buf.getvalue()


def attach_to_allure(item: pytest.Item) -> None:
    """Attach the item's metrics as CSV when allure-pytest is installed (a no-op without --alluredir)."""
    metrics = metrics_of(item.nodeid, item.user_properties)
    if not metrics:
        return
    try:
        import allure
    except ImportError:
        return
    allure.attach(metrics_csv(metrics), name="cdna2 metrics", attachment_type=allure.attachment_type.CSV)


def tiers_of(item: pytest.Item) -> tuple[str, ...]:
    """The tier markers of a test, from its markers only: a folder named ``perf/`` or a parametrize id "kernel"
    is a keyword, not a tier."""
    return tuple(t for t in TIERS if item.get_closest_marker(t) is not None)


def tier_of(tiers: Iterable[str]) -> str | None:
    """The tier a test is counted in: its first tier marker in TIERS order, or None for an untiered test."""
    have = set(tiers)
    return next((t for t in TIERS if t in have), None)


def _ids(ids: list[str]) -> str:
    return ", ".join(ids[:10]) + (f", ... ({len(ids)} in all)" if len(ids) > 10 else "")


class PerfGate:
    """Perf tests run last and only after the whole correctness suite passed in the same session: no test failed
    or errored, nothing failed to collect, no test was deselected (-k, -m, --lf) or picked by node id
    (file.py::test), every other test has run, and each required tier had a passing test."""

    def __init__(self, required: tuple[str, ...]) -> None:
        self.required = required  # correctness tiers that must have passed in this session
        self.failed: list[str] = []
        self.collect_errors: list[str] = []
        self.deselected = 0
        self.picked: list[str] = []  # node-id arguments (file.py::test) that selected correctness tests
        self.finished: set[str] = set()  # non-perf tests whose teardown has reported
        self.passed_tiers: set[str] = set()

    def record(self, report: pytest.TestReport) -> None:
        """Remember a failed non-perf test (any phase), the tiers that had a passing test, and finished tests.
        The tiers come from ``report.cdna2_tiers`` (set from the item's markers when the report was made); a
        report without it (a crashed xdist worker's) counts as a correctness test."""
        tiers = getattr(report, "cdna2_tiers", ())
        if "perf" in tiers:
            return
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)
        if report.when == "call" and report.passed:
            self.passed_tiers.update(tiers)
        if report.when == "teardown":
            self.finished.add(report.nodeid)

    def record_collect(self, report: pytest.CollectReport) -> None:
        """A file (or folder) that failed to collect hides its tests: it blocks perf like a failed test."""
        if report.failed:
            self.collect_errors.append(report.nodeid or "(session)")

    def skip_reason(self, *, device: str, xdist_worker: bool, perf_on_cpu: bool,
                    pending: list[str] | None = None, reference_ops: tuple[str, ...] = ()) -> str | None:
        """Why a perf test must not run now, or None when it may. ``pending``: correctness tests of the session
        that have not run yet; ``reference_ops``: ops the engine runs on the reference (CDNA2_REFERENCE_OPS)."""
        if xdist_worker:
            return (
                "cdna2 perf: gated on the whole session, which xdist splits over workers; run the "
                "suite without -n (`pytest --cdna2-device=N -p no:xdist`), correctness tiers and perf in one run"
            )
        stop = []  # what failed
        if self.failed:
            stop.append(f"{len(self.failed)} correctness test(s) failed: {_ids(self.failed)}")
        if self.collect_errors:
            stop.append(f"{len(self.collect_errors)} collection error(s) hid tests: {_ids(self.collect_errors)}")
        head = [f"skipped because {'; '.join(stop)}"] if stop else []
        if device == "cpu" and not perf_on_cpu:
            head.append("the device is the CPU; perf numbers need a GPU (--cdna2-device=N)")
        if reference_ops:
            head.append(f"CDNA2_REFERENCE_OPS runs {', '.join(reference_ops)} on the reference; perf times the "
                        "kernels: unset it")
        why = []  # what the session did not run
        if self.deselected:
            why.append(f"{self.deselected} correctness test(s) deselected (-k, -m, --lf, --sw)")
        if self.picked:
            why.append(f"correctness tests picked by node id ({_ids(self.picked)}), not whole files")
        if pending:
            why.append(f"{len(pending)} correctness test(s) not run yet (ordered after perf): {_ids(pending)}")
        missing = [t for t in self.required if t not in self.passed_tiers]
        if missing:
            no_triton = "isa" in missing and importlib.util.find_spec("triton") is None
            hint = " (the isa tier compiles with Triton, not installed: pip install -e '.[suite]')" if no_triton else ""
            why.append(f"no passing {', '.join(missing)} test in this session{hint}")
        if not head and not why:
            return None
        if not why:
            return f"cdna2 perf: {'; '.join(head)}"
        return (f"cdna2 perf: {'; '.join(head + why)}: perf runs only after the whole suite passed in the same run "
                f"(every {', '.join(self.required)} test selected and passing; `pytest --cdna2-device=N`)")


@dataclass
class _Outcome:
    tier: str | None
    outcome: str = "passed"
    metrics: list[Metric] = field(default_factory=list)
    reason: str = ""


class TierTally:
    """Final outcome and metrics of every test, from its reports; renders the per-tier summary."""

    def __init__(self) -> None:
        self.tests: dict[str, _Outcome] = {}

    def add(self, report: pytest.TestReport) -> None:
        """Fold one phase report (setup/call/teardown) into its test's final outcome."""
        t = self.tests.setdefault(report.nodeid, _Outcome(tier_of(getattr(report, "cdna2_tiers", ()))))
        if report.failed:  # pytest's own words: a failing call failed, a failing setup or teardown errored
            t.outcome = "failed" if report.when == "call" or t.outcome == "failed" else "error"
        elif report.skipped and t.outcome not in ("failed", "error"):
            t.outcome = "skipped"
            if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
                t.reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        metrics = metrics_of(report.nodeid, report.user_properties)
        if len(metrics) >= len(t.metrics):  # later phases carry everything recorded so far
            t.metrics = metrics

    def counts(self, tier: str) -> dict[str, int]:
        """{"passed": n, "failed": n, "skipped": n, "error": n} for one tier."""
        c = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        for t in self.tests.values():
            if t.tier == tier:
                c[t.outcome] += 1
        return c

    def worst(self, tier: str) -> list[Metric]:
        """The worst value of each metric name recorded in ``tier``, worst-first by failure."""
        best: dict[str, Metric] = {}
        for t in self.tests.values():
            if t.tier != tier:
                continue
            for m in t.metrics:
                if m.metric not in best or m.worse_than(best[m.metric]):
                    best[m.metric] = m
        return sorted(best.values(), key=lambda m: (m.ok, m.metric))

    def lines(self) -> list[str]:
        """The summary: one line per tier that ran, then its worst metrics indented."""
        out = []
        for tier in TIERS:
            c = self.counts(tier)
            if not any(c.values()):
                continue
            errors = f", {c['error']} error{'s' * (c['error'] > 1)}" if c["error"] else ""
            out.append(f"{tier:<12} {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped{errors}")
            if tier == "perf" and c["skipped"]:
                reasons = {t.reason for t in self.tests.values() if t.tier == "perf" and t.reason}
                out += [f"    {r}" for r in sorted(reasons)]
            out += [f"    worst {m.line()}" for m in self.worst(tier)]
        return out
