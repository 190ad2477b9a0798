"""examples/kubernetes: the JobSet manifests run commands asyncsgd and torchrun accept, at
the addresses and worker counts the manifests themselves define.

No cluster here, so what Kubernetes would do is done by hand: ``expand`` is its $(VAR)
expansion of command and args, the Job controller's JOB_COMPLETION_INDEX and the JobSet
controller's pod labels get sample values, and a pod's DNS name is computed as JobSet
names it (<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>).

Every command line is parsed by the command's own parser, not run with --help: --help is
eager, so it exits 0 before click converts any value ('asyncsgd worker --world four
--help' exits 0; only unknown options are caught beside it). ``parse_asyncsgd`` builds the
click context instead, which converts every option and raises on an unknown one, a bad
value or a stray argument, without running the command. torchrun's part goes through
torchrun's argparse parser with abbreviations off: argparse would otherwise take
'--max-restart' for '--max-restarts'.

Needs PyYAML (setup.cfg's dev extras: pyyaml>=6); it is imported without a skip, since a
skipped check would hide broken manifests.
"""

import configparser
import contextlib
import io
import json
import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from asyncsgd.cli import cli
from asyncsgd.errors import ConfigError
from conftest import read_events

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "examples" / "kubernetes"
PS, TORCHRUN, READER = "jobset-ps.yaml", "jobset-torchrun.yaml", "runs-reader.yaml"

# What the JobSet controller would put in the downward-API fields the manifests read.
SAMPLE_UID = "0b5c3a52-7e0f-4c4e-9a57-3f1d2c8e9a10"


# ----- reading the manifests -------------------------------------------------------------

def documents(name: str) -> list:
    with open(HERE / name) as fh:
        return [d for d in yaml.safe_load_all(fh) if d]


def the(docs: list, kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def replicated(js: dict) -> dict:
    return {rj["name"]: rj for rj in js["spec"]["replicatedJobs"]}


def job_spec(js: dict, rj_name: str) -> dict:
    return replicated(js)[rj_name]["template"]["spec"]


def pod_spec(js: dict, rj_name: str) -> dict:
    return job_spec(js, rj_name)["template"]["spec"]


def container(js: dict, rj_name: str) -> dict:
    containers = pod_spec(js, rj_name)["containers"]
    assert len(containers) == 1, f"{rj_name}: one container expected"
    return containers[0]


def pod_dns(js: dict, rj_name: str, job_index: int = 0, pod_index: int = 0) -> str:
    """The stable DNS name JobSet gives a pod (subdomain: the JobSet's name by default)."""
    name = js["metadata"]["name"]
    subdomain = js["spec"].get("network", {}).get("subdomain") or name
    return f"{name}-{rj_name}-{job_index}-{pod_index}.{subdomain}"


def mount_path(js: dict, rj_name: str, volume: str) -> str:
    mounts = {m["name"]: m["mountPath"] for m in container(js, rj_name).get("volumeMounts", [])}
    assert volume in mounts, f"{rj_name} does not mount volume {volume!r}"
    return mounts[volume]


# ----- what Kubernetes does to a container's command line -----------------------------------

_REF = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(text: str, env: dict) -> str:
    """Kubernetes' expansion of command, args and env values: $(NAME) becomes the value of
    the container's variable NAME, $$ a literal $, a reference to an unknown name stays as
    written."""
    def one(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(one, text)


def container_env(js: dict, rj_name: str, index: int) -> dict:
    """The variables of pod ``index``'s container: the Job controller's (Indexed Jobs), then
    the manifest's, with the JobSet controller's labels and the pod's name as samples."""
    pod_name = f"{js['metadata']['name']}-{rj_name}-0-{index}-x7k2q"
    fields = {"metadata.labels['jobset.sigs.k8s.io/jobset-name']": js["metadata"]["name"],
              "metadata.labels['jobset.sigs.k8s.io/jobset-uid']": SAMPLE_UID,
              "metadata.name": pod_name}
    env = {}
    if job_spec(js, rj_name).get("completionMode") == "Indexed":
        env["JOB_COMPLETION_INDEX"] = str(index)
    for var in container(js, rj_name).get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{var['name']}: no sample value for fieldRef {path}"
            env[var["name"]] = fields[path]
    return env


def command_line(js: dict, rj_name: str, index: int = 0) -> list:
    """Pod ``index``'s argv, as the kubelet would start it."""
    c = container(js, rj_name)
    env = container_env(js, rj_name, index)
    argv = [expand(str(t), env) for t in c.get("command", []) + c.get("args", [])]
    # A $( left after expansion is a variable the container does not define (Kubernetes
    # passes it on literally) or a shell command substitution Kubernetes would try to expand.
    assert not any("$(" in t for t in argv), f"{rj_name}: unexpanded $( in {argv}"
    return argv


# ----- the commands' own parsers -----------------------------------------------------------

def parse_asyncsgd(argv: list) -> click.Context:
    """The context 'asyncsgd ARGV' would run its command with; the test fails, naming the
    problem, where asyncsgd would refuse the command line."""
    assert argv and argv[0] in cli.commands, f"not an asyncsgd command: {argv[:1]}"
    assert not {"-h", "--help"} & set(argv), "--help would skip the check of the other options"
    command = cli.commands[argv[0]]
    root = logging.getLogger()
    level = root.level  # -v's callback sets the root logger's level: leave pytest's alone
    try:
        return command.make_context(f"asyncsgd {argv[0]}", list(argv[1:]))
    except click.ClickException as exc:
        pytest.fail(f"asyncsgd {shlex.join(argv)}: {exc.format_message()}")
    finally:
        root.setLevel(level)


def given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def parse_torchrun(args: list):
    """torchrun's namespace for ARGS (torchrun's own arguments, then the module's)."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    parser.allow_abbrev = False  # an abbreviated (misspelled) option must not pass
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"torchrun {shlex.join(args)}: {err.getvalue().strip()}")


def endpoint(address: str) -> tuple:
    m = re.fullmatch(r"(?:tcp://)?([^:/]+):(\d+)", address)
    assert m, f"not HOST:PORT: {address!r}"
    return m.group(1), int(m.group(2))


def container_port(js: dict, rj_name: str, name: str) -> int:
    ports = {p.get("name"): p["containerPort"] for p in container(js, rj_name).get("ports", [])}
    assert name in ports, f"{rj_name} declares no port {name!r}"
    return ports[name]


# ----- structure ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,jobs", [(PS, ["server", "workers"]), (TORCHRUN, ["node"])])
def test_each_manifest_is_a_jobset_with_its_replicated_jobs_and_claims(name, jobs):
    docs = documents(name)
    js = the(docs, "JobSet")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert list(replicated(js)) == jobs
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
    for rule in js["spec"]["failurePolicy"].get("rules", []):
        assert set(rule.get("targetReplicatedJobs", [])) <= set(jobs)
    assert set(js["spec"]["successPolicy"].get("targetReplicatedJobs", [])) <= set(jobs)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for rj_name in jobs:
        job = job_spec(js, rj_name)
        assert replicated(js)[rj_name]["replicas"] == 1
        # Indexed: stable hostnames (the DNS names below) and JOB_COMPLETION_INDEX.
        assert job["completionMode"] == "Indexed"
        assert job["completions"] == job["parallelism"]
        pod = pod_spec(js, rj_name)
        for volume in pod.get("volumes", []):
            assert volume["persistentVolumeClaim"]["claimName"] in claims
        if "podFailurePolicy" in job:
            # Kubernetes refuses a podFailurePolicy with another restartPolicy, and rules
            # naming a container the pod does not have.
            assert pod["restartPolicy"] == "Never"
            for rule in job["podFailurePolicy"]["rules"]:
                if "onExitCodes" in rule:
                    assert rule["onExitCodes"]["containerName"] == container(js, rj_name)["name"]


def test_ps_set_succeeds_with_its_server_and_fails_at_once_on_a_wrong_command():
    js = the(documents(PS), "JobSet")
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["server"]}
    rules = js["spec"]["failurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJobSet"
    assert rules[0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    # Exit code 2 is asyncsgd's for a wrong command line (click's usage errors) and for a
    # wrong setting (ConfigError): what the podFailurePolicies treat as hopeless.
    assert click.UsageError.exit_code == ConfigError.exit_code == 2
    for rj_name in ("server", "workers"):
        job = job_spec(js, rj_name)
        fail = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
        assert [r["onExitCodes"]["values"] for r in fail] == [[2]]
        # No second pod while a failed one is still terminating (the server's: still
        # writing its checkpoint into the run directory).
        assert job["podReplacementPolicy"] == "Failed"


# ----- jobset-ps.yaml ----------------------------------------------------------------------

def server_script_env(js: dict) -> dict:
    env = container_env(js, "server", 0)
    assert env["RUNS"] == mount_path(js, "server", "runs"), "RUNS must be the claim's mount"
    return env


def run_server_script(js: dict, runs: Path, tmp_path: Path) -> list:
    """Run the server container's command (its start-up script) with a stub 'asyncsgd' on
    PATH and the run directories in ``runs``; the argv of each asyncsgd it started."""
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir(exist_ok=True)
    record = tmp_path / "calls.txt"
    record.write_text("")
    stub = stub_dir / "asyncsgd"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(0o755)
    argv = command_line(js, "server")
    env = {**server_script_env(js), "RUNS": str(runs), "PATH": f"{stub_dir}:/usr/bin:/bin"}
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


def without(argv: list, flag: str) -> list:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def with_value(argv: list, flag: str, value: str) -> list:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


@pytest.mark.processes
def test_ps_server_script_starts_a_run_resumes_it_and_sets_aside_one_without_checkpoint(
        tmp_path):
    js = the(documents(PS), "JobSet")
    runs = tmp_path / "runs"
    runs.mkdir()
    run_dir = runs / f"{js['metadata']['name']}-{SAMPLE_UID}"
    workers = job_spec(js, "workers")["completions"]

    # First start: nothing there, a new run in the JobSet's own directory.
    (fresh,) = run_server_script(js, runs, tmp_path)
    ctx = parse_asyncsgd(fresh)
    assert fresh[0] == "ps-server"
    assert ctx.params["out"] == str(run_dir) and ctx.params["resume"] is None
    assert ctx.params["workers"] == workers
    host, port = endpoint(ctx.params["bind"])
    assert host == "0.0.0.0" and port == container_port(js, "server", "ps")

    # A restart after a checkpoint: resume it, with the same settings and no --out (which
    # ps-server refuses beside --resume).
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "checkpoint.pt").write_text("")
    (resumed,) = run_server_script(js, runs, tmp_path)
    ctx = parse_asyncsgd(resumed)
    assert ctx.params["resume"] == str(run_dir) and not given(ctx, "out")
    assert without(resumed, "--resume") == without(fresh, "--out")

    # A restart after a start that died before its first checkpoint: nothing to resume;
    # its directory is kept aside and a new run takes its place.
    (run_dir / "checkpoint.pt").unlink()
    (again,) = run_server_script(js, runs, tmp_path)
    assert again == fresh
    aside = [p for p in runs.iterdir() if p.name.startswith(f"{run_dir.name}.no-checkpoint-")]
    assert len(aside) == 1 and (aside[0] / "config.json").exists()
    assert not run_dir.exists()  # the stub wrote nothing: the real server would create it


@pytest.mark.slow
def test_ps_server_script_commands_really_start_and_resume_a_run(tmp_path, run_cli):
    """The script's two command lines against the real server: the resumed one must pass
    ps-server's checks of a resumed run (no --out, the run's task and data). Each runs 3 s,
    on a free local port, with no worker."""
    js = the(documents(PS), "JobSet")
    runs = tmp_path / "runs"
    runs.mkdir()
    (fresh,) = run_server_script(js, runs, tmp_path)
    run_dir = Path(parse_asyncsgd(fresh).params["out"])

    def quick(argv):
        return with_value(with_value(argv, "--bind", "tcp://127.0.0.1:0"), "--max-seconds", "3")

    res = run_cli(*quick(fresh))
    assert res.returncode == 0, res.stderr
    assert (run_dir / "checkpoint.pt").exists()
    (resumed,) = run_server_script(js, runs, tmp_path)
    assert "--resume" in resumed
    res = run_cli(*quick(resumed))
    assert res.returncode == 0, res.stderr
    assert [e["event"] for e in read_events(run_dir) if e["event"] in ("start", "resume")] \
        == ["start", "resume"]


@pytest.mark.processes
@pytest.mark.parametrize("which", ["first", "last"])
def test_ps_workers_commands_are_valid_and_reach_the_server(tmp_path, which):
    js = the(documents(PS), "JobSet")
    job = job_spec(js, "workers")
    index = 0 if which == "first" else job["completions"] - 1
    argv = command_line(js, "workers", index)
    assert argv[0] == "asyncsgd"
    ctx = parse_asyncsgd(argv[1:])
    assert argv[1] == "worker"
    # Rank from the completion index, one rank per pod, and the server expecting them all.
    assert ctx.params["rank"] == index
    assert ctx.params["world"] == job["completions"] == job["parallelism"]
    (tmp_path / "runs").mkdir()
    (fresh,) = run_server_script(js, tmp_path / "runs", tmp_path)
    server = parse_asyncsgd(fresh)
    assert server.params["workers"] == ctx.params["world"]
    # The server pod's stable DNS name and the port it binds and declares.
    host, port = endpoint(ctx.params["server"])
    assert host == pod_dns(js, "server")
    assert port == endpoint(server.params["bind"])[1] == container_port(js, "server", "ps")
    assert ctx.params["task"] == server.params["task"]


# ----- jobset-torchrun.yaml ----------------------------------------------------------------

def test_torchrun_command_is_valid_and_meets_at_pod_zero():
    js = the(documents(TORCHRUN), "JobSet")
    job = job_spec(js, "node")
    argv = command_line(js, "node", 1)
    assert argv[0] == "torchrun"
    args = parse_torchrun(argv[1:])
    assert args.module and args.training_script == "asyncsgd"
    ctx = parse_asyncsgd(args.training_script_args)
    assert args.training_script_args[0] == "ps-job"

    # One torchrun per pod, all of them in the rendezvous, hosted by pod 0.
    assert int(args.nnodes) == job["completions"] == job["parallelism"]
    assert args.rdzv_backend == "c10d"
    host, port = endpoint(args.rdzv_endpoint)
    assert host == pod_dns(js, "node", 0, 0)
    assert port == container_port(js, "node", "rendezvous")
    assert args.max_restarts >= 1
    # Rank 0 serves; there must be workers besides it.
    assert int(args.nnodes) * int(args.nproc_per_node) > ctx.params["servers"]
    # The run directory: the default runs/<time>-ps under the working directory, which is
    # the claim's mount (a fixed --out would be refused after a restart without checkpoint).
    assert not given(ctx, "out")
    assert container(js, "node")["workingDir"] == mount_path(js, "node", "runs")


# ----- runs-reader.yaml, the README, the Dockerfile ----------------------------------------

def test_runs_reader_mounts_the_ps_claim_where_the_server_writes():
    pod = the(documents(READER), "Pod")
    ps_docs = documents(PS)
    claims = {d["metadata"]["name"] for d in ps_docs if d["kind"] == "PersistentVolumeClaim"}
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] in claims
    (mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    assert mount["mountPath"] == server_script_env(the(ps_docs, "JobSet"))["RUNS"]


def _dig(node, path: list):
    """Every value at dotted ``path`` below ``node`` (at any depth)."""
    found = []
    if isinstance(node, dict):
        value = node
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            found.append(value)
        for child in node.values():
            found += _dig(child, path)
    elif isinstance(node, list):
        for child in node:
            found += _dig(child, path)
    return found


def _quoted_in(snippet: str, name: str) -> bool:
    """Whether the README's `snippet` says what manifest ``name`` holds: 'a.b: value' a
    setting there, '--flag value' a flag on a command line there, any other its text."""
    text = (HERE / name).read_text()
    setting = re.fullmatch(r"([A-Za-z][\w.]*): (\S+)", snippet)
    if setting:
        value = yaml.safe_load(setting.group(2))
        return value in _dig(documents(name), setting.group(1).split("."))
    flag = re.fullmatch(r"(--[\w-]+) (\S+)", snippet)
    if flag:
        js = the(documents(name), "JobSet")
        for rj_name in replicated(js):
            words = " ".join(command_line(js, rj_name)).split()
            if any(a == flag.group(1) and b == flag.group(2) for a, b in zip(words, words[1:])):
                return True
        return False
    return snippet in text


def test_readme_quotes_the_manifests_as_they_are():
    readme = (HERE / "README.md").read_text()
    for path in re.findall(r"examples/kubernetes/[\w.-]+", readme):
        assert (ROOT / path).exists(), path
    sets = {}
    for name in (PS, TORCHRUN):
        js = the(documents(name), "JobSet")
        sets[js["metadata"]["name"]] = js
    claims = {d["metadata"]["name"] for name in (PS, TORCHRUN) for d in documents(name)
              if d["kind"] == "PersistentVolumeClaim"}
    # Label selectors, jobset and job names in the commands.
    for selector in re.findall(r"-l (\S+)", readme):
        labels = dict(pair.split("=") for pair in selector.split(","))
        js = sets[labels["jobset.sigs.k8s.io/jobset-name"]]
        if "jobset.sigs.k8s.io/replicatedjob-name" in labels:
            assert labels["jobset.sigs.k8s.io/replicatedjob-name"] in replicated(js)
    for name in re.findall(r"jobset (asyncsgd[\w-]*)", readme):
        assert name in sets, name
    for job in re.findall(r"job/([\w-]+)", readme):
        assert any(job == f"{n}-{rj}-0" for n, js in sets.items() for rj in replicated(js)), job
    for claim in re.findall(r"asyncsgd-[\w-]*-runs", readme):
        assert claim in claims, claim
    # Where the run directories land.
    ps = sets["asyncsgd-ps"]
    assert f"`{server_script_env(ps)['RUNS']}/asyncsgd-ps-<UID>`" in readme
    torchrun = sets["asyncsgd-torchrun"]
    assert f"`{container(torchrun, 'node')['workingDir']}/runs/<time>-ps`" in readme
    assert "--checkpoint-every 30" in readme and _quoted_in("--checkpoint-every 30", PS)
    # The table of files: how many pods, and processes per torchrun.
    workers = job_spec(ps, "workers")["completions"]
    assert f"| 1 server + {workers} workers |" in readme
    nodes = job_spec(torchrun, "node")["completions"]
    nproc = parse_torchrun(command_line(torchrun, "node")[1:]).nproc_per_node
    assert f"| {nodes} nodes | `torchrun --nproc-per-node {nproc} " in readme
    # The recovery table: each column's `snippets` hold in that column's manifest.
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| failure"))
    columns = [cell.strip(" `") for cell in lines[start].strip("|").split("|")]
    assert columns[1:] == [PS, TORCHRUN], columns
    assert re.fullmatch(r"[|-]+", lines[start + 1])  # the header's rule, then the rows
    rows = [line for line in lines[start + 2:] if line.startswith("|")]
    assert len(rows) == 6
    checked = 0
    for line in rows:
        cells = line.strip("|").split("|")
        assert len(cells) == len(columns), f"README table row with a cell too few or many: {line}"
        for name, cell in zip(columns[1:], cells[1:]):
            for snippet in re.findall(r"`([^`]+)`", cell):
                assert _quoted_in(snippet, name), f"{name}: README quotes `{snippet}`"
                checked += 1
    assert checked >= 8  # the table was found and read


def test_image_gets_every_package_the_commands_import():
    """The Dockerfile installs the repository with 'pip install .', not editable: only the
    packages setup.cfg lists land in the image ('asyncsgd ps-job' imports asyncsgd.jobs)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "asyncsgd").rglob("__init__.py")}
    assert on_disk <= listed, f"setup.cfg's packages miss {sorted(on_disk - listed)}"
    # ... and the Dockerfile copies what the build reads.
    copied = set()
    for line in (HERE / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied |= set(line.split()[1:-1])
    mapped = {d.split("=")[1].strip() for d in cfg["options"]["package_dir"].strip().splitlines()}
    files = set(re.findall(r"file: *(\S+)", cfg["metadata"]["long_description"]))
    assert {"asyncsgd", "setup.cfg", "pyproject.toml"} | mapped | files <= copied, copied
