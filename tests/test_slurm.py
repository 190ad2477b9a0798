"""The Slurm examples (examples/slurm/) submitted to a real Slurm.

ps-job.sbatch runs ``asyncsgd ps-job`` under torchrun (one agent per node);
ps-job-het.sbatch runs ``asyncsgd ps-server`` and ``asyncsgd worker`` as the two
components of a heterogeneous job. Each must end COMPLETED with its run stopped at
the target accuracy.

Where no Slurm controller answers, the module starts one of its own as root with
``LOCAL_SLURM_NODES=2 examples/slurm/local-slurm.sh start`` (it installs Debian's
slurm-wlm and munge when missing: 9 s here, packages included) and stops it afterwards;
two nodes because the hetjob and the two-node torchrun job need them (Slurm never puts
two components of a hetjob on one node). Skipped, saying why and how, where that is not
possible (not root, no apt-get).

Without accounting there is no sacct: a job's outcome is ``scontrol show job``'s
state and exit code (the controller keeps finished jobs for MinJobAge seconds) and
the job's output file.
"""

import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest

from conftest import read_json

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "slurm"
START = "examples/slurm/local-slurm.sh start"  # both as root
START2 = "LOCAL_SLURM_NODES=2 examples/slurm/local-slurm.sh start"

# The run stops at the first evaluation that reaches TARGET, the 85%: that is
# the check. Its final evaluation, after the pushes in flight at the stop, can come out
# lower (0.88 -> 0.82 in trials here, 0.88 -> 0.842 once in CI), so it is not checked.
TARGET = 0.85
JOB_WAIT_S = 240  # a job took 10-20 s here; a loaded machine is slower


def _slurm_unavailable() -> Optional[str]:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo are not on PATH"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                           timeout=10, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "no Slurm controller answered 'sinfo' within 10 s"
    if r.returncode != 0:
        return f"'sinfo' failed ({r.stderr.strip() or r.returncode})"
    return None


def _start_local_slurm() -> Optional[str]:
    """Start the local Slurm as the suite's own setup; None once it answers, else why
    not."""
    if os.geteuid() != 0:
        return "not root, so the tests cannot start a local Slurm"
    if shutil.which("apt-get") is None and shutil.which("sbatch") is None:
        return "no apt-get to install Slurm with"
    r = subprocess.run(["bash", str(EXAMPLES / "local-slurm.sh"), "start"], cwd=REPO,
                       env={**os.environ, "LOCAL_SLURM_NODES": "2"}, capture_output=True,
                       text=True, timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        pytest.fail(f"local-slurm.sh start failed ({r.returncode}):\n{r.stdout}{r.stderr}",
                    pytrace=False)
    why = _slurm_unavailable()
    if why:  # started, and still nothing answers: a failure, not a reason to skip
        pytest.fail(f"local-slurm.sh start succeeded but {why}:\n{r.stdout}{r.stderr}",
                    pytrace=False)
    return None


@pytest.fixture(scope="module", autouse=True)
def local_slurm():
    """A Slurm to submit to: the one running, else one this module starts (and stops after
    its tests; one that was running stays); skipped, saying why, where neither can be."""
    why = _slurm_unavailable()
    started = False
    if why:
        why = _start_local_slurm()
        started = why is None
    if why:
        pytest.skip(f"{why}: start a local Slurm as root with '{START}' ('{START2}' for "
                    "the hetjob)")
    yield
    if started:
        subprocess.run(["bash", str(EXAMPLES / "local-slurm.sh"), "stop"], cwd=REPO,
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


def _usable_nodes() -> int:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                       timeout=10, check=True)
    states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
    return sum(st.rstrip("*~#!%$@^-") in ("idle", "mix", "alloc", "comp", "planned")
               for st in states.values())


def _need_nodes(n: int) -> None:
    have = _usable_nodes()
    if have < n:
        pytest.skip(f"needs {n} usable Slurm nodes, this Slurm has {have}: as root, '{START2}'")


def _job_ids(name: str) -> list:
    """Ids of this user's queued or running jobs called NAME (a hetjob by its leader)."""
    r = subprocess.run(["squeue", "-h", "--name", name, "-o", "%F"], capture_output=True,
                       text=True, timeout=10)
    return sorted(set(r.stdout.split()))


def _job_states(job_id: str) -> list:
    """JobState of the job (each component of a hetjob), while the controller keeps it."""
    r = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                       timeout=10)
    return re.findall(r"JobState=(\S+)", r.stdout) if r.returncode == 0 else []


def sbatch_wait(script: Path, tmp_path: Path, env: dict, *options: str):
    """Submit SCRIPT from the repository root and wait for its end, polling the queue
    every half second (``sbatch --wait``, the guide's way, polls with growing pauses: a
    10 s job took 40 s); returns (the job's exit code, job id, output text). Cancels the
    job if it is still queued or running when this returns or fails."""
    name = f"asyncsgd-test-{uuid.uuid4().hex[:10]}"  # unique: what to cancel afterwards
    cmd = ["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path}/%x-%j.out",
           "--time=10", *options, str(script)]
    try:
        r = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, text=True, timeout=60,
                           stdin=subprocess.DEVNULL, capture_output=True)
        assert r.returncode == 0, f"sbatch failed ({r.returncode}): {r.stderr}"
        job_id = r.stdout.strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch printed no job id: {r.stdout!r} {r.stderr!r}"
        deadline = time.monotonic() + JOB_WAIT_S
        while _job_ids(name):
            assert time.monotonic() < deadline, f"job {job_id} still in the queue after " \
                                                f"{JOB_WAIT_S} s"
            time.sleep(0.5)
    finally:
        left = _job_ids(name)
        if left:
            subprocess.run(["scancel", *left], timeout=30)
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           timeout=10).stdout
    # ExitCode=CODE:SIGNAL of each component (a hetjob has two); sbatch --wait's would be
    # the largest code, 128 + SIGNAL for a killed one
    codes = [int(code) or (128 + int(sig) if int(sig) else 0)
             for code, sig in re.findall(r"ExitCode=(\d+):(\d+)", shown)]
    assert codes, f"no record of job {job_id}: {shown!r}"
    files = list(tmp_path.glob(f"{name}-{job_id}.out"))
    assert files, f"no output file of job {job_id} in {tmp_path}"
    return max(codes), job_id, files[0].read_text(errors="replace")


def check_completed(rc: int, job_id: str, output: str) -> None:
    assert rc == 0, f"job {job_id} exit code {rc}; its output:\n{output[-4000:]}"
    states = _job_states(job_id)
    # The controller keeps a finished job's record MinJobAge seconds (Slurm's default 300,
    # local-slurm.sh's 600); checked within seconds of the end, it is there
    assert states and all(s == "COMPLETED" for s in states), \
        f"job {job_id}: {states}\n{output[-4000:]}"


def check_run(run_dir: Path, output: str, workers: int) -> dict:
    assert f"run directory: {run_dir}" in output, output[-4000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["stopped_by"] == "target", summary
    assert summary["best_metric"] >= TARGET and summary["time_to_target"] is not None, summary
    assert len(summary["workers_joined"]) == workers, summary
    return summary


def readme_submissions() -> list:
    """docs/cluster.md's ``cluster:slurm`` block, one (environment, sbatch options, script) per
    line: the tests submit what users copy."""
    text = (REPO / "docs" / "cluster.md").read_text()
    found = re.search(r"<!-- cluster:slurm -->\n```bash\n(.+?)\n```", text, re.S)
    assert found, "docs/cluster.md has no cluster block slurm"
    submissions = []
    for line in found.group(1).splitlines():
        argv = shlex.split(line, comments=True)
        env = {}
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        assert argv[0] == "sbatch" and argv[-1].endswith(".sbatch"), line
        submissions.append(pytest.param(env, argv[1:-1], argv[-1], id=" ".join(
            [*(f"{k}={v}" for k, v in env.items()), *argv[1:]])))
    return submissions


@pytest.mark.timeout(JOB_WAIT_S + 40)
@pytest.mark.parametrize("env,options,script", readme_submissions())
def test_the_readme_submissions_train_to_the_target(tmp_path, cache_dir, env, options, script):
    """ps-job.sbatch: torchrun's rank 0 serves, every other process of every node is a
    worker. ps-job-het.sbatch: the server's component and the workers' (2 tasks), which
    never share a node."""
    het = script.endswith("-het.sbatch")
    nodes = 2 if het else int(dict(o.split("=", 1) for o in options
                                   if o.startswith("--nodes=")).get("--nodes", 1))
    _need_nodes(nodes)
    run_dir = tmp_path / "run"
    env = {**env, "RUN_DIR": str(run_dir), "TARGET": str(TARGET), "MAX_SECONDS": "120",
           "ASYNCSGD_CACHE": str(cache_dir)}
    rc, job_id, output = sbatch_wait(REPO / script, tmp_path, env, *options)
    check_completed(rc, job_id, output)
    if het:
        assert len(_job_states(job_id)) == 2  # both components
        check_run(run_dir, output, workers=2)
    else:
        check_run(run_dir, output, workers=nodes * int(env.get("NPROC_PER_NODE", 4)) - 1)
        assert f"{nodes} node(s)" in output
