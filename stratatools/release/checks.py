"""Named checks with pass / fail / skip and their renderings (console rows, JSON, JUnit XML, markdown).

Used by ``validate-release``. A check that could not run for lack of input is ``skip`` with the reason; a
check that ran and found a problem is ``fail``. JUnit XML follows the common Ant/Surefire schema (one
``testsuite`` of one ``testcase`` per check, ``failure`` and ``skipped`` children), which CI systems and
junitparser read.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    """One named check.

    Attributes:
        name: stable identifier (``profile-stale``).
        title: what it checks, for people.
        status: pass, fail or skip.
        reason: one line saying why.
        details: JSON-able facts behind the verdict.
        time_s: seconds it took.
    """

    name: str
    title: str
    status: str = SKIP
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "status": self.status, "reason": self.reason,
                "details": self.details, "time_s": round(self.time_s, 4)}


@dataclass
class CheckSuite:
    """An ordered set of checks for one subject (a release)."""

    name: str
    checks: list[Check] = field(default_factory=list)
    subject: dict[str, Any] = field(default_factory=dict)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def run(self, name: str, title: str, fn, *args, **kwargs) -> Check:
        """Run ``fn(*args) -> (status, reason, details)`` as a check and record it (with its time)."""
        t0 = time.perf_counter()
        status, reason, details = fn(*args, **kwargs)
        c = Check(name, title, status, reason, details or {}, time.perf_counter() - t0)
        return self.add(c)

    def skip(self, name: str, title: str, reason: str) -> Check:
        return self.add(Check(name, title, SKIP, reason))

    @property
    def counts(self) -> dict[str, int]:
        out = {PASS: 0, FAIL: 0, SKIP: 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    @property
    def ok(self) -> bool:
        return self.counts[FAIL] == 0

    @property
    def exit_code(self) -> int:
        """0 when nothing failed, 1 otherwise."""
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.name, "subject": self.subject, "ok": self.ok, "counts": self.counts,
                "checks": [c.to_dict() for c in self.checks]}

    def to_junit(self) -> str:
        """JUnit XML text: one testsuite, one testcase per check."""
        c = self.counts
        suites = ET.Element("testsuites", name="stratatools", tests=str(len(self.checks)), failures=str(c[FAIL]),
                            errors="0", skipped=str(c[SKIP]))
        total = sum(x.time_s for x in self.checks)
        suite = ET.SubElement(suites, "testsuite", name=self.name, tests=str(len(self.checks)),
                              failures=str(c[FAIL]), errors="0", skipped=str(c[SKIP]), time=f"{total:.3f}")
        for chk in self.checks:
            tc = ET.SubElement(suite, "testcase", classname=f"validate_release.{self.name}", name=chk.name,
                               time=f"{chk.time_s:.3f}")
            if chk.status == FAIL:
                f = ET.SubElement(tc, "failure", message=chk.reason, type="CheckFailed")
                f.text = f"{chk.title}: {chk.reason}"
            elif chk.status == SKIP:
                ET.SubElement(tc, "skipped", message=chk.reason)
            else:
                so = ET.SubElement(tc, "system-out")
                so.text = chk.reason
        ET.indent(suites)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def to_markdown(self) -> str:
        """A markdown summary: verdict line and a table of checks."""
        c = self.counts
        verdict = "PASS" if self.ok else "FAIL"
        lines = [f"# validate-release: {self.name}", "",
                 f"**{verdict}**: {c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped", ""]
        if self.subject:
            for k, v in self.subject.items():
                lines.append(f"- {k}: `{v}`")
            lines.append("")
        lines += ["| check | status | reason |", "|---|---|---|"]
        icon = {PASS: "pass", FAIL: "**FAIL**", SKIP: "skip"}
        for chk in self.checks:
            reason = chk.reason.replace("|", "\\|")
            lines.append(f"| `{chk.name}` | {icon[chk.status]} | {reason} |")
        return "\n".join(lines) + "\n"
