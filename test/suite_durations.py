"""Where the suite's time goes, per test module: pytest hooks that test/conftest.py takes in.

pytest's ``--durations`` lists single test phases; a module's cost is its server start-ups (fixture set-up), its
tests and its teardowns together, and on two xdist workers a module runs wholly on one worker (test/conftest.py's
scheduler), so the sum of its phases is the time it held that worker. At the end of every run the 15 slowest modules
are printed; ``--suite-report NAME.md`` also writes every module's time, the run's wall time and outcome counts to
NAME.md (generated: the command, commit, date and CPUs in it) with the raw numbers in NAME.json.

Our own code rather than a plugin: pytest and pytest-xdist report each phase's duration to the controller
(``pytest_runtest_logreport``), and summing them per module is the whole job.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

SLOWEST_MODULES = 15
_PHASES = ("setup", "call", "teardown")
_seconds = collections.defaultdict(lambda: dict.fromkeys(_PHASES, 0.0))  # module -> phase -> s
_tests = collections.defaultdict(set)  # module -> test node ids
_outcomes = collections.Counter()  # passed / failed / skipped / error, as pytest counts them
_start = [time.time()]


def pytest_addoption(parser):
    parser.addoption("--suite-report", metavar="NAME.md", default=None,
                     help="write every test module's time (set-up + call + teardown, seconds) to NAME.md and "
                          "NAME.json (test/suite_durations.py)")


def pytest_sessionstart(session):
    _start[0] = time.time()


def pytest_runtest_logreport(report):
    """Each test phase's duration, added to its module (on the xdist controller: the workers' reports)."""
    module = report.nodeid.split("::", 1)[0]
    _seconds[module][report.when] += report.duration
    _tests[module].add(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        _outcomes["error" if report.failed and report.when != "call" else report.outcome] += 1


def module_rows() -> list:
    """[(module, total s, setup s, call s, teardown s, tests)] slowest first."""
    rows = [(m, sum(p.values()), p["setup"], p["call"], p["teardown"], len(_tests[m])) for m, p in _seconds.items()]
    return sorted(rows, key=lambda r: -r[1])


def markdown_table(rows: list) -> list:
    lines = ["| module | total s | set-up s | call s | teardown s | tests |", "|---|---|---|---|---|---|"]
    return lines + [f"| {m} | {t:.1f} | {s:.1f} | {c:.1f} | {d:.1f} | {n} |" for m, t, s, c, d, n in rows]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The slowest modules (every run), then the report (with --suite-report)."""
    if hasattr(config, "workerinput"):  # (an xdist worker: the controller prints)
        return
    rows = module_rows()
    if not rows:
        return
    wall = time.time() - _start[0]
    terminalreporter.write_sep("=", f"{min(SLOWEST_MODULES, len(rows))} slowest test modules (set-up + call + "
                                    f"teardown; sum of modules {sum(r[1] for r in rows):.0f} s, wall {wall:.0f} s)")
    for m, t, s, c, d, n in rows[:SLOWEST_MODULES]:
        terminalreporter.write_line(f"{t:8.1f} s  {m}  (set-up {s:.1f}, call {c:.1f}, teardown {d:.1f}; {n} tests)")
    path = config.getoption("--suite-report")
    if path:
        write_report(pathlib.Path(path), rows, wall, exitstatus, config)
        terminalreporter.write_line(f"suite report: {path}")


def write_report(path: pathlib.Path, rows: list, wall: float, exitstatus: int, config) -> None:
    """NAME.md (generated; not to be edited by hand) and NAME.json (its raw numbers)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                          text=True).stdout.strip():
            commit += " with uncommitted changes"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    workers = getattr(config.option, "numprocesses", None)
    raw = {"command": "pytest " + shlex.join(config.invocation_params.args), "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "xdist_workers": workers,
           "python": sys.version.split()[0], "wall_s": wall, "exit_status": int(exitstatus),
           "outcomes": dict(_outcomes),
           "modules": [dict(zip(("module", "total_s", "setup_s", "call_s", "teardown_s", "tests"), r)) for r in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(_outcomes.items()))
    body = [f"# The test suite's time per module ({raw['date'][:10]})", "",
            f"Generated by test/suite_durations.py, with its raw numbers in `{path.with_suffix('.json').name}`; not "
            "edited by hand.", "", "```bash", f"JAX_PLATFORMS=cpu {raw['command']}", "```", "",
            f"- commit {commit}, {raw['cpus']} CPUs ({raw['usable_cpus']} usable), {workers or 0} xdist workers, "
            f"Python {raw['python']}",
            f"- wall {wall:.0f} s ({wall / 60:.1f} min) from the session's start to its summary; {counts}; "
            f"exit status {int(exitstatus)}",
            f"- sum of the modules' times {sum(r[1] for r in rows):.0f} s (on two workers the wall time is about half "
            "of it plus the workers' imbalance)", "", *markdown_table(rows), ""]
    path.write_text("\n".join(body))
