"""What the conditions of a comparison did to its modes, said before its table.

Two conditions tilt a comparison against the synchronous modes whatever the algorithms
do: more training processes than cores (lock-step modes then wait on the scheduler) and
one learning rate for every mode (a mode that averages N gradients into a step needs a
larger one).
"""

from __future__ import annotations

from typing import Optional

from ..config.modes import ModeSpec


def lockstep(spec: ModeSpec) -> bool:
    """Every process of the mode waits for all the others at each step or round: ddp and
    its variants, and the parameter server's sync rounds (ps-sync, ps-backup, diloco)."""
    return spec.command == "ddp" or (spec.command == "ps-server" and spec.consistency == "sync")


def averaging(spec: ModeSpec) -> bool:
    """Each update is the mean of one gradient per process: one step per N batches. Not
    the local-steps modes, whose --lr is each worker's inner lr."""
    return lockstep(spec) and "--local-steps" not in spec.flags + spec.worker_flags


def _names(specs: list) -> str:
    return ", ".join(s.name for s in specs)


def oversubscription(processes: int, cores: int, modes: list,
                     shards: Optional[object] = None) -> Optional[str]:
    """The line naming more training processes (workers or ranks) than cores, or None;
    ``shards``: the parameter server's --shards, said where a ps-* mode runs."""
    if processes <= cores:
        return None
    server = [s for s in modes if s.command == "ps-server"]
    beside = (f"; the ps-* modes also run a parameter server, with --shards "
              f"{shards if shards is not None else 'auto'} shard process(es)" if server else "")
    waiting = [s for s in modes if lockstep(s)]
    blame = (f" Lock-step modes ({_names(waiting)}) wait at every step for their slowest "
             "process, often one the scheduler has set aside: their times pay for the "
             "scheduler, not for the algorithm." if waiting else "")
    return (f"Oversubscribed: {processes} training processes on {cores} cores (the workers "
            f"or ranks of each parallel mode{beside}), so they take turns on the cores."
            f"{blame} Figures that hold beyond this host need --procs {cores} or fewer.")


def caveat(processes: int, cores: int, modes: list) -> str:
    """The sentence a verdict ends with when the comparison was oversubscribed, else ''."""
    if processes <= cores:
        return ""
    waiting = [s for s in modes if lockstep(s)]
    blame = (f": the lock-step modes ({_names(waiting)}) paid for the scheduler, not for "
             "the algorithm" if waiting else ": every parallel mode waited for cores")
    return f"Oversubscribed ({processes} training processes on {cores} cores){blame}."


def fairness_notes(processes: int, cores: int, modes: list, tuned: Optional[dict], *,
                   lr: Optional[float] = None, shards: Optional[object] = None,
                   own_lr: tuple = (), real_clock: bool = True) -> list:
    """The report's first lines: oversubscription (real clock only) and the learning rate
    each mode used. ``processes``: training processes of each parallel mode; ``cores``:
    the host's; ``tuned``: {mode: lr} chosen by --tune lr ({} before it chose), or None
    (every mode used ``lr``, the task's or --lr; ``own_lr``: modes whose --mode-args set
    their own)."""
    notes = []
    over = oversubscription(processes, cores, modes, shards) if real_clock else None
    if over is not None:
        notes.append(over)
    if tuned is not None:  # {}: tuning, not yet done
        if tuned:
            notes.append("Learning rate tuned per mode (--tune lr): "
                         + ", ".join(f"{mode} {value:g}" for mode, value in tuned.items()) + ".")
        return notes
    which = "the task's" if lr is None else f"lr {lr:g}"
    except_ = (f", except {', '.join(own_lr)}, whose --mode-args set their own"
               if own_lr else "")
    line = f"One learning rate for every mode: {which}{except_}."
    held = [s for s in modes if averaging(s) and s.name not in own_lr]
    if held:
        line += (f" Synchronous modes that average one gradient per process into each step "
                 f"({_names(held)}) take one step per {processes} batches where the others "
                 "take one per batch, so they need a larger lr (linear scaling: lr x "
                 f"{processes}); at one lr they are disadvantaged.")
    notes.append(line + " --tune lr gives each mode its own.")
    return notes


def recorded_notes(runs: list) -> tuple:
    """(lines, verdict caveat) of [(label, Run)] read back (``asyncsgd plot``), from what
    their config.json recorded: training processes and the host's CPUs. Runs on the
    virtual clock, or that do not record both, say nothing."""
    groups: dict = {}
    for label, run in runs:
        found = _recorded(label, run.record)
        if found is not None:
            procs, cpus, spec, shards = found
            groups.setdefault((procs, cpus), {}).setdefault(spec.name, (spec, shards))
    lines, caveats = [], []
    for (procs, cpus), named in groups.items():
        specs = [spec for spec, _ in named.values()]
        shards = next((s for _, s in named.values() if s is not None), None)
        line = oversubscription(procs, cpus, specs, shards)
        if line is not None:
            lines.append(line)
            caveats.append(caveat(procs, cpus, specs))
    return lines, " ".join(caveats)


def _recorded(label: str, record: dict) -> Optional[tuple]:
    """(training processes, host CPUs, its ModeSpec, its --shards) from a config.json."""
    if record.get("clock") == "virtual":
        return None
    settings, mode = record.get("config", {}), record.get("mode")
    procs = {"single": 1, "hogwild": settings.get("procs"), "ddp": settings.get("procs"),
             "ps": settings.get("workers")}.get(mode)
    cpus = record.get("host", {}).get("cpus")
    if not procs or not cpus:
        return None
    command = "ps-server" if mode == "ps" else mode
    consistency = str(settings.get("consistency")) if mode == "ps" else None
    return procs, cpus, ModeSpec(label, command, consistency), settings.get("shards")
