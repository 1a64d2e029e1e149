"""The ranks a launcher started (torchrun or srun), driven from rank 0 as the warm pool's ranks are
driven from the process that started them (docs/checking.md §10, "The external launcher").

Rank 0 runs the caller's code; every other rank ``serve``s rank 0's jobs. ``Ranks.run(function,
*args)`` runs ``function(*args)`` on every rank in a fresh default process group and returns the
answers in rank order, as ``pool(W).run`` does; between jobs no process is in a group, so rank 0
can run one device's code alone (``world.alone``). Jobs, answers and the stop travel through the
launcher's TCP store, never a process group, so bad input stops every rank before any group is
joined. ``ranks_for(world_size)`` is this runner while one is ``active``, else the warm pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gatherlab.core import cli, terms
from gatherlab.ranks import pool as pools
from gatherlab.ranks import watched
from gatherlab.ranks.pool import COLLECTIVE_TIMEOUT, RankError

__all__ = [
    "BACKENDS", "DEVICES", "SLURM_VARIABLES", "TORCHRUN_VARIABLES", "Launched", "RankZeroGone",
    "Ranks", "active", "connect", "launched", "launched_rank", "ranks_for", "serve",
]  # fmt: skip

DEVICES = tuple(terms.Device)
"""Where the ranks compute (`gatherlab.core.terms.Device`): ``cpu`` or ``cuda``."""
BACKENDS = {device: device.backend for device in terms.Device}
"""Each device's process group backend (`gatherlab.core.terms.Device.backend`)."""
# How long a rank waits for one answer of the store before it asks again (a job of rank 0's may
# take hours: the waiting rank only checks that rank 0's store is still there).
POLL = timedelta(seconds=60)
# After a failed job: how long rank 0 waits for the answers of ranks that have not answered.
ANSWER_GRACE = COLLECTIVE_TIMEOUT + timedelta(seconds=30)
# How long rank 0 waits, when it stops, for every rank to have read the stop (and printed its line).
STOP_GRACE = timedelta(seconds=30)


class RankZeroGone(RuntimeError):
    """Rank 0's store cannot be reached any more: rank 0 ended without stopping this rank."""


@dataclasses.dataclass(frozen=True)
class Launched:
    """This process as one rank of a launcher's ranks: its ``rank`` of ``world_size``, its
    ``local_rank`` on its node, the store's ``address`` and ``port``, and the ``launcher``
    (``torchrun`` or ``srun``)."""

    rank: int
    world_size: int
    local_rank: int
    address: str
    port: int
    launcher: str


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""torchrun's environment variables of a rank: its rank, the number of ranks, its rank on its
node."""
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
"""SLURM's (srun's) environment variables of a rank, in the order of `TORCHRUN_VARIABLES`."""


def launched_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it in ``environ`` (the process's environment):
    torchrun's ``RANK`` first, else SLURM's ``SLURM_PROCID``; None when neither is set. A value
    that is no integer raises ``ValueError``."""
    environ = os.environ if environ is None else environ
    for name in (TORCHRUN_VARIABLES[0], SLURM_VARIABLES[0]):
        if name in environ:
            return int(environ[name])
    return None


def launched(environ: Mapping[str, str] | None = None) -> Launched | None:
    """This process's place among a launcher's ranks, read from ``environ`` (the process's
    environment): torchrun's variables first (torchrun inside a SLURM job sets them), else
    SLURM's; None when neither launcher started it. A ValueError of one line for a variable that
    is missing or not an integer."""
    environ = os.environ if environ is None else environ
    if TORCHRUN_VARIABLES[0] in environ or TORCHRUN_VARIABLES[1] in environ:
        names, launcher = TORCHRUN_VARIABLES, "torchrun"
    elif SLURM_VARIABLES[0] in environ:
        names, launcher = SLURM_VARIABLES, "srun"
    else:
        return None
    values = []
    for name in (*names, "MASTER_PORT"):
        text = environ.get(name)
        if text is None or not text.strip().isdigit():
            allowed = (
                "MASTER_ADDR and MASTER_PORT of rank 0's node" if name == "MASTER_PORT" else ""
            )
            raise ValueError(
                f"{launcher}: {name}={text!r} is not allowed; allowed: an integer"
                + (f" ({allowed})" if allowed else "")
            )
        values.append(int(text))
    address = environ.get("MASTER_ADDR")
    if not address:
        raise ValueError(
            f"{launcher}: MASTER_ADDR is not set; allowed: the address of rank 0's node"
        )
    rank, world_size, local_rank, port = values
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{launcher}: rank {rank} of {world_size} ranks; allowed: 0 … {world_size - 1}"
        )
    return Launched(rank, world_size, local_rank, address, port, launcher)


def connect(place: Launched, timeout: timedelta = COLLECTIVE_TIMEOUT) -> dist.Store:
    """The store every rank shares: torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``), else
    one that rank 0 opens at ``MASTER_ADDR:MASTER_PORT`` and the others connect to; its keys
    under a prefix of their own (per torchrun restart)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        place.address, place.port, place.world_size, is_master=place.rank == 0 and not agent,
        timeout=timeout, wait_for_workers=False,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"gatherlab/attempt_{attempt}/", store)


def use_device(place: Launched, device: str) -> None:
    """With ``cuda``: this rank's own GPU, ``LOCAL_RANK`` among the GPUs it sees (each rank sees
    one where the launcher binds one GPU per task)."""
    if device == terms.Device.CUDA:
        torch.cuda.set_device(place.local_rank % torch.cuda.device_count())


@dataclasses.dataclass(frozen=True)
class _Answer:
    rank: int
    ok: bool
    value: Any  # the result, or the error's line
    order: int  # a failure's place among the job's failures (1: first; a peer's collective
    # fails only after the first failing rank has left the group); 0 for a result
    warned: list[Any]
    named: int | None = None  # the rank a failure's line is about, where not this one's own
    # (``watched.CollectiveError``: a peer raised, or several ranks' collectives differ)
    own: bool = True  # whether the line is the named rank's own error (else it names the ranks)


def _cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU (a result travels to rank 0 that way)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {
            f.name: _cpu(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        return dataclasses.replace(value, **changed)
    if isinstance(value, dict):
        return {key: _cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu(item) for item in value)
    return value


def _job(
    store: dist.Store, number: int, place: Launched, device: str,
    function: Callable[..., Any], args: tuple[Any, ...], watch_s: float | None = None,
) -> _Answer:  # fmt: skip
    """One rank's part of job ``number``: join its group, run (with ``watch_s``, its collectives
    compared with the peers' before they run: ``collectives``), leave once no peer is in a
    collective; the answer, not sent."""
    hook = sys.excepthook  # init_process_group wraps it and never unwraps it
    peers = None
    if watch_s is not None:
        peers = watched.Peers(store, f"watch_{number}", place.rank, watch_s)
    timeout = COLLECTIVE_TIMEOUT if watch_s is None else timedelta(seconds=watch_s)
    named, own = None, True
    with warnings.catch_warnings(record=True) as caught:
        try:
            use_device(place, device)
            dist.init_process_group(
                BACKENDS[device], store=dist.PrefixStore(f"group_{number}/", store),
                rank=place.rank, world_size=place.world_size, timeout=timeout,
            )  # fmt: skip
            with watched.watched(peers):
                value = _cpu(function(*args))
            pickle.dumps(value)  # a result that does not pickle is this rank's error
            ok, order = True, 0
        except Exception as error:
            ok, value = False, cli.error_line(error)
            if isinstance(error, watched.CollectiveError):
                value, named, own = error.line, error.rank, error.own
            order = store.add(f"failures_{number}", 1)  # before this rank leaves the group
        finally:
            # Nobody leaves the group while a peer is still in a collective (a gloo peer that
            # leaves aborts the process of one that waits for it).
            if dist.is_initialized():
                if peers is None:
                    with contextlib.suppress(Exception):
                        dist.barrier()
                else:
                    peers.wait_ended(range(place.world_size))
                dist.destroy_process_group()
            sys.excepthook = hook
    return _Answer(place.rank, ok, value, order, pools.sendable_warnings(caught), named, own)


def _wait(store: dist.Store, key: str, limit: timedelta | None = None) -> bytes | None:
    """The value of ``key`` once it is set; None after ``limit`` (None: no limit). Raises
    `RankZeroGone` when the store cannot be reached."""
    waited = timedelta(0)
    while limit is None or waited < limit:
        step = POLL if limit is None else min(POLL, limit - waited)
        try:
            store.wait([key], step)
            return store.get(key)
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower():
                raise RankZeroGone(cli.first_line(error)) from None
            waited += step
        except (dist.DistError, RuntimeError, OSError) as error:
            raise RankZeroGone(cli.first_line(error)) from None
    return None


def serve(
    place: Launched, store: dist.Store, device: str = terms.Device.CPU
) -> tuple[int, str | None]:
    """A rank other than 0: run rank 0's jobs until it stops this rank; return the exit status
    and the line to print (None: nothing) that rank 0 sent. Raises `RankZeroGone`."""
    number = 0
    while True:
        kind, *rest = pickle.loads(_wait(store, f"job_{number}"))
        if kind == "stop":
            status, line = rest
            store.add("stopped", 1)
            return status, line
        answer = _job(store, number, place, device, *rest)
        try:
            payload = pickle.dumps(answer)
        except Exception as error:  # sent: the error, not the result
            payload = pickle.dumps(dataclasses.replace(
                answer, ok=False, value=cli.error_line(error), order=0
            ))  # fmt: skip
        store.set(f"answer_{number}_{place.rank}", payload)
        number += 1


class Ranks:
    """Rank 0's handle on the launcher's ranks: ``run(function, *args)`` as a pool's (every rank,
    results in rank order, ``RankError`` naming a failed rank), ``stop(status, line)`` once at the
    end."""

    def __init__(self, place: Launched, store: dist.Store, device: str = terms.Device.CPU):
        if place.rank != 0:
            raise ValueError(f"rank {place.rank} serves; only rank 0 drives the ranks")
        self.place, self.store, self.device = place, store, device
        self.world_size = place.world_size
        self._jobs = 0
        self._stopped = False

    def run(self, function: Callable[..., Any], *args: Any) -> list[Any]:
        if self._stopped:
            raise RankError(f"the {self.world_size} ranks of {self.place.launcher} were stopped")
        number = self._jobs
        self._jobs += 1
        self.store.set(
            f"job_{number}", pickle.dumps(("run", function, args, watched.watch_timeout()))
        )
        watch_s = watched.watch_timeout()
        answers = {0: _job(self.store, number, self.place, self.device, function, args, watch_s)}
        failed = not answers[0].ok
        for rank in range(1, self.world_size):
            payload = _wait(self.store, f"answer_{number}_{rank}", ANSWER_GRACE if failed else None)
            answers[rank] = None if payload is None else pickle.loads(payload)
            failed = failed or answers[rank] is None or not answers[rank].ok
        with contextlib.suppress(Warning) if failed else contextlib.nullcontext():
            pools.deliver_warnings(
                [answer.warned for answer in answers.values() if answer is not None]
            )
        return _results(answers, self.world_size)

    def stop(self, status: int, line: str | None = None) -> None:
        """Every other rank ends with ``status`` (printing ``line`` first, when given); returns
        once they have read it, or after ``STOP_GRACE``."""
        if self._stopped:
            return
        self._stopped = True
        self.store.set(f"job_{self._jobs}", pickle.dumps(("stop", status, line)))
        deadline = time.monotonic() + STOP_GRACE.total_seconds()
        while time.monotonic() < deadline and self.store.add("stopped", 0) < self.world_size - 1:
            time.sleep(0.02)


def _results(answers: Mapping[int, _Answer | None], world_size: int) -> list[Any]:
    """The results in rank order; else `RankError` naming the first rank that did not answer
    (it died or hangs), else the rank that failed first (its peers' collectives fail after it)."""
    if all(answer is not None and answer.ok for answer in answers.values()):
        return [answers[rank].value for rank in range(world_size)]
    silent = [rank for rank, answer in answers.items() if answer is None]
    if silent:
        rank = silent[0]
        line = f"no answer within {ANSWER_GRACE.total_seconds():.0f} s: the process died or hangs"
    else:
        failed = [answer for answer in answers.values() if answer is not None and not answer.ok]
        # A rank's own error first (a peer that passes it on, or several ranks' disagreement,
        # only after it), then the one that failed first.
        first = min(
            failed, key=lambda answer: (answer.named is not None, answer.order, answer.rank)
        )
        rank = first.rank if first.named is None else first.named
        line = first.value
        if not first.own:  # the line names the ranks itself
            raise RankError(line, None, rank, line)
    raise RankError(f"rank {rank}: {line}", None, rank, line)


_active: contextvars.ContextVar[Ranks | None] = contextvars.ContextVar(
    "gatherlab_external_ranks", default=None
)


@contextlib.contextmanager
def active(ranks: Ranks) -> Iterator[Ranks]:
    """While the block runs, ``ranks_for`` finds the launcher's ranks."""
    token = _active.set(ranks)
    try:
        yield ranks
    finally:
        _active.reset(token)


def ranks_for(world_size: int) -> Ranks | pools.WorkerPool:
    """Where ``world_size`` ranks run a job (``run(function, *args)``): the launcher's ranks while
    they are active (a ValueError when their number differs), else the warm pool."""
    ranks = _active.get()
    if ranks is None:
        return pools.pool(world_size)
    if ranks.world_size != world_size:
        raise ValueError(f"{world_size} ranks asked for; the launcher started {ranks.world_size}")
    return ranks
