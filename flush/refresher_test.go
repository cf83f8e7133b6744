package flush

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/snapshot"
)

// A route table stored before SetRoutes refused unmatchable patterns is
// applied, and its unmatchable patterns are logged once per version.
func TestRefresherWarnsOfUnmatchableRoutes(t *testing.T) {
	ctx := context.Background()
	l, e := ledgerRig(t, nil)
	v, err := l.SetRoutes(ctx, 1, map[string]int64{"POST /v1/exports": 25, "GET /v1/tasks": 1})
	if err != nil {
		t.Fatal(err)
	}
	mustExecSQL(t, l, fmt.Sprintf(`UPDATE route_weights SET pattern = 'get /v1/tasks' WHERE version = %d AND pattern = 'GET /v1/tasks'`, v))

	var out bytes.Buffer
	r := &Refresher{Ledger: l, Engine: e, Logger: slog.New(slog.NewTextHandler(&out, nil))}
	for range 2 {
		if err := r.RefreshOnce(ctx); err != nil {
			t.Fatalf("refresh with a stored unmatchable pattern: %v; want it applied", err)
		}
	}
	if s := e.Snapshot(); s == nil || s.Routes.Version != v {
		t.Fatalf("engine snapshot %+v, want routes version %d", s, v)
	}
	if n := strings.Count(out.String(), "level=WARN"); n != 1 || !strings.Contains(out.String(), `get /v1/tasks`) || !strings.Contains(out.String(), "quotad admin routes set") {
		t.Fatalf("%d warnings, want 1 naming the pattern and the fix:\n%s", n, out.String())
	}
	if _, err := l.SetRoutes(ctx, 1, map[string]int64{"GET /v1/tasks": 1}); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := r.RefreshOnce(ctx); err != nil || out.Len() != 0 {
		t.Fatalf("refresh of a clean table: %v, logged %q", err, out.String())
	}
}

// hungSnapshotLedger's Snapshot hangs until its caller gives up.
type hungSnapshotLedger struct {
	Ledger
	calls atomic.Int64
}

func (l *hungSnapshotLedger) Snapshot(ctx context.Context, _ time.Time) (*snapshot.Snapshot, error) {
	l.calls.Add(1)
	<-ctx.Done()
	return nil, ctx.Err()
}

// A snapshot read that hung (a lock on a config table, a connection to a
// server gone without a word) stopped the loop for good: the node enforced
// its last config for the rest of its life, without a word in the log. Each
// read is bounded, the loop goes on, and the failures are logged once a
// minute, with the snapshot's age.
func TestRefresherGivesUpOnAHungRead(t *testing.T) {
	sq, e := ledgerRig(t, nil)
	l := &hungSnapshotLedger{Ledger: sq}
	var out logbuf.Buffer
	r := &Refresher{Ledger: l, Engine: e, Interval: time.Millisecond, Timeout: 5 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&out, nil))}
	r.Start()
	defer r.Close()
	waitfor.Cond(t, 10*time.Second, "three snapshot reads", func() bool { return l.calls.Load() >= 3 })
	r.Close()
	if n := r.Errors(); n < 2 {
		t.Fatalf("%d failed refreshes counted, want each hung read", n)
	}
	log := out.String()
	if n := strings.Count(log, "level=WARN"); n != 1 || !strings.Contains(log, "no snapshot within 5ms") || !strings.Contains(log, "snapshot_age=\"none read yet\"") {
		t.Fatalf("%d warnings, want 1 naming the bound and the snapshot's age:\n%s", n, log)
	}
}

// olderSnapshotLedger serves its ledger's config under a lower version, as
// a ledger restored from a backup does.
type olderSnapshotLedger struct{ Ledger }

func (l olderSnapshotLedger) Snapshot(ctx context.Context, at time.Time) (*snapshot.Snapshot, error) {
	s, err := l.Ledger.Snapshot(ctx, at)
	if err == nil {
		s.Version--
	}
	return s, err
}

// A config older than the one held (a ledger restored from a backup) undoes
// what changed since on every node, keys revoked since working again; it is
// applied (the ledger is the only source) with a warning, once a version.
func TestRefresherWarnsOfAnOlderConfig(t *testing.T) {
	ctx := context.Background()
	l, e := ledgerRig(t, nil)
	if _, err := l.SetRoutes(ctx, 1, map[string]int64{"GET /v1/tasks": 1}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	r := &Refresher{Ledger: l, Engine: e, Logger: slog.New(slog.NewTextHandler(&out, nil))}
	if err := r.RefreshOnce(ctx); err != nil || out.Len() != 0 {
		t.Fatalf("first refresh: %v, logged %q", err, out.String())
	}
	held := e.Snapshot().Version
	r.Ledger = olderSnapshotLedger{l}
	for range 2 {
		if err := r.RefreshOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := e.Snapshot().Version; got != held-1 {
		t.Fatalf("config version %d after the older one was read, want %d (applied)", got, held-1)
	}
	if n := strings.Count(out.String(), "level=WARN"); n != 1 || !strings.Contains(out.String(), "older than the one this node held") {
		t.Fatalf("%d warnings, want 1 saying the config went back:\n%s", n, out.String())
	}
}
