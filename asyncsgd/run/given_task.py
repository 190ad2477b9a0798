"""The API's ``task=`` as an object: a Task, or a top-level function returning one, beside
the "module:function" string the settings hold and config.json records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..core.tasks import OBJECT_PREFIX, Task, load_task, task_reference
from ..errors import TaskError


def task_given(config: Any, settings: dict) -> tuple:
    """``(config, settings, source)``: ``task=`` among the keywords (or in the settings
    dataclass) replaced by the name a run records, and ``source`` the object given (None
    for a name). A function is recorded as its ``module:function`` (refused when it has
    none: a lambda, a closure); a Task as ``object:NAME``, which only the same object
    given again resumes."""
    source = settings.get("task")
    if source is None and config is not None:
        source = getattr(config, "task", None)
    if source is None or isinstance(source, str):
        return config, settings, None
    if isinstance(source, Task):
        name = OBJECT_PREFIX + source.name
    elif callable(source):
        name = task_reference(source)
    else:
        raise TaskError(f"task={source!r}: give a task name ('mnist1d-cnn', "
                        "'module:function'), a top-level function returning a Task, or a Task")
    if "task" in settings or config is None:
        settings = {**settings, "task": name}
    else:
        config = dataclasses.replace(config, task=name)
    return config, settings, source


def task_from(source: Any, cfg: Any) -> Optional[Task]:
    """The Task ``source`` gives with the run's settings ``cfg`` (None: the modes build the
    one ``cfg.task`` names)."""
    if source is None or isinstance(source, Task):
        return source
    return load_task(source, samples=cfg.samples, data_dir=cfg.data_dir,
                     cache_dir=cfg.cache_dir, seed=cfg.seed)


def task_named(config: Any, settings: dict, where: str) -> tuple:
    """``(config, settings)`` with ``task=`` as a name other processes import, for
    ``where`` (the parameter server, compare's runs) that build the task by name: a
    function of an importable module becomes its ``module:function``; a Task, or a
    function of the running script, is refused in one line."""
    config, settings, source = task_given(config, settings)
    if isinstance(source, Task):
        raise TaskError(f"task=<Task {source.name}>: {where} build the task by name, so a "
                        "Task object cannot reach them; give a top-level function of a "
                        "module that returns it (task=my_task.make_task)")
    if source is not None and source.__module__ == "__main__":
        raise TaskError(f"task={source.__qualname__}: {where} build the task by name and "
                        "cannot import the running script (__main__); move the function "
                        "into a module (my_task.py) and pass task=my_task.make_task")
    return config, settings
