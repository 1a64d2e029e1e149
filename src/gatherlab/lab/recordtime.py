"""One update plain and recorded in turns: the recorder's cost against the update it records, as
``python -m gatherlab.bench record`` (an MLP) and ``size`` (`gatherlab.lab.sizes`: a ResNet and a
ViT at 1M-86M parameters) measure it (docs/performance.md)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gatherlab.check.sizing import resident_bytes

__all__ = ["RECORD_WARM_UP", "recording_bytes", "time_record", "update"]

RECORD_WARM_UP = 2  # pairs of updates before the timed ones (the first writes the full gradient)


def update(model, optimizer, criterion, inputs, targets) -> None:
    """One plain update: forward, the loss, backward, the optimizer's step (recorded, the rows,
    the loss and the gradient are taken by the recorder's hooks on the model, the criterion and
    the optimizer)."""
    optimizer.zero_grad()
    criterion(model(inputs), targets).backward()
    optimizer.step()


def recording_bytes(out: Path) -> dict[str, int]:
    """The sizes of a recording's files: its update lines (with their rows' digests, which
    format version 2 writes beside them in ``rows.u64``), its sketches, its full gradients, the
    rest (header, final record)."""
    from gatherlab.recording import format as recording_format

    sizes = {"lines": 0, "sketches": 0, "full": 0, "rest": 0}
    for path in out.rglob("*"):
        if not path.is_file():
            continue
        if path.name in (recording_format.UPDATES, recording_format.ROWS):
            sizes["lines"] += path.stat().st_size
        elif path.name == recording_format.SKETCHES:
            sizes["sketches"] += path.stat().st_size
        elif path.parent.name == recording_format.FULL:
            sizes["full"] += path.stat().st_size
        else:
            sizes["rest"] += path.stat().st_size
    return sizes


def time_record(
    build: Callable[[], torch.nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    repeats: int,
    k: int | None,
    out: Path,
) -> dict:
    """Plain and recorded updates of two copies of the same model (``build()``, the same weights
    each call) in turns (which goes first alternating), ``repeats`` timed pairs after
    `RECORD_WARM_UP`; their medians, the median of the pairs' ratios, the resident memory the
    recorder adds, the bytes it wrote. The recorder is the one line a plain loop adds
    (``Recorder(model, optimizer, out, loss=criterion)``, its defaults: the first update's full
    gradient kept where the model is small; ``k`` None: the default sketch size)."""
    from gatherlab.recording.recorder import Recorder
    from gatherlab.recording.sketch import DEFAULT_K

    k = DEFAULT_K if k is None else k
    names = ("plain", "recorded")
    models = {name: build() for name in names}
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-4) for n, m in models.items()}
    criteria = {name: torch.nn.MSELoss() for name in names}
    for name in names:  # gradients allocated before the memory is read
        update(models[name], optimizers[name], criteria[name], inputs, targets)
    gc.collect()
    before = resident_bytes()
    recorder = Recorder(
        models["recorded"], optimizers["recorded"], out, loss=criteria["recorded"], k=k
    )
    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    cpu: dict[str, list[float]] = {"plain": [], "recorded": []}  # this process's CPU time
    gc.disable()  # no collection inside a timed update (an update makes no cyclic garbage)
    try:
        for pair in range(RECORD_WARM_UP + repeats):
            order = ("plain", "recorded") if pair % 2 == 0 else ("recorded", "plain")
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                update(models[name], optimizers[name], criteria[name], inputs, targets)
                if pair >= RECORD_WARM_UP:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
            if pair == RECORD_WARM_UP - 1:
                warmed = resident_bytes()  # after the first updates (the first's full gradient)
    finally:
        gc.enable()
    end = resident_bytes()
    updates = RECORD_WARM_UP + repeats
    recorder.close()
    after = recording_bytes(out)
    final = len(recorder.parts) * k * 8  # the final weights' sketch, written at the close
    during = {**after, "sketches": after["sketches"] - final}
    ratios = [r / p for r, p in zip(times["recorded"], times["plain"], strict=True)]
    cpu_ratios = [r / p for r, p in zip(cpu["recorded"], cpu["plain"], strict=True)]
    return {
        "dtype": str(inputs.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in models["plain"].parameters()),
        "parts": len(recorder.parts),
        "plain_ms": 1e3 * statistics.median(times["plain"]),
        "recorded_ms": 1e3 * statistics.median(times["recorded"]),
        "ratio": statistics.median(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
        "fastest_ratio": min(times["recorded"]) / min(times["plain"]),
        "first_resident": warmed - before,
        "later_resident": end - warmed,
        "signs": sum(-(-p.numel() // k) * 8 for p in models["plain"].parameters()),
        "line": during["lines"] / updates,
        "sketch": during["sketches"] / updates,
        "per_update": (during["lines"] + during["sketches"]) / updates,
        "full": after["full"],
        "once": after["rest"] + after["sketches"] - during["sketches"],  # + the final sketch
    }
