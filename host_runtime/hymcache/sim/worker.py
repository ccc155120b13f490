"""A vLLM-like serving worker (v1 scheduler, one GPU) and the benchmark client, as simulation processes.

Worker, one step at a time (``Worker.run``):

1. schedule with a token budget of ``max_num_batched_tokens`` (chunked prefill): running requests
   first (a decode token each, or the next chunk of their prefill), then waiting requests first come
   first served while ``max_num_seqs`` allows. A waiting request is looked up once: the GPU prefix
   cache's longest hit, then the remote tier beyond it (``RemoteTier.lookup``); it is admitted if the
   GPU's KV cache can hold its blocks (evicting free cached blocks), else it waits (head of line);
2. the KV connector's loads of newly admitted requests, synchronously (``start_load_kv``: the
   connector loads before the forward; LMCache's non-layerwise mode does the same). A block not
   loaded is recomputed: the request's computed prefix stops there;
3. stores of requests whose prefill completes in this step are reserved (copies run during the
   forward), the forward runs (``gpu.StepModel``), then the stores are written (``wait_for_save``);
4. outputs: a request whose prefill completed has its first token (TTFT) at the end of the step,
   its newly full blocks join the GPU prefix cache; after ``max_tokens`` tokens it finishes, its
   blocks go free (tail first), the tier is told.

Prefix lookups never include the prompt's last token (it must be computed to give the logits), as
vLLM and the connector do: ``lookup_blocks = (input - 1) // tokens_per_block``.

Two clients (``workload.client``):

* ``turn-barrier`` (``client``): the turns one after another, a barrier between them; each turn's
  requests in conversation order, at most ``concurrency`` in flight. Turn t of every conversation
  is served before turn t + 1 of any: the reuse distance of a conversation's prefix is a whole
  turn of every conversation (an LMSYS-style replay measured turn by turn, Fig. 13).
* ``per-session`` (``session_client``): AIPerf's multi-turn mode -- ``concurrency`` sessions in
  flight, each a conversation whose next turn is sent when its previous turn's response is in
  (plus ``turn_delay``), no barrier across conversations; a session that ends takes the next
  conversation (in conversation order). Source: AIPerf docs/tutorials/multi-turn.md, "Execution
  Flow" (turn 1, wait for the response, the turn delay, turn 2 with the history, ...) and its
  example (``--conversation-num 10 --concurrency 2``: "2 conversations will run concurrently").

Both report per turn index (turn t's rows: every conversation's turn t, whenever it ran).

A Mooncake trace (``workload.kind = mooncake``) has its own, open-loop client (``open_client``): each
request is submitted at its timestamp, however many are in flight; its rows are windows of arrival time.

Each request records when its connector load ran (``load_start``, ``load_end``): the report's read
bandwidth while loading and its peak come from these spans.
"""

from __future__ import annotations

from collections import deque

from .events import Env


class Request:
    __slots__ = ("rid", "conv", "turn", "input", "max_tokens", "full_blocks", "lookup_blocks", "reusable_blocks",
                 "gpu_hit", "remote_hit", "loaded", "computed", "generated", "looked_up", "alloc_blocks",
                 "cached", "arrival", "first_token", "finish", "done", "read_bytes", "write_bytes",
                 "skipped_inserts", "timeouts", "new_load", "computed_tokens", "shared_blocks", "worker",
                 "decode_tokens", "decoded", "prefill_done", "kv_arrived", "decode_blocks", "keys", "load_start",
                 "load_end")

    def __init__(self, turn, tokens_per_block: int, max_tokens: int, done, decode_tokens: int = 0):
        self.rid = f"c{turn.conversation}-t{turn.turn}"
        self.conv, self.turn = turn.conversation, turn.turn
        self.input, self.max_tokens = turn.input_tokens, max_tokens
        self.full_blocks = turn.input_tokens // tokens_per_block
        self.lookup_blocks = (turn.input_tokens - 1) // tokens_per_block
        # blocks of a shared prefix (every conversation's first tokens): keyed alike across conversations
        self.shared_blocks = getattr(turn, "shared_tokens", 0) // tokens_per_block
        self.worker = getattr(turn, "worker", 0)
        # a trace's block keys (each names its prefix, as a Mooncake hash id); () for the generated workloads,
        # whose keys are (owner, position)
        self.keys = getattr(turn, "keys", ())
        # blocks an earlier request computed: the previous turn's full input blocks (and the shared prefix)
        self.reusable_blocks = min(max(turn.prev_input_tokens // tokens_per_block, self.shared_blocks),
                                   self.lookup_blocks)
        self.gpu_hit = self.remote_hit = self.loaded = self.computed = self.generated = 0
        self.looked_up = False
        self.alloc_blocks = 0
        self.cached: list = []
        self.arrival = self.first_token = self.finish = 0.0
        self.done = done
        self.read_bytes = self.write_bytes = self.skipped_inserts = self.timeouts = 0
        self.new_load = 0
        self.computed_tokens = 0  # prefill tokens the GPU computed for it
        # PD: tokens the decode worker generates after the prefill worker's first one (0: no decode stage)
        self.decode_tokens, self.decoded, self.decode_blocks = decode_tokens, 0, 0
        self.prefill_done = self.kv_arrived = 0.0
        self.load_start = self.load_end = 0.0  # the connector's load of this request (equal: none)

    def owner(self, i: int) -> int:
        """Whose block ``i`` is: -1 for the shared prefix (the same key in every conversation), else the conversation."""
        return -1 if i < self.shared_blocks else self.conv

    def gpu_key(self, i: int) -> int:
        if self.keys:
            return self.keys[i]
        return ((self.owner(i) + 1) << 24) | i

    def gpu_keys(self, lo: int, hi: int) -> list:
        """``[gpu_key(i) for i in range(lo, hi)]``, without a call per block."""
        if self.keys:
            return list(self.keys[lo:hi])
        shared = min(max(self.shared_blocks, lo), hi)
        own = (self.conv + 1) << 24
        return list(range(lo, shared)) + [own | i for i in range(shared, hi)]  # the shared prefix: owner -1


class _Sleeper:
    """A worker's loop that sleeps on ``_wake`` (an event) while it has nothing to do."""

    _wake = None

    def _wakeup(self) -> None:
        if self._wake is not None:
            wake, self._wake = self._wake, None
            wake.succeed()


class Worker(_Sleeper):
    def __init__(self, env: Env, step_model, gpu_cache, tier, *, tokens_per_block: int, max_num_batched_tokens: int,
                 max_num_seqs: int, handoff=None):
        self.env, self.step_model, self.gpu, self.tier = env, step_model, gpu_cache, tier
        # PD prefill: ``handoff(req, release)`` takes a request whose prefill is done; its GPU blocks stay held
        # until ``release()`` (the decode worker has pulled its KV), as vLLM's P/D connectors delay the free
        self.handoff = handoff
        self.handed = 0
        self.B = tokens_per_block
        self.budget, self.max_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._wake = None
        self.steps = 0
        self.busy_ns = 0.0
        self.load_ns = 0.0
        self.load_spans: list[tuple[float, float]] = []  # (start, end) of each step's connector loads

    def submit(self, req: Request) -> None:
        req.arrival = self.env.now
        self.waiting.append(req)
        self._wakeup()

    def _look_up(self, r: Request) -> None:
        r.looked_up = True
        keys = r.gpu_keys(0, r.lookup_blocks)
        r.gpu_hit = self.gpu.match(keys)
        r.remote_hit = self.tier.lookup(r)

    def run(self):
        env, B, gpu, tier = self.env, self.B, self.gpu, self.tier
        while True:
            if not self.waiting and not self.running:
                self._wake = env.event()
                yield self._wake
                continue
            budget = self.budget
            chunks: list[tuple[Request, int]] = []  # (request, tokens this step)
            for r in self.running:
                if budget <= 0:
                    break
                n = min(budget, r.input - r.computed) if r.computed < r.input else 1
                chunks.append((r, n))
                budget -= n
            admitted = []
            while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
                r = self.waiting[0]
                if not r.looked_up:
                    self._look_up(r)
                blocks = -(-(r.input + r.max_tokens) // B)
                hit = r.gpu_keys(0, r.gpu_hit)
                if not gpu.allocate(hit, blocks - r.gpu_hit):
                    if not self.running and not self.handed:
                        raise ValueError(f"request {r.rid} needs {blocks} KV blocks; the GPU's KV cache holds "
                                         f"{gpu.capacity} (raise gpu_memory_utilization or use a smaller model)")
                    break
                self.waiting.popleft()
                self.running.append(r)
                r.alloc_blocks, r.cached = blocks, hit
                r.new_load = r.remote_hit
                r.computed = (r.gpu_hit + r.remote_hit) * B
                n = min(budget, r.input - r.computed)
                chunks.append((r, n))
                admitted.append(r)
                budget -= n
            if not chunks:
                self._wake = env.event()
                yield self._wake
                continue
            t0 = env.now
            # the connector's loads, before the forward
            for r in admitted:
                if r.new_load:
                    r.load_start = env.now
                    loaded = yield from tier.load(r, r.new_load)
                    r.load_end = env.now
                    r.loaded = loaded
                    self._cache(r, r.gpu_hit + loaded)
                    if loaded < r.new_load:  # recompute from the first block not loaded
                        r.computed = (r.gpu_hit + loaded) * B
                    r.new_load = 0
                else:
                    tier.finish(r)  # nothing to load: the Manager forgets its hint now (update_state_after_alloc)
            self.load_ns += env.now - t0
            if env.now > t0:
                self.load_spans.append((t0, env.now))
            # what this step computes (positions may have moved back after a failed load)
            spans = []
            completing = []
            for r, n in chunks:
                if r.computed < r.input:
                    n = min(n, r.input - r.computed)
                    spans.append((r.computed, n))
                    if r.computed + n >= r.input:
                        completing.append(r)
                else:
                    spans.append((r.input + r.generated - 1, 1))
            for r in completing:
                tier.reserve_store(r)
            yield env.now + self.step_model.step_ns(spans)
            for r in completing:
                yield from tier.store(r)
            self.steps += 1
            self.busy_ns += env.now - t0
            now = env.now
            for (r, _), (start, n) in zip(chunks, spans):
                if r.computed < r.input:
                    r.computed_tokens += n
                    r.computed = start + n
                    self._cache(r, min(r.computed // B, r.full_blocks))
                    if r.computed >= r.input:
                        r.generated = 1
                        r.first_token = now
                else:
                    r.generated += 1
                if r.generated >= r.max_tokens:
                    self._finish(r)

    def _cache(self, r: Request, upto: int) -> None:
        """``r``'s blocks up to ``upto`` are full and computed (or loaded): into the GPU prefix cache."""
        if self.gpu.caching and upto > len(r.cached):
            keys = r.gpu_keys(len(r.cached), upto)
            self.gpu.cache(keys)
            r.cached.extend(keys)

    def _finish(self, r: Request) -> None:
        self.running.remove(r)
        self.tier.finish(r)
        if self.handoff is not None:  # PD: the decode worker takes it; the blocks stay until it has the KV
            r.prefill_done = self.env.now
            self.handed += 1
            self.handoff(r, lambda: self._release(r))
            return
        self.gpu.free(r.cached, r.alloc_blocks - len(r.cached))
        r.finish = self.env.now
        r.done.succeed(r)

    def _release(self, r: Request) -> None:
        self.handed -= 1
        self.gpu.free(r.cached, r.alloc_blocks - len(r.cached))
        self._wakeup()


class DecodeWorker(_Sleeper):
    """The PD decode worker (vLLM with a P/D connector, decode side): a request whose prefill is done waits
    here FIFO; it is admitted when ``max_num_seqs`` and the GPU's KV cache (its prompt + ``decode_tokens``)
    allow, then its KV is pulled from the prefill worker (``pull(req)``: a process over the P->D links; the
    prefill worker frees its blocks when it lands); it joins the decode batch once its KV is in. Every step
    decodes one token of every running request (``StepModel``: memory-bound); the first decoded token is
    the client's first token (TTFT), the last one ends the request."""

    def __init__(self, env: Env, step_model, capacity_blocks: int, *, tokens_per_block: int, max_num_seqs: int,
                 pull):
        self.env, self.step_model, self.capacity = env, step_model, capacity_blocks
        self.B, self.max_seqs, self.pull = tokens_per_block, max_num_seqs, pull
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.arriving = 0
        self.used = 0
        self.peak_used = 0
        self.steps = 0
        self.busy_ns = 0.0
        self._wake = None

    def submit(self, req: Request) -> None:
        self.waiting.append(req)
        self._wakeup()

    def _pull(self, r: Request):
        yield from self.pull(r)
        r.kv_arrived = self.env.now
        self.arriving -= 1
        self.running.append(r)
        self._wakeup()

    def run(self):
        env, B = self.env, self.B
        while True:
            while self.waiting and len(self.running) + self.arriving < self.max_seqs:
                r = self.waiting[0]
                blocks = -(-(r.input + r.decode_tokens) // B)
                if self.used + blocks > self.capacity:
                    if not self.running and not self.arriving:
                        raise ValueError(f"request {r.rid} needs {blocks} KV blocks; the decode worker's KV cache "
                                         f"holds {self.capacity}")
                    break
                self.waiting.popleft()
                self.used += blocks
                self.peak_used = max(self.peak_used, self.used)
                r.decode_blocks = blocks
                self.arriving += 1
                env.process(self._pull(r))
            if not self.running:
                self._wake = env.event()
                yield self._wake
                continue
            t0 = env.now
            batch = list(self.running)
            yield env.now + self.step_model.step_ns([(r.input + r.decoded, 1) for r in batch])
            self.steps += 1
            self.busy_ns += env.now - t0
            now = env.now
            for r in batch:
                r.decoded += 1
                if r.decoded == 1:
                    r.first_token = now
                if r.decoded >= r.decode_tokens:
                    self.running.remove(r)
                    self.used -= r.decode_blocks
                    r.finish = now
                    r.done.succeed(r)


def _serve(env: Env, workers: list, turn, tokens_per_block: int, max_tokens: int, decode_tokens: int, on_done):
    """One request of ``turn`` on its worker until it is answered, then ``on_done``: the clients' one way to
    submit. A turn with its own answer length (``Turn.output_tokens``, a trace's) decodes that many tokens: on the
    decode worker in PD (in place of ``decode_tokens``), else in place of ``max_tokens``."""
    answer = turn.output_tokens
    if answer is not None:
        if decode_tokens:
            decode_tokens = answer
        else:
            max_tokens = answer
    req = Request(turn, tokens_per_block, max_tokens, env.event(), decode_tokens)
    workers[req.worker % len(workers)].submit(req)
    yield req.done
    on_done(req)


def client(env: Env, turns, workers, *, concurrency: int, tokens_per_block: int, max_tokens: int,
           on_turn_start, on_done, decode_tokens: int = 0):
    """Turn by turn, a barrier between turns; each turn's requests in order, ``concurrency`` in flight.
    ``workers``: one worker, or the prefill workers (a request goes to its conversation's, ``Turn.worker``).
    ``decode_tokens``: PD: the prefill worker computes the prompt (``max_tokens`` 1), the decode worker
    the rest."""
    if not isinstance(workers, (list, tuple)):
        workers = [workers]
    for t, batch in enumerate(turns, 1):
        on_turn_start(t, env.now)
        queue = deque(batch)

        def slot():
            while queue:
                yield from _serve(env, workers, queue.popleft(), tokens_per_block, max_tokens, decode_tokens, on_done)

        slots = [env.process(slot()) for _ in range(min(concurrency, len(batch)))]
        for s in slots:
            yield s.done


def session_client(env: Env, turns, workers, *, concurrency: int, tokens_per_block: int, max_tokens: int,
                   on_turn_start, on_done, decode_tokens: int = 0, turn_delay_ns: float = 0.0):
    """AIPerf's multi-turn client (module docstring): ``concurrency`` sessions, each runs one conversation's
    turns back to back -- turn k + 1 is submitted ``turn_delay_ns`` after turn k's last token -- then takes the
    next conversation. ``turns[t - 1]``: turn t of every conversation (as ``client``); ``on_turn_start(t, now)``
    fires when the first request of turn t is submitted (turn indices start in order: a conversation's turn
    t + 1 follows its turn t)."""
    if not isinstance(workers, (list, tuple)):
        workers = [workers]
    by_conv: dict[int, list] = {}
    for batch in turns:
        for turn in batch:
            by_conv.setdefault(turn.conversation, []).append(turn)
    queue = deque(by_conv[c] for c in sorted(by_conv))
    started: set[int] = set()

    def session():
        while queue:
            conv = queue.popleft()
            for k, turn in enumerate(conv):
                if k and turn_delay_ns > 0:
                    yield env.now + turn_delay_ns
                if turn.turn not in started:
                    started.add(turn.turn)
                    on_turn_start(turn.turn, env.now)
                yield from _serve(env, workers, turn, tokens_per_block, max_tokens, decode_tokens, on_done)

    sessions = [env.process(session()) for _ in range(min(concurrency, len(queue)))]
    for s in sessions:
        yield s.done


def open_client(env: Env, turns, workers, *, tokens_per_block: int, max_tokens: int, window_ns: float,
                on_turn_start, on_done, decode_tokens: int = 0):
    """A trace's client, open loop: every request (``Turn.arrival_ns``) submitted at its arrival, however many
    are in flight. ``turns``: the requests of each window that has any (``window_ns`` long, from 0), window
    by window; ``Turn.turn`` is the window's number w; ``on_turn_start(w, start)`` fires for each of them in
    order, at its start (or at the first arrival in it). An empty window has no row and costs nothing."""
    if not isinstance(workers, (list, tuple)):
        workers = [workers]
    pending = []

    for batch in turns:
        if not batch:
            continue
        w = batch[0].turn
        start = (w - 1) * window_ns
        if start > env.now:
            yield start
        on_turn_start(w, env.now)
        for turn in batch:
            if turn.arrival_ns > env.now:
                yield turn.arrival_ns
            pending.append(env.process(_serve(env, workers, turn, tokens_per_block, max_tokens, decode_tokens,
                                              on_done)))
    for p in pending:
        yield p.done
