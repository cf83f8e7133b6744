package node

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logbuf"
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
