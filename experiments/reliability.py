"""Run every fault-injection scenario and write RELIABILITY.md with what it measured.

    python experiments/reliability.py                 # ~6 min on 2 cores
    python experiments/reliability.py --only curve,fuzz --out /tmp/R.md

Each scenario is a test in tests/ with real processes and sockets and an
exact oracle where one exists; the tests append their figures (messages
tried, crashes, updates lost, detection latency, reconnect time, ...) to
$ASYNCSGD_FIGURES, and this script runs them with it set, then writes the
report: one row per promise with its result and run time, then the figures.
Also writes experiments/results/reliability.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results import RESULTS  # noqa: E402

# (key, reliability promise, pytest node ids that prove it)
SCENARIOS = [
    ("curve", "1. CURVE: right key in; wrong server key, unknown key, no key refused; "
              "nothing from them applied",
     ["tests/test_security.py::test_curve_matrix_admits_only_the_right_key",
      "tests/test_security.py::test_plain_server_beyond_loopback_warns_loudly",
      "tests/test_security.py::test_old_or_curveless_libzmq_is_refused_with_the_reason"]),
    ("garbage", "2. Garbage flood: no crash, no stall, file descriptors back to baseline",
     ["tests/test_ps_faults.py::test_garbage_flood_neither_crashes_nor_stalls_a_good_worker"]),
    ("oversized", "3. Oversized frames: sender dropped, memory bounded, others unaffected",
     ["tests/test_ps_faults.py::test_oversized_frames_drop_their_sender_and_nothing_else"]),
    ("fuzz", "4. Fuzzed decoder (hypothesis) and a soak of malformed messages over CURVE: "
             "exact oracle",
     ["tests/test_fuzz.py"]),
    ("drops", "5. Dropped and duplicated pushes and ACKs: exact oracle",
     ["tests/test_ps_faults.py::test_drops_and_duplicates_lose_and_double_nothing"]),
    ("workers", "6. Worker SIGKILL mid-push; SIGSTOP/SIGCONT under sync",
     ["tests/test_ps_kills.py::test_worker_sigkill_mid_push_leaves_no_half_applied_update",
      "tests/test_ps_kills.py::test_stopped_worker_is_dropped_then_rejoins_under_sync"]),
    ("shards", "7. Shard SIGKILL, restart from checkpoint, lost updates counted, target reached",
     ["tests/test_ps_kills.py::test_shard_sigkill_restarts_from_its_checkpoint_and_counts_lost_updates",
      "tests/test_ps_kills.py::test_training_reaches_its_target_through_a_shard_crash"]),
    ("hogwild", "8. Hogwild: SIGINT/SIGTERM/SIGKILL leave no orphans or /dev/shm leaks; "
                "a SIGKILLed child reported",
     ["tests/test_hogwild_failures.py"]),
    ("checkpoints", "9. Checkpoints: malicious pickle refused; SIGKILL during a save harmless",
     ["tests/test_data_and_parts.py::test_malicious_checkpoint_is_refused_and_runs_nothing",
      "tests/test_checkpoint_faults.py"]),
    ("exactly-once", "10. Exactly once through incarnations, far-apart and reordered sequence "
                     "numbers, a sync shard SIGKILL and a shard that forgot the worker; lying "
                     "hellos refused; shards serve only admitted workers; errors echo the request",
     ["tests/test_exactly_once.py"]),
    ("identities", "11. Protocol fuzzer: thousands of worker ids, incarnations, goodbyes, "
                   "malformed hellos, pushes without admission; DC-ASGD copies under 200 ids: "
                   "exact oracle, server alive, shard memory bounded; 50,000 fresh hellos "
                   "leave the front's roster and memory bounded",
     ["tests/test_hostile_peers.py"]),
    ("liveness", "12. Liveness independent of compute: a 3 s step against a 1.5 s heartbeat "
                 "timeout is no drop; a worker stopped by Ctrl-C/SIGTERM says goodbye; threads "
                 "share the host",
     ["tests/test_worker_liveness.py"]),
    ("lifecycle", "13. Beside busy processes: --max-seconds is the command's time, start-up "
                  "and stop included; every mode ends exit 0 without forcing a process; "
                  "single leaves busy cores alone",
     ["tests/test_lifecycle.py"]),
    ("phases", "14. A worker killed before a push, between its parts, after the shard applied it "
               "but before the ack was read, after the ack; a shard around its checkpoint; the "
               "front while welcoming: every push applied once or counted lost (the audit)",
     ["tests/test_phase_faults.py"]),
    ("golden", "15. Golden trajectories: ps-sync, ddp, diloco and the virtual clock repeat their "
               "recorded per-round digests; a sync server killed and resumed repeats them",
     ["tests/test_golden.py"]),
    ("chaos", "16. A kill schedule (workers, shard, server, links, throttling) under ps-async "
              "and ps-backup:auto: nothing doubled or lost, every fault recovered",
     ["tests/test_chaos.py"]),
]

LIMITS = """\
## Known limits

- libzmq bounds each *frame* (ZMQ_MAXMSGSIZE) and counts its high-water marks in
  whole messages, so a peer that streams an endless multipart message is buffered
  until it ends. With CURVE on, only a peer holding an admitted key can try.
- Admission is not authentication: any peer that can reach the front with the
  model's signature is welcomed under ids of its choosing. It can take the free
  worker records (at most max(256, 4 x --workers) per shard; new ids are then
  refused with `too-many-workers` until records go silent or say bye), and after
  a restore report a version that inflates `lost_updates`; it cannot corrupt
  parameters beyond what its own pushes do (NaN/Inf and `--max-grad-norm` guard
  those), touch another id's or incarnation's state, or stop the server. Turn on
  CURVE to admit only known keys.
- Lost updates are counted from the versions workers report after a restart:
  exact for acknowledgements delivered in order; a worker that never reconnects
  reports nothing.
- A push reaches each shard exactly once, but a worker killed between its shards
  leaves one step applied on some shards only (each shard still holds whole pushes).
- SIGKILL of a whole process group, multiprocessing's resource tracker included,
  leaves its named semaphores (2 of 32 bytes per process group) in /dev/shm: no
  process is left to remove them. Ctrl-C, SIGTERM and a SIGKILL of the parent
  alone leave nothing (`experiments/load_test.py`, `tests/test_hogwild_failures.py`).
"""


def run(keys: list, python: str) -> tuple:
    """Run the chosen scenarios under pytest; (junit results by node, figures)."""
    nodes = [n for key, _, ids in SCENARIOS if key in keys for n in ids]
    with tempfile.TemporaryDirectory() as tmp:
        figures_path, junit = Path(tmp) / "figures.jsonl", Path(tmp) / "junit.xml"
        env = dict(os.environ, ASYNCSGD_FIGURES=str(figures_path))
        # A shell runs background jobs with SIGINT ignored, and children inherit that:
        # the Ctrl-C tests need it back.
        subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", *nodes], cwd=ROOT, env=env, check=False,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        cases = {}
        for case in ET.parse(junit).getroot().iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases[name] = {"result": "failed" if failed else "skipped" if skipped else "passed",
                           "seconds": float(case.get("time", 0))}
        figures = [json.loads(line) for line in figures_path.read_text().splitlines()] \
            if figures_path.exists() else []
    return cases, figures


def _environment() -> str:
    import torch
    import zmq
    return (f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"torch {torch.__version__}, pyzmq {zmq.pyzmq_version()}, "
            f"libzmq {zmq.zmq_version()} (CURVE {'yes' if zmq.has('curve') else 'no'})")


def report(keys: list, cases: dict, figures: list) -> str:
    lines = ["# Reliability and security: what the fault tests measured", "",
             "Produced by `python experiments/reliability.py`, which runs the fault-injection "
             "tests below (real processes, real sockets on 127.0.0.1, exact oracles where one "
             "exists) and collects the figures they record. Rerun it to refresh this file.", "",
             f"Machine: {_environment()}.", "",
             "| promise | tests | result | seconds |", "|---|---|---|---|"]
    for key, promise, ids in SCENARIOS:
        if key not in keys:
            continue
        mine = {n: c for n, c in cases.items() if any(n.startswith(i) for i in ids)}
        passed = sum(c["result"] == "passed" for c in mine.values())
        result = "passed" if mine and passed == len(mine) else \
            f"{len(mine) - passed} of {len(mine)} FAILED" if mine else "not run"
        lines.append(f"| {promise} | {len(mine)} | {result} | "
                     f"{sum(c['seconds'] for c in mine.values()):.0f} |")
    lines += ["", "## Figures", ""]
    for fig in figures:
        items = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in fig.items() if k != "scenario")
        lines.append(f"- **{fig['scenario']}** — {items}")
    crashes = sum(f.get("crashes", 0) for f in figures)
    tried = sum(f.get("messages", 0) + f.get("connections", 0) for f in figures)
    lines += ["", f"Malformed messages and garbage connections tried: {tried:,}; server "
                  f"crashes: {crashes}.", "", LIMITS]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(k for k, _, _ in SCENARIOS),
                        help="comma-separated scenarios: " + ", ".join(k for k, _, _ in SCENARIOS))
    parser.add_argument("--out", default=str(ROOT / "RELIABILITY.md"), help="report to write")
    args = parser.parse_args()
    keys = [k for k in args.only.split(",") if k]
    unknown = sorted(set(keys) - {k for k, _, _ in SCENARIOS})
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}")
    cases, figures = run(keys, sys.executable)
    text = report(keys, cases, figures)
    Path(args.out).write_text(text + "\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reliability.json").write_text(
        json.dumps({"tests": cases, "figures": figures}, indent=2) + "\n")
    print(text)
    failed = [n for n, c in cases.items() if c["result"] == "failed"]
    if failed:
        sys.exit(f"{len(failed)} scenario test(s) failed: {failed}")


if __name__ == "__main__":
    main()
