"""Runs that finish under load: every mode while busy processes spin beside it.

    python experiments/load_test.py                    # ~10 min on 2 cores, 6 spinners
    python experiments/load_test.py --modes hogwild --spinners 0

For ``hogwild --procs 8``, ``ps-server`` with two workers and ``ddp --procs 2``,
each started through the installed CLI in a process group of its own:

- a run to its stop condition (epochs; the PS: its workers done) ends exit 0,
  status ok;
- ``--max-seconds N`` ends within a few seconds of N, status ok;
- Ctrl-C (SIGINT to the process group, as a terminal sends it; to each of the
  PS's processes at its own age) at 1 s, at 3 s and mid-training ends with
  exit 130 and status interrupted, the run saved (or, before the run directory
  exists, nothing to save), no process of the run left behind and no new
  /dev/shm entry (run it alone: other jobs' entries count too).

Prints a table and writes ``experiments/results/load_test.md`` (and ``.json``).
Exits 1 when a row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import RESULTS  # noqa: E402

BIN = Path(sys.executable).parent / "asyncsgd"
MODES = ("hogwild", "ps", "ddp")
TASK = ("--task", "mnist1d-cnn", "--progress", "off")
BUDGET = 15  # --max-seconds of the max-seconds rows
MID = 10     # seconds: "mid-training" for the Ctrl-C rows, past every mode's start-up


def _cmd(*args) -> list:
    return [str(BIN), *[str(a) for a in args]]


class Run:
    """One command in a process group of its own, watched for every process it starts."""

    def __init__(self, args: list, out: Path):
        self.out = out
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.seen: set = set()

    def watch(self) -> None:
        try:
            self.seen |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def interrupt(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.2)
        timed_out = self.proc.poll() is None
        if timed_out:
            os.killpg(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate()
        seconds = time.monotonic() - self.started
        time.sleep(1.0)  # children get a moment to follow their parent out
        left = [p for p in self.seen if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        summary = {}
        if (self.out / "summary.json").exists():
            summary = json.loads((self.out / "summary.json").read_text())
        return {"exit": "timeout" if timed_out else self.proc.returncode,
                "seconds": round(seconds, 1), "status": summary.get("status"),
                "stopped_by": summary.get("stopped_by"), "orphans": len(left),
                "stderr_tail": err.strip().splitlines()[-3:]}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(mode: str, tmp: Path, budget: tuple, epochs: int) -> tuple:
    """The mode's runs: (the run whose summary counts, its helpers). ``budget``: the
    --max-seconds flags of the run (the server's, for the PS), ``epochs``: everyone's."""
    out = tmp / "run"
    if mode in ("hogwild", "ddp"):
        procs = 8 if mode == "hogwild" else 2
        return Run(_cmd(mode, "--procs", procs, "--out", out, "--epochs", epochs, *budget,
                        *TASK), out), []
    address = f"tcp://127.0.0.1:{_free_port()}"
    server = Run(_cmd("ps-server", "--bind", address, "--shards", 2, "--workers", 2,
                      "--out", out, *budget, *TASK), out)
    time.sleep(3)  # docs/parameter-server.md's order: the server first
    workers = [Run(_cmd("worker", "--server", address, "--rank", r, "--world", 2, *TASK,
                        "--epochs", epochs), tmp / f"w{r}") for r in range(2)]
    return server, workers


def scenario(mode: str, kind: str, at: float) -> dict:
    """``kind``: done (to its stop condition), budget (--max-seconds) or ctrl-c at ``at`` s."""
    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        budget = ("--max-seconds", BUDGET) if kind == "budget" else ()
        main, helpers = start(mode, tmp, budget, 2 if kind == "done" else 1000)
        if kind == "ctrl-c":  # each process at its own age ``at``, as a user in its terminal
            for run in (main, *helpers):
                while time.monotonic() - run.started < at:
                    run.watch()
                    time.sleep(0.1)
                run.interrupt()
        results = [run.finish(timeout=300) for run in (main, *helpers)]
        created = main.out.exists()
    shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    row = {"mode": mode, "scenario": kind if kind != "ctrl-c" else f"Ctrl-C at {at:g} s",
           **results[0], "helpers_exit": [r["exit"] for r in results[1:]],
           "helpers_orphans": sum(r["orphans"] for r in results[1:]), "shm_left": shm_left,
           "run_dir": created}
    expect_exit = 130 if kind == "ctrl-c" else 0
    # A Ctrl-C before the run directory exists (the CLI still importing torch) has
    # nothing to save: exit 130 and nothing on disk is the right end then.
    saved = row["status"] == ("interrupted" if kind == "ctrl-c" else "ok") or (
        kind == "ctrl-c" and not created)
    ok = row["exit"] == expect_exit and row["orphans"] == 0 and not shm_left and \
        row["helpers_orphans"] == 0 and saved
    if kind == "budget":
        ok = ok and row["stopped_by"] == "max_seconds" and row["seconds"] <= BUDGET + 5
    # A worker stopped with Ctrl-C exits 130; one whose server stopped first ends 0.
    ok = ok and all(e in ((0, 130) if kind == "ctrl-c" else (0,)) for e in row["helpers_exit"])
    row["ok"] = ok
    return row


def table(rows: list, spinners: int) -> str:
    lines = [f"# Runs under load ({spinners} busy processes on {os.cpu_count()} cores)", "",
             "Produced by `python experiments/load_test.py`.", "",
             "| mode | scenario | exit | status | stopped by | seconds | workers' exits | "
             "orphans | /dev/shm left | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    status = {True: "(no run yet)", False: None}
    for r in rows:
        shown = r["status"] or status[not r["run_dir"]]
        lines.append(f"| {r['mode']} | {r['scenario']} | {r['exit']} | {shown} | "
                     f"{r['stopped_by']} | {r['seconds']} | {r['helpers_exit'] or '-'} | "
                     f"{r['orphans'] + r['helpers_orphans']} | {len(r['shm_left'])} | "
                     f"{'yes' if r['ok'] else '**NO**'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: "
                        + ", ".join(MODES))
    parser.add_argument("--spinners", type=int, default=6, help="busy processes beside")
    parser.add_argument("--scenarios", default="done,budget,ctrl-c", help="comma-separated: "
                        "done, budget, ctrl-c (at 1 s, 3 s and mid-training)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    # A shell starts a background job ('cmd &', no job control) with SIGINT ignored, and
    # commands inherit that: their Ctrl-C rows would test nothing. A terminal's are live.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.spinners)]
    rows = []
    try:
        time.sleep(2 if spinners else 0)
        for mode in modes:
            for kind, at in (("done", 0), ("budget", 0), ("ctrl-c", 1), ("ctrl-c", 3),
                             ("ctrl-c", MID)):
                if kind not in args.scenarios.split(","):
                    continue
                rows.append(scenario(mode, kind, at))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    text = table(rows, args.spinners)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "load_test.md").write_text(text + "\n")
        (RESULTS / "load_test.json").write_text(json.dumps(rows, indent=2) + "\n")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
