"""Generation jobs for the server: a bounded queue, a fixed number of slots, one compute thread for all.

The event loop never runs a forward pass. One compute thread decodes every running job together, as
llama.cpp's server and vLLM do (continuous batching): each step is one forward of the model over one new
token per job, each job in its own row of a slot cache (enlace.model.SlotCache) at its own position. A job
that gets a slot is prefilled alone (generate's own path, into its row) between two steps and joins the
batch; one that ends leaves it, and its row goes to the last active job. Each job keeps its own sampler,
seed and repetition guard, exactly as `enlace.generate.generate` draws them, so its tokens do not depend on
who else is decoding. A prompt that starts with tokens whose KV the engine computed before (the preamble, a
conversation's earlier turns) gets that prefix copied into its row and prefills only the rest
(serve/prefix.py). The thread hands each step's text to the loop in one call. A job stops between two
steps once its `cancel` event is set: the client disconnected, or the server stops. Admission is decided
at once: a request that finds every slot busy and the queue full is refused, never parked; one admitted
waits for a slot at most a set time. /health turns "degraded" after DEGRADED_AFTER generations in a row
failed (the model's device lost, memory exhausted): a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generate import RepeatGuard, prompt_logits, sample_next
from ..load.preamble import StopScanner
from ..model import KVCache, SlotCache
from ..runtime import release_openmp_team
from .loader import Served
from .prefix import PrefixCache

log = logging.getLogger("enlace.serve")
DEGRADED_AFTER = 3  # failed generations in a row
PROMPT_CACHE = 2048  # positions of prompt KV kept for reuse by default (enlace serve --prompt-cache)
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
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k likeliest rivals


@dataclass
class Event:
    kind: str  # "text", "done" or "error"
    text: str = ""
    finish_reason: str | None = None  # done: "stop", "length" or "cancelled"
    usage: dict[str, Any] | None = None
    timings: dict[str, float] | None = None
    # text: each new token's {"token", "logprob", "top": [(token, logprob), ...]} when the request asked
    logprobs: list[dict[str, Any]] | None = None


class Job:
    def __init__(self, req: GenRequest):
        self.req = req
        self.cancel = threading.Event()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.state = "waiting"  # then "running" (the compute thread has it) or "gone" (left before a slot)
        self.started = 0.0  # when it got its slot (perf_counter)


@dataclass
class _Slot:
    """A running job as the compute thread holds it."""

    job: Job
    stop_ids: frozenset[int]
    guard: RepeatGuard
    gen: torch.Generator
    stream: Any  # a TextStream
    scan: StopScanner
    budget: int  # new tokens it may still generate in all
    ids: list[int] = field(default_factory=list)  # the tokens whose KV its row holds (prompt, then fed ones)
    cached: int = 0  # prompt positions copied from the prefix cache, not prefilled
    length: int = 0  # positions in its cache row
    token: int = 0  # the token the next step feeds
    n: int = 0
    first: float = 0.0
    last: float = 0.0
    finish: str = "length"


class Engine:
    """The served model behind `slots` rows of one compute thread and a waiting queue of `queue` requests."""

    def __init__(self, served: Served, slots: int = 1, queue: int = 16, prompt_cache: int = PROMPT_CACHE):
        """prompt_cache: positions of prompt KV kept for reuse (serve/prefix.py), 0 for none."""
        if slots < 1:
            raise ValueError(f"slots {slots}: must be at least 1")
        if queue < 0:
            raise ValueError(f"queue {queue}: must be >= 0")
        if prompt_cache < 0:
            raise ValueError(f"prompt_cache {prompt_cache}: must be >= 0")
        self.served, self.slots, self.queue = served, slots, queue
        self._free: asyncio.Semaphore | None = None  # made on the server's loop
        self.admitted = 0  # running + waiting; only the loop thread touches it
        self.running: set[Job] = set()
        self.consecutive_failures = 0
        self.stats = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "refused": 0,
                      "tokens_generated": 0, "prompt_tokens": 0, "prompt_tokens_cached": 0,
                      "prompt_cache_hits": 0}  # fmt: skip
        # Only the compute thread touches it; status() reads its size (a stale figure at worst).
        self._prefix = PrefixCache(prompt_cache) if prompt_cache else None
        # The compute thread's side: jobs handed over, the batch, its cache, events not yet delivered.
        self._wake = threading.Condition()
        self._incoming: list[Job] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._active: list[_Slot] = []
        self._cache: SlotCache | None = None
        self._outbox: list[tuple[Job, Event | None, tuple | None]] = []

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
        prefix = self._prefix
        cache = {"prompt_cache_limit": prefix.limit if prefix else 0,
                 "prompt_cache_tokens": prefix.tokens if prefix else 0}  # fmt: skip
        return {"slots": self.slots, "busy": busy, "queued": self.admitted - busy, "queue": self.queue,
                **self.stats, **cache, "consecutive_failures": self.consecutive_failures}  # fmt: skip

    def admit(self, req: GenRequest) -> Job:
        """A job holding a place in the queue; QueueFull at once when there is none."""
        if self.admitted >= self.slots + self.queue:
            self.stats["refused"] += 1
            raise QueueFull(f"{self.slots} generation slot(s) busy and {self.queue} request(s) waiting")
        self.admitted += 1
        self.stats["requests"] += 1
        return Job(req)

    async def start(self, job: Job, timeout: float) -> None:
        """Wait for a slot (QueueTimeout after `timeout` seconds), then hand the job to the compute thread.

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
        job.state, job.started = "running", time.perf_counter()
        self.running.add(job)
        with self._wake:
            if self._thread is None:
                release_openmp_team()  # the load's team: the compute thread's must be the only one
                self._thread = threading.Thread(target=self._run, name="enlace-compute", daemon=True)
                self._thread.start()
            self._incoming.append(job)
            self._wake.notify()

    async def events(self, job: Job) -> AsyncIterator[Event]:
        """The events of a started job until done or error.

        Closing or cancelling this iterator (the client went away) stops the generation at the next step.
        The slot and the queue place are given back when the compute thread lets the job go, not before.
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
        """The job's client is gone: a running job stops at its next step (the compute thread gives the place
        back); a waiting one gives its queue place back now. Idempotent."""
        job.cancel.set()
        if job.state == "waiting":
            job.state = "gone"
            self.admitted -= 1

    def _done(self, job: Job, finish: str | None, n: int, prompt: int = 0, cached: int = 0) -> None:
        """On the loop: the compute thread let the job go (finish None: it failed) after n new tokens, its
        prompt's `cached` positions of `prompt` copied from the prefix cache."""
        self.running.discard(job)
        self.admitted -= 1
        self.free.release()
        if finish is None:
            self.stats["failed"] += 1
            self.consecutive_failures += 1
            return
        self.stats["tokens_generated"] += n
        self.stats["prompt_tokens"] += prompt
        self.stats["prompt_tokens_cached"] += cached
        self.stats["prompt_cache_hits"] += cached > 0
        self.stats["cancelled" if finish == "cancelled" else "completed"] += 1
        if finish != "cancelled":
            self.consecutive_failures = 0

    # ---- the compute thread ----

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._incoming or self._active or self._closing):
                        self._wake.wait()
                    new, self._incoming = self._incoming, []
                    closing = self._closing
                for job in new:
                    self._join(job)
                if closing:
                    for slot in list(self._active):
                        slot.finish = "cancelled"
                        self._leave(slot)
                elif self._active:
                    self._step()
                self._deliver()
                if closing:
                    return

    def _post(self, job: Job, event: Event | None = None, done: tuple | None = None) -> None:
        self._outbox.append((job, event, done))

    def _deliver(self) -> None:
        """Hand the events of a step to the loop in one call (not one per token and stream)."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            batch[0][0].loop.call_soon_threadsafe(self._receive, batch)
        except RuntimeError:
            pass  # the loop has closed: nobody waits for these

    def _receive(self, batch: list[tuple[Job, Event | None, tuple | None]]) -> None:
        for job, event, done in batch:
            if event is not None:
                job.events.put_nowait(event)
            if done is not None:
                self._done(job, *done)

    def _fail(self, slots: list[_Slot]) -> None:
        """A bug or an out-of-memory: these requests fail with a generic line, the server goes on."""
        log.exception("generation failed")  # the details go to the log; the client gets a generic line
        for slot in slots:
            if slot in self._active:
                self._drop(slot)
            self._post(slot.job, Event("error", GENERIC_FAILURE), (None, slot.n))

    def _join(self, job: Job) -> None:
        """Prefill a new job into a free row and take its first token; it joins the batch unless it ended."""
        r, served = job.req, self.served
        stop_ids = frozenset(() if r.ignore_eos else served.eos_ids)
        guard = RepeatGuard(r.repetition_penalty, r.no_repeat_ngram, stop_ids, served.copy, r.prompt_ids)
        slot = _Slot(job=job, stop_ids=stop_ids, guard=guard,
                     gen=torch.Generator(device="cpu").manual_seed(r.seed), stream=None, scan=StopScanner([*r.stop, *served.stops], served.trim),
                     budget=min(r.max_tokens, served.context - len(r.prompt_ids)))  # fmt: skip
        if job.cancel.is_set():
            slot.finish = "cancelled"
            return self._finish(slot)
        try:
            slot.stream = served.stream(r.prompt_ids)
            cache = self._room(len(r.prompt_ids) + slot.budget)
            row = cache.cache.row(len(self._active))
            slot.cached = self._prefix.load(r.prompt_ids, row) if self._prefix else 0
            ids = torch.tensor([r.prompt_ids[slot.cached :]], device=served.device)
            logits = prompt_logits(served.model, ids, row)
            slot.ids, slot.length = list(r.prompt_ids), len(r.prompt_ids)
            if self._prefix is not None:  # at once: a request joining before this one ends reuses it too
                self._prefix.store(slot.ids, row, slot.length)
            self._active.append(slot)
            if not self._take(slot, logits):
                self._leave(slot)
        except Exception:
            self._fail([slot])

    def _room(self, need: int) -> SlotCache:
        """The slot cache, grown (doubling, up to the context) to hold `need` positions in a row."""
        have = self._cache.cache.max_len if self._cache is not None else 0
        if need <= have:
            return self._cache
        model, served = self.served.model, self.served
        size = min(max(need, 2 * have, 64), served.context)
        dtype = next(model.parameters()).dtype
        grown = KVCache.empty(model.cfg, self.slots, size, torch.device(served.device), dtype)
        if self._cache is not None:
            for old, new in zip(self._cache.cache.k + self._cache.cache.v, grown.k + grown.v, strict=True):
                new[:, :, :have] = old
        self._cache = SlotCache(grown, [])
        return self._cache

    def _step(self) -> None:
        """One forward over every active job's last token; each takes its next one or leaves."""
        slots = list(self._active)
        try:
            cache = self._cache
            cache.lengths = [s.length for s in slots]
            idx = torch.tensor([[s.token] for s in slots], device=self.served.device)
            logits = self.served.model(idx, cache=cache).logits[:, -1]
            for s in slots:
                s.ids.append(s.token)
                s.length += 1
            leaving = [s for i, s in enumerate(slots) if not self._take(s, logits[i : i + 1])]
        except Exception:
            return self._fail(slots)
        for s in leaving:
            self._leave(s)

    def _take(self, slot: _Slot, logits: torch.Tensor) -> bool:
        """Sample the slot's next token from its logits [1, V], as generate does; emit its text. Whether
        it goes on."""
        r = slot.job.req
        nxt = sample_next(slot.guard.apply(logits.cpu()), r.temperature, r.top_k, r.top_p, slot.gen)
        token = int(nxt.item())
        slot.last = time.perf_counter()
        if slot.n == 0:
            slot.first = slot.last
        slot.n += 1
        if token in slot.stop_ids:  # the model ended: what was held back as a possible stop is text
            slot.finish = "stop"
            return False
        slot.guard.push(token)
        text, hit = slot.scan.feed(slot.stream.push(token))
        if r.logprobs is not None:  # an event for each token, with or without text
            self._post(slot.job, Event("text", text, logprobs=[self._logprob(logits, token, r.logprobs)]))
        elif text:
            self._post(slot.job, Event("text", text))
        if hit:
            slot.finish = "stop"  # the text ends before the stop string: nothing held back is sent
            return False
        if slot.job.cancel.is_set():
            slot.finish = "cancelled"
            return False
        slot.token = token
        return slot.n < slot.budget

    def _logprob(self, logits: torch.Tensor, token: int, top: int) -> dict[str, Any]:
        """The model's log-probability of `token` (before temperature and the repetition controls, as vLLM
        and OpenAI give it) and the `top` likeliest tokens'."""
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        text = self.served.token_text
        rivals = torch.topk(lp, top) if top else None
        pairs = (
            zip(rivals.indices.tolist(), rivals.values.tolist(), strict=True) if rivals is not None else ()
        )
        return {"token": text(token), "logprob": float(lp[token]), "top": [(text(i), v) for i, v in pairs]}

    def _drop(self, slot: _Slot) -> None:
        """Take the slot out of the batch; the last active row moves into its row."""
        i, last = self._active.index(slot), len(self._active) - 1
        if i != last:
            moved = self._active[last]
            for t in self._cache.cache.k + self._cache.cache.v:
                t[i, :, : moved.length] = t[last, :, : moved.length]
            self._active[i] = moved
        self._active.pop()

    def _leave(self, slot: _Slot) -> None:
        if self._prefix is not None and not self._closing:  # its prompt and answer: the next turn's prefix
            self._prefix.store(slot.ids, self._cache.cache.row(self._active.index(slot)), slot.length)
        self._drop(slot)
        self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        """The job's last text, its usage and timings; then the loop gives its slot back."""
        r, n, finish = slot.job.req, slot.n, slot.finish
        tail = slot.scan.flush() if finish != "cancelled" else ""
        if tail:
            self._post(slot.job, Event("text", tail))
        first = slot.first or slot.job.started
        decode_s = (slot.last or first) - first
        timings = {
            "prompt_tokens": len(r.prompt_ids),
            "prompt_ms": (first - slot.job.started) * 1000,
            "completion_tokens": n,
            "decode_ms": decode_s * 1000,
            # The first token comes out of the prefill; the rate is that of the n - 1 decode steps after it.
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        }
        usage = {"prompt_tokens": len(r.prompt_ids), "completion_tokens": n, "total_tokens": len(r.prompt_ids) + n,
                 "prompt_tokens_details": {"cached_tokens": slot.cached}}  # fmt: skip
        done = (finish, n, len(r.prompt_ids), slot.cached)
        self._post(slot.job, Event("done", finish_reason=finish, usage=usage, timings=timings), done)
        log.info(
            "%d prompt (%d cached) + %d new tokens, %s, %.0f ms to the first token, %.1f tokens/s",
            len(r.prompt_ids), slot.cached, n, finish, timings["prompt_ms"], timings["decode_tokens_per_s"],
        )  # fmt: skip

    def close(self) -> None:
        """Stop every running generation at its next step and wait for the compute thread."""
        for job in list(self.running):
            job.cancel.set()
        with self._wake:
            self._closing = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
