package node

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logbuf"
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

// A step of the system clock is held against until the ledger's clock
// confirms the new reading or the clock comes back; each is logged once.
func TestClockWatchHoldsAStepUntilTheLedgerConfirmsIt(t *testing.T) {
	june := time.Date(2026, 6, 30, 23, 59, 50, 0, time.UTC)
	july := time.Date(2026, 7, 1, 1, 0, 0, 0, time.UTC)
	raw := engine.NewManualClock(june)
	steady := engine.NewSteadyClock(raw, maxClockOffset)
	var logs logbuf.Buffer
	var offset, step atomic.Int64
	w := &clockWatch{steady: steady, clock: steady, log: slog.New(slog.NewTextHandler(&logs, nil)), offset: &offset, step: &step}
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
