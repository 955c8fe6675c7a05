"""Pipeline schedules as data: validity, closed-form bubbles, microbatches in flight, slots."""
import pytest

from autopar.errors import AutoparError
from autopar.pipeline import schedules as S


def _unit(a):  # forward 1, backward 2: the usual t_B = 2 t_F
    return 1.0 if a.kind == "F" else 2.0


def _check_valid(sch):
    """Every action once, on its chunk's stage, after its inputs (another stage: earlier tick)."""
    when = sch.when()
    assert len(when) == 2 * sch.microbatches * sch.chunks
    for row in sch.ticks:
        for s, acts in enumerate(row):
            assert len(acts) <= 2 and len({a.kind for a in acts}) == len(acts)
            for a in acts:
                assert sch.stage_of(a.chunk) == s
    for a, t in when.items():
        deps = ([S.Action("F", a.mb, a.chunk - 1)] if a.kind == "F" and a.chunk else [])
        if a.kind == "B":
            deps.append(S.Action("F", a.mb, a.chunk))
            if a.chunk < sch.chunks - 1:
                deps.append(S.Action("B", a.mb, a.chunk + 1))
        for d in deps:
            same = sch.stage_of(d.chunk) == sch.stage_of(a.chunk)
            assert when[d] <= t if same else when[d] < t, (a, d)


CASES = [(2, 1, 4), (4, 1, 8), (4, 1, 4), (3, 1, 7), (2, 2, 4), (4, 2, 8), (2, 3, 6)]


@pytest.mark.parametrize("name", S.SCHEDULES)
@pytest.mark.parametrize("p,v,m", CASES)
def test_schedules_are_valid(name, p, v, m):
    _check_valid(S.build(name, p, v, m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 7), (8, 16)])
def test_gpipe_and_eager_1f1b_bubble_is_textbook(p, m):
    for name in ("gpipe", "eager_1f1b"):
        tl = S.price(S.build(name, p, 1, m), _unit)
        assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert tl.makespan_s == pytest.approx(3.0 * (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 4, 8)])
def test_interleaved_bubble_is_textbook(p, v, m):
    for name in ("gpipe", "1f1b"):           # circular (MaxText) and interleaved 1F1B
        tl = S.price(S.build(name, p, v, m), _unit)
        assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
        assert tl.bubble_fraction == pytest.approx(S.ideal_bubble(name, p, v, m))


def test_plain_1f1b_in_lockstep_pays_for_its_memory():
    # Two stages: the textbook bubble. More: the steady state idles too (module docstring), so
    # the loss does not shrink away with more microbatches as the textbook's does
    assert S.price(S.build("1f1b", 2, 1, 8), _unit).bubble_fraction == pytest.approx(1 / 9)
    for p, m in [(4, 8), (4, 16), (3, 9)]:
        assert S.price(S.build("1f1b", p, 1, m), _unit).bubble_fraction > (p - 1) / (m + p - 1)
    for p in (3, 4, 8):
        plain = S.price(S.build("1f1b", p, 1, 96), _unit).bubble_fraction
        assert plain > 0.25 and plain > 3 * (p - 1) / (96 + p - 1)
        assert S.price(S.build("eager_1f1b", p, 1, 96), _unit).bubble_fraction == pytest.approx(
            (p - 1) / (96 + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 2), (3, 7)])
def test_in_flight_microbatches(p, m):
    assert S.in_flight(S.build("gpipe", p, 1, m)) == (m,) * p
    assert S.in_flight(S.build("1f1b", p, 1, m)) == tuple(min(m, p - s) for s in range(p))
    assert max(S.in_flight(S.build("eager_1f1b", p, 1, m))) <= min(m, 2 * p - 1)
    assert S.in_flight(S.build("gpipe", p, 2, 2 * p)) == (4 * p,) * p


def test_price_scales_with_cores_and_transfers():
    sch = S.build("gpipe", 4, 1, 4)
    alone = S.price(sch, _unit)
    shared = S.price(sch, _unit, cores=1.0)        # one core for four stages: no overlap at all
    assert shared.makespan_s == pytest.approx(4 * 4 * 3.0)     # all the work, serially
    assert shared.makespan_s > alone.makespan_s
    moved = S.price(sch, _unit, transfer=lambda t, f, b: 0.5)
    hops = sum(1 for t in sch.ticks if any(a.kind == "F" and a.chunk < 3 or a.kind == "B"
                                           and a.chunk > 0 for acts in t for a in acts))
    assert moved.transfer_s == pytest.approx(0.5 * hops)
    assert moved.makespan_s == pytest.approx(alone.makespan_s + 0.5 * hops)


def test_shared_ends_split_the_pool_evenly():
    """Three jobs of 1, 2 and 3 s (at the priced speed) on a pool worth 1.5 workers: 3 jobs at
    0.5 each until the first ends (2 s), 2 at 0.75 until the second (+4/3 s), the last at 1.5
    (+2/3 s): all the work over the pool. A job of no work ends at once."""
    assert S.shared_ends([3.0, 1.0, 2.0, 0.0], 1.5) == pytest.approx([4.0, 2.0, 2 + 4 / 3, 0.0])


def test_lockstep_ticks_share_the_pool():
    """With a pool, a tick's work lasts its sum over the pool: one stage busy runs faster than
    priced, a pool of one worker serialises every stage (GPipe's 16 F and 16 B of 1 and 2 s:
    48 s), and the busy time is each stage's own share."""
    sch = S.build("gpipe", 4, 1, 4)
    one = S.price(sch, _unit, pool=1.0)
    assert one.makespan_s == pytest.approx(4 * 4 * 3.0)
    assert one.tick_s[0] == pytest.approx(1.0)               # only stage 0's first forward
    fast = S.price(sch, _unit, pool=4.0)
    assert fast.tick_s[0] == pytest.approx(0.25)              # alone on a pool of four
    assert fast.makespan_s < S.price(sch, _unit).makespan_s


def test_async_stages_share_the_pool():
    """``price_async`` with a pool: one microbatch through two stages is a chain, one action
    at a time, each at the whole pool's speed (F 1, B 2 on a pool of 2: 6 s of work in 3 s);
    on a pool worth one stage the pool never idles while an action may start, so the makespan
    is all the work, however the schedule orders it (a stage counts as busy while its action
    is in flight, slowed or not, as a trace of the running step counts it); without a pool,
    the old timeline."""
    chain = S.price_async(S.build("1f1b", 2, 1, 1), _unit, pool=2.0)
    assert chain.makespan_s == pytest.approx(3.0) and sum(chain.busy_s) == pytest.approx(3.0)
    for name in ("gpipe", "1f1b", "zb_h1", "zb_v"):
        sch = S.build(name, 2, S.default_virtual(name), 4)
        tl = S.price_async(sch, _unit, pool=1.0)
        assert tl.makespan_s == pytest.approx(sum(_unit(a) for a in sch.when()))
    # two stages busy at once each run at half the pool: the spans show it
    tl = S.price_async(S.build("gpipe", 2, 1, 2), lambda a: 1.0, pool=2.0)
    spans = {(s, a.kind, a.mb): (t0, t1) for s, t0, t1, a in tl.spans}
    assert spans[(0, "F", 0)] == pytest.approx((0.0, 0.5))              # alone: twice as fast
    assert spans[(0, "F", 1)] == pytest.approx((0.5, 1.5))              # beside F(0, 1)
    assert spans[(1, "F", 0)] == pytest.approx((0.5, 1.5))
    # the controller's issuing still gates each start
    slow = S.price_async(S.build("1f1b", 2, 1, 1), _unit, issue_s=10.0, pool=2.0)
    assert slow.makespan_s == pytest.approx(40.0 + 1.0)      # the last B issued at 40 s
    assert S.price_async(sch, _unit, pool=None) == S.price_async(sch, _unit)


def test_every_tick_pays_the_runtime_overhead():
    """``tick_s`` lengthens every tick, idle ones too, so it raises the bubble."""
    sch = S.build("1f1b", 4, 1, 8)
    bare, paid = S.price(sch, _unit), S.price(sch, _unit, tick_s=0.25)
    assert paid.overhead_s == pytest.approx(0.25 * len(sch.ticks))
    assert paid.makespan_s == pytest.approx(bare.makespan_s + 0.25 * len(sch.ticks))
    assert paid.busy_s == bare.busy_s and paid.bubble_fraction > bare.bubble_fraction


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_slots_never_overlap(name):
    sch = S.build(name, 4, 2, 8)
    for intervals in (S.stash_intervals(sch), S.inbox_intervals(sch, "F"),
                      S.inbox_intervals(sch, "B")):
        slots = S.allocate(intervals)
        for i, (s, k, a, b) in enumerate(intervals):
            for s2, k2, a2, b2 in intervals[i + 1:]:
                if s == s2 and slots.slot[(s, k)] == slots.slot[(s2, k2)]:
                    assert b < a2 or b2 < a
    assert S.allocate(S.stash_intervals(sch)).count == max(S.in_flight(sch))


@pytest.mark.parametrize("args,fix", [
    (("zigzag", 2, 1, 4), "use one of"),
    (("gpipe", 2, 2, 3), "use microbatches=4"),
    (("1f1b", 0, 1, 4), "stages=0"),
    (("1f1b", 2, 1, 2.5), "microbatches=2.5"),
])
def test_bad_schedule_options(args, fix):
    with pytest.raises(AutoparError, match=fix):
        S.build(*args)


def test_gantt_draws_every_action():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    sch = S.build("1f1b", 4, 2, 8)
    ax = S.gantt(S.price(sch, _unit))
    assert len(ax.patches) == 2 * sch.microbatches * sch.chunks
    assert "bubble" in ax.get_title()
