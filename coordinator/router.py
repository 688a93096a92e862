"""One front door over several engine replicas (`--data-parallel-size N`): each replica is an
engine of its own (scheduler, block allocator, KV pool and store, worker group in its own
placement group), and the router sends each request to one of them.

The router stands where a single AsyncEngine would (ServerState, the gRPC and HTTP doors call the
same methods), so a client cannot tell how many replicas there are. The replicas' engines live in
this process, each with its own step thread, which lets the router read their allocators'
prefix-cache indexes directly: no hash publishing, no approximate copy of what each replica holds.

Routing (`--routing-policy`):

- `prefix` (the default with N > 1): the replica of least cost, where

      cost(r) = MISS_WEIGHT * uncached(r) + pending(r) + RUNNING_SEQ_TOKENS * running(r)

  `uncached(r)`: prompt tokens this request would compute on r, i.e. the prompt less its longest
  run of leading full blocks that r holds (device or CPU tier) or that the router has just sent
  to r (requests in flight share a prefix before any of it is cached); `pending(r)`: uncached
  prompt tokens of r's requests that have not produced their first token yet (the prefill work
  queued ahead of this one); `running(r)`: r's requests in flight. A token already queued costs
  one (this request waits for it); a token this request adds costs MISS_WEIGHT = 2 (this request
  waits for it, and so does every request queued behind it on r; recomputing a prefix another
  replica holds also spends cache room on a second copy). A running sequence is charged
  RUNNING_SEQ_TOKENS, about what one decoding sequence adds to each step of the engine, against
  prompt tokens in the same chunked step. So a long cached prefix wins unless its replica has
  about twice its length more work queued (measured: with a weight of 1, prefix routing kept 86%
  of one replica's hit rate on benchmarks/routing.py; see the README). When in-flight counts are badly
  imbalanced (max - min > IMBALANCE_ABS and max > IMBALANCE_REL * min, SGLang's router's
  trigger), the least loaded replica is taken whatever the prefixes say. Ties go to the replica
  that was sent fewer requests so far, so unrelated requests spread out.
- `least-loaded`: fewest requests in flight (then fewest pending tokens, then fewest routed so far).
- `round-robin`: in turn.

Prefill/decode disaggregation (`--prefill-replicas P --decode-replicas D`): replicas have roles,
and share one KV store (coordinator/kv_handoff.py). A request whose prompt has at least one full
block the decode side lacks, and at least `pd_min_prompt_tokens` tokens, first goes to a prefill
replica (by the same cost, among prefill replicas) as a prefill-only request: its full blocks but
the one holding the last token (`max_tokens=1`, its token discarded), published to the store under
a lease. Then a decode replica (by cost among decode replicas, which sees the published blocks
as cached) serves the whole request: it loads those blocks, computes the tail, samples the first
token and decodes; the client sees that one stream. The lease is released once the decode side
has produced a token, or when the request ends; leases older than `pd_kv_lease` are expired.
Shorter prompts, prompts the decode side holds already, and prompt-logprob requests go straight to
a decode replica. A prefill hop that fails (its replica stops, its step keeps crashing) only
means the decode replica computes the prompt itself (`pd_fallback_recomputes`); so does an expired
lease. With no decode replica serving, any serving replica decodes.

Faults: a replica's worker faults are recovered inside it (its engine rebuilds its workers);
while it rebuilds, new requests go to the others. A replica whose engine stops (its restart
budget spent, or its node gone) is taken out of routing and rebuilt from scratch in the
background; its requests in flight move to another replica: those with no output yet start
over, a single-sample request with output continues from its tokens (its prompt plus what it
has generated: greedy and seeded sampling give the same tokens they would have), and the rest
are ended UNAVAILABLE. The server fails only when no replica is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from coordinator.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError
from coordinator.engine import _first_line
from coordinator.kv_cache_manager import hash_block
from coordinator.outputs import RequestOutput
from coordinator.sampling_params import RequestOutputKind, SamplingParams
from coordinator.stats import combine_replica_stats, engine_stats

log = logging.getLogger("pagedserve.router")

ROUTING_POLICIES = ("prefix", "least-loaded", "round-robin")
RUNNING_SEQ_TOKENS = 16
MISS_WEIGHT = 2
IMBALANCE_ABS, IMBALANCE_REL = 64, 1.5
# Prefix blocks the router remembers having routed (hash -> replica), newest kept: enough for a
# few hundred distinct long prompts in flight at once.
ROUTED_PREFIX_BLOCKS = 65536
# A replica whose engine stopped is rebuilt up to this many times in RESTART_WINDOW_S seconds,
# each attempt RESTART_BACKOFF_S after the last; then it stays out.
MAX_REPLICA_RESTARTS, RESTART_WINDOW_S, RESTART_BACKOFF_S = 3, 600.0, 2.0
REBUILD_WAIT_AT_SHUTDOWN_S = 120.0


class Replica:
    """One engine replica as the router sees it: its engine, whether it takes requests, and the
    load the router has put on it."""

    def __init__(self, index: int, engine: AsyncEngine, role: str = ""):
        self.index = index
        self.engine = engine
        self.role = role  # "prefill", "decode", or "" (colocated)
        self.state = "serving"  # serving | restarting (its workers rebuild) | down | failed
        self.in_flight = 0  # requests routed here and not finished
        self.pending_tokens = 0  # uncached prompt tokens of those without a first token yet
        self.routed = 0
        self.restarts: list[float] = []  # when its engine was rebuilt

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` this replica's prefix cache holds (device or CPU tier). Read
        beside a running step: dict lookups, safe under the GIL, and a block evicted meanwhile
        only makes the estimate one block too kind."""
        kv = self.engine.llm_engine.scheduler.kv
        if not kv.enable_prefix_caching:
            return 0
        device, cpu = kv.pool, kv.cpu_pool
        n = 0
        for h in hashes:
            if device.lookup(h) is None and (cpu is None or cpu.lookup(h) is None):
                break
            n += 1
        return n


class Router:
    """The AsyncEngine interface over `engines`, one per replica. `rebuild(index)` makes a new
    AsyncEngine (started) for a replica whose engine stopped; it runs in a thread."""

    def __init__(self, engines: list[AsyncEngine], policy: str = "prefix", max_queued_requests: int = 1024,
                 rebuild: Callable[[int], AsyncEngine] | None = None, roles: list[str] | None = None,
                 handoff=None, pd_min_prompt_tokens: int = 0):
        """`roles` (one per engine: "prefill" or "decode") and `handoff` (their shared store, a
        coordinator.kv_handoff.HandoffStore) turn prefill/decode disaggregation on."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}; got {policy!r}")
        if not engines:
            raise ValueError("a router needs at least one replica")
        roles = roles or [""] * len(engines)
        self.replicas = [Replica(i, e, role) for i, (e, role) in enumerate(zip(engines, roles))]
        for replica in self.replicas:
            replica.engine.llm_engine.role = replica.role
        self.handoff = handoff
        self.pd_min_prompt_tokens = pd_min_prompt_tokens
        self.pd_handoffs = 0  # requests a prefill replica computed the prompt of
        self.pd_fallbacks = 0  # of which the decode side computed the whole prompt after all
        self.policy = policy
        self.max_queued_requests = max_queued_requests
        self._rebuild = rebuild
        self.block_size = engines[0].llm_engine.config.block_size
        self._routed_prefixes: OrderedDict[bytes, int] = OrderedDict()
        self._round_robin = itertools.count()
        self._ids = itertools.count()
        self._requests: set[str] = set()
        self._num_checking = 0
        self._restart_listeners: list = []
        self._stopped = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # Rebuilds whose engine is not (yet) a replica's: a stop cancels the task awaiting one,
        # not the rebuild, so stop() waits for what it still builds and ends it.
        self._rebuilds: set[asyncio.Future] = set()
        self._orphans: list[AsyncEngine] = []  # what those built, ended by stop()
        self.error: BaseException | None = None
        self.failovers = 0

    # ---- the AsyncEngine interface ------------------------------------------------------------
    def start(self) -> None:
        """Start every replica's engine loop (on this event loop) and watch it."""
        for replica in self.replicas:
            replica.engine.start()
            self._watch(replica)
        if self.handoff is not None:
            self._spawn(self._expire_leases())

    @property
    def llm_engine(self):
        """A serving replica's engine (the model name, tokenizer and input checks are the same in
        every replica)."""
        return next((r.engine for r in self.replicas if r.serving), self.replicas[0].engine).llm_engine

    def replica_engines(self) -> list[tuple[str, object]]:
        """(replica label, LLMEngine) of every replica with an engine: for the metrics."""
        return [(str(r.index), r.engine.llm_engine) for r in self.replicas if r.state != "failed"]

    @property
    def num_queued(self) -> int:
        return self._num_checking + sum(r.engine.num_queued for r in self.replicas if r.serving)

    def add_restart_listener(self, listener) -> None:
        """`await listener(True)` when no replica can take a request (all rebuilding), False when
        one can again."""
        self._restart_listeners.append(listener)

    async def generate(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                       request_id: str = "", priority: int = 0, messages: list[dict] | None = None,
                       timeout: float | None = None, chat_options: dict | None = None,
                       max_tokens_field: str | None = None) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.generate, on the replica the policy picks."""
        loop = asyncio.get_running_loop()
        expires = None if timeout is None else loop.time() + timeout
        self.check_accepting(request_id)
        self._num_checking += 1
        try:
            token_ids = await self.check_input(prompt, prompt_token_ids, params, priority, messages, chat_options,
                                               max_tokens_field)
        finally:
            self._num_checking -= 1
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._requests.add(request_id)
        try:
            async for out in self._serve(request_id, token_ids, params, priority, expires, prompt, timeout):
                yield out
        finally:
            self._requests.discard(request_id)

    def check_accepting(self, request_id: str = "") -> None:
        """AsyncEngine.check_accepting, for the cluster: EngineDeadError, ValueError (the id is
        taken) or QueueFullError when a new request would be refused now."""
        if self.error is not None:
            raise EngineDeadError(f"every replica has failed: {self.error!r}", request_id, self.error, in_flight=False)
        if request_id and request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.num_queued >= self.max_queued_requests:
            raise QueueFullError(f"the queue is full ({self.max_queued_requests} requests waiting)")

    async def check_input(self, *args, **kwargs) -> list[int]:
        """AsyncEngine.check_input, on a serving replica (every replica serves the same model)."""
        return await self._any_serving().engine.check_input(*args, **kwargs)

    async def reset_prefix_cache(self) -> bool:
        """Every serving replica's prefix cache forgotten (True only if none had a block in use),
        and the routes the router remembered by prefix with them."""
        done = await asyncio.gather(*(r.engine.reset_prefix_cache() for r in self.replicas if r.serving))
        self._routed_prefixes.clear()
        return all(done)

    async def stats(self) -> dict:
        """The cluster's totals (engine_stats' keys), the routing figures, and per replica
        replica.<i>.<key> for REPLICA_KEYS plus whether it serves and what was routed to it."""
        live = [r for r in self.replicas if r.state in ("serving", "restarting")]
        total = combine_replica_stats([r.engine.llm_engine for r in live])
        total["num_queued"] = self.num_queued
        total["num_replicas"] = len(self.replicas)
        total["replicas_serving"] = sum(r.serving for r in self.replicas)
        total["replica_restarts"] = sum(len(r.restarts) for r in self.replicas)
        total.update(self.cluster_counters())
        if self.handoff is not None:
            total.update(self.handoff.stats())
        for r in self.replicas:
            prefix = f"replica.{r.index}."
            total[prefix + "serving"] = int(r.serving)
            total[prefix + "routed"] = r.routed
            total[prefix + "in_flight"] = r.in_flight
            if r in live:
                stats = engine_stats(r.engine.llm_engine)
                stats["num_queued"] = r.engine.num_queued
                total.update({prefix + key: stats[key] for key in REPLICA_KEYS})
        return total

    def cluster_counters(self) -> dict:
        """The router's own lifetime counters (for GetStats and /metrics)."""
        out = {"requests_failed_over": self.failovers}
        if self.handoff is not None:
            out.update(pd_handoffs=self.pd_handoffs, pd_fallback_recomputes=self.pd_fallbacks,
                       pd_store_restarts=self.handoff.restarts)
        return out

    async def drain(self, timeout: float) -> int:
        return sum(await asyncio.gather(*(r.engine.drain(timeout) for r in self.replicas)))

    async def wait_stopped(self) -> BaseException | None:
        await self._stopped.wait()
        return self.error

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._orphans = await self._finish_rebuilds()
        engines = [r.engine for r in self.replicas] + self._orphans
        await asyncio.gather(*(e.stop() for e in engines), return_exceptions=True)
        self._stopped.set()

    async def _finish_rebuilds(self) -> list[AsyncEngine]:
        """The engines of rebuilds still running as the router stops: stopping cancels the tasks
        that await them, not their threads, and what those build holds workers and CPUs."""
        built = []
        for future in list(self._rebuilds):
            try:
                built.append(await asyncio.wait_for(future, REBUILD_WAIT_AT_SHUTDOWN_S))
            except Exception as e:  # it failed (and released what it had), or it hangs
                log.warning("a replica rebuilt while the router stopped did not finish: %r", e)
        self._rebuilds.clear()
        return built

    def shutdown_engines(self) -> None:
        """Release every replica's workers and KV store (blocking: call in a thread), and those
        of a rebuild that finished as the router stopped."""
        for engine in [r.engine for r in self.replicas] + self._orphans:
            _shutdown_quietly(engine)
        if self.handoff is not None:
            self.handoff.close()

    # ---- routing ------------------------------------------------------------------------------
    def _any_serving(self) -> Replica:
        replica = next((r for r in self.replicas if r.serving), None)
        if replica is None:
            raise EngineDeadError("no replica is serving now (workers restarting); retry shortly", "",
                                  RuntimeError("no replica"), in_flight=False)
        return replica

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The prompt's full blocks' chained hashes, as every replica's allocator computes them."""
        hashes, bs = [], self.block_size
        for i in range(len(token_ids) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def choose(self, token_ids: list[int], hashes: list[bytes] = (), role: str = "") -> tuple[Replica, int]:
        """(replica, prompt tokens it must compute) under the policy, among serving replicas (of
        `role`, when one serves; else any); `hashes`: the prompt's block hashes (block_hashes),
        which the prefix policy weighs."""
        candidates = [r for r in self.replicas if r.serving]
        if role and any(r.role == role for r in candidates):
            candidates = [r for r in candidates if r.role == role]
        if not candidates:
            raise EngineDeadError("no replica can take the request now (workers restarting or replicas "
                                  "down); retry shortly", "", RuntimeError("no replica"), in_flight=False)
        if self.policy == "round-robin":
            return candidates[next(self._round_robin) % len(candidates)], len(token_ids)
        if self.policy == "least-loaded":
            return min(candidates, key=lambda r: (r.in_flight, r.pending_tokens, r.routed, r.index)), len(token_ids)
        loads = [r.in_flight for r in candidates]
        if max(loads) - min(loads) > IMBALANCE_ABS and max(loads) > IMBALANCE_REL * min(loads):
            best = min(candidates, key=lambda r: (r.in_flight, r.pending_tokens, r.routed, r.index))
            return best, len(token_ids) - self.block_size * self._matched_blocks(best, hashes)
        best, best_cost, best_uncached = None, None, 0
        for r in candidates:
            uncached = len(token_ids) - self.block_size * self._matched_blocks(r, hashes)
            cost = MISS_WEIGHT * uncached + r.pending_tokens + RUNNING_SEQ_TOKENS * r.in_flight
            if best is None or cost < best_cost or (cost == best_cost and r.routed < best.routed):
                best, best_cost, best_uncached = r, cost, uncached
        return best, best_uncached

    def _matched_blocks(self, replica: Replica, hashes: list[bytes]) -> int:
        cached = replica.cached_blocks(hashes)
        routed = 0
        for h in hashes:
            if self._routed_prefixes.get(h) != replica.index:
                break
            routed += 1
        return max(cached, routed)

    def _remember_route(self, hashes: list[bytes], replica: Replica) -> None:
        for h in hashes:
            self._routed_prefixes[h] = replica.index
            self._routed_prefixes.move_to_end(h)
        while len(self._routed_prefixes) > ROUTED_PREFIX_BLOCKS:
            self._routed_prefixes.popitem(last=False)

    # ---- serving one request, moving it if its replica stops -----------------------------------
    async def _serve(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int,
                     expires: float | None, prompt: str | None, timeout: float | None) -> AsyncIterator[RequestOutput]:
        lease = None  # the prefill hop's lease key, until the decode side has produced a token
        handed = 0  # prompt blocks a prefill replica was asked to hand over
        # A replica streams every step even to a FINAL_ONLY request: the routing's load, the
        # handoff's lease and a failover's continuation all follow its first token; the client
        # gets the last output alone, whole.
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        if final_only:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        try:
            if self.handoff is not None:
                lease, handed = await self._prefill_hop(request_id, token_ids, params, priority, expires, timeout)
            async for out in self._decode(request_id, token_ids, params, priority, expires, prompt, timeout,
                                          lease is not None):
                if lease is not None:
                    self.handoff.release(lease)
                    lease = None
                    if out.metrics is not None and out.metrics.num_cached_tokens < handed * self.block_size:
                        self.pd_fallbacks += 1  # the lease expired, or a block failed its checksum
                if final_only:
                    if not out.finished:
                        continue
                    out = _whole(out)
                yield out
        finally:
            if lease is not None:
                self.handoff.release(lease)

    async def _prefill_hop(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int,
                           expires: float | None, timeout: float | None) -> tuple[str | None, int]:
        """Have a prefill replica publish the prompt's full blocks (all but the one holding the
        last token) when that is worth a hop; returns (lease key, blocks asked for), or (None, 0)
        when the request goes straight to a decode replica. A failed hop is not the request's
        failure: the decode side computes the prompt itself."""
        bs = self.block_size
        full = (len(token_ids) - 1) // bs
        if full == 0 or len(token_ids) < self.pd_min_prompt_tokens or params.prompt_logprobs is not None:
            return None, 0
        hashes = self.block_hashes(token_ids[:full * bs])
        decoders = [r for r in self.replicas if r.serving and r.role == "decode"]
        prefillers = [r for r in self.replicas if r.serving and r.role == "prefill"]
        if not prefillers or not decoders or max(r.cached_blocks(hashes) for r in decoders) >= full:
            return None, 0  # no one to hop to, or the decode side has the prompt already
        replica, uncached = self.choose(token_ids[:full * bs], hashes, role="prefill")
        key = f"{request_id}:prefill"
        replica.routed += 1
        replica.in_flight += 1
        replica.pending_tokens += uncached
        self.pd_handoffs += 1
        try:
            stream = replica.engine.generate_checked(token_ids[:full * bs], SamplingParams(temperature=0.0, max_tokens=1),
                                                     key, priority, expires, None, timeout, publish_kv=True)
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    pass
        except (EngineDeadError, RequestFailedError) as e:
            if isinstance(e, EngineDeadError) and (e.in_flight or replica.engine.error is not None):
                self._replica_stopped(replica, e.cause)
            log.warning("the prefill hop of request %s failed on replica %d (%s); its decode replica computes "
                        "the prompt", request_id, replica.index, _first_line(e))
        finally:
            replica.in_flight -= 1
            replica.pending_tokens -= uncached
        if self.handoff.lease_blocks(key) == 0:
            self.handoff.release(key)
            self.pd_fallbacks += 1
            return None, 0
        return key, full

    async def _expire_leases(self) -> None:
        """Expire handoff leases nobody claimed in time (their requests recompute), and replace
        the shared store if it died."""
        while True:
            await asyncio.sleep(min(1.0, self.handoff.lease_seconds / 4))
            if not self.handoff.alive():
                await self._restart_handoff_store()
                continue
            expired = self.handoff.expire()
            if expired:
                log.warning("%d handoff leases expired unclaimed (their decode replicas recompute): %s",
                            len(expired), ", ".join(expired[:5]))

    async def _restart_handoff_store(self) -> None:
        """A new store in place of the dead one: every replica attaches it at its next step, and
        routing uses it at once. Meanwhile (and if it cannot start: retried each sweep) requests
        whose KV was in the dead store recompute on their decode replica."""
        dead = self.handoff
        try:
            new = await asyncio.get_running_loop().run_in_executor(None, dead.restarted)
        except Exception as e:  # noqa: BLE001 - the cluster serves on, every prompt computed where it decodes
            log.error("the prefill/decode KV store died and could not be restarted (retrying): %s", e)
            return
        self.handoff = new
        for replica in self.replicas:
            replica.engine.llm_engine.offer_handoff_store(new)
        dead.close()
        log.warning("the prefill/decode KV store died; restarted it (%d restarts)", new.restarts)

    async def _decode(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int,
                      expires: float | None, prompt: str | None, timeout: float | None,
                      handed_over: bool) -> AsyncIterator[RequestOutput]:
        """The request on the replica the policy picks (a decode replica under P/D), moved to
        another when that one's engine stops."""
        delivered: RequestOutput | None = None  # the last output the client got
        run_ids, run_params = token_ids, params
        role = "decode" if self.handoff is not None else ""
        while True:  # once, or again on another replica after this one's engine stopped
            # Hashed once per route, and only where the policy weighs prefixes (or a handoff).
            hashes = self.block_hashes(run_ids) if self.policy == "prefix" or handed_over else []
            replica, uncached = self.choose(run_ids, hashes, role)  # a stopped replica is out of routing
            self._remember_route(hashes, replica)
            replica.routed += 1
            replica.in_flight += 1
            replica.pending_tokens += uncached
            waiting_first = True
            try:
                stream = replica.engine.generate_checked(run_ids, run_params, request_id, priority, expires,
                                                         prompt, timeout)
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        if waiting_first:
                            replica.pending_tokens -= uncached
                            waiting_first = False
                        if run_ids is not token_ids:
                            out = _continued(out, token_ids, delivered)
                        delivered = out
                        yield out
                return
            except EngineDeadError as e:
                if not e.in_flight and replica.engine.error is None:
                    raise  # drained as the server stops: not a replica fault
                self._replica_stopped(replica, e.cause)
                if delivered is not None and not _continuable(params):
                    raise EngineDeadError(
                        f"replica {replica.index} failed while serving request {request_id!r}, and a request "
                        f"with several samples, beams or a grammar cannot continue elsewhere: {e.cause!r}",
                        request_id, e.cause, in_flight=False) from None
                self.failovers += 1
                log.warning("replica %d stopped under request %s; it moves to another replica (%d tokens "
                            "generated so far)", replica.index, request_id,
                            0 if delivered is None else len(delivered.outputs[0].token_ids))
                if delivered is not None:
                    done = delivered.outputs[0].token_ids
                    run_ids = token_ids + list(done)
                    run_params = dataclasses.replace(params, max_tokens=None if params.max_tokens is None
                                                     else params.max_tokens - len(done),
                                                     min_tokens=max(0, params.min_tokens - len(done)),
                                                     prompt_logprobs=None)
            finally:
                replica.in_flight -= 1
                if waiting_first:
                    replica.pending_tokens -= uncached

    # ---- replica faults -----------------------------------------------------------------------
    def _watch(self, replica: Replica) -> None:
        engine = replica.engine
        engine.add_restart_listener(lambda restarting: self._workers_restarting(replica, engine, restarting))

        async def watch():
            error = await engine.wait_stopped()
            if error is not None and replica.engine is engine:
                self._replica_stopped(replica, error)

        self._spawn(watch())

    async def _workers_restarting(self, replica: Replica, engine: AsyncEngine, restarting: bool) -> None:
        if replica.engine is not engine or replica.state not in ("serving", "restarting"):
            return
        before = any(r.serving for r in self.replicas)
        replica.state = "restarting" if restarting else "serving"
        await self._tell_listeners(before)

    async def _tell_listeners(self, before: bool) -> None:
        after = any(r.serving for r in self.replicas)
        if after != before:
            for listener in self._restart_listeners:
                await listener(not after)

    def _replica_stopped(self, replica: Replica, error: BaseException | None) -> None:
        if replica.state in ("down", "failed"):
            return
        before = any(r.serving for r in self.replicas)
        replica.state = "down"
        log.error("replica %d stopped (%r); it is out of routing and will be rebuilt", replica.index, error)
        self._spawn(self._tell_listeners(before))
        self._spawn(self._restart(replica, error))

    async def _restart(self, replica: Replica, error: BaseException | None) -> None:
        loop = asyncio.get_running_loop()
        old = replica.engine
        await old.stop()
        await loop.run_in_executor(None, _shutdown_quietly, old)
        while True:
            now = time.monotonic()
            replica.restarts = [t for t in replica.restarts if now - t < RESTART_WINDOW_S]
            if self._rebuild is None or len(replica.restarts) >= MAX_REPLICA_RESTARTS:
                replica.state = "failed"
                log.error("replica %d is left out for good (%d rebuilds in %g s)", replica.index,
                          len(replica.restarts), RESTART_WINDOW_S)
                if all(r.state == "failed" for r in self.replicas):
                    self.error = error or RuntimeError("every replica failed")
                    self._stopped.set()
                return
            replica.restarts.append(now)
            await asyncio.sleep(RESTART_BACKOFF_S)
            future = loop.run_in_executor(None, self._rebuild, replica.index)
            self._rebuilds.add(future)
            try:
                # Shielded: a stop cancels this task, not the rebuild; stop() ends what it builds.
                engine = await asyncio.shield(future)
            except Exception as e:
                self._rebuilds.discard(future)
                log.error("replica %d could not be rebuilt: %r", replica.index, e)
                error = e
                continue
            self._rebuilds.discard(future)
            before = any(r.serving for r in self.replicas)
            replica.engine, replica.state = engine, "serving"
            replica.in_flight = replica.pending_tokens = 0
            self._watch(replica)
            log.warning("replica %d serves again", replica.index)
            await self._tell_listeners(before)
            return

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# Per-replica keys GetStats reports as replica.<i>.<key>, beside the cluster's totals.
REPLICA_KEYS = ("num_running", "num_waiting", "num_swapped", "num_queued", "kv_usage", "kv_blocks_used",
                "kv_blocks_total", "prefix_cache_hits", "prefix_cache_queries", "generation_tokens",
                "prompt_tokens", "worker_restarts")


def _continuable(params: SamplingParams) -> bool:
    """Whether a request can go on from its tokens on another replica: one sample, no beams, no
    grammar (whose matcher state would have to be rebuilt there)."""
    return (params.n == 1 and (params.best_of or 1) == 1 and not params.use_beam_search
            and params.structured_outputs is None)


def _continued(out: RequestOutput, prompt_ids: list[int], before: RequestOutput | None) -> RequestOutput:
    """An output of a request continued on another replica, as the client's stream expects it:
    the original prompt, and the tokens, text and logprobs generated before the move in front."""
    if before is None:
        return out
    done = before.outputs[0]
    c = out.outputs[0]
    c.token_ids = list(done.token_ids) + list(c.token_ids)
    c.text = done.text + c.text
    if c.logprobs is not None and done.logprobs is not None:
        c.logprobs = list(done.logprobs) + list(c.logprobs)
    if c.cumulative_logprob is not None and done.cumulative_logprob is not None:
        c.cumulative_logprob += done.cumulative_logprob
    out.prompt_token_ids = prompt_ids
    out.prompt_logprobs = before.prompt_logprobs
    return out


def _whole(out: RequestOutput) -> RequestOutput:
    """A finished output as a FINAL_ONLY request's only one: each sample's delta is all of it."""
    for c in out.outputs:
        c.delta_token_ids, c.delta_text = list(c.token_ids), c.text
    if out.outputs:
        out.delta_token_ids, out.delta_text = out.outputs[0].delta_token_ids, out.outputs[0].delta_text
    return out


def _shutdown_quietly(engine: AsyncEngine) -> None:
    try:
        engine.llm_engine.shutdown()
    except Exception as e:  # its workers may be gone with their node
        log.warning("a stopped replica's engine did not shut down cleanly: %r", e)
