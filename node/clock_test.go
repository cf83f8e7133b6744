package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

type fixedLedgerClock struct {
	at  time.Time
	err error
}

func (c fixedLedgerClock) Clock(context.Context) (time.Time, error) { return c.at, c.err }

func TestMeasureClockOffset(t *testing.T) {
	at := time.Date(2026, 6, 30, 23, 59, 0, 0, time.UTC)
	for _, ahead := range []time.Duration{90 * time.Second, -90 * time.Second, 0} {
		wall := func() int64 { return at.Add(ahead).UnixNano() }
		d, rtt, err := measureClockOffset(context.Background(), fixedLedgerClock{at: at}, wall)
		// The reading is taken at the middle of the round trip.
		if err != nil || d != ahead-rtt/2 {
			t.Fatalf("offset %v (round trip %v), %v; want %v less half the round trip", d, rtt, err, ahead)
		}
	}
	down := errors.New("connection refused")
	if _, _, err := measureClockOffset(context.Background(), fixedLedgerClock{err: down}, nil); !errors.Is(err, down) {
		t.Fatalf("a ledger out of reach: %v", err)
	}
}

// A node whose clock is 90 minutes ahead of the ledger's says so: in the
// gauge, on the status page, and in one warning that says what to do.
func TestNodeReportsItsClockOffset(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	var logs logbuf.Buffer
	clock := engine.NewManualClock(time.Now().Add(90*time.Minute - time.Second))
	nd := startNodesWith(t, dsn, func(c *Config) {
		c.Clock = clock
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})[0]
	const want = "this node's clock is 1h29m5" // less the time since the manual clock was set
	waitFor(t, 10*time.Second, "the clock check's warning", func() bool { return strings.Contains(logs.String(), want) })
	if !strings.Contains(logs.String(), "ahead of the ledger's") || !strings.Contains(logs.String(), "synchronise the clocks (NTP") {
		t.Fatalf("warning:\n%s", logs.String())
	}
	if n := strings.Count(logs.String(), "this node's clock is"); n != 1 {
		t.Fatalf("%d clock warnings, want 1 per episode", n)
	}
	offset := gaugeValue(t, nd, "quotaring_clock_offset_seconds")
	if offset < 89*60 || offset > 90*60 {
		t.Fatalf("quotaring_clock_offset_seconds = %v, want about 5400", offset)
	}
	if d := nd.statusData(context.Background()); !strings.HasPrefix(d.ClockOffset, "+1h29m5") || !d.ClockOff {
		t.Fatalf("status page: clock %q from the ledger's (flagged %v), want +1h29m5x.xxxs flagged", d.ClockOffset, d.ClockOff)
	}
}

// Times the ledger wrote are compared with the ledger's clock, this node's
// only when the ledger does not answer.
func TestLedgerNow(t *testing.T) {
	at := time.Date(2026, 6, 30, 23, 0, 0, 0, time.UTC)
	if got := ledgerNow(context.Background(), fixedLedgerClock{at: at}); !got.Equal(at) {
		t.Fatalf("ledgerNow = %v, want the ledger's %v", got, at)
	}
	before := time.Now()
	if got := ledgerNow(context.Background(), fixedLedgerClock{err: errors.New("down")}); got.Before(before) || got.After(time.Now()) {
		t.Fatalf("ledgerNow with the ledger down = %v, want this node's clock", got)
	}
}

// A step of the system clock is held against until the ledger's clock
// confirms the new reading or the clock comes back; each is logged once.
func TestClockWatchHoldsAStepUntilTheLedgerConfirmsIt(t *testing.T) {
	june := time.Date(2026, 6, 30, 23, 59, 50, 0, time.UTC)
	july := time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC)
	raw := engine.NewManualClock(june)
	steady := engine.NewSteadyClock(raw, DefaultMaxClockOffset)
	var logs logbuf.Buffer
	var offset, step atomic.Int64
	w := &clockWatch{steady: steady, clock: steady, log: slog.New(slog.NewTextHandler(&logs, nil)), offset: &offset, step: &step, max: DefaultMaxClockOffset}
	ctx := context.Background()
	month := func() time.Month { return time.Unix(0, steady.Now().Wall).UTC().Month() }

	w.check(ctx, fixedLedgerClock{at: june})
	if step.Load() != 0 || time.Duration(offset.Load()).Abs() > 10*time.Millisecond || logs.String() != "" {
		t.Fatalf("a clock that agrees: step %v, offset %v, logs %q", time.Duration(step.Load()), time.Duration(offset.Load()), logs.String())
	}

	// The system clock jumps into July; the ledger is still in June.
	raw.SetWall(july)
	if month() != time.June {
		t.Fatalf("after the jump the node bills in %v, want June", month())
	}
	for range 2 {
		w.check(ctx, fixedLedgerClock{at: june})
	}
	if got := time.Duration(step.Load()); got != july.Sub(june) {
		t.Fatalf("step gauge %v, want %v", got, july.Sub(june))
	}
	if got := time.Duration(offset.Load()); got.Abs() > 10*time.Millisecond {
		t.Fatalf("offset of the clock the node bills by: %v, want about 0", got)
	}
	if n := strings.Count(logs.String(), "stepped by +1h0m10s against its monotonic clock"); n != 1 ||
		!strings.Contains(logs.String(), "the new reading is +1h0m10s") || !strings.Contains(logs.String(), "keeps the time it had before the step") {
		t.Fatalf("want one warning that names the step and what the node does:\n%s", logs.String())
	}
	// The ledger out of reach confirms nothing.
	w.check(ctx, nil)
	if month() != time.June || step.Load() == 0 {
		t.Fatalf("with the ledger out of reach: billing in %v, step %v; want June, held", month(), time.Duration(step.Load()))
	}

	// Put right: followed again, said once.
	raw.SetWall(june.Add(time.Second / 2))
	w.check(ctx, fixedLedgerClock{at: june})
	if step.Load() != 0 || !strings.Contains(logs.String(), "back where it was before its step") {
		t.Fatalf("put right: step %v, logs:\n%s", time.Duration(step.Load()), logs.String())
	}

	// A step the ledger's clock agrees with (the node's clock was the wrong
	// one, and NTP put it right) is followed.
	raw.SetWall(july)
	w.check(ctx, fixedLedgerClock{at: july})
	if step.Load() != 0 || month() != time.July || !strings.Contains(logs.String(), "now agrees with the ledger's: following it") {
		t.Fatalf("confirmed step: step %v, billing in %v, logs:\n%s", time.Duration(step.Load()), month(), logs.String())
	}
}

// A node whose system clock jumps into the next month goes on billing in
// this one, and says so on its status page and in its gauges; put right,
// it follows the clock again.
func TestNodeBillsThroughAClockJumpInItsMonth(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	var logs logbuf.Buffer
	nd := startNodesWith(t, dsn, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })[0]
	if nd.sys == nil || nd.steady == nil {
		t.Fatal("a node without Config.Clock does not read the system clock through a steady clock")
	}
	ctx := context.Background()
	thisMonth := shard.PeriodOf(time.Now().UnixNano()).End() / 1e9
	charge := func(id string) {
		t.Helper()
		res, err := nd.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1, EventID: id})
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %s: %v %v", id, res.Reason, err)
		}
		if res.Reset != thisMonth {
			t.Fatalf("charge %s answered in the month that resets %s, want %s", id,
				time.Unix(res.Reset, 0).UTC().Format(time.DateOnly), time.Unix(thisMonth, 0).UTC().Format(time.DateOnly))
		}
	}
	charge("before")
	now := time.Now().UTC()
	nd.sys.SetOffset(time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now))
	charge("during")
	waitFor(t, 10*time.Second, "the step held against", func() bool { return gaugeValue(t, nd, "quotaring_clock_step_seconds") > 3600 })
	if d := nd.statusData(ctx); d.ClockStep == "" || d.ClockOff {
		t.Fatalf("status page: step %q, clock off %v; want the step shown, the clock the node bills by not off", d.ClockStep, d.ClockOff)
	}
	if !strings.Contains(logs.String(), "keeps the time it had before the step") {
		t.Fatalf("no warning about the step:\n%s", logs.String())
	}
	charge("later")
	nd.sys.SetOffset(0)
	charge("put right")
	// The next check sees the clock back (every 15 s; Track is what the
	// loop runs, so run one here rather than wait).
	if d := nd.steady.Track(); d != 0 {
		t.Fatalf("put right, the clock still stands %v from the one the node keeps", d)
	}
}

// A node whose clock is off the ledger's with no step to show for it (it
// started that way) takes the ledger's time when more of the other members
// agree with the ledger than not, and only warns otherwise.
func TestClockWatchTakesTheLedgersTimeWhenTheOthersSideWithIt(t *testing.T) {
	ahead := time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC)
	ledger := time.Date(2026, 6, 30, 23, 50, 0, 0, time.UTC)
	raw := engine.NewManualClock(ahead)
	steady := engine.NewSteadyClock(raw, DefaultMaxClockOffset) // trusts the clock as it starts
	var logs logbuf.Buffer
	var offset, step atomic.Int64
	var agree, off int
	var published []ring.ClockVerdict
	w := &clockWatch{steady: steady, clock: steady, log: slog.New(slog.NewTextHandler(&logs, nil)), offset: &offset, step: &step, max: DefaultMaxClockOffset,
		peers:   func() (int, int) { return agree, off },
		publish: func(_ context.Context, v ring.ClockVerdict) { published = append(published, v) }}
	ctx := context.Background()
	month := func() time.Month { return time.Unix(0, steady.Now().Wall).UTC().Month() }

	// Alone, then with as many others off as agreeing: the ledger's clock
	// may be the wrong one; warn, bill by the node's own.
	for _, p := range [][2]int{{0, 0}, {1, 1}} {
		agree, off = p[0], p[1]
		w.check(ctx, fixedLedgerClock{at: ledger})
		if month() != time.July || step.Load() != 0 {
			t.Fatalf("%d others agree, %d off: billing in %v, step %v; want July, no step", agree, off, month(), time.Duration(step.Load()))
		}
	}
	if !strings.Contains(logs.String(), "this node's clock is 1h10m0s ahead of the ledger's") || strings.Contains(logs.String(), "bills by the ledger's time") {
		t.Fatalf("want the offset warning alone:\n%s", logs.String())
	}
	if !slices.Equal(published, []ring.ClockVerdict{ring.ClockOff}) {
		t.Fatalf("published %v, want [off]", published)
	}

	// Two of three others side with the ledger: take its time.
	agree, off = 2, 1
	w.check(ctx, fixedLedgerClock{at: ledger})
	if month() != time.June {
		t.Fatalf("with the others siding with the ledger the node bills in %v, want June", month())
	}
	if got := time.Duration(step.Load()); (got - 70*time.Minute).Abs() > 10*time.Millisecond {
		t.Fatalf("step gauge %v, want about 1h10m (the clock's offset)", got)
	}
	if got := time.Duration(offset.Load()); got.Abs() > 10*time.Millisecond {
		t.Fatalf("offset of the clock the node bills by: %v, want about 0", got)
	}
	if !strings.Contains(logs.String(), "and 2 of the other members agree with the ledger's (1 do not): the node bills by the ledger's time") {
		t.Fatalf("want a warning that the node takes the ledger's time:\n%s", logs.String())
	}
	if !slices.Equal(published, []ring.ClockVerdict{ring.ClockOff, ring.ClockAgrees}) {
		t.Fatalf("published %v, want [off agrees]", published)
	}
	w.check(ctx, fixedLedgerClock{at: ledger})
	if n := strings.Count(logs.String(), "bills by the ledger's time"); n != 1 || strings.Contains(logs.String(), "stepped by") {
		t.Fatalf("a second check: %d warnings about the ledger's time (want 1), or one about a step:\n%s", n, logs.String())
	}

	// NTP puts the clock right: the node follows its own again.
	raw.SetWall(ledger.Add(100 * time.Millisecond))
	w.check(ctx, fixedLedgerClock{at: ledger})
	if step.Load() != 0 || !strings.Contains(logs.String(), "following its own again") {
		t.Fatalf("clock put right: step %v, logs:\n%s", time.Duration(step.Load()), logs.String())
	}
}

// Two nodes: the second's clock is a month ahead as if it had started so
// (trusted, no step). Once the first's verdict reaches it, it bills by the
// ledger's time, in this month.
func TestNodeWithAClockOffTakesTheLedgersTime(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	accounts := map[string]int64{}
	for i := range 20 {
		accounts[fmt.Sprint("a", i)] = 100
	}
	seedLedger(t, dsn, accounts)
	var logs logbuf.Buffer
	nodes := startNodesWith(t, dsn, nil, func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })
	n2 := nodes[1]
	waitFor(t, 10*time.Second, "the first node's verdict at the second", func() bool {
		agree, _ := n2.peerClocks()
		return agree == 1
	})
	var mine string // an account n2 owns
	for id := range accounts {
		if m, ok := n2.Ring().Owner(id); ok && m.ID == n2.cfg.ID {
			mine = id
			break
		}
	}
	if mine == "" {
		t.Fatal("n2 owns none of 20 accounts")
	}
	now := time.Now().UTC()
	n2.sys.SetOffset(time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now))
	n2.steady.Trust() // as if it had started with this clock
	n2.clockWake <- struct{}{}
	waitFor(t, 10*time.Second, "n2 billing by the ledger's time", func() bool { return gaugeValue(t, n2, "quotaring_clock_step_seconds") > 3600 })
	if !strings.Contains(logs.String(), "1 of the other members agree with the ledger's (0 do not)") {
		t.Fatalf("no warning that the node takes the ledger's time:\n%s", logs.String())
	}
	thisMonth := shard.PeriodOf(time.Now().UnixNano()).End() / 1e9
	res, err := nodes[0].Router().Charge(context.Background(), router.ChargeRequest{Account: mine, Route: "GET /x", Units: 1, EventID: "e1"})
	if err != nil || res.Reason != shard.OK || res.Reset != thisMonth {
		t.Fatalf("charge at n2 through n1: %v %v, reset %s; want ok in this month", res.Reason, err, time.Unix(res.Reset, 0).UTC().Format(time.DateOnly))
	}
	n2.sys.SetOffset(0)
	n2.clockWake <- struct{}{}
	waitFor(t, 10*time.Second, "n2 following its own clock again", func() bool { return gaugeValue(t, n2, "quotaring_clock_step_seconds") == 0 })
}

// A node that starts with its clock a month ahead, beside one whose clock
// agrees with the ledger's, bills by the ledger's time from its first
// account on: Start checks the clock, and waits for the other's verdict,
// before the node takes any.
func TestNodeStartedWithItsClockOffTakesTheLedgersTimeAtOnce(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	now := time.Now().UTC()
	ahead := time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now)
	var logs logbuf.Buffer
	nodes := startNodesWith(t, dsn, nil, func(c *Config) {
		c.TestClockOffset = ahead
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	n2 := nodes[1]
	if got := time.Unix(0, n2.clock.Now().Wall).UTC(); got.Month() != now.Month() {
		t.Fatalf("right after Start the node bills at %v, want this month (%v)", got, now.Month())
	}
	if got := time.Duration(n2.clockStep.Load()); (got - ahead).Abs() > time.Second {
		t.Fatalf("step gauge right after Start: %v, want about %v", got, ahead)
	}
	if !strings.Contains(logs.String(), "1 of the other members agree with the ledger's (0 do not)") {
		t.Fatalf("no warning that the node takes the ledger's time:\n%s", logs.String())
	}
}

// The status page gives the time the node bills by (here a lone node's
// clock, two days off, which it follows for want of others to side with
// the ledger), not the process's.
func TestStatusPageShowsTheTimeTheNodeBillsBy(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 10})
	n1 := startNodesWith(t, dsn, func(c *Config) { c.TestClockOffset = 48 * time.Hour })[0]
	billing := time.Unix(0, n1.clock.Now().Wall).UTC()
	if billing.Sub(time.Now()) < 47*time.Hour {
		t.Fatalf("the lone node bills at %v, not two days ahead: the test's premise does not hold", billing)
	}
	if page := statusPage(t, n1); !strings.Contains(page, billing.Format("2006-01-02")) {
		t.Fatalf("the status page does not show the time the node bills by (%s)", billing.Format("2006-01-02"))
	}
}

// gaugeValue reads one gauge from the node's registry.
func gaugeValue(t *testing.T, nd *Node, name string) float64 {
	t.Helper()
	families, err := nd.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no gauge %s", name)
	return 0
}

// A node restarted alone with its clock a month ahead (its seeds do not
// answer) waits for the others, as a node alone does; when they reach it,
// it asks their verdicts on its clock before it takes an account, and
// bills by the ledger's time from the first. It took accounts by its own
// clock until the clock loop's next check: the accounts it charged moved
// into the next month for good, and the client ids they remembered expired
// there (a retry billed twice: chaos seed 56).
func TestNodeRestartedAloneWithItsClockOffTakesTheLedgersTimeBeforeServing(t *testing.T) {
	now := time.Now().UTC()
	var logs logbuf.Buffer
	again, n2 := restartAlone(t, func(c *Config, _ *Node) {
		c.TestClockOffset = time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now)
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	if why := again.notServable(); !strings.Contains(why, "alone in the ring") {
		t.Fatalf("restarted alone: notServable %q, want it waiting for n2", why)
	}

	n2.gossipF.UnblockAll() // n2's rejoin loop reaches it
	waitFor(t, 20*time.Second, "the restarted node serving", again.isServing)
	if got := time.Unix(0, again.clock.Now().Wall).UTC(); got.Month() != now.Month() {
		t.Fatalf("as it took accounts the node billed at %v, want this month (%v): n2 agrees with the ledger's clock\n%s", got, now.Month(), logs.String())
	}
	if !strings.Contains(logs.String(), "1 of the other members agree with the ledger's (0 do not)") {
		t.Fatalf("no warning that the node takes the ledger's time:\n%s", logs.String())
	}
}

// A first node (no --join) restarted with its clock a month ahead finds
// nobody to ask at its clock check, alone in its ring; when the others
// reach it before it looks whether it may serve, it asks them before its
// first account. It served by its own clock until the clock loop's next
// check: the accounts it charged moved into the next month for good, and
// retries of their client ids were billed twice (chaos seed 81).
func TestFirstNodeRestartedWithItsClockOffAsksTheOthersWhoReachedIt(t *testing.T) {
	now := time.Now().UTC()
	var logs logbuf.Buffer
	checked := false
	again, _ := restartAlone(t, func(c *Config, n2 *Node) {
		if len(c.Join) != 0 {
			t.Fatalf("n1 has --join %v: the test wants the first node, which has none", c.Join)
		}
		c.TestClockOffset = time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now)
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		c.afterClockCheck = func(nd *Node) { // alone at its clock check: n2 cannot reach it
			checked = true
			if !strings.Contains(logs.String(), "ahead of the ledger's") {
				t.Errorf("at the clock check the node did not find its clock ahead:\n%s", logs.String())
			}
			n2.gossipF.UnblockAll() // n2's rejoin loop reaches it now
			waitFor(t, 20*time.Second, "the restarted node seeing n2", func() bool { return len(nd.Ring().View().Members) == 2 })
		}
	})
	if !checked {
		t.Fatal("Start did not run the hook after its clock check")
	}
	if !again.isServing() {
		t.Fatalf("n2 reached the node before it looked, but it did not serve at once: %q", again.notServable())
	}
	if got := time.Unix(0, again.clock.Now().Wall).UTC(); got.Month() != now.Month() {
		t.Fatalf("as it took accounts the node billed at %v, want this month (%v): n2 agrees with the ledger's clock\n%s", got, now.Month(), logs.String())
	}
	if !strings.Contains(logs.String(), "1 of the other members agree with the ledger's (0 do not)") {
		t.Fatalf("no warning that the node takes the ledger's time:\n%s", logs.String())
	}
}
