package flush

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/wal"
)

// An idle node still writes its heartbeat to the ledger (quotad revoke
// tells a running node from a lost one by it).
func TestIdleSettlerHeartbeats(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects now
	now := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	l, s := settlerRig(t, clock, SettlerOptions{Heartbeat: time.Nanosecond})
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	heartbeat := func() time.Time {
		t.Helper()
		nodes, err := l.Nodes(ctx)
		if err != nil || len(nodes) != 1 {
			t.Fatalf("nodes %v, %v", nodes, err)
		}
		return nodes[0].Heartbeat
	}
	if h := heartbeat(); !h.Equal(now) {
		t.Fatalf("heartbeat %s after Register, want %s", h, now)
	}
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	if n, err := s.SettleOnce(ctx); err != nil || n != 0 {
		t.Fatalf("settle of an empty log: %d, %v", n, err)
	}
	if h := heartbeat(); !h.Equal(clock()) {
		t.Fatalf("heartbeat %s after an idle settle a minute on, want %s", h, clock())
	}
}

// With a settle interval longer than the heartbeat's, the loop still
// heartbeats (revoke would otherwise take a running node for a lost one).
func TestSettlerLoopHeartbeatsBetweenSettles(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects now
	now := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); now = now.Add(time.Second); return now }
	l, s := settlerRig(t, clock, SettlerOptions{Interval: time.Hour, Heartbeat: 10 * time.Millisecond})
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	first := lastHeartbeat(t, l)
	s.Start()
	defer s.Close()
	deadline := time.Now().Add(10 * time.Second)
	for !lastHeartbeat(t, l).After(first) {
		if time.Now().After(deadline) {
			t.Fatal("no heartbeat within 10 s with a settle interval of an hour")
		}
		time.Sleep(5 * time.Millisecond) // NB: polls a condition, bounded by the deadline
	}
}

func lastHeartbeat(t *testing.T, l Ledger) time.Time {
	t.Helper()
	nodes, err := l.Nodes(context.Background())
	if err != nil || len(nodes) != 1 {
		t.Fatalf("nodes %v, %v", nodes, err)
	}
	return nodes[0].Heartbeat
}

// settlerRig opens a migrated SQLite ledger on clock, a log and an engine
// of node q1 (ledgerRig), and a settler with opts (Ledger and Engine filled
// in); all are closed when the test ends.
func settlerRig(t *testing.T, clock func() time.Time, opts SettlerOptions) (*SQLite, *Settler) {
	t.Helper()
	l, e := ledgerRig(t, clock)
	opts.Ledger, opts.Engine = l, e
	s, err := NewSettler(opts)
	if err != nil {
		t.Fatal(err)
	}
	return l, s
}

// ledgerRig opens a migrated SQLite ledger on clock (nil: the wall clock)
// and a log and an engine of node q1, closed when the test ends.
func ledgerRig(t *testing.T, clock func() time.Time) (*SQLite, *engine.Engine) {
	t.Helper()
	ctx := context.Background()
	l, err := OpenSQLite(ctx, filepath.Join(t.TempDir(), "ledger.db"), SQLiteOptions{Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	log, err := wal.Open(wal.Options{Dir: t.TempDir(), NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.Open(engine.Options{Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); log.Close() })
	return l, e
}
