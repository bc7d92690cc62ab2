"""The sim backend's discrete-event engine: virtual clocks, queues, one actor at a time.

An *actor* is a rank's thread, a thread it starts (a reducer's comm thread), or a step function
(a timing-only rank, ``timing.py``). Exactly one actor runs at a time: the one with the least
(virtual time, key), key = (rank, index). It runs until it blocks (a message, a lock of another
actor) or spends time (compute, a sleep); only then does the next one run. So the order of
everything the actors do, and every virtual time, is a function of the program and the model
alone: the same command gives the same timeline on any machine at any load.

Work that takes time is a ``Task``: it holds ``Resource`` s (a link's port, a device) for given
durations. A task is eligible from the time it is posted; tasks that want the same resource queue,
in order of (eligible time, rank distance, source, posting order). Tasks start only after every
actor due at that time has run (``_dispatch`` comes last at each time), so two transfers posted at
the same virtual time compete on equal terms whichever actor ran first:

    time ->      0     c    2c    3c
    port 0 tx  [0->1 ][0->2 ][0->3 ]        direct all-reduce, 4 ranks: each rank's sends go to
    port 1 tx  [1->2 ][1->3 ][1->0 ]        r+1, r+2, ... (rotated, as NCCL orders them), so each
    port 1 rx  [0->1 ][3->1 ][2->1 ]        round is a permutation and no port waits: 3c in all

Everything here runs under the baton (the running actor's thread): nothing needs a lock of its own.
"""

from __future__ import annotations

import heapq
import threading
from _thread import allocate_lock
from bisect import insort
from collections.abc import Callable
from typing import Any

from dplab.reference.communicator import CommError, PeerLost

__all__ = ["Engine", "Actor", "Resource", "Task", "Deadlock", "SimError"]


def _key(task: Task) -> tuple:
    return task.key


_END, _RELEASE, _ACTOR, _DISPATCH = 0, 1, 2, 3
READY, RUNNING, BLOCKED, OUTSIDE, DONE = "ready", "running", "blocked", "outside", "done"


class SimError(CommError):
    """The simulation cannot go on (a failure already stopped it)."""


class Deadlock(CommError):
    """Every actor waits and nothing is under way: nobody will ever send what they wait for."""


class Resource:
    """A server that does ``servers`` tasks at a time (one: a port of a link, or a device; more: a
    pool, such as the cores an operating system hands processes to). ``queue``: the eligible tasks
    waiting for it, in key order; ``busy``: every server is taken."""

    __slots__ = ("name", "busy", "queue", "servers", "used")

    def __init__(self, name: str, servers: int = 1) -> None:
        self.name, self.busy, self.servers, self.used = name, False, servers, 0
        self.queue: list[Task] = []

    def __repr__(self) -> str:
        return f"Resource({self.name})"


class Task:
    """Work that holds ``holds`` [(resource, seconds)] from its start; done at the longest hold.
    ``key`` = (eligible time, order) ranks it among waiting tasks, ``order`` an integer that packs
    (rank distance, rank, posting order) (``Engine.order``);
    ``on_end(t)`` runs when it is done."""

    __slots__ = ("key", "holds", "on_end", "start", "end", "freed_at_end")

    def __init__(
        self,
        holds: list[tuple[Resource, float]],
        on_end: Callable[[float], None],
        key: tuple[float, int],
    ) -> None:
        self.holds, self.on_end, self.key = holds, on_end, key
        self.start = self.end = -1.0
        self.freed_at_end: list[Resource] = []


class Actor:
    """One thing that runs in virtual time. A thread actor waits on ``lock`` until it holds the
    baton; a step actor (``step`` given) is called in place by whoever holds it."""

    __slots__ = (
        "key",
        "order",
        "rank",
        "main",
        "time",
        "state",
        "lock",
        "token",
        "step",
        "error",
        "waiting",
        "peers",
        "joiners",
        "name",
        "thread",
        "pending",
        "debt",
        "debt_on",
        "busy",
        "wake_at",
    )

    def __init__(
        self,
        key: tuple[int, int],
        main: bool,
        step: Callable[[Actor], None] | None = None,
        name: str = "",
    ) -> None:
        self.key, self.rank, self.main, self.step, self.name = key, key[0], main, step, name
        self.order = (key[0] << 16) | key[1]  # key as one integer: the heap compares it often
        self.time, self.state, self.token = 0.0, OUTSIDE if main else READY, 0
        self.lock = allocate_lock()
        self.lock.acquire()  # held: released by whoever hands this actor the baton
        self.error: BaseException | None = None
        self.waiting: str = (
            ""  # what a blocked actor waits for, in words (for a deadlock's message)
        )
        self.peers: tuple[int, ...] = ()  # the ranks it waits for (-1: any)
        self.pending = 0  # transfers it still waits for
        self.debt, self.debt_on = (
            0.0,
            None,
        )  # compute done but not yet spent on its device (``owe``)
        self.busy: Task | None = None  # its compute, queued on its device (``flush``)
        self.wake_at: float | None = None  # a wake-up that came while it was busy
        self.joiners: list[Actor] = []
        self.thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Actor{self.key}({self.state}, t={self.time:.9g})"


class Engine:
    """Virtual time for one world: ``actors`` by key, the event heap, the tasks that wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self.actors: dict[tuple[int, int], Actor] = {}
        self.failed: BaseException | None = None
        self._heap: list[tuple] = []
        self._seq = 0
        self._due: dict[float, list[Task]] = {}  # eligible time -> tasks that become eligible then
        self._freed: list[Resource] = []  # resources freed since the last dispatch
        self.unfinished = 0  # tasks submitted and not yet done
        self._dispatch_at: set[float] = set()  # times with a dispatch in the heap
        self._local = threading.local()
        self._entry = threading.Lock()  # ranks enter a job from their own threads, before any baton
        self.tasks_done = 0  # tasks finished so far: the simulator's events, for events per second
        self.diagnose: Callable[[Actor], BaseException | None] = lambda actor: None  # at a deadlock
        self.contact: Callable[[Actor], None] = lambda actor: None  # it reads a clock, waits, ...

    # -- actors --------------------------------------------------------------------------------
    def add(self, actor: Actor) -> Actor:
        self.actors[actor.key] = actor
        return actor

    def current(self) -> Actor | None:
        """The calling thread's actor while it holds the baton; None outside the simulation."""
        actor = getattr(self._local, "actor", None)
        return (
            actor if actor is not None and actor.state == RUNNING and self.failed is None else None
        )

    def attach(self, actor: Actor) -> None:
        """The calling thread is ``actor`` from now on."""
        actor.thread = threading.current_thread()
        self._local.actor = actor

    def mains_inside(self) -> list[Actor]:
        return [a for a in self.actors.values() if a.main and a.state != OUTSIDE]

    def enter(self, actor: Actor) -> None:
        """A rank's main thread starts a job: it waits until every main actor has, then for the
        baton.
        Every rank starts a job at the engine's time (the launcher hands jobs out together)."""
        with self._entry:
            self._check()
            self.attach(actor)
            actor.state, actor.error = READY, None
            self._push_actor(actor, self.now)
            last = not any(a.main and a.state == OUTSIDE for a in self.actors.values())
        if last:
            self._switch(actor)  # the last rank to enter starts the clock
        else:
            self._wait_baton(actor)

    def leave(self, actor: Actor, error: BaseException | None = None) -> None:
        """A rank's main thread ends its job (``error``: it raised); the baton goes on without
        it."""
        if self.failed is not None:
            actor.state = OUTSIDE
            return
        if error is None:
            self.settle(actor)
        actor.debt = 0.0
        actor.state, actor.error = OUTSIDE, error
        actor.token = -1  # any wake-up still in the heap is stale now
        self._hand_on(actor)

    def spawn(self, parent: Actor, name: str) -> Actor:
        """A new actor for a thread ``parent`` starts: same rank, ready once the parent's compute so
        far is done. Never hands the baton over: a thread is often started under a lock."""
        index = 1 + max(k[1] for k in self.actors if k[0] == parent.rank)
        child = self.add(Actor((parent.rank, index), False, name=name))
        self._push_actor(child, self.later(parent))
        return child

    def finish(self, actor: Actor) -> None:
        """A spawned actor's thread ends: wake its joiners, hand the baton on, never wait again."""
        if self.failed is None:
            self.settle(actor)
        actor.state = DONE
        for j in actor.joiners:
            self.wake(j, actor.time)
        actor.joiners.clear()
        if self.failed is None:
            self._hand_on(actor)

    def join(self, actor: Actor, other: Actor) -> None:
        """``actor`` waits until ``other`` (a spawned actor) has finished."""
        self.flush(actor)
        if other.state == DONE:
            return
        other.joiners.append(actor)
        self.block(actor, f"the end of thread {other.name or other.key}", (other.rank,))

    def advance(self, actor: Actor, seconds: float) -> None:
        """``actor`` spends ``seconds`` of virtual time holding nothing (a sleep)."""
        self.settle(actor)
        self._push_actor(actor, actor.time + max(seconds, 0.0))
        actor.state = READY
        self._switch(actor)

    def owe(self, actor: Actor, seconds: float, device: Resource) -> None:
        """``actor`` computed for ``seconds`` on ``device``: the time is spent at its next contact
        with another actor (``flush``, ``settle``), not now. Meanwhile its clock stays where the
        compute began and it runs on: compute touches nobody else, and not handing the baton over
        at every operation is what lets a rank hold a lock of its own around torch calls (and is
        far cheaper)."""
        actor.debt += seconds
        actor.debt_on = device

    def later(self, actor: Actor) -> float:
        """``actor``'s time once its compute so far is spent (its device permitting)."""
        return actor.time + actor.debt

    def flush(self, actor: Actor) -> None:
        """Queue ``actor``'s compute debt on its device, without waiting for it: the actor is busy
        until that task ends, and a wake-up meanwhile takes effect at its end."""
        if actor.debt > 0:
            seconds, actor.debt = actor.debt, 0.0
            task = Task(
                [(actor.debt_on, seconds)],
                lambda end: self._unbusy(actor, end),
                (actor.time, self.order(0, actor.rank)),
            )
            actor.busy = task
            self.submit(task, actor.time)

    def settle(self, actor: Actor) -> None:
        """Spend ``actor``'s compute debt on its device now, waiting for it (before a message)."""
        self.flush(actor)
        if actor.busy is not None:
            actor.wake_at = actor.time
            self.block(actor, "its compute")

    def _unbusy(self, actor: Actor, end: float) -> None:
        actor.busy = None
        actor.time = max(actor.time, end)
        if actor.wake_at is not None and actor.state == BLOCKED:
            t, actor.wake_at = actor.wake_at, None
            actor.state = READY
            self._push_actor(actor, max(t, end))

    def block(self, actor: Actor, what: str, peers: tuple[int, ...] = ()) -> None:
        """``actor`` waits until ``wake`` (``what``, on ``peers``: for a deadlock's message); the
        baton goes to the next actor meanwhile."""
        actor.state, actor.waiting, actor.peers = BLOCKED, what, peers
        self._switch(actor)

    def wake(self, actor: Actor, t: float) -> None:
        """A blocked ``actor`` may go on at time ``t`` (not before its own time, nor before its
        compute is done)."""
        if actor.state != BLOCKED:
            return
        if actor.busy is not None:
            actor.wake_at = t if actor.wake_at is None else min(actor.wake_at, t)
            return
        actor.state = READY
        self._push_actor(actor, max(t, actor.time))

    def hold(self, actor: Actor, holds: list[tuple[Resource, float]]) -> None:
        """``actor`` runs a task on ``holds`` and resumes when it is done."""
        self.flush(actor)
        task = Task(holds, lambda t: self.wake(actor, t), (actor.time, self.order(0, actor.rank)))
        self.submit(task, actor.time)
        self.block(actor, f"its work on {', '.join(r.name for r, _ in holds)}")

    def timer(self, actor: Actor, t: float) -> int:
        """Wake ``actor`` at ``t`` unless something wakes it first; the token to tell which came."""
        actor.token = self._next_seq()
        heapq.heappush(self._heap, (t, 1, actor.order, actor.token, _ACTOR, actor))
        return actor.token

    # -- tasks ---------------------------------------------------------------------------------
    def order(self, distance: int, rank: int) -> int:
        """A task's rank among those eligible at the same time, as one integer: by rank distance (a
        rank's sends go to r+1, r+2, ... first, as NCCL orders them), then rank, then posting
        order."""
        return (distance << 52) | (rank << 32) | self._next_seq()

    def submit(self, task: Task, t: float) -> None:
        """``task`` is eligible from ``t``: it starts at the dispatch at ``t`` or later."""
        self.unfinished += 1
        self._due.setdefault(t, []).append(task)
        self._want_dispatch(t)

    def _want_dispatch(self, t: float) -> None:
        if t not in self._dispatch_at:  # one dispatch per time: at each task's eligible time, and
            self._dispatch_at.add(t)  # whenever a resource frees
            self._push(t, 2, 0, _DISPATCH, None)

    def _dispatch(self, t: float) -> None:
        """Start every eligible task whose resources are all free, in key order. Only tasks that
        became eligible now or wait for a resource freed since the last dispatch can start: any
        other waits for a resource that is still busy."""
        self._dispatch_at.discard(t)
        due = self._due.pop(t, [])
        for task in due:
            for r, _ in task.holds:
                insort(r.queue, task, key=_key)
        candidates = list(due)
        for r in self._freed:
            candidates.extend(r.queue)
        self._freed.clear()
        if len(candidates) > 1:
            candidates.sort(key=_key)
        for task in candidates:
            if task.start >= 0:
                continue  # started already (a task waiting on two freed resources comes twice)
            holds = task.holds
            if (
                holds[0][0].busy
                or (len(holds) > 1 and holds[1][0].busy)
                or any(r.busy for r, _ in holds[2:])
            ):
                continue
            task.start = t
            longest = max(d for _, d in holds)
            for r, d in holds:
                r.used += 1
                r.busy = r.used >= r.servers
                r.queue.remove(task)
                if d < longest:
                    self._push(t + d, 0, self._next_seq(), _RELEASE, r)
                else:  # freed by the task's end: one event, not one per resource
                    task.freed_at_end.append(r)
            task.end = t + longest
            self._push(task.end, 0, self._next_seq(), _END, task)

    def _free(self, r: Resource, t: float) -> None:
        r.used -= 1
        r.busy = False
        if r.queue:
            self._freed.append(r)
            self._want_dispatch(t)

    # -- the scheduler -------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push(self, t: float, prio: int, order: Any, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (t, prio, order, self._next_seq(), kind, obj))

    def ready(self, actor: Actor, t: float) -> None:
        """``actor`` (a new step actor) is due at ``t``."""
        actor.state = READY
        self._push_actor(actor, t)

    def _push_actor(self, actor: Actor, t: float) -> None:
        actor.token = self._next_seq()
        heapq.heappush(self._heap, (t, 1, actor.order, actor.token, _ACTOR, actor))

    def _next(self) -> Actor | None:
        """Process events in time order until an actor is due; None when nothing is left to do."""
        heap = self._heap
        while heap:
            t, _, _, seq, kind, obj = heapq.heappop(heap)
            self.now = t
            if kind == _ACTOR:
                if seq != obj.token or obj.state in (OUTSIDE, DONE):
                    continue  # a stale wake-up (woken earlier, or gone)
                obj.time, obj.state = t, RUNNING
                if obj.step is None:
                    return obj
                obj.step(obj)  # a step actor runs in place, then is ready, blocked or done
                if obj.state == RUNNING:
                    obj.state = DONE
            elif kind == _END:
                self.tasks_done += 1
                self.unfinished -= 1
                for r in obj.freed_at_end:
                    self._free(r, t)
                obj.on_end(t)
            elif kind == _RELEASE:
                self._free(obj, t)
            else:
                self._dispatch(t)
        return None

    def run(self) -> None:
        """Drive step actors until nothing is left (timing-only runs: no thread holds the baton)."""
        if self._next() is not None:
            raise SimError("a thread actor is due, but run() drives step actors only")
        self._stalled_check()

    def _switch(self, me: Actor) -> None:
        """``me`` has set its state (ready with a wake-up pushed, or blocked): run whoever is
        next."""
        nxt = self._next()
        if nxt is me:
            return
        if nxt is None:
            self._stalled(me)
        else:
            nxt.lock.release()  # hand over the baton
        self._wait_baton(me)

    def _hand_on(self, me: Actor) -> None:
        """``me`` leaves the simulation: the baton goes to whoever is next, never back."""
        nxt = self._next()
        if nxt is not None:
            nxt.lock.release()
        elif self.mains_inside():
            self._stalled(None)

    def _wait_baton(self, me: Actor) -> None:
        me.lock.acquire()
        if self.failed is not None and me.state != RUNNING:
            raise me.error or SimError(f"the simulation stopped: {self.failed}")
        if me.error is not None and me.state == RUNNING:
            error, me.error = me.error, None
            raise error

    def _check(self) -> None:
        if self.failed is not None:
            raise SimError(f"the simulation stopped earlier: {self.failed}")

    def _stalled_check(self) -> None:
        blocked = [a for a in self.actors.values() if a.state == BLOCKED]
        if blocked and not self.unfinished and not self._heap:
            raise Deadlock(
                f"{len(blocked)} ranks wait and nothing is under way: "
                + "; ".join(f"rank {a.rank} waits for {a.waiting}" for a in blocked[:4])
            )

    def _stalled(self, me: Actor | None) -> None:
        """Nothing is due and ranks are still inside their job: every one of them waits for a
        message nobody will send. Each gets an error saying what it waited for (or, if it waited
        for a rank that failed, ``PeerLost`` naming it); the simulation stops."""
        failed = {
            a.rank
            for a in self.actors.values()
            if a.main and a.state == OUTSIDE and a.error is not None
        }
        blocked = [a for a in self.actors.values() if a.state == BLOCKED]
        if not any(a.main for a in blocked):
            return  # every job is over: leftover threads (an idle comm thread) wait for the next
        waiting = [a for a in blocked if a.main or a.peers]  # not threads idle on their own queue
        for a in waiting:
            lost = [r for r in sorted(failed) if r in a.peers or (-1 in a.peers and a.rank != r)]
            if lost:
                a.error = PeerLost(
                    f"rank {a.rank} waited for {a.waiting}, but rank {lost[0]} failed "
                    "first (see its error)"
                )
            else:
                a.error = self.diagnose(a) or Deadlock(
                    f"rank {a.rank} waits for {a.waiting} at t={self.now:.9g} s, but every rank "
                    "waits and nothing is under way: nobody will send it (do all ranks call the "
                    "same collectives, sends and receives?)"
                )
        self.failed = next((a.error for a in waiting), Deadlock("deadlock"))
        for a in waiting:
            if a is not me:
                a.lock.release()
        if me is not None:
            me.lock.release()  # so that its own wait returns at once, with its error
