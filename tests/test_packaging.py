"""The wheel a user installs: one top-level package, ``asyncsgd``, and commands that run.

The repository keeps ``servers/`` and ``workers/`` beside ``asyncsgd/``; setup.cfg maps
them to ``asyncsgd.servers`` and ``asyncsgd.workers`` so that no generic name lands in
site-packages. This builds the wheel, reads what it would install, installs it into a
fresh virtual environment (no network: its dependencies come from this environment's
site-packages through a path entry, which runs none of their .pth hooks, so the
editable install of the checkout stays out) and trains from it, outside the checkout.
"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # builds a wheel and a venv

ROOT = Path(__file__).resolve().parents[1]


def _wheel(tmp_path: Path) -> Path:
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True,
                   timeout=240)
    wheels = list(out.glob("asyncsgd-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_installs_only_asyncsgd_and_trains_from_a_fresh_venv(tmp_path):
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"asyncsgd"}, sorted(top)
    for module in ("asyncsgd/servers/shard.py", "asyncsgd/workers/client.py",
                   "asyncsgd/wire/protocol.py", "asyncsgd/cli.py"):
        assert module in names, module
    assert not any(n.startswith(("servers/", "workers/", "tests/")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True
                          ).stdout.strip()
    # The dependencies (torch, zmq, ...) from here, after the wheel's own site-packages.
    Path(site, "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=240)
    installed = {p.name for p in Path(site).iterdir()}
    assert "asyncsgd" in installed and not {"servers", "workers"} & installed, installed

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(py), "-c", "import asyncsgd, asyncsgd.servers.server, "
                            "asyncsgd.workers.worker; print(asyncsgd.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
                           timeout=120).stdout.strip()
    assert where.startswith(site), (where, site)  # the wheel, not the checkout
    run = subprocess.run([str(venv / "bin" / "asyncsgd"), "hogwild", "--task", "mnist1d-mlp",
                          "--samples", "800", "--procs", "2", "--epochs", "1", "--progress",
                          "off", "--out", str(tmp_path / "run")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
