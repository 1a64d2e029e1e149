"""The gradient audit: for every gather × loss style × world size, which gradient do the ranks get?

``python -m gatherlab.audit [--out DIR] [overrides]`` composes ``experiment=gather_audit`` with the
overrides (the same job as ``python -m gatherlab.train experiment=gather_audit``), takes one
global batch, computes the parameter gradient that DDP hands to the optimizer on W real gloo ranks
and compares it with the 1-device gradient of the same batch, in float64 (``gradients``). Each
gather of the ``gather`` group is audited (also one a directory on ``hydra.searchpath`` adds), with
the prediction it declares. It writes ``audit.csv``, ``audit.md`` and ``audit.png``/``.pdf`` into
the output directory (rows gathers, columns loss × W, the measured class, marked where it differs
from the prediction).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from gatherlab import config, configcheck, jobs, report, runfiles
from gatherlab.config import ConfigError


def run(cfg: DictConfig, overrides: Sequence[str], out: Path) -> pd.DataFrame:
    """The audit of a checked ``experiment=gather_audit`` config composed from ``overrides``,
    for the gathers of ``audit.gathers`` (None: every option of the group); writes its files
    into ``out`` and returns its table."""
    names = cfg.audit.gathers
    with config.composed():
        gathers = config.build_gathers(None if names is None else list(names), overrides)
    table = jobs.run_audit(cfg, out, gathers)
    report.write_audit(table, out)
    return table


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.audit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. audit.world_sizes=[2]")
    args = parser.parse_args(argv)
    overrides = ["experiment=gather_audit", *args.overrides]
    out = args.out or Path("outputs") / "audit" / f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    try:
        if (out / runfiles.AUDIT).exists():
            raise ConfigError(f"--out {out} already holds an audit; it is never overwritten")
        with config.composed():
            cfg, _ = config.compose(overrides)
        configcheck.check(cfg)
        table = run(cfg, overrides, out)
    except ConfigError as error:
        print(f"gatherlab.audit: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(report.audit_markdown(table))
    print(f"written: {out}/audit.{{csv,md,png,pdf}}")


if __name__ == "__main__":
    main()
