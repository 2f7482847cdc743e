"""Generation jobs for the server: a bounded queue, a fixed number of slots, one worker thread per slot.

The event loop never runs a forward pass: each job runs `enlace.generate.generate` (the one implementation the
CLI uses too, with its own KV cache per call) in a worker thread and hands its text to the loop as events. A
job stops between two tokens once its `cancel` event is set: the client disconnected, or the server stops.
Admission is decided at once: a request that finds every slot busy and the queue full is refused, never
parked; one admitted waits for a slot at most a set time. /health turns "degraded" after DEGRADED_AFTER
generations in a row failed (the model's device lost, memory exhausted): a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..generate import generate
from .loader import Served

log = logging.getLogger("enlace.serve")
DEGRADED_AFTER = 3  # failed generations in a row
GENERIC_FAILURE = "generation failed (the server's log has the details)"


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""


class QueueTimeout(Exception):
    """The request waited for a slot longer than the server allows."""


@dataclass
class GenRequest:
    """A validated request: prompt ids, a budget that fits the context, and the sampling settings."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    no_repeat_ngram: int
    seed: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Event:
    kind: str  # "text", "done" or "error"
    text: str = ""
    finish_reason: str | None = None  # done: "stop", "length" or "cancelled"
    usage: dict[str, Any] | None = None
    timings: dict[str, float] | None = None


class StopScanner:
    """Cuts the text at the first stop string, holding back any tail that could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """The text safe to emit now, and whether a stop string ended it."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job:
    def __init__(self, req: GenRequest):
        self.req = req
        self.cancel = threading.Event()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.state = "waiting"  # then "running" (a worker has it) or "gone" (left before a slot was free)

    def emit(self, event: Event) -> None:
        """From the worker thread: hand an event to the loop (dropped if the loop has already closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass


class Engine:
    """The served model behind `slots` worker threads and a waiting queue of `queue` requests."""

    def __init__(self, served: Served, slots: int = 1, queue: int = 16):
        if slots < 1:
            raise ValueError(f"slots {slots}: must be at least 1")
        if queue < 0:
            raise ValueError(f"queue {queue}: must be >= 0")
        self.served, self.slots, self.queue = served, slots, queue
        self.pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="enlace-slot")
        self._free: asyncio.Semaphore | None = None  # made on the server's loop
        self.admitted = 0  # running + waiting; only the loop thread touches it
        self.running: set[Job] = set()
        self.consecutive_failures = 0
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "refused": 0,
                      "tokens_generated": 0}  # fmt: skip

    @property
    def free(self) -> asyncio.Semaphore:
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        return self._free

    @property
    def healthy(self) -> bool:
        return self.consecutive_failures < DEGRADED_AFTER

    def status(self) -> dict[str, Any]:
        busy = len(self.running)
        return {"slots": self.slots, "busy": busy, "queued": self.admitted - busy, "queue": self.queue,
                **self.stats, "consecutive_failures": self.consecutive_failures}  # fmt: skip

    def admit(self, req: GenRequest) -> Job:
        """A job holding a place in the queue; QueueFull at once when there is none."""
        if self.admitted >= self.slots + self.queue:
            self.stats["refused"] += 1
            raise QueueFull(f"{self.slots} generation slot(s) busy and {self.queue} request(s) waiting")
        self.admitted += 1
        self.stats["requests"] += 1
        return Job(req)

    async def start(self, job: Job, timeout: float) -> None:
        """Wait for a slot (QueueTimeout after `timeout` seconds), then run the job in a worker thread.

        Cancelled while waiting (the client went away), or timed out: the queue place is given back."""
        try:
            await asyncio.wait_for(self.free.acquire(), timeout)
        except asyncio.TimeoutError:
            self.abandon(job)
            self.stats["refused"] += 1
            raise QueueTimeout(f"no generation slot free within {timeout:g} s") from None
        except BaseException:
            self.abandon(job)
            raise
        if job.state != "waiting" or job.cancel.is_set():  # abandoned while the slot was being handed over
            self.free.release()
            self.abandon(job)
            return
        job.state = "running"
        self.running.add(job)
        future = asyncio.get_running_loop().run_in_executor(self.pool, self._work, job)
        future.add_done_callback(lambda f: self._done(job, f))

    async def events(self, job: Job) -> AsyncIterator[Event]:
        """The events of a started job until done or error.

        Closing or cancelling this iterator (the client went away) stops the generation at the next token.
        The slot and the queue place are given back when the worker thread is done, not before.
        """
        try:
            if job.state != "running":
                return
            while True:
                event = await job.events.get()
                yield event
                if event.kind in ("done", "error"):
                    return
        finally:
            job.cancel.set()  # harmless once the job has finished

    def abandon(self, job: Job) -> None:
        """The job's client is gone: a running job stops at its next token (its worker gives the place back);
        a waiting one gives its queue place back now. Idempotent."""
        job.cancel.set()
        if job.state == "waiting":
            job.state = "gone"
            self.admitted -= 1

    def _done(self, job: Job, future: asyncio.Future) -> None:
        self.running.discard(job)
        self.admitted -= 1
        self.free.release()
        if future.cancelled() or future.exception() is not None:
            self.stats["failed"] += 1
            self.consecutive_failures += 1
            # Whoever waits on the job must not wait forever (the worker may have died before saying so).
            job.events.put_nowait(Event("error", GENERIC_FAILURE))
            return
        finish, n = future.result()
        self.stats["tokens_generated"] += n
        self.stats["cancelled" if finish == "cancelled" else "completed"] += 1
        if finish != "cancelled":
            self.consecutive_failures = 0

    def _work(self, job: Job) -> tuple[str, int]:
        """The worker thread: generate, decode and emit text; check for cancellation between tokens."""
        r, served = job.req, self.served
        stop_ids = () if r.ignore_eos else tuple(served.eos_ids)
        t0 = time.perf_counter()
        first = last = t0
        n, finish = 0, "length"
        try:
            stream, scan = served.stream(r.prompt_ids), StopScanner(r.stop)
            tokens = generate(
                served.model, r.prompt_ids, r.max_tokens, temperature=r.temperature, top_k=r.top_k,
                top_p=r.top_p, repetition_penalty=r.repetition_penalty, no_repeat_ngram=r.no_repeat_ngram,
                seed=r.seed, eos_ids=stop_ids, device=served.device,
            )  # fmt: skip
            for token in tokens:
                last = time.perf_counter()
                if n == 0:
                    first = last
                n += 1
                if token in stop_ids:  # the model ended: what was held back as a possible stop is text
                    finish = "stop"
                    break
                text, hit = scan.feed(stream.push(token))
                if text:
                    job.emit(Event("text", text))
                if hit:
                    finish = "stop"  # the text ends before the stop string: nothing held back is sent
                    break
                if job.cancel.is_set():  # before the next forward pass
                    finish = "cancelled"
                    break
            tail = scan.flush() if finish != "cancelled" else ""
            if tail:
                job.emit(Event("text", tail))
        except Exception:  # a bug or an out-of-memory: this request fails, the server goes on
            log.exception("generation failed")  # the details go to the log; the client gets a generic line
            job.emit(Event("error", GENERIC_FAILURE))
            raise
        decode_s = last - first
        timings = {
            "prompt_tokens": len(r.prompt_ids),
            "prompt_ms": (first - t0) * 1000,
            "completion_tokens": n,
            "decode_ms": decode_s * 1000,
            # The first token comes out of the prefill; the rate is that of the n - 1 decode steps after it.
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        }
        usage = {"prompt_tokens": len(r.prompt_ids), "completion_tokens": n,
                 "total_tokens": len(r.prompt_ids) + n}  # fmt: skip
        job.emit(Event("done", finish_reason=finish, usage=usage, timings=timings))
        log.info(
            "%d prompt + %d new tokens, %s, %.0f ms to the first token, %.1f tokens/s",
            len(r.prompt_ids), n, finish, timings["prompt_ms"], timings["decode_tokens_per_s"],
        )  # fmt: skip
        return finish, n

    def close(self) -> None:
        """Stop every running generation at its next token and wait for the worker threads."""
        for job in list(self.running):
            job.cancel.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
