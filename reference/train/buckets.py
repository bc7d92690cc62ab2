"""Bucketed gradient all-reduce that overlaps the backward pass (the DDP reducer).

Gradients appear last layer first. One all-reduce per parameter would pay one latency each; one
after backward would leave the network idle while we compute. So, as PyTorch DDP does, parameters
are grouped in reverse order into buckets of about ``bucket_cap_mb``, and once every gradient of a
bucket is ready the comm thread all-reduces it in place (a contiguous slice of the flat gradient)
while backward goes on. Buckets launch strictly in order, so every rank runs the same collectives.
Four layers, two per bucket (made-up time units): bucket 0 starts when layer 2's backward ends and
hides behind layers 1 and 0; bucket 1 can start only after layer 0, so ``wait()`` pays for it all.

    time ->  0         10        20        30        40        50        60
    main     [ layer 3 ][ layer 2 ][ layer 1 ][ layer 0 ][      wait      ]
    comm                           [ bucket 0 = 3,2 ]    [ bucket 1 = 1,0 ]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from dplab.reference import collectives
from dplab.reference.algorithms.layout import resolve
from dplab.reference.communicator import Communicator
from dplab.reference.errors import ConfigError

__all__ = ["assign_buckets", "Reducer"]


def assign_buckets(slices: Sequence[slice], itemsize: int, bucket_cap_mb: float) -> list[list[int]]:
    """Parameter indices per bucket, walking parameters in reverse (the order backward makes them).

    A bucket closes once it holds at least ``bucket_cap_mb`` MiB (the rule of torch DDP); a
    parameter is never split, so one larger than the cap closes the bucket it lands in.

    Args:
        slices: each parameter's slice of the flat vector, in forward order.
        itemsize: bytes per element of the gradient.
        bucket_cap_mb: the cap, in MiB.

    Returns:
        Parameter indices per bucket, the last parameters first.

    Raises:
        ConfigError: ``bucket_cap_mb`` <= 0.
    """
    if bucket_cap_mb <= 0:
        raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(slices))):
        if buckets[-1] and size >= cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += (slices[i].stop - slices[i].start) * itemsize
    return [b for b in buckets if b]


class Reducer:
    """Owns the buckets of one flat gradient buffer and the thread that reduces them.

    ``algorithm="auto"`` is resolved per bucket (``auto.chosen``: the cost model's pick for its
    bytes) before the all-reduce sees it. ``allreduce``: the executor that runs each bucket's
    all-reduce (the spine's by default; DDP passes the engine's, ``dplab.backends.fastpath``).

    Args:
        comm: this rank's communicator.
        grad: the flat gradient buffer; its buckets are all-reduced in place.
        slices: each parameter's slice of ``grad``, in forward order, contiguous.
        bucket_cap_mb: a bucket closes once it holds this many MiB.
        algorithm: the all-reduce for every bucket (a registered one, "native" or "auto").
        allreduce: the executor each bucket's all-reduce runs on.

    Raises:
        ConfigError: ``bucket_cap_mb`` <= 0, or parameters that are not laid out in forward order.
    """

    def __init__(self, comm: Communicator, grad: np.ndarray, slices: Sequence[slice],
                 bucket_cap_mb: float = 25.0, algorithm: str = "ring", *,
                 allreduce: Callable[..., object] = collectives.allreduce) -> None:
        self.comm, self.grad, self.algorithm, self._allreduce = comm, grad, algorithm, allreduce
        self.buckets = assign_buckets(slices, grad.itemsize, bucket_cap_mb)
        self.bucket_of = {i: b for b, params in enumerate(self.buckets) for i in params}
        self.ranges = [(min(slices[i].start for i in ps), max(slices[i].stop for i in ps))
                       for ps in self.buckets]
        for (a, b), ps in zip(self.ranges, self.buckets):
            if b - a != sum(slices[i].stop - slices[i].start for i in ps):
                raise ConfigError("bucket parameters must be contiguous in the flat gradient, "
                                  "in reverse order: lay parameters out in forward order")
        self.require_backward_grad_sync = True  # False: gradients accumulate, nothing is reduced
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._comm_loop, daemon=True, name="dplab-comm")
        self._thread.start()
        self.reset()

    def reset(self) -> None:
        """Start a new step: nothing ready, nothing launched (``wait`` calls it once a step is
        reduced)."""
        self._missing = [len(ps) for ps in self.buckets]
        self._ready: set[int] = set()
        self._next_launch = 0
        self._done = threading.Semaphore(0)
        self._error: BaseException | None = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside this block launch no reduction.

        The same as setting ``require_backward_grad_sync`` False for the block (torch DDP's
        attribute, the one flag per micro-batch nanoGPT sets)."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def mark_param_as_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final for this step: launch every bucket now complete, in
        order.

        Args:
            i: an index into the ``slices`` the reducer was made with.

        Raises:
            ConfigError: ``i`` was marked twice in one step.
        """
        if not self.require_backward_grad_sync:
            return
        if i in self._ready:
            raise ConfigError(f"parameter {i} was marked ready twice in one step: mark each once "
                              "per step")
        self._ready.add(i)
        b = self.bucket_of[i]
        self._missing[b] -= 1
        while self._next_launch < len(self.buckets) and self._missing[self._next_launch] == 0:
            self._queue.put(self._next_launch)
            self._next_launch += 1

    def wait(self) -> None:
        """Block until every bucket is reduced (``grad`` holds the sum);
        then reset for the next step."""
        if self._next_launch != len(self.buckets):
            raise ConfigError(f"only {self._next_launch} of {len(self.buckets)} buckets were "
                              "ready: every parameter must get a gradient before wait()")
        for _ in self.buckets:
            self._done.acquire()
        error = self._error
        self.reset()
        if error is not None:
            raise error

    def algorithm_for(self, buf: np.ndarray) -> str:
        """The schedule that reduces ``buf``: the configured one resolved on the hosts
        (``hierarchical`` takes g from ``comm.hosts``; ``layout.resolve``), or for "auto" the cost
        model's pick for its size and hosts (every rank prices the same fit and layout, so every
        rank picks the same).

        Args:
            buf: the bucket's slice of the gradient.

        Returns:
            The algorithm name to run, resolved ("hierarchical:4", a registered one, or "native").
        """
        if self.algorithm == "auto":  # the cost model loads for runs that ask for it
            from dplab.reference.auto import chosen

            return chosen(self.comm, buf)
        return resolve(self.algorithm, self.comm.hosts)

    def close(self) -> None:
        """Stop the comm thread (after the reductions already queued); the last call on it.

        """
        self._queue.put(None)
        self._thread.join()

    def _comm_loop(self) -> None:
        while (b := self._queue.get()) is not None:
            a, z = self.ranges[b]
            with self.comm.tracer.span(
                "bucket",
                bytes=(z - a) * self.grad.itemsize,
                algorithm=self.algorithm,
                thread="comm",
                extra={"bucket": b},
            ):
                try:
                    if self._error is None:
                        bucket = self.grad[a:z]
                        self._allreduce(self.comm, bucket, self.algorithm_for(bucket))
                except BaseException as e:  # handed to the main thread by wait()
                    self._error = e
            self._done.release()
