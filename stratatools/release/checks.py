"""Named checks with pass / fail / skip and their renderings (console rows, JSON, JUnit XML, markdown).

Used by ``validate-release``. A check that could not run for lack of input is ``skip`` with the reason; a
check that ran and found a problem is ``fail``. JUnit XML is valid against both the Jenkins junit-10.xsd and the
Apache Ant schema junitparser follows (see :meth:`CheckSuite.to_junit`); ``to_github`` gives GitHub Actions
annotations.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


def _gh_msg(s: str) -> str:
    """Escape a GitHub Actions workflow-command message (``%``, CR, LF)."""
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_prop(s: str) -> str:
    """Escape a workflow-command property value (the message escapes plus ``:`` and ``,``)."""
    return _gh_msg(s).replace(":", "%3A").replace(",", "%2C")


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
    started: float = field(default_factory=time.time)

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
        """JUnit XML text: one ``testsuite`` in a ``testsuites`` root, one ``testcase`` per check.

        Valid against both JUnit schemas CI systems use (tests/fixtures keeps both): the Jenkins junit-10.xsd and
        the stricter Apache Ant one that junitparser follows. Hence: no attributes on ``testsuites``; the suite
        carries package, id, name, timestamp (local ISO 8601, no zone), hostname, tests/failures/errors/skipped
        and time, and the children properties (at least one property: Jenkins wants one), testcases, system-out
        and system-err; a testcase has name, classname and time and at most one of skipped or failure (the
        reason of a passing check goes to the suite's system-out).
        """
        import socket

        from stratatools.core.version import __version__

        c = self.counts
        suites = ET.Element("testsuites")
        total = sum(x.time_s for x in self.checks)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started))
        host = (socket.gethostname() or "localhost").strip() or "localhost"
        suite = ET.SubElement(suites, "testsuite", name=self.name or "release", tests=str(len(self.checks)),
                              failures=str(c[FAIL]), errors="0", skipped=str(c[SKIP]), time=f"{total:.3f}",
                              timestamp=stamp, hostname=host, id="0", package="stratatools.validate_release")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="stratatools.version", value=__version__)
        for k, v in self.subject.items():
            ET.SubElement(props, "property", name=f"subject.{k}", value=str(v))
        out = []
        for chk in self.checks:
            tc = ET.SubElement(suite, "testcase", classname=f"validate_release.{self.name or 'release'}",
                               name=chk.name, time=f"{chk.time_s:.3f}")
            if chk.status == FAIL:
                f = ET.SubElement(tc, "failure", message=chk.reason, type="CheckFailed")
                f.text = f"{chk.title}: {chk.reason}"
            elif chk.status == SKIP:
                ET.SubElement(tc, "skipped", message=chk.reason)
            out.append(f"{chk.name}: {chk.status}: {chk.reason}")
        ET.SubElement(suite, "system-out").text = "\n".join(out)
        ET.SubElement(suite, "system-err").text = ""
        ET.indent(suites)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def to_github(self) -> str:
        """GitHub Actions workflow commands, one line per failed (``::error``) or skipped (``::notice``) check,
        with ``file=`` the input the check is about (``details["file"]`` or the subject's model) and a title.
        Properties and message are escaped as the runner expects (``%``, CR, LF; plus ``:`` and ``,`` in
        properties)."""
        lines = []
        default = str(self.subject.get("model", "")) if self.subject else ""
        for chk in self.checks:
            if chk.status == PASS:
                continue
            cmd = "error" if chk.status == FAIL else "notice"
            f = str(chk.details.get("file", default)) if isinstance(chk.details, dict) else default
            props = [f"title={_gh_prop(f'validate-release {chk.name}')}"]
            if f:
                props.insert(0, f"file={_gh_prop(f)}")
            lines.append(f"::{cmd} {','.join(props)}::{_gh_msg(chk.reason or chk.title)}")
        c = self.counts
        lines.append(f"::notice title=validate-release::{_gh_msg(self.name)}: {c[PASS]} passed, {c[FAIL]} failed, "
                     f"{c[SKIP]} skipped")
        return "\n".join(lines) + "\n"

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
