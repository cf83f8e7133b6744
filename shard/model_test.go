package shard

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestBucketAgainstNaiveSimulation drives the bucket and a per-millisecond
// simulation with the same random arrivals and requires the same decisions,
// and that a bucket hammered every millisecond admits exactly b + floor(r*t).
func TestBucketAgainstNaiveSimulation(t *testing.T) {
	for _, c := range []struct{ rate, burst int64 }{{1, 1}, {10, 5}, {3, 7}, {1000, 1}, {7, 100}} {
		t.Run(fmt.Sprintf("r=%d,b=%d", c.rate, c.burst), func(t *testing.T) {
			plan := Plan{Rate: Rate{Tokens: c.rate, Per: time.Second}, Burst: c.burst}
			for seed := uint64(1); seed <= 5; seed++ {
				rng := rand.New(rand.NewPCG(seed, uint64(c.rate)))
				var b Bucket
				// naive: milli-tokens, +rate each ms, capped at burst*1000, a request needs 1000.
				naive, capMilli := c.burst*1000, c.burst*1000
				for ms := int64(0); ms < 20_000; ms++ {
					if ms > 0 {
						naive = min(capMilli, naive+c.rate)
					}
					for k := rng.IntN(3); k > 0; k-- {
						b.refill(&plan, ms*int64(time.Millisecond))
						got, _ := b.allow(&plan)
						want := naive >= 1000
						if got != want {
							t.Fatalf("seed %d at %d ms: bucket says %v, naive says %v", seed, ms, got, want)
						}
						if got {
							b.take(&plan)
							naive -= 1000
						}
					}
				}
			}
			// Hammered: exactly b + floor(r*t) in a window t from full.
			for _, window := range []time.Duration{0, 350 * time.Millisecond, time.Second, 2500 * time.Millisecond, 10 * time.Second} {
				var b Bucket
				admitted := int64(0)
				for ns := int64(0); ns <= int64(window); ns += int64(time.Millisecond) {
					b.refill(&plan, ns)
					for ok, _ := b.allow(&plan); ok; ok, _ = b.allow(&plan) {
						b.take(&plan)
						admitted++
					}
				}
				if want := c.burst + c.rate*int64(window)/int64(time.Second); admitted != want {
					t.Fatalf("window %s: admitted %d, want b + floor(r*t) = %d", window, admitted, want)
				}
			}
		})
	}
}

// model is a deliberately simple account: one hard or soft monthly quota,
// plain maps, float-free bucket by brute force.
type model struct {
	quota     int64
	hard      bool
	rate      int64 // tokens per second; 0 = none
	burst     int64
	period    Period
	seen      int64 // latest wall
	used      map[Period]int64
	events    map[string]modelEvent // client ids
	maxReplay int32                 // Params.MaxReplays; 0: no bound
	milli     int64                 // bucket in milli-tokens... at ms resolution
	lastMs    int64
	bucketSet bool
}

type modelEvent struct {
	wall     int64
	units    int64
	period   Period
	refunded bool
	replays  int32 // answered Replayed (none is taken back here)
}

func (m *model) step(now Now) Period {
	if p := PeriodOf(now.Wall); p > m.period {
		m.period = p
	}
	m.seen = max(m.seen, now.Wall)
	if m.rate > 0 {
		ms := now.Mono / int64(time.Millisecond)
		if !m.bucketSet {
			m.milli, m.lastMs, m.bucketSet = m.burst*1000, ms, true
		}
		if ms-m.lastMs > m.burst*1000 { // long enough to fill from empty at >= 1 token/s
			m.lastMs = ms - m.burst*1000
		}
		for ; m.lastMs < ms; m.lastMs++ {
			m.milli = min(m.burst*1000, m.milli+m.rate)
		}
	}
	return m.period
}

func (m *model) charge(id string, units int64, now Now) (Reason, int64) {
	p := m.step(now)
	if e, ok := m.event(id, now); ok && !e.refunded { // a refunded id is charged again: a retry of failed work
		if m.maxReplay > 0 && e.replays >= m.maxReplay {
			return ReplayLimit, m.remaining() // served that often: refused before the rate limit, no token
		}
		if m.rate > 0 && m.milli < 1000 {
			return RateLimited, m.remaining() // a replay is served again: it takes a token
		}
		if m.rate > 0 {
			m.milli -= 1000
		}
		e.replays++
		m.events[id] = e
		return Replayed, m.remaining()
	}
	if m.rate > 0 && m.milli < 1000 {
		return RateLimited, m.remaining()
	}
	if m.hard && units > 0 && m.used[p]+units > m.quota {
		return QuotaExceeded, m.remaining()
	}
	if m.rate > 0 {
		m.milli -= 1000
	}
	if units > 0 {
		m.used[p] += units
		m.events[id] = modelEvent{units: units, period: p, wall: m.seen}
	}
	return OK, m.remaining()
}

func (m *model) refund(id string, now Now) (Reason, int64) {
	m.step(now)
	e, ok := m.event(id, now)
	switch {
	case !ok:
		return UnknownEvent, m.remaining()
	case e.refunded:
		return AlreadyRefunded, m.remaining()
	}
	e.refunded = true
	m.events[id] = e
	m.used[e.period] -= e.units
	return Refunded, m.remaining()
}

// event finds a client id charged less than 24 hours (the dedup window)
// before the latest wall reading.
func (m *model) event(id string, now Now) (modelEvent, bool) {
	e, ok := m.events[id]
	if ok && m.seen-e.wall >= int64(24*time.Hour) {
		delete(m.events, id)
		return e, false
	}
	return e, ok
}

func (m *model) remaining() int64 { return max(0, m.quota-m.used[m.period]) }

// TestStateMachineMatchesModel runs random charges, retries, refunds, plan
// changes and clock steps (including jumps across month ends and backwards)
// through Account and the model, requiring the same decisions; then it
// rebuilds the account from its records alone and requires the same state.
func TestStateMachineMatchesModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		hard := rapid.Bool().Draw(t, "hard")
		quota := rapid.Int64Range(0, 30).Draw(t, "quota")
		rate := rapid.SampledFrom([]int64{0, 1, 5, 1000}).Draw(t, "rate")
		burst := rapid.Int64Range(1, 4).Draw(t, "burst")
		plan := Plan{ID: "p", MonthlyQuota: quota, Hard: hard, Burst: burst}
		if rate > 0 {
			plan.Rate = Rate{Tokens: rate, Per: time.Second}
		}
		params := DefaultParams()
		params.MaxReplays = rapid.SampledFrom([]int32{0, 2, DefaultMaxReplays}).Draw(t, "max replays")
		cfg := AccountConfig{ID: "a", Plan: plan}
		a := NewAccount(cfg)
		m := &model{quota: quota, hard: hard, rate: rate, burst: burst, used: map[Period]int64{}, events: map[string]modelEvent{}, maxReplay: params.MaxReplays}
		wall := at("2026-06-29T00:00:00Z").Wall
		mono := int64(0)
		var log []Record
		for i, n := 0, rapid.IntRange(1, 120).Draw(t, "ops"); i < n; i++ {
			now := Now{Wall: wall, Mono: mono}
			var rec Record
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op < 5:
				id := fmt.Sprint("e", rapid.IntRange(0, 15).Draw(t, "id"))
				units := rapid.Int64Range(0, 6).Draw(t, "units")
				d := a.Charge(&Charge{EventID: id, ClientID: true, Route: "r", Units: units}, now, &params, &rec)
				wr, wrem := m.charge(id, units, now)
				if d.Reason != wr || d.Remaining != wrem {
					t.Fatalf("op %d charge %s %d: got %v remaining %d, model %v %d", i, id, units, d.Reason, d.Remaining, wr, wrem)
				}
			case op < 7:
				id := fmt.Sprint("e", rapid.IntRange(0, 15).Draw(t, "id"))
				d := a.Refund(id, nil, "", now, &params, &rec)
				wr, wrem := m.refund(id, now)
				if d.Reason != wr || d.Remaining != wrem {
					t.Fatalf("op %d refund %s: got %v remaining %d, model %v %d", i, id, d.Reason, d.Remaining, wr, wrem)
				}
			case op == 7:
				q := rapid.Int64Range(0, 30).Draw(t, "newquota")
				plan.MonthlyQuota, m.quota = q, q
				cfg.Plan = plan
				a.Configure(cfg)
			default:
				step := rapid.SampledFrom([]time.Duration{time.Millisecond, 300 * time.Millisecond, 2 * time.Second, 36 * time.Hour, -48 * time.Hour}).Draw(t, "step")
				wall += int64(step)
				if step > 0 {
					mono += int64(step)
				}
			}
			if rec.Type != 0 {
				log = append(log, rec)
			}
		}
		// Replay: a fresh account fed only the records reaches the same state.
		b := NewAccount(cfg)
		for i := range log {
			enc := log[i].AppendEncode(nil)
			var rec Record
			if err := rec.Decode(enc); err != nil {
				t.Fatal(err)
			}
			b.ApplyRecord(uint64(i+1), &rec, &params)
		}
		// Compare at the latest wall reading: an account moved to a later
		// period by an operation without a record (a refusal) only learns it
		// again from a later reading, so compare at one at least as late as
		// any the account has seen.
		now := Now{Wall: max(wall, m.seen), Mono: mono}
		if got, want := fmt.Sprint(b.Usage(now), spent(b)), fmt.Sprint(a.Usage(now), spent(a)); got != want {
			t.Fatalf("replayed state %s, live state %s", got, want)
		}
	})
}

// spent lists the grants with something used or reserved: replay creates an
// untouched monthly grant lazily, live state may hold it already.
func spent(a *Account) []GrantView {
	var out []GrantView
	for _, g := range a.Grants() {
		if g.Used != 0 || g.Allowance != 0 {
			out = append(out, g)
		}
	}
	return out
}

// A bucket never holds more than its burst: hammered every nanosecond with
// a rate whose tokens are not small against its period, every window
// [s, s+t] between two admissions admits at most burst + floor(t·Tokens/Per)
// (G7, exact). A refill that lands exactly where the bucket fills up must
// stop at the capacity: keeping the few credits past it admitted one request
// a nanosecond early, one over the bound.
func TestBucketNeverHoldsMoreThanItsBurst(t *testing.T) {
	for _, c := range []struct {
		tokens, burst int64
		per           time.Duration
	}{{3, 1, 10}, {3, 2, 10}, {7, 1, 10}, {4, 3, 9}} {
		t.Run(fmt.Sprintf("%d/%dns,b=%d", c.tokens, c.per, c.burst), func(t *testing.T) {
			plan := Plan{Rate: Rate{Tokens: c.tokens, Per: c.per}, Burst: c.burst}
			var b Bucket
			var admitted []int64
			for ns := int64(0); ns < 2000; ns++ {
				b.refill(&plan, ns)
				for ok, _ := b.allow(&plan); ok; ok, _ = b.allow(&plan) {
					b.take(&plan)
					admitted = append(admitted, ns)
				}
			}
			for i := range admitted {
				for j := i; j < len(admitted); j++ {
					span := admitted[j] - admitted[i]
					if n, bound := int64(j-i+1), c.burst+span*c.tokens/int64(c.per); n > bound {
						t.Fatalf("%d admitted in [%d, %d] ns, bound burst + floor(t·rate) = %d", n, admitted[i], admitted[j], bound)
					}
				}
			}
		})
	}
}
