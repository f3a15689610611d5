"""A failing rank stops the whole job within seconds, and the job says why once.

A rank that fails records why (its rank, host, node, error and exit code) in the run directory's failures/
and in the group's store, before its process ends. The launcher's last line is the first such record, and
it returns that record's exit code (launcher.LaunchFailed). The other ranks stop without a word:

- with gloo, a peer's exit breaks the collective a survivor waits in ("Connection closed by peer"). That
  error is not the cause: the survivor finds the peer's record and exits with the peer's exit code;
- where the collective does not notice (NCCL waits out its timeout, or a peer's exit hangs), its `PeerWatch`
  ends the process GRACE_SECONDS after the record appears;
- a peer whose heartbeat stops for `lost_after` seconds (VLM_RECIPES_LOST_AFTER) is lost: its host is down,
  its network cut, or its process frozen. Its watcher records that, naming it, and ends (EXIT_RANK_LOST).

Why a thread and not the process group's timeout: that timeout also cuts legitimate waits (the other
ranks at a barrier while rank 0 writes final/). NVIDIA's resiliency extension beats from the training loop,
so its timeout must outlast a checkpoint save; a thread keeps beating through long steps and saves.
The store is the TCPStore torchrun's rendezvous made (MASTER_ADDR:MASTER_PORT). A frozen store host
never answers (its operations block past their timeout), so one thread talks to the store and another
judges from the times of its answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from vlm_recipes.errors import EXIT_RANK_LOST, GuardError, exit_code_of
from vlm_recipes.files import read_json, write_json

log = logging.getLogger(__name__)

FAILURES_DIR = "failures"  # in the run directory: rank-<N>.json, the last launched group's records
LOST_AFTER_ENV = "VLM_RECIPES_LOST_AFTER"  # seconds without a heartbeat before a rank counts as lost
DEFAULT_LOST_AFTER = 120.0  # a save that holds the interpreter this long would look lost
NODE_RANK_ENV = "VLM_RECIPES_NODE_RANK"  # the launcher's node number, for the messages
BEAT_SECONDS = 1.0
GRACE_SECONDS = 10.0  # a process still alive this long after a failure was recorded is ended
LOOK_SECONDS = 5.0  # how long a rank whose collective broke looks for the peer's record
STORE_TIMEOUT = timedelta(seconds=5)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a rank runs."""

    rank: int
    host: str
    node: int
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, node {self.node}, pid {self.pid})"


def this_place() -> Place:
    return Place(
        int(os.environ.get("RANK", "0")),
        socket.gethostname(),
        int(os.environ.get(NODE_RANK_ENV, os.environ.get("GROUP_RANK", "0"))),
        os.getpid(),
    )


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """One rank's record: its own error, or (`lost`) that a peer stopped answering."""

    place: Place
    exit_code: int
    error: str  # as run.json's `error`: "DataError: ..."; for a lost peer, who was lost
    attempt: int  # torchrun's restart count: a restarted group's records replace the last one's
    at: float  # time.time()
    lost: bool = False
    resume_overrides: tuple[str, ...] = ()

    def message(self) -> str:
        if self.lost:
            return f"{self.error}; {self.place.describe()} stopped (exit {self.exit_code})"
        return f"{self.place.describe()} failed (exit {self.exit_code}): {self.error}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankFailure:
        data = json.loads(text)
        data["resume_overrides"] = tuple(data.get("resume_overrides", ()))
        return cls(**{**data, "place": Place(**data["place"])})


def own_failure(error: BaseException) -> RankFailure:
    text = f"{type(error).__name__}: {error}".removesuffix(": ")
    overrides = tuple(getattr(error, "resume_overrides", ()))
    return RankFailure(this_place(), exit_code_of(error), text, attempt(), time.time(), False, overrides)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# ---------------------------------------------------------------------------------------------
# The records on disk: what the launchers read once their group has ended


def write_record(run_dir: Path, failure: RankFailure) -> None:
    try:
        (run_dir / FAILURES_DIR).mkdir(exist_ok=True)
        write_json(run_dir / FAILURES_DIR / f"rank-{failure.place.rank}.json", json.loads(failure.to_json()))
    except OSError as error:  # a full disk: the store still tells the peers
        log.warning("could not record rank %d's failure in %s: %s", failure.place.rank, run_dir, error)


def root_cause(run_dir: Path) -> RankFailure | None:
    """The failure that stopped the last group: the first rank that failed on its own, else the first
    record of a lost peer. None when no rank recorded one."""
    records = []
    for path in sorted((run_dir / FAILURES_DIR).glob("rank-*.json")):
        try:
            records.append(RankFailure.from_json(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue  # half-written by a process that was killed
    if not records:
        return None
    latest = max(r.attempt for r in records)
    return min((r for r in records if r.attempt == latest), key=lambda r: (r.lost, r.at))


def clear_records(run_dir: Path) -> None:
    for path in (run_dir / FAILURES_DIR).glob("rank-*.json"):
        path.unlink(missing_ok=True)


def record_in_run_json(run_dir: Path, failure: RankFailure) -> None:
    """run.json says the run failed, with the failing rank's error and exit code."""
    try:
        manifest = read_json(run_dir / "run.json")
        manifest.update(
            status="failed",
            error=failure.error,
            exit_code=failure.exit_code,
            failed_rank=dataclasses.asdict(failure.place),
            ended_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        write_json(run_dir / "run.json", manifest)
    except (OSError, ValueError) as error:
        log.warning("could not record the run's end in %s: %s", run_dir / "run.json", error)


def lost_after() -> float:
    text = os.environ.get(LOST_AFTER_ENV)
    try:
        seconds = float(text) if text else DEFAULT_LOST_AFTER
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise GuardError(f"{LOST_AFTER_ENV}={text}: give the seconds without a heartbeat, e.g. 120")
    return seconds


# ---------------------------------------------------------------------------------------------
# Inside each rank


class PeerWatch:
    """Beats this rank's heartbeat into the group's store and watches one peer's (each rank is watched by
    one other: the same local rank on the next node). Ends this process once a failure is recorded and it
    has not ended by itself, or once its peer or the store stops answering."""

    def __init__(self, run_dir: Path, store, place: Place, world: int, peer: int, lost_after: float):
        self.run_dir, self.store, self.place, self.world, self.peer = run_dir, store, place, world, peer
        self.lost_after = lost_after
        self.store_address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        self.failure: RankFailure | None = None  # the first failure seen, this rank's or a peer's
        self.places: dict[int, Place] = {}  # rank 0's (the store's) and the peer's, read once
        now = time.monotonic()
        self._answered = now  # the store's last answer
        self._peer_beat, self._peer_moved, self._peer_done = -1, now, False
        self._deadline: float | None = None
        self._stopped = threading.Event()

    @classmethod
    def start(cls, run_dir: Path, world: int) -> PeerWatch | None:
        """The watch of this rank of a launched group (None in one process, or without a store)."""
        import torch.distributed as dist

        if world < 2 or "MASTER_ADDR" not in os.environ:
            return None
        seconds, place = lost_after(), this_place()
        try:
            client = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=STORE_TIMEOUT,
                wait_for_workers=False,
            )
            store = dist.PrefixStore(f"vlm_recipes/attempt-{attempt()}", client)
            store.set(f"place/{place.rank}", json.dumps(dataclasses.asdict(place)))
        except (RuntimeError, ValueError) as error:  # the failures still reach the launcher on disk
            log.warning("no watch of the other ranks: the group's store did not answer (%s)", error)
            return None
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        peer = (place.rank + (per_node if world > per_node else 1)) % world
        watch = cls(run_dir, store, place, world, peer, seconds)
        for target in (watch._talk, watch._judge):
            threading.Thread(target=target, name=f"peer-watch-{target.__name__}", daemon=True).start()
        return watch

    # -- the store's side: may block for as long as the store's host is frozen
    def _talk(self) -> None:
        me, peer = self.place.rank, self.peer
        while not self._stopped.is_set():
            try:
                self.store.add(f"beat/{me}", 1)
                for rank in {0, peer} - self.places.keys():
                    if self.store.check([f"place/{rank}"]):
                        self.places[rank] = self._place_of(rank)
                if self.failure is None and self.store.add("failures", 0) > 0:
                    self._saw(RankFailure.from_json(self.store.get("failure/1").decode()))
                beat, done = self.store.add(f"beat/{peer}", 0), self.store.check([f"done/{peer}"])
            except Exception:  # DistStoreError, DistNetworkError: the judge reads the silence
                self._stopped.wait(BEAT_SECONDS)
                continue
            now = time.monotonic()
            self._answered = now
            if beat != self._peer_beat or done:
                self._peer_beat, self._peer_moved, self._peer_done = beat, now, done
            self._stopped.wait(BEAT_SECONDS)

    # -- the judge: never touches the store
    def _judge(self) -> None:
        while not self._stopped.wait(BEAT_SECONDS):
            now = time.monotonic()
            if self._deadline is not None:
                if now >= self._deadline:
                    self._end()
                continue
            if now - self._answered > 3 * BEAT_SECONDS and (found := root_cause(self.run_dir)):
                self._saw(found)  # rank 0 failed and its store went with it: its record is on disk
            elif now - self._answered > self.lost_after:
                self._lose(self._store_lost(now - self._answered))
            elif not self._peer_done and now - self._peer_moved > self.lost_after:
                self._lose(self._peer_lost(now - self._peer_moved))

    def _saw(self, failure: RankFailure) -> None:
        if self.failure is None:
            self.failure, self._deadline = failure, time.monotonic() + GRACE_SECONDS

    def _peer_lost(self, silent: float, rank: int | None = None) -> str:
        rank = self.peer if rank is None else rank
        who = self.places.get(rank) or within(STORE_TIMEOUT.total_seconds(), lambda: self._place_of(rank))
        return (
            f"{who.describe() if who else f'rank {rank}'} was lost: no heartbeat for {silent:.0f} s "
            f"(its host down, its network cut, or its process frozen or killed)"
        )

    def _place_of(self, rank: int) -> Place:
        return Place(**json.loads(self.store.get(f"place/{rank}")))

    def _store_lost(self, silent: float) -> str:
        holder = self.places.get(0)
        return (
            f"{holder.describe() if holder else 'rank 0'} was lost: the group's store at "
            f"{self.store_address}, which it or its node's launcher holds, has not answered for "
            f"{silent:.0f} s (its host down, its network cut, or its process frozen or killed)"
        )

    def _lose(self, description: str) -> None:
        failure = RankFailure(self.place, EXIT_RANK_LOST, description, attempt(), time.time(), lost=True)
        self.record(failure)
        self.failure = failure
        self._end()

    def _end(self) -> None:
        """This process's end, from the watch: its main thread is blocked, or its exit hangs."""
        failure = self.failure
        if failure is not None and failure.place.rank != self.place.rank and self.place.rank == 0:
            record_in_run_json(self.run_dir, failure)
        code = failure.exit_code if failure is not None else EXIT_RANK_LOST
        log.info("ending this process (exit %d): %s", code, failure.message() if failure else "")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)

    # -- the main thread's side
    def record(self, failure: RankFailure) -> None:
        """This rank's record, on disk and in the store (the store's part given up on if it blocks)."""
        write_record(self.run_dir, failure)

        def tell() -> None:
            number = self.store.add("failures", 1)
            self.store.set(f"failure/{number}", failure.to_json())

        within(STORE_TIMEOUT.total_seconds(), tell)

    def record_own(self, error: BaseException) -> None:
        """This rank failed on its own: recorded; the watch ends the process if its exit hangs."""
        failure = own_failure(error)
        self.record(failure)
        self._saw(failure)

    def stop_if_a_peer_failed(self, interrupted: bool) -> None:
        """When this rank's error came from a peer (it failed or was lost first), this process ends now,
        silently, with the peer's exit code; rank 0 records the peer's failure in run.json. Returns when the
        error is this rank's own. A Ctrl-C only looks: every rank got it."""
        with sigterm_held():  # on one host torchrun's agent stops the survivors: first say why
            failure = self.peer_failure(0.0 if interrupted else LOOK_SECONDS)
        if failure is None:
            return
        if self.place.rank == 0:
            record_in_run_json(self.run_dir, failure)
        self._stopped.set()
        raise SystemExit(failure.exit_code)

    def peer_failure(self, wait: float) -> RankFailure | None:
        """A peer's record, or this rank's record of a peer that stopped answering; waits up to `wait`
        seconds for the record of the peer whose exit broke this rank's collective. A peer stopped
        answering when its heartbeat stood still for 3 beats of the wait, or the store did."""
        before = self._beats() if wait else None
        ends = time.monotonic() + wait
        while True:
            now = time.monotonic()
            if self.failure is not None and self.failure.place.rank != self.place.rank:
                return self.failure
            if (found := root_cause(self.run_dir)) is not None and found.place.rank != self.place.rank:
                return found
            if now >= ends:
                break
            time.sleep(0.2)
        if not wait:
            return None
        after = self._beats()
        if before is None or after is None:
            lost = self._store_lost(now - self._answered)
        else:
            stalled = [r for r, beat in before.items() if beat == after.get(r) and beat >= 0]
            if not stalled:
                return None  # every peer is alive and none failed: the error is this rank's own
            lost = self._peer_lost(wait, stalled[0])
        failure = RankFailure(self.place, EXIT_RANK_LOST, lost, attempt(), time.time(), lost=True)
        self.record(failure)
        return failure

    def _beats(self) -> dict[int, int] | None:
        """Every other rank's heartbeat count (-1: ended well); None when the store does not answer."""

        def read() -> dict[int, int]:
            ranks = [r for r in range(self.world) if r != self.place.rank]
            done = {r for r in ranks if self.store.check([f"done/{r}"])}
            return {r: -1 if r in done else self.store.add(f"beat/{r}", 0) for r in ranks}

        return within(STORE_TIMEOUT.total_seconds(), read)

    def finished(self) -> None:
        """This rank ended well: its peers stop watching its heartbeat."""
        within(STORE_TIMEOUT.total_seconds(), lambda: self.store.set(f"done/{self.place.rank}", "1"))
        self._stopped.set()


def within(seconds: float, call: Callable[[], T]) -> T | None:
    """`call()` in a thread of its own, given up on after `seconds` (a frozen store never answers, past
    its own timeout); None when it failed or did not answer."""
    result: list = []

    def run() -> None:
        try:
            result.append(call())
        except Exception as error:  # what is on disk still reaches the launcher
            log.debug("the group's store did not answer: %s", error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """SIGTERM held off (in the main thread) while a survivor looks for why its collective broke."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
