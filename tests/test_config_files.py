"""Config files (--config, --print-config, a run's config.yaml) and --help in option groups,
run in this process (conftest.run_cli_here)."""

import dataclasses
import json
import re
from pathlib import Path

import click
import pytest
import yaml

import asyncsgd.api
import asyncsgd.ps
import asyncsgd.ray
from asyncsgd.cli import cli
from asyncsgd.config import make_config
from asyncsgd.config.files import load
from asyncsgd.config.groups import GROUPS, TITLES, slug
from asyncsgd.errors import ConfigError
from conftest import one_line_error

ROOT = Path(__file__).parent.parent

# what each settings command calls, and flags that differ from every default
CALLS = {
    "hogwild": (asyncsgd.api, "hogwild", ["--lr", "0.05", "--procs", "3", "--lock",
                                         "--task", "mnist1d-mlp"]),
    "single": (asyncsgd.api, "single", ["--amp", "bf16", "--batch-size", "16"]),
    "ddp": (asyncsgd.api, "ddp", ["--comm-hook", "powersgd:2", "--procs", "2",
                                 "--max-seconds", "30"]),
    "ps-server": (asyncsgd.ps, "serve", ["--consistency", "ssp:3", "--optimizer", "adam",
                                        "--shards", "2"]),
    "worker": (asyncsgd.ps, "work", ["--compress", "topk:0.1", "--rank", "1", "--world", "2"]),
    "ps-job": (asyncsgd.ps, "job", ["--consistency", "sync", "--push-every", "2",
                                   "--no-exit-when-done"]),
    "ray-job": (asyncsgd.ray, "run", ["--workers", "3", "--cpus-per-worker", "0.5"]),
    "compare": (asyncsgd.api, "compare", ["--mode-args", "hogwild=--lock", "--mode-args",
                                         "ps-async=--optimizer adam", "--budget", "30"]),
    "simulate": (asyncsgd.api, "simulate", ["--workers", "16", "--step-time", "2ms"]),
}


class _Called(Exception):
    pass


@pytest.fixture
def called(monkeypatch, run_cli_here):
    """``called(command, *args)``: the settings the command passes to the Python API, the
    API itself stopped before it runs anything."""

    def run(command, *args):
        module, name, _ = CALLS[command]
        seen = {}

        def capture(**settings):
            seen.update(settings)
            raise _Called

        monkeypatch.setattr(module, name, capture)
        with pytest.raises(_Called):
            run_cli_here(command, *args)
        return seen

    return run


def _settings_commands():
    return {name: cmd for name, cmd in cli.commands.items()
            if getattr(cmd, "settings_class", None) is not None}


def test_every_option_of_every_settings_command_has_a_group():
    commands = _settings_commands()
    assert set(commands) == set(CALLS) | {"plot"}
    for name, cmd in commands.items():
        fields = {f.name for f in dataclasses.fields(cmd.settings_class)}
        options = {p.name for p in cmd.params
                   if isinstance(p, click.Option) and p.name not in ("verbose", "help")}
        assert fields <= options
        lacking = sorted(o for o in options if o not in GROUPS)
        assert not lacking, f"asyncsgd {name}: add {lacking} to asyncsgd/config/groups.py"


def test_a_group_key_is_never_a_setting_name():
    assert not {slug(t) for t in TITLES} & set(GROUPS)


def test_ps_job_help_lists_its_options_in_groups(run_cli_here):
    res = run_cli_here("ps-job", "--help")
    assert res.returncode == 0, res.stderr
    headings = re.findall(r"^(\S[^\n]*):$", res.stdout, flags=re.M)
    assert headings == ["Config file", "Task and data", "Stop conditions", "Training",
                        "Processes and devices", "Parameter server", "Network and security",
                        "Stragglers and simulated costs", "Output", "Other options"]
    assert "Options:" not in res.stdout
    section = res.stdout.split("\nTraining:\n")[1].split("\n\n")[0]
    assert "--lr " in section and "--bind" not in section
    for flag in ("--config", "--print-config", "--consistency", "--bind", "--audit-dir"):
        assert len(re.findall(rf"^  {flag}\b", res.stdout, flags=re.M)) == 1, flag


@pytest.mark.parametrize("command", sorted(CALLS))
def test_print_config_writes_a_file_that_gives_the_same_settings(command, called,
                                                                 run_cli_here, tmp_path):
    module, name, flags = CALLS[command]
    cls = _settings_commands()[command].settings_class
    printed = run_cli_here(command, *flags, "--print-config")
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "settings.yaml"
    path.write_text(printed.stdout)
    from_flags = make_config(cls, None, called(command, *flags))
    from_file = make_config(cls, None, called(command, "--config", path))
    assert from_file == from_flags != cls()
    again = run_cli_here(command, "--config", path, "--print-config")
    assert again.stdout == printed.stdout


def test_options_given_beside_the_file_win(called, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("training: {lr: 0.1, batch-size: 8}\nstop_conditions:\n  epochs: 3\n")
    assert called("single", "--config", path, "--lr", "0.2") == {
        "lr": 0.2, "batch_size": 8, "epochs": 3}


def test_a_file_may_be_flat_or_nested_toml_json_or_a_run_record(tmp_path):
    names = ("lr", "batch_size", "target", "epochs", "mode_args")
    flat = tmp_path / "a.yml"
    flat.write_text("lr: 0.1\nbatch-size: 8\ntarget_accuracy: 0.9\nmode_args: [x=1]\n")
    assert load(str(flat), names, "compare") == {"lr": 0.1, "batch_size": 8, "target": 0.9,
                                                 "mode_args": ["x=1"]}
    toml = tmp_path / "a.toml"
    toml.write_text("epochs = 3\n[training]\nlr = 0.1\n")
    assert load(str(toml), names, "single") == {"epochs": 3, "lr": 0.1}
    record = tmp_path / "config.json"
    record.write_text(json.dumps({"mode": "single", "task": {}, "config": {
        "lr": 0.1, "out": "runs/a", "resume": None}}))
    assert load(str(record), names, "single") == {"lr": 0.1}
    empty = tmp_path / "e.yaml"
    empty.write_text("# nothing yet\n")
    assert load(str(empty), names, "single") == {}


@pytest.mark.parametrize("name, text, fragments", [
    ("a.yaml", "lr: 0.1\nfoo: 2\n", ["unknown setting(s) foo for asyncsgd single",
                                     "option names"]),
    ("a.yaml", "training:\n  lr: abc\n", ["lr: 'abc' is not a valid float", "--lr VALUE"]),
    ("a.yaml", "amp: off\n", ["amp: False is not one of", "quote it"]),
    ("a.yaml", "lr: [1, 2]\n", ["lr takes one value"]),
    ("a.yaml", "lr: 1\ntraining: {lr: 2}\n", ["lr is given twice"]),
    ("a.yaml", "lr: [1\n", ["not valid YAML (line 2", "fix the file"]),
    ("a.toml", "lr = \n", ["not valid TOML"]),
    ("a.json", "{lr: 1}", ["not valid JSON"]),
    ("a.yaml", "- 1\n", ["holds a list, not settings"]),
    ("a.ini", "lr=1\n", ["name it .yaml, .yml, .toml or .json"]),
    (None, "", ["no such file"]),
])
def test_a_bad_file_is_one_line_naming_it(run_cli_here, tmp_path, name, text, fragments):
    path = tmp_path / (name or "missing.yaml")
    if name:
        path.write_text(text)
    res = run_cli_here("single", "--config", path, "--epochs", "1")
    assert res.returncode == 2
    one_line_error(res, f"--config {path}: ", *fragments)


def test_the_guides_example_file_is_read(run_cli_here, tmp_path):
    guide = (ROOT / "docs" / "config-files.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", guide, flags=re.S).group(1)
    path = tmp_path / "job.yaml"
    path.write_text(example)
    res = run_cli_here("ps-server", "--config", path, "--print-config")
    assert res.returncode == 0, res.stderr
    printed = yaml.safe_load(res.stdout)
    for group, settings in yaml.safe_load(example).items():
        for key, value in settings.items():
            assert printed[group][key.replace("-", "_")] == value, key


def test_a_runs_config_yaml_starts_the_same_run_again(run_cli_here, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    res = run_cli_here("single", "--samples", "200", "--epochs", "1", "--lr", "0.07",
                       "--progress", "off", "--out", first)
    assert res.returncode == 0, res.stderr
    written = yaml.safe_load((first / "config.yaml").read_text())
    assert "out" not in written["output"] and "resume" not in written["output"]
    res = run_cli_here("single", "--config", first / "config.yaml", "--progress", "off",
                       "--out", second)
    assert res.returncode == 0, res.stderr
    settings = [json.loads((run / "config.json").read_text())["config"]
                for run in (first, second)]
    assert settings[0] == {**settings[1], "out": str(first)}
    resumed = run_cli_here("single", "--resume", first, "--epochs", "2", "--print-config")
    assert resumed.returncode == 0, resumed.stderr
    assert yaml.safe_load(resumed.stdout)["training"]["lr"] == 0.07


def test_a_bad_config_raises_config_error_from_python_too(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load(str(tmp_path / "none.yaml"), ("lr",), "single")
