"""The serve worker's slot scheduler in-process (moecache/server/worker.py), on the tiny model on the
CPU: ``max_tokens`` 0, one request failing inside a batched step while the others finish with their
lone text, a cancelled request freeing its slot, more slots than one forward pass carries (16), and
a failure of the scheduler itself answering every client instead of hanging them."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import replace

import numpy as np
import pytest

import moecache
import moecache.server.worker as wk
from faults import bad_row
from moecache.sampling import SamplingParams
from moecache.server.schemas import GenRequest
from moecache.server.worker import Job, Worker


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from moecache.testing.synth import PRESETS, write_model

    path = tmp_path_factory.mktemp("worker") / "tiny.gguf"
    write_model(path, PRESETS["tiny"], seed=3)
    with moecache.load(path, n_ctx=2048, n_threads=2, no_moe_profile=True) as m:
        yield m


def gen(n: int, **kw) -> GenRequest:
    return GenRequest(max_tokens=n, sampling=SamplingParams(temp=0.0), stop=(), stream=False, include_usage=False,
                      ignore_eos=True, **kw)


def run_jobs(worker: Worker, jobs_spec: list[tuple[list[int], GenRequest]], timeout: float = 120.0) -> list[tuple]:
    """Submit every job at once; return each one's ("done", Result) or ("error", ApiError)."""
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(ids, g, loop) for ids, g in jobs_spec]
        for j in jobs:
            worker.submit(j)

        async def last(job: Job) -> tuple:
            while True:
                kind, value = await job.events.get()
                if kind != "text":
                    return kind, value

        async def every() -> list[tuple]:
            return await asyncio.wait_for(asyncio.gather(*(last(j) for j in jobs)), timeout)
        return loop.run_until_complete(every())
    finally:
        loop.close()


def test_max_tokens_zero_generates_nothing(llm):
    w = Worker(llm, 2, lambda j, r: None, print)
    try:
        (kind, res), = run_jobs(w, [([1, 2, 3], gen(0))])
        assert kind == "done" and res.n_tokens == 0 and res.text == "" and res.finish_reason == "length"
    finally:
        w.stop()


def test_one_failing_request_leaves_the_batch_alone(llm, monkeypatch):
    """A request whose sampling fails mid-batch (here: its logprobs) gets a 500; the others of the
    same decode steps finish with the text each gets alone."""
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    w = Worker(llm, 4, lambda j, r: None, print)
    try:
        alone = [run_jobs(w, [(p, gen(12))])[0][1].text for p in prompts]
        real = wk.token_logprob

        def flaky(logits, tok, n_top):
            if n_top == 7:
                raise RuntimeError("injected")
            return real(logits, tok, n_top)
        monkeypatch.setattr(wk, "token_logprob", flaky)
        out = run_jobs(w, [(prompts[0], gen(12)), (prompts[1], gen(12, logprobs=7)), (prompts[2], gen(12))])
        assert out[1][0] == "error" and out[1][1].status == 500 and "injected" in out[1][1].message
        assert [out[0][1].text, out[2][1].text] == [alone[0], alone[2]]
        assert w.decode_tokens > w.decode_steps  # they were decoded together
        assert w.n_processing == 0 and w.alive()
    finally:
        w.stop()


def test_more_slots_than_one_pass_and_a_cancelled_one(llm):
    """18 slots: decode steps in passes of at most 16 give each its lone text; a cancelled job ends
    "cancelled" and its slot is free."""
    w = Worker(llm, 18, lambda j, r: None, print)
    try:
        prompts = [[20 + i, 40 + i] for i in range(18)]
        alone = [run_jobs(w, [(p, gen(6))])[0][1].text for p in prompts[:3]]
        steps, tokens = w.decode_steps, w.decode_tokens
        out = run_jobs(w, [(p, gen(6)) for p in prompts])
        assert all(k == "done" for k, _ in out) and [r.text for _, r in out[:3]] == alone
        assert (w.decode_tokens - tokens) / (w.decode_steps - steps) > 8  # short prompts admitted in one step
        loop = asyncio.new_event_loop()
        job = Job([1, 2], replace(gen(5000)), loop)
        job.cancel()
        w.submit(job)
        async def first() -> tuple:
            return await asyncio.wait_for(job.events.get(), 30)
        kind, err = loop.run_until_complete(first())
        loop.close()
        assert kind == "error" and err.status == 503
        assert w.n_processing == 0 and all(s["is_processing"] is False for s in w.slots())
    finally:
        w.stop()


def test_a_scheduler_failure_answers_everyone_and_refuses_new_work(llm, monkeypatch):
    w = Worker(llm, 2, lambda j, r: None, print)

    def broken(*a):
        raise RuntimeError("scheduler bug")
    monkeypatch.setattr(w, "_step", broken)
    out = run_jobs(w, [([1, 2], gen(4))], timeout=30)
    assert out[0][0] in ("done", "error")  # answered (cancelled or refused), not left hanging
    w._thread.join(5)
    assert not w.alive()
    with pytest.raises(Exception, match="shutting down"):
        w.submit(Job([1], gen(1), asyncio.new_event_loop()))


def test_metrics_expose_each_caches_hit_and_miss_counters():
    """/metrics' expert-cache lines: per cache its hits, misses (counters, so a client can take the
    hit rate of any interval from two reads) and uploads, from the cache's own CacheStats; and the
    worker's decode passes, their tokens and the seconds inside the engine's decode and prompt
    calls."""
    from moecache.moe.cache import CacheStats
    from moecache.server.metrics import Metrics
    from moecache.server.worker import WorkerStatus

    a, b = CacheStats(), CacheStats()
    a.hits, a.misses, a.uploads = 90, 10, 7
    b.hits, b.misses, b.uploads = 3, 1, 0
    text = Metrics().render(WorkerStatus(0, 0, [], (4, 10), (0.25, 1.5), [a, b]))
    got = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert got["moecache:decode_steps_total"] == 4 and got["moecache:decode_step_tokens_total"] == 10
    assert got["moecache:decode_seconds_total"] == 0.25 and got["moecache:prompt_eval_seconds_total"] == 1.5
    assert got['moecache:expert_cache_hits_total{cache="0"}'] == 90
    assert got['moecache:expert_cache_misses_total{cache="0"}'] == 10
    assert got['moecache:expert_cache_hit_rate{cache="0"}'] == 0.9
    assert got['moecache:expert_cache_hits_total{cache="1"}'] == 3
    assert got['moecache:expert_cache_misses_total{cache="1"}'] == 1
    assert got['moecache:expert_cache_uploads_total{cache="0"}'] == 7
    assert "# TYPE moecache:expert_cache_misses_total counter" in text


def test_step_histograms_count_each_decode_pass_and_each_gap_of_a_batch(llm, monkeypatch):
    """``decode_pass`` observes every decode call (count = decode_steps, sum = decode_seconds);
    ``between_passes`` observes the gap before each pass that continues a slot of the last one: a
    lone request of n tokens takes its first from the prompt, then n - 1 passes with n - 2 gaps
    between them; the gaps are the worker's own time, not the engine's (a decode call made 20 ms
    longer moves only ``decode_pass``)."""
    import time

    w = Worker(llm, 2, lambda j, r: None, print)
    try:
        out = run_jobs(w, [([1, 2, 3], gen(6))])
        assert out[0][0] == "done"
        st = w.status()
        assert st.decode == (5, 5)
        assert st.decode_pass.count == 5 and st.decode_pass.total == pytest.approx(st.engine_s[0])
        assert st.between_passes.count == 4
        orig = llm.engine.decode

        def slow(*a, **k):
            time.sleep(0.02)
            return orig(*a, **k)
        monkeypatch.setattr(llm.engine, "decode", slow)
        out = run_jobs(w, [([4, 5], gen(4))])  # 3 more passes, 2 more gaps
        d = w.status().decode_pass.minus(st.decode_pass)
        g = w.status().between_passes.minus(st.between_passes)
        assert d.count == 3 and d.quantile(0.0) >= 0.02
        assert g.count == 2 and g.total < 0.5 * d.total  # (the engine's 60+ ms are not in the gaps)
    finally:
        w.stop()


def test_streamed_text_joins_to_the_result_and_precedes_done(llm):
    """Text pieces leave the worker once per step (``emit_texts``, before the next decode pass):
    each job's streamed pieces, in order, join to its result's text, and nothing comes after
    ``done``; with three jobs decoded together."""
    w = Worker(llm, 3, lambda j, r: None, print)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(ids, gen(n), loop) for ids, n in (([1, 2, 3], 9), ([4, 5], 5), ([6, 7, 8, 9], 12))]
        for j in jobs:
            w.submit(j)

        async def events(job: Job) -> list[tuple]:
            out = []
            while True:
                kind, value = await job.events.get()
                out.append((kind, value))
                if kind != "text":
                    await asyncio.sleep(0.2)  # anything sent after the end would be queued by now
                    return out + [job.events.get_nowait() for _ in range(job.events.qsize())]

        async def every() -> list[list[tuple]]:
            return await asyncio.wait_for(asyncio.gather(*(events(j) for j in jobs)), 120)
        got = loop.run_until_complete(every())
    finally:
        loop.close()
        w.stop()
    for evs, n in zip(got, (9, 5, 12)):
        kinds = [k for k, _ in evs]
        assert kinds[-1] == "done" and set(kinds[:-1]) <= {"text"}, kinds
        res = evs[-1][1]
        assert res.n_tokens == n and "".join(v for k, v in evs if k == "text") == res.text


def test_emit_texts_one_call_per_loop_in_order_and_a_closed_loop_cancels():
    from moecache.server.worker import emit_texts

    a, b = asyncio.new_event_loop(), asyncio.new_event_loop()
    ja, jb, jc = Job([1], gen(1), a), Job([1], gen(1), a), Job([1], gen(1), b)
    b.close()
    emit_texts([(ja, "x"), (jb, "1"), (ja, "y"), (jc, "lost")])
    a.run_until_complete(asyncio.sleep(0))  # the loop runs the delivery
    a.close()
    assert [ja.events.get_nowait() for _ in range(ja.events.qsize())] == [("text", "x"), ("text", "y")]
    assert jb.events.get_nowait() == ("text", "1")
    assert jc.cancelled.is_set() and not ja.cancelled.is_set()


class Together(queue.Queue):
    """A queue whose items (other than None, the worker's stop) appear ``n`` at a time: jobs that
    are admitted together, whatever the threads' timing."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.held = n, []

    def put(self, item, block=True, timeout=None):
        if item is None:
            return super().put(item, block, timeout)
        self.held.append(item)
        if len(self.held) == self.n:
            with self.not_empty:
                self.queue.extend(self.held)
                self.unfinished_tasks += len(self.held)
                self.held = []
                self.not_empty.notify()


def test_prompts_of_several_slots_go_in_one_pass_with_their_lone_text(llm, monkeypatch):
    """Prompts admitted together are evaluated in passes of several slots' chunks (at most -ub
    tokens, here 16: 9 + 3 + 4 of 14 in the first step, the other 10 in the next while the first
    two decode), each job getting the text it gets alone; a job whose prompt logits are not
    finite fails alone (500) while the others of its pass finish."""
    eng = llm.engine
    prompts = [list(range(30, 39)), [5, 6, 7], list(range(50, 64))]
    w = Worker(llm, 3, lambda j, r: None, print)
    try:
        alone = [run_jobs(w, [(p, gen(6))])[0][1].text for p in prompts]
    finally:
        w.stop()
    monkeypatch.setattr(eng, "n_ubatch", 16)
    parts: list[list[int]] = []
    real = eng.eval_seqs

    def spy(ps, kvs):
        parts.append([len(p) for p in ps])
        return real(ps, kvs)
    monkeypatch.setattr(eng, "eval_seqs", spy)
    with monkeypatch.context() as m:  # the worker's queue shows each run_jobs call's 3 jobs at once
        m.setattr(wk.queue, "Queue", lambda: Together(3))
        w = Worker(llm, 3, lambda j, r: None, print)
    try:
        out = run_jobs(w, [(p, gen(6)) for p in prompts])
        assert parts == [[9, 3, 4]]  # then C's last 10 alone, through Engine.eval
        assert [k for k, _ in out] == ["done"] * 3 and [r.text for _, r in out] == alone
        # the engine's time, each call once: the pass of three prompts counts once here, and in each
        # of the three requests' own prompt time
        assert w.decode_seconds > 0 and 0 < w.prompt_seconds < sum(r.timings.t_prompt for _, r in out)
        monkeypatch.setattr(eng.model, "forward_parts", bad_row(eng.model.forward_parts, 1, np.inf))  # B's row
        out = run_jobs(w, [(p, gen(6)) for p in prompts])
        assert out[1][0] == "error" and out[1][1].status == 500 and "non-finite" in out[1][1].message
        assert [out[0][1].text, out[2][1].text] == [alone[0], alone[2]]
        assert w.n_processing == 0 and w.alive()
    finally:
        w.stop()


def test_sync_stream_waits_for_the_loop_and_keeps_the_text(llm):
    """``sync_stream`` (an experiment, off by default): emit_texts tells a step's end once the one
    loop has run the streaming task it woke (not for two loops, nor a closed one), and a worker
    that waits for it at each step's end gives every job the text it gets without."""
    import threading

    from moecache.server.worker import emit_texts

    a, b = asyncio.new_event_loop(), asyncio.new_event_loop()
    ja, jb = Job([1], gen(1), a), Job([1], gen(1), b)
    ev = threading.Event()
    seen = []

    async def stream() -> None:  # the streaming task the delivery wakes: it runs before the mark
        seen.append(await ja.events.get())
        seen.append(ev.is_set())
    task = a.create_task(stream())
    a.run_until_complete(asyncio.sleep(0))  # the task waits on the queue
    assert emit_texts([(ja, "x")], ev) and not ev.is_set()
    a.run_until_complete(asyncio.sleep(0.01))  # the loop's turns: delivery, the task, then the mark
    assert task.done() and seen == [("text", "x"), False] and ev.is_set()
    assert not emit_texts([(ja, "y"), (jb, "z")], threading.Event())
    b.close()
    assert not emit_texts([(jb, "lost")], threading.Event()) and jb.cancelled.is_set()
    a.close()
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    plain = Worker(llm, 2, lambda j, r: None, print)
    try:
        want = [r.text for _, r in run_jobs(plain, [(p, gen(8)) for p in prompts])]
    finally:
        plain.stop()
    waits = []  # (told, the worker's wait_s) of every emit_texts call

    def spy(items, streamed=None):
        waits.append(streamed is not None)
        return emit_texts(items, streamed)
    synced = Worker(llm, 2, lambda j, r: None, print, sync_stream=True, deliver=spy)
    try:
        out = run_jobs(synced, [(p, gen(8)) for p in prompts])
        assert [k for k, _ in out] == ["done"] * 2 and [r.text for _, r in out] == want
    finally:
        synced.stop()
    # the steps' ends waited (6 of the 7 decode steps: the last one's text goes out as each job
    # ends), the first tokens and the ends did not
    assert waits.count(True) >= 6 and waits.count(False) >= 2, waits


@pytest.mark.parametrize("mode", ["merge_prompts off", "short parts with experts in host RAM"])
def test_first_token_is_sent_before_another_slots_prompt_chunk(llm, monkeypatch, mode):
    """Where slots' prompt chunks get a pass each (``merge_prompts=False``; or, the default at
    8 GiB, experts in host RAM and every chunk below ``Engine.prompt_pass_min``, here faked at 32),
    a prompt's first token goes to its client as soon as it is sampled, not after the prompt chunk
    another slot evaluates next in the same step: jobs A (slot 0) and B (slot 1) are admitted
    together; in the first step A's prompt is evaluated and its first token sampled, then B's
    prompt chunk, which is held until A's first text has reached A's loop (5 s at most)."""
    import threading

    from moecache.engine import Engine

    eng = llm.engine
    merge = mode != "merge_prompts off"
    if merge:
        monkeypatch.setattr(Engine, "prompt_pass_min", property(lambda self: 32))
    both_in = threading.Event()
    real_admit = Worker._admit

    def admit_both(self):
        both_in.wait(timeout=10.0)  # both jobs queued before the first admission
        return real_admit(self)
    monkeypatch.setattr(Worker, "_admit", admit_both)
    w = Worker(llm, 2, lambda j, r: None, print, merge_prompts=merge)
    loop = asyncio.new_event_loop()
    a_text = threading.Event()
    real_eval = eng.eval
    held = []

    def holding_eval(tokens, logits="last", kv=None):
        if kv is w.seqs[1] and kv.n_past == 0 and not held:  # B's first chunk
            held.append(a_text.wait(timeout=5.0))  # True: A's text reached its loop first
        return real_eval(tokens, logits=logits, kv=kv)
    monkeypatch.setattr(eng, "eval", holding_eval)
    try:
        ja = Job([1, 2, 3], gen(3), loop)
        jb = Job(list(range(1, 21)), gen(2), loop)

        async def drain(job: Job, flag: threading.Event | None) -> str:
            while True:
                kind, value = await job.events.get()
                if kind == "text" and flag is not None:
                    flag.set()
                if kind != "text":
                    return kind

        async def both() -> list[str]:
            w.submit(ja)
            w.submit(jb)
            both_in.set()
            return await asyncio.wait_for(asyncio.gather(drain(ja, a_text), drain(jb, None)), 120)
        kinds = loop.run_until_complete(both())
    finally:
        loop.close()
        w.stop()
    assert kinds == ["done", "done"] and held == [True], (kinds, held)
