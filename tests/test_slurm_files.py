"""The Slurm examples' files, read without a Slurm (examples/slurm/, issue 40 friction 15).

Where a job's output file lands, that git ignores it, and that the local Slurm's documented
commands run as written where one is root and there is no sudo (a container).
"""

import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "slurm"
SCRIPTS = sorted(EXAMPLES.glob("*.sbatch"))


def _sbatch_option(script: Path, name: str) -> str:
    found = re.findall(rf"^#SBATCH .*--{name}=(\S+)", script.read_text(), re.M)
    assert len(found) == 1, f"{script.name}: #SBATCH --{name} {found}"
    return found[0]


def _ignored(path: str) -> bool:
    """Whether a .gitignore of the repository (the root's, or one in a directory above
    PATH) ignores PATH, by their plain patterns (the only kind they hold)."""
    parts = Path(path).parts
    for depth in range(len(parts)):
        rules = REPO.joinpath(*parts[:depth], ".gitignore")
        if not rules.is_file():
            continue
        rest = parts[depth:]
        verdict = None
        for line in rules.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            negate, pattern = line.startswith("!"), line.lstrip("!")
            dirs_only, pattern = pattern.endswith("/"), pattern.rstrip("/")
            names = rest[:-1] if dirs_only else rest  # a dir/ pattern matches a directory above
            anchored = pattern.startswith("/") or "/" in pattern
            candidates = ["/".join(rest[:i + 1]) for i in range(len(names))] if anchored \
                else list(names)
            if any(fnmatch.fnmatchcase(c, pattern.lstrip("/")) for c in candidates):
                verdict = not negate
        if verdict is not None:
            return verdict
    return False


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_jobs_output_file_lands_under_runs_and_git_ignores_it(script):
    """Not in the repository root (where sbatch runs), but beside the job's run directory
    runs/slurm-<jobid>-<kind>; runs/ is in every checkout (sbatch does not make the
    directories of --output: a job whose directory is missing fails without a word)."""
    name = _sbatch_option(script, "job-name")
    out = _sbatch_option(script, "output").replace("%x", name).replace("%j", "123")
    assert Path(out).parent == Path("runs"), f"{script.name}: --output={out}"
    run_dir = re.search(r"RUN_DIR=\$\{RUN_DIR:-\$SLURM_SUBMIT_DIR/(\S+)\}",
                        script.read_text()).group(1).replace("$SLURM_JOB_ID", "123")
    assert out == run_dir + ".out", (out, run_dir)
    assert _ignored(out), f"git does not ignore {out}"
    assert (REPO / "runs" / ".gitignore").is_file() and not _ignored("runs/.gitignore")
    assert _ignored("runs/20260101-120000-hogwild/metrics.jsonl")


@pytest.mark.parametrize("left", ["asyncsgd-ps-job-41.out", "asyncsgd-ps-het-42.out",
                                  "slurm-43.out"])
def test_output_files_left_in_the_submit_directory_are_ignored(left):
    """Those of the scripts before (--output=%x-%j.out) and Slurm's default name, for a job
    submitted with --output of its own."""
    assert _ignored(left)
    assert not _ignored("README.md") and not _ignored("examples/slurm/ps-job.sbatch")


def _documented_commands():
    """Each line in the docs and the script's header that runs local-slurm.sh."""
    for path in (REPO / "docs" / "cluster.md", EXAMPLES / "README.md",
                 EXAMPLES / "local-slurm.sh", REPO / "tests" / "test_slurm.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "local-slurm.sh " in line and "need_root" not in line and "die " not in line:
                yield pytest.param(line, id=f"{path.name}:{number}")


@pytest.mark.parametrize("line", list(_documented_commands()))
def test_the_local_slurm_commands_run_as_written_without_sudo(line):
    """A container's root has no sudo ('sudo: command not found'), 'sudo VAR=1 cmd' is
    refused by sudo's default policy, and 'status' needs no root at all: the commands say
    'as root' where root is needed, and local-slurm.sh itself names sudo to one who is
    not root."""
    assert not re.search(r"\bsudo\s+(\S+=\S*\s+)*\S*local-slurm\.sh", line), line
