"""Checks of a composed run configuration, each failing with one line that names the key, the
value and what is allowed. They run before any worker process starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from gatherlab import gather, launch

# Per accelerator, the precisions whose layouts gatherlab can judge (report.TOLERANCE): float64
# to ~1e-10, float32 to ~1e-5. Mixed precision rounds too coarsely to tell a bug from noise.
PRECISIONS = {"cpu": ("32-true", "64-true"), "gpu": ("32-true", "64-true")}


class ConfigError(ValueError):
    """A configuration value that cannot run; the message is one line."""


def _integer(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer ≥ {minimum}"
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")
    return value


def check(cfg: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` for the first value of ``cfg`` that cannot run."""
    _integer("steps", cfg["steps"], minimum=1)
    _integer("seed", cfg["seed"], minimum=0)
    _integer("log_every", cfg.get("log_every", 0), minimum=0)
    global_batch_size = _integer("global_batch_size", cfg["global_batch_size"], minimum=1)
    nodes = _integer("layout.nodes", cfg["layout"].get("nodes", 1), minimum=1)
    devices = _integer("layout.devices", cfg["layout"]["devices"], minimum=1) * nodes
    accelerator = cfg["layout"]["accelerator"]
    if accelerator not in PRECISIONS:
        raise ConfigError(
            f"layout.accelerator={accelerator!r} is unknown; allowed: {', '.join(PRECISIONS)}"
        )
    allowed = PRECISIONS[accelerator]
    if cfg["precision"] not in allowed:
        raise ConfigError(
            f"precision={cfg['precision']!r} is not supported on layout.accelerator="
            f"{accelerator}; allowed: {', '.join(allowed)}"
        )
    if cfg["gather"]["name"] not in gather.NAMES:
        raise ConfigError(
            f"gather={cfg['gather']['name']!r} is unknown; allowed: {', '.join(gather.NAMES)}"
        )
    launcher = cfg["launcher"]["name"]
    if launcher not in launch.LAUNCHERS:
        raise ConfigError(
            f"launcher={launcher!r} is unknown; allowed: {', '.join(launch.LAUNCHERS)}"
        )
    if launcher == "pool" and accelerator != "cpu":
        raise ConfigError(
            f"launcher=pool is not allowed with layout.accelerator={accelerator!r}; "
            "allowed: launcher=spawn or launcher=external"
        )
    if nodes > 1 and launcher != "external":
        raise ConfigError(
            f"layout.nodes={nodes} needs ranks started on every node; allowed: launcher=external "
            "(torchrun or SLURM), or layout.nodes=1"
        )
    if accelerator == "gpu" and launcher != "external":
        available = torch.cuda.device_count()
        if available < cfg["layout"]["devices"]:
            raise ConfigError(
                f"layout.devices={cfg['layout']['devices']} GPUs asked for, this machine has "
                f"{available}; allowed: a cpu layout, or at most {available} GPUs"
            )
    if cfg["model"].get("norm") == "sync" and accelerator == "cpu":
        raise ConfigError(
            "model.norm='sync' (torch's SyncBatchNorm) refuses CPU tensors; allowed with "
            "layout.accelerator=cpu: global (the same statistics, on any backend), local"
        )
    if global_batch_size % devices:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide by layout.devices={devices}; "
            f"allowed: a multiple of {devices}"
        )
    num_samples = cfg["data"]["num_samples"]
    if global_batch_size > num_samples:
        raise ConfigError(
            f"global_batch_size={global_batch_size} exceeds data.num_samples={num_samples}; "
            f"allowed: at most {num_samples}"
        )


def machine_warning(cfg: Mapping[str, Any]) -> str | None:
    """A warning, not an error: more CPU ranks than this machine has cores run, sharing them."""
    if cfg["layout"]["accelerator"] != "cpu":
        return None
    ranks, cores = cfg["layout"]["devices"], len(os.sched_getaffinity(0))
    if ranks <= cores:
        return None
    return (
        f"layout.devices={ranks} CPU ranks on {cores} core(s): they share the cores; the "
        "results are the same, the run is slower"
    )
