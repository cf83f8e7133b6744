package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// A data dir restored from a copy older than the ledger, started while the
// ledger is down, serves from the copy; its charges take sequence numbers
// the original dir used and the ledger settled. When the ledger answers,
// the node can never settle them: it used to log an ERROR every retry and
// go on taking charges (ready, hard accounts served from the copy's
// allowances), and its stop said "the ledger was never reached". It stops
// taking charges and exits without settling, says what it refused at its
// stop, leaves in the dir which records the ledger billed already, and
// refuses to start on the dir again, whether the ledger is up or down.
func TestStaleDataDirStopsWhenTheLedgerAnswers(t *testing.T) {
	dsn, direct, proxy, ok := proxiedPG(t)
	if !ok {
		return
	}
	ctx := context.Background()
	l, err := flush.Open(ctx, direct, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Soft: charges need no reservation, so the stale node serves them
	// whatever the copy held reserved.
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "metered", MonthlyQuota: 1000}); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acme", "metered"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	orig, stale := filepath.Join(dir, "n1"), filepath.Join(dir, "copy")
	var logs logbuf.Buffer
	start := func(dataDir string) (*Node, error) {
		cfg := nodeConfig(dsn, "n1", dataDir)
		cfg.LedgerRetry = 50 * time.Millisecond
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		return Start(ctx, cfg)
	}
	mustStart := func(dataDir string) *Node {
		t.Helper()
		nd, err := start(dataDir)
		if err != nil {
			t.Fatalf("start on %s: %v", dataDir, err)
		}
		waitFor(t, 20*time.Second, "n1 serving", nd.isServing)
		return nd
	}
	charge := func(nd *Node) (shard.Decision, error) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		res, err := nd.Router().Charge(cctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1})
		return res.Decision, err
	}
	chargeN := func(nd *Node, k int) {
		t.Helper()
		for range k {
			waitFor(t, 10*time.Second, "a charge of acme", func() bool {
				d, err := charge(nd)
				return err == nil && d.Reason == shard.OK
			})
		}
	}
	settled := func(nd *Node) {
		t.Helper()
		waitFor(t, 10*time.Second, "n1's log settled", func() bool { return nd.wal.SettledSeq() == nd.wal.DurableSeq() })
	}

	// The original dir: 2 charges settled, 3 left unsettled by a crash
	// while the ledger was down, and copied then (a disk snapshot).
	nd := mustStart(orig)
	chargeN(nd, 2)
	settled(nd)
	proxy.SetDown(true)
	chargeN(nd, 3)
	nd.Kill()
	if err := os.CopyFS(stale, os.DirFS(orig)); err != nil {
		t.Fatal(err)
	}
	_ = os.Remove(filepath.Join(stale, "LOCK"))
	proxy.SetDown(false)
	// The original goes on: it settles the 3 and 4 more, and stops cleanly.
	nd = mustStart(orig)
	chargeN(nd, 4)
	settled(nd)
	mark := nd.wal.SettledSeq()
	if err := nd.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}

	// The copy, started with the ledger down: it serves from the copy.
	proxy.SetDown(true)
	st := mustStart(stale)
	opened := st.wal.DurableSeq()
	if opened >= mark {
		t.Fatalf("the copy holds records to %d, the ledger settled the original to %d: not a stale copy", opened, mark)
	}
	chargeN(st, 5)
	taken := st.wal.DurableSeq()
	proxy.SetDown(false)
	select {
	case <-st.Fenced():
	case <-time.After(30 * time.Second):
		st.Shutdown(ctx)
		t.Fatalf("the stale copy went on serving after the ledger answered:\n%s", logs.String())
	}
	if d, err := charge(st); err == nil && d.Reason == shard.OK {
		t.Fatal("the stale copy took a charge after it found the conflict")
	}
	err = st.StopFenced(ctx)
	if !errors.Is(err, flush.ErrMarkConflict) || !errors.Is(err, flush.ErrStaleDataDir) ||
		!strings.Contains(err.Error(), "the ledger was reached and refused this data dir") || strings.Contains(err.Error(), "never reached") {
		t.Fatalf("StopFenced: %v; want the mark conflict, saying the ledger refused the dir", err)
	}
	// The likeliest remedy first: the node's current dir, if it exists.
	if !strings.Contains(logs.String(), "if the node's current data dir still exists") {
		t.Errorf("the conflict's log does not say to start the node on its current dir if it still exists:\n%s", logs.String())
	}

	// The dir says which records the ledger billed (the copy's, to
	// opened) and which it never saw (the 5 taken since).
	ro, err := wal.Open(wal.Options{Dir: stale, AnyNode: true, ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	sd, ok, err := flush.ReadStaleDir(ro)
	ro.Close()
	if err != nil || !ok || sd.Billed != opened || sd.LedgerMark != mark || sd.Durable != taken {
		t.Fatalf("the stale note: %+v %v %v; want billed through %d, ledger mark %d, durable %d", sd, ok, err, opened, mark, taken)
	}
	events, err := l.Events(ctx, "acme")
	if err != nil || len(events) != 9 {
		t.Fatalf("acme's events: %d, %v; want the original's 9, none of the copy's", len(events), err)
	}

	// Started again on the dir, up or down, it refuses.
	for _, down := range []bool{true, false} {
		proxy.SetDown(down)
		nd, err := start(stale)
		if err == nil {
			nd.Shutdown(ctx)
			t.Fatalf("started again on the stale copy (ledger down: %v)", down)
		}
		if !errors.Is(err, flush.ErrStaleDataDir) || !strings.Contains(err.Error(), fmt.Sprint("quotad reconcile --data-dir ", stale)) {
			t.Fatalf("start again on the stale copy (ledger down: %v): %v; want ErrStaleDataDir naming reconcile", down, err)
		}
	}
	proxy.SetDown(false)
}
