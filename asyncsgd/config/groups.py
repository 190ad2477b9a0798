"""Option groups: the section of --help each setting is listed in, and its key in a config file.

One table, setting name -> group title; the titles' order is the order of the sections. A
config file may nest settings under a group's slug (``training: {lr: 0.1}``).
"""

from __future__ import annotations

from typing import Optional

CONFIG_FILE = "Config file"
TASK = "Task and data"
STOP = "Stop conditions"
TRAINING = "Training"
PROCESSES = "Processes and devices"
SERVER = "Parameter server"
NETWORK = "Network and security"
STRAGGLERS = "Stragglers and simulated costs"
COMPARISON = "Comparison"
OUTPUT = "Output"
OTHER = "Other options"  # -v and --help, which no settings class has

TITLES = (CONFIG_FILE, TASK, STOP, TRAINING, PROCESSES, SERVER, NETWORK, STRAGGLERS,
          COMPARISON, OUTPUT, OTHER)

_MEMBERS = {
    CONFIG_FILE: "config print_config",
    TASK: "task samples data_dir cache_dir seed data_dispatch embeddings",
    STOP: "max_seconds target epochs budget stop_at_target exit_when_done",
    TRAINING: "batch_size lr momentum weight_decay optimizer nesterov_period amp "
              "simulate_staleness local_steps local_warmup push_every inner_optimizer "
              "inner_weight_decay local_lr lock lr_schedule warmup clip_grad_norm accumulate",
    PROCESSES: "procs start_method threads device share_cores quantum_ms backend comm_hook "
               "dist_timeout workers local_workers servers shards rank world "
               "cpus_per_worker gpus_per_worker max_restarts start_timeout shard_restarts",
    SERVER: "consistency sync_reduce backup_workers staleness_lr dc_asgd max_grad_norm "
            "early_parts allow_nonfinite heartbeat_timeout balance balance_every min_batch "
            "heartbeat server_timeout id_space evict table_optimizer table_lr",
    NETWORK: "bind server advertise address curve_secret curve_server_key allowed_clients "
             "transport busy_poll_us push_dtype pull_dtype compress",
    STRAGGLERS: "slowdown delay step_time gradient_bytes latency link slow_workers "
                "worker_speeds leave join",
    COMPARISON: "modes repeats tune tune_budget clock mode_args grace ddp_backend "
                "allow_mixed",
    OUTPUT: "out resume eval_every checkpoint_every progress tensorboard record_digests "
            "audit_dir log_to",
}

GROUPS = {name: title for title, names in _MEMBERS.items() for name in names.split()}


def group_of(name: str) -> Optional[str]:
    """The group title of setting ``name``; None for one the table lacks."""
    return GROUPS.get(name)


def slug(title: str) -> str:
    """A group's key in a config file: 'Stop conditions' -> 'stop_conditions'."""
    return title.lower().replace(" ", "_")
