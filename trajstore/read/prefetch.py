"""The reader's prefetching replay (``Reader.iter``): decode the next steps on a thread pool while
the caller works, and on CUDA start the host-to-device copy of the next batch (``torch_bridge``)
before the current one is handed out."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..base import threads as _threads
from ..errors import ConfigError
from ..device.bridge import Arena, as_device, host_arena, launch, on_device, stage
from ..device.tree import map_tensors

__all__ = ["iterate", "ReadAhead", "SERIAL_PREFETCH"]

SERIAL_PREFETCH = 4  # from this prefetch depth on, each step's joins and conversions run on its worker
# thread, not the shared pool; Arrow still decodes its row groups on Arrow's pool (benchmarks/RESULTS.md)
STAGE_ON_CONSUMER = True  # CUDA: a decoded step is staged (padded fields planned) on the consumer's thread,
# which mostly waits for the decodes, not on the prefetch thread that decoded it (benchmarks/RESULTS.md)
WHEN_AHEAD = True  # CUDA: where every decode in flight is done when the consumer takes a step (it computes longer
# than a step decodes, so time inside next() is what it waits for), the next decode starts after the step is
# staged and its copy launched, not before (its start, in Python, would slow that staging), and the steps decoded
# from then on are staged on their prefetch threads, until the decodes fall behind again: time inside next()
# 1.0 against 2.0 ms on the H200 (benchmarks/RESULTS.md, issue 23, eleventh round)
# CUDA: ``prefetch`` decodes stay in flight while the consumer stages a step and copies are under
# way (the steps held are at most prefetch decoding or decoded, one being staged, two copying): a
# prefetch thread that finished its step does not wait for the consumer's staging to start the next.
# Starting each step's copy on its prefetch thread instead measured slower (benchmarks/RESULTS.md)


def iterate(read: Callable[[int, Arena | None], Any], steps: list[int], device: Any = None, prefetch: int = 2,
            workers: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(step, batch)`` for ``steps`` in order, decoding up to ``prefetch`` steps ahead on a
    thread pool (``read(step, arena)`` decodes one step, into ``arena`` when it is not None).
    On CUDA, steps are decoded into pinned memory, staged on the consumer's thread
    (``STAGE_ON_CONSUMER``; padded fields planned for the device; on their prefetch threads while the
    decodes are ahead of the consumer, ``WHEN_AHEAD``) and the copy of the next
    batch is started (on a side stream) before the current one is handed out; the consumer's
    stream waits on each batch's event. Closing the iterator (``break``) cancels pending work,
    waits for running decodes and returns their staging buffers."""
    if type(prefetch) is not int or prefetch < 0:
        raise ConfigError(f"prefetch must be an int >= 0, got {prefetch!r}")
    d = as_device(device)
    cuda = d is not None and d.type == "cuda"
    other = d is not None and d.type not in ("cpu", "cuda")
    consumer = torch.cuda.current_stream(d) if cuda else None
    ahead = False  # CUDA: the decodes were all done when the consumer last took a step (``WHEN_AHEAD``)

    def load(step: int) -> Any:
        if prefetch >= SERIAL_PREFETCH:  # several steps decode at once: no nested pool
            _threads.serial()
        if not cuda:
            return read(step, None)
        arena = host_arena(d)  # padded fields are built on the device (trajstore/device/pad.py)
        try:
            obj = read(step, arena)
            return (obj, arena) if STAGE_ON_CONSUMER and not ahead else stage(obj, arena=arena)
        except BaseException:
            arena.release()
            raise

    def staged(fut: Future) -> Any:  # CUDA: the step's Staged batch
        x = fut.result()
        if type(x) is not tuple:
            return x
        try:
            return stage(x[0], arena=x[1])
        except BaseException:
            x[1].release()
            raise

    pool = ThreadPoolExecutor(max_workers=workers or max(1, prefetch), thread_name_prefix="trajstore-read")
    pending: deque[tuple[int, Future]] = deque()
    issued: deque[tuple[int, Any]] = deque()  # CUDA: copies started, not yet yielded
    todo = iter(steps)

    def fill() -> None:
        while len(pending) < max(1, prefetch):
            s = next(todo, None)
            if s is None:
                return
            pending.append((s, pool.submit(load, s)))

    def take() -> tuple[int, Any, Any]:  # CUDA: the next decoded step, staged and its copy started
        nonlocal ahead
        s, fut = pending.popleft()
        ahead = WHEN_AHEAD and fut.done() and all(f.done() for _, f in pending)
        if not ahead:
            fill()  # decodes behind the consumer: the next one starts before this step is staged
        return (s, *launch(staged(fut), d, consumer))  # (else the caller's fill(), after the launch)

    try:
        fill()
        while pending or issued:
            if not cuda:
                s, fut = pending.popleft()
                obj = fut.result()
                fill()
                yield s, (on_device(map_tensors(obj, lambda t: t.to(d)), d) if other else obj)
                continue
            if not issued:
                issued.append(take())
            # start the next copy now if its decode is done, so it overlaps the consumer's compute
            if pending and pending[0][1].done() and len(issued) < 2:
                issued.append(take())
            s, obj, ev = issued.popleft()
            if ev is not None:
                consumer.wait_event(ev)
            fill()
            yield s, on_device(obj, d)
    finally:
        for _, _, ev in issued:  # never let the caching allocator reuse memory a copy still writes
            if ev is not None:
                consumer.wait_event(ev)
        issued.clear()
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)
        for _, fut in pending:
            if not fut.cancelled() and fut.exception() is None and cuda:
                x = fut.result()
                (x[1] if type(x) is tuple else x).release()
        pending.clear()


class ReadAhead:
    """Replay read-ahead: ``Reader.iter`` over ``step`` and the recorded steps after it, one step ahead,
    to ``device`` (None: the CPU)."""

    def __init__(self, reader: Any, step: int, device: Any = None):
        steps = reader.steps
        self.order = deque([step, *steps[bisect.bisect_right(steps, step):]])
        self._it: Iterator[tuple[int, Any]] = reader.iter(list(self.order), device=device, prefetch=1)

    @property
    def step(self) -> int | None:
        """The step it reads next (being read in the background once the first one was taken)."""
        return self.order[0] if self.order else None

    def take(self) -> Any:
        self.order.popleft()
        return next(self._it)[1]

    def close(self) -> None:
        self._it.close()  # cancels the read ahead, waits for a running one
