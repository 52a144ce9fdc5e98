"""The scheduler (sala/engine/scheduler.py) on its own, against plans worked by hand: the token
budget, decodes before prompt chunks, admission in order past what does not fit, preemption of
the newest request, the evaluation mode's chunk granule, the bounded queue, and what a decoding
strategy reserves. Steps are "run" by advancing the requests as the engine would."""
import pytest

from sala import lightning
from sala.engine.scheduler import QueueFull, Schedule
from tests.engine.parts import build, request, with_pages


def advance(batch: Schedule) -> None:
    """What the engine's postprocess does to the requests of a plain step (a fixed token each)."""
    for r, _, end in batch.prefills:
        r.num_computed = end
        if end == r.num_tokens:
            r.output_ids.append(7)
    for r in batch.decodes:
        r.num_computed += 1
        r.output_ids.append(7)


def spans(batch: Schedule) -> list[tuple[int, int, int]]:
    return [(id(r), s, e) for r, s, e in batch.prefills]


def test_budget_decodes_first_then_chunks_in_arrival_order():
    p = build(max_batch_tokens=24, max_seqs=4)
    a, b, c = request(30), request(10), request(5)
    for r in (a, b, c):
        p.scheduler.add(r)
    first = p.scheduler.schedule()
    assert first.decodes == [] and spans(first) == [(id(a), 0, 24)]  # the budget cuts a's prompt
    advance(first)
    second = p.scheduler.schedule()  # a's rest, then b whole, then c's first 5 - all within 24
    assert spans(second) == [(id(a), 24, 30), (id(b), 0, 10), (id(c), 0, 5)] and second.num_tokens == 21
    advance(second)
    third = p.scheduler.schedule()
    assert third.decodes == [a, b, c] and not third.prefills and third.num_tokens == 3
    assert all(len(r.pages) == p.cache.pages_for(r.num_computed + 1) for r in (a, b, c))


def test_a_waiting_request_that_does_not_fit_is_passed_over():
    p = with_pages(6, max_batch_tokens=64, max_seqs=3, max_model_len=96)
    running, small, third = request(40), request(8), request(8)
    p.scheduler.add(running)
    advance(p.scheduler.schedule())  # 41 positions: 3 of the 6 pages
    large = request(80)  # its first chunk (63 tokens, 4 pages) does not fit the 3 left
    for r in (large, small, third):
        p.scheduler.add(r)
    batch = p.scheduler.schedule()
    assert batch.decodes == [running] and [r for r, _, _ in batch.prefills] == [small, third]
    assert list(p.scheduler.waiting) == [large]


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    p = with_pages(6, max_batch_tokens=64, max_seqs=2, max_model_len=96)
    older, newer = request(46, max_tokens=30), request(46, max_tokens=30, first=50)  # 47 positions: 3 pages each
    for r in (older, newer):
        p.scheduler.add(r)
    while p.scheduler.running != [older, newer] or any(r.prefilling for r in (older, newer)):
        advance(p.scheduler.schedule())
    assert len(p.cache.free_pages) == 0
    for _ in range(3):  # until position 48, which needs a fourth page each: the newer request gives its pages up
        batch = p.scheduler.schedule()
        if p.scheduler.num_preemptions:
            break
        advance(batch)
    assert p.scheduler.num_preemptions == 1 and batch.decodes == [older] and list(p.scheduler.waiting) == [newer]
    assert newer.pages == [] and newer.state_slot == -1 and newer.num_computed == 0 and len(older.pages) == 4
    assert len(p.cache.free_pages) == 2


def test_evaluation_mode_cuts_prompts_only_at_the_lightning_chunk():
    chunk = lightning.CHUNK_SIZE
    p = build(batch_invariant=True, max_batch_tokens=chunk + 40, max_seqs=2)
    r = request(3 * chunk + 50)
    p.scheduler.add(r)
    ends = []
    while not r.output_ids:
        batch = p.scheduler.schedule()
        ends += [e for _, _, e in batch.prefills]
        advance(batch)
    # Each chunk as far as the budget (chunk + 40 tokens) reaches, cut back to a multiple of the chunk; the last to the end.
    assert ends == [chunk, 2 * chunk, 3 * chunk, 3 * chunk + 50]


def test_the_queue_is_bounded():
    p = build(max_waiting=2)
    p.scheduler.add(request(4))
    p.scheduler.add(request(4))
    with pytest.raises(QueueFull):
        p.scheduler.add(request(4))


class Reserving:
    """A decoding strategy's step that reserves 3 positions past the next token and 5 rows."""

    lookahead, rows, drafts = 3, 5, False

    def __init__(self, plain):
        self.plain = plain

    def for_step(self, decoding, prompts=False):
        return self if decoding else self.plain


def test_what_a_decoding_strategy_reserves_is_what_the_scheduler_takes():
    p = build(max_batch_tokens=32, max_seqs=4)
    p.scheduler.decoding = Reserving(p.decoding)
    a = request(15, max_tokens=20)
    p.scheduler.add(a)
    advance(p.scheduler.schedule())  # a's prompt: a plain step (nothing decodes yet)
    b = request(40)
    p.scheduler.add(b)
    batch = p.scheduler.schedule()
    assert batch.decoding is p.scheduler.decoding and batch.decodes == [a]
    assert len(a.pages) == p.cache.pages_for(a.num_computed + 1 + 3)  # 16 + 3 positions: two pages
    assert spans(batch) == [(id(b), 0, 32 - 5)]  # the budget less a's 5 rows


def test_the_strategy_is_told_whether_prompt_chunks_may_join_the_step():
    """Whether a prompt is part-way or waits with a seat free, before the decoding strategy picks
    its step (Medusa decodes such a step plainly where its verify steps compile)."""
    p = build(max_batch_tokens=32, max_seqs=2)
    told = []

    class Telling(Reserving):
        def for_step(self, decoding, prompts=False):
            told.append((len(decoding), prompts))
            return super().for_step(decoding, prompts)

    p.scheduler.decoding = Telling(p.decoding)
    a, b, c = request(15, max_tokens=20), request(40, max_tokens=20), request(5)
    p.scheduler.add(a)
    advance(p.scheduler.schedule())  # a's prompt
    advance(p.scheduler.schedule())  # a decodes, nothing waits
    p.scheduler.add(b)
    first = p.scheduler.schedule()  # b waits, a seat is free: its first chunk joins
    assert spans(first) == [(id(b), 0, 32 - 5)]
    advance(first)
    p.scheduler.add(c)  # no seat for c
    advance(p.scheduler.schedule())  # b part-way: its rest joins
    assert p.scheduler.schedule().prefills == [] and list(p.scheduler.waiting) == [c]
    assert told[0] == (0, True) and [t for t in told if t[0]] == [(1, False), (1, True), (1, True), (2, False)]
