"""``task=`` as an object in the Python API: a top-level function or a Task, recorded in
config.json by name; what cannot reach spawned processes refused in one line before
anything starts; ``Task.from_model``."""

import functools
import json
import subprocess
import sys

import pytest
import torch

import asyncsgd
import asyncsgd.ray
from asyncsgd import HogwildConfig, Task
from asyncsgd.core.tasks import load_task
from asyncsgd.errors import TaskError
from asyncsgd.run.given_task import task_given
from conftest import read_json
from tasks_for_tests import dense_counter, index_counter


def _closure():
    def make_task(samples=None):
        return index_counter(samples)
    return make_task


@pytest.mark.parametrize("call", ["hogwild", "single", "ddp"])
@pytest.mark.parametrize("task, why", [
    (lambda samples=None: index_counter(samples), "a lambda has no importable name"),
    (_closure(), "_closure.<locals>.make_task is defined inside a function (a closure)"),
    (functools.partial(index_counter, 10), "a partial has no importable name"),
])
def test_a_task_function_without_a_name_is_refused_before_anything_starts(tmp_path, call,
                                                                         task, why):
    with pytest.raises(TaskError) as caught:
        getattr(asyncsgd, call)(task=task, out=str(tmp_path / "run"))
    message = str(caught.value)
    assert why in message and "define the task function with def at the top level of a " \
        "module" in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_the_settings_record_a_function_by_name_and_a_task_as_an_object():
    task = index_counter(20)
    assert task_given(None, {"task": index_counter}) == (
        None, {"task": "tasks_for_tests:index_counter"}, index_counter)
    assert task_given(None, {"task": task, "epochs": 1}) == (
        None, {"task": "object:index-counter", "epochs": 1}, task)
    assert task_given(None, {"task": "lm"}) == (None, {"task": "lm"}, None)
    config, settings, source = task_given(HogwildConfig(task=dense_counter), {})
    assert (config.task, settings, source) == ("tasks_for_tests:dense_counter", {},
                                               dense_counter)
    with pytest.raises(TaskError, match=r"^task=3: give a task name"):
        task_given(None, {"task": 3})


def test_a_task_object_run_is_only_rebuilt_from_the_same_object():
    with pytest.raises(TaskError) as caught:
        load_task("object:index-counter")
    assert str(caught.value) == ("task 'object:index-counter' was a Task object given as "
                                 "task= in Python: pass the same task= again (to resume the "
                                 "run, or to Run.model(task=...))")


def test_single_trains_the_same_from_a_name_a_function_and_a_task(tmp_path):
    """index_counter with lr 1: every row's weight ends at exactly -1 after one epoch,
    whichever form named the task; config.json names it as the settings do."""
    base = dict(samples=40, epochs=1, progress="off", threads=1)
    runs = {form: asyncsgd.single(task=task, out=str(tmp_path / form), **base)
            for form, task in (("name", "tasks_for_tests:index_counter"),
                               ("function", index_counter), ("object", index_counter(40)))}
    for form, recorded in (("name", "tasks_for_tests:index_counter"),
                           ("function", "tasks_for_tests:index_counter"),
                           ("object", "object:index-counter")):
        assert read_json(tmp_path / form / "config.json")["config"]["task"] == recorded
        model = asyncsgd.load_run(runs[form].run_dir).model(
            task=index_counter(40) if form == "object" else None)
        assert torch.equal(model.weight.weight, -torch.ones(40, 1)), form


def test_from_model_builds_a_task_from_a_factory_and_datasets():
    x, y = torch.arange(12.0).view(6, 2), torch.tensor([0, 1, 0, 1, 0, 1])
    data = torch.utils.data.TensorDataset(x, y)
    task = Task.from_model(functools.partial(torch.nn.Linear, 2, 2), data, data,
                           name="linear", lr=0.5)
    assert (task.name, task.lr, task.batch_size, len(task.train), len(task.test)) == (
        "linear", 0.5, 32, 6, 6)
    inputs, targets = task.train.rows(torch.tensor([1, 4]))
    assert torch.equal(inputs[0], x[[1, 4]]) and torch.equal(targets, y[[1, 4]])
    assert Task.from_model(index_counter, data, data).name == "index_counter"


_SCRIPT = '''
import torch
import asyncsgd
import asyncsgd.ray
from asyncsgd import Task


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = self.y.view(-1, 1).float() * 2 + torch.randn(n, 4, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model():
    return torch.nn.Linear(4, 2)


def make_task(samples=None):
    return Task.from_model(make_model, Blobs(samples or 64, 0), Blobs(32, 1), name="blobs")


if __name__ == "__main__":
    common = dict(procs=2, epochs=1, samples=64, progress="off", threads=1)
    for form, task in (("name", "tasks_for_tests:dense_counter"), ("function", make_task),
                       ("object", make_task(64))):
        result = asyncsgd.hogwild(task=task, out="runs/" + form, **common)
        print(form, result.summary["status"], result.summary["samples"])
'''


def test_the_three_task_forms_run_from_a_script(tmp_path, cli_env):
    """A user's script, run as one: Hogwild's spawned workers get a name, a function of the
    script itself, and a Task of the script's own Dataset."""
    (tmp_path / "script.py").write_text(_SCRIPT)
    res = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=cli_env,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["name ok 64", "function ok 64", "object ok 64"]
    recorded = [json.loads((tmp_path / "runs" / form / "config.json").read_text())["config"]
                ["task"] for form in ("name", "function", "object")]
    assert recorded == ["tasks_for_tests:dense_counter", "__main__:make_task", "object:blobs"]


@pytest.mark.parametrize("call", [asyncsgd.compare, asyncsgd.simulate, asyncsgd.ps.serve,
                                  asyncsgd.ps.work, asyncsgd.ps.job, asyncsgd.ray.start])
def test_what_builds_the_task_by_name_takes_a_function_of_a_module_only(call, monkeypatch):
    def in_main(samples=None):
        return index_counter(samples)
    in_main.__module__, in_main.__qualname__ = "__main__", "in_main"
    monkeypatch.setattr(sys.modules["__main__"], "in_main", in_main, raising=False)
    cases = [(index_counter(20), "task=<Task index-counter>: "),
             (in_main, "task=in_main: "), (lambda: None, "a lambda has no importable name")]
    for task, message in cases:
        with pytest.raises(TaskError) as caught:
            call(task=task)
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_function_of_a_module_reaches_the_parameter_server_by_name():
    from asyncsgd.run.given_task import task_named
    assert task_named(None, {"task": dense_counter, "workers": 2}, "x") == (
        None, {"task": "tasks_for_tests:dense_counter", "workers": 2})
