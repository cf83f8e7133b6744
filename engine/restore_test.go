package engine_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// restartRig is one node's log, engine and settler on a shared ledger,
// reopened on the same data dir by open.
type restartRig struct {
	t     *testing.T
	l     flush.Ledger
	clock *engine.ManualClock
	dir   string
	node  string
	owns  func(account string) bool // nil: every account
	log   *wal.Log
	e     *engine.Engine
	s     *flush.Settler
}

func (r *restartRig) open() {
	r.t.Helper()
	log, err := wal.Open(wal.Options{Dir: filepath.Join(r.dir, r.node), NodeID: r.node})
	if err != nil {
		r.t.Fatal(err)
	}
	e, err := engine.Open(engine.Options{Log: log, Clock: r.clock, Reserver: &flush.Reserver{Ledger: r.l, Node: r.node, Incarnation: log.Incarnation()}, Owns: r.owns})
	if err != nil {
		r.t.Fatal(err)
	}
	s, err := flush.NewSettler(flush.SettlerOptions{Ledger: r.l, Engine: e, Events: true})
	if err != nil {
		r.t.Fatal(err)
	}
	if err := s.Register(context.Background()); err != nil {
		r.t.Fatal(err)
	}
	r.log, r.e, r.s = log, e, s
}

func (r *restartRig) close() { r.e.Close(); r.log.Close() }

// refresh reads the config snapshot as a node does: the settled mark first.
func (r *restartRig) refresh() {
	r.t.Helper()
	settled := r.log.SettledSeq()
	snap, err := r.l.Snapshot(context.Background(), time.Unix(0, r.clock.Now().Wall))
	if err != nil {
		r.t.Fatal(err)
	}
	if err := r.e.SetSnapshot(snap, settled); err != nil {
		r.t.Fatal(err)
	}
}

func (r *restartRig) settle() {
	r.t.Helper()
	if _, err := r.s.SettleOnce(context.Background()); err != nil {
		r.t.Fatal(err)
	}
}

func (r *restartRig) charge(account string, units int64) engine.Result {
	r.t.Helper()
	res, err := r.e.Charge(context.Background(), account, shard.Charge{Route: "r", Units: units})
	if err != nil || res.Reason != shard.OK {
		r.t.Fatalf("%s: charge %d of %s: %s, %v", r.node, units, account, res.Reason, err)
	}
	return res
}

// bumpConfig changes the config's version, so that the next refresh keeps
// its snapshot in the log.
func bumpConfig(t *testing.T, l flush.Ledger, plan string) {
	t.Helper()
	if err := l.UpsertPlan(context.Background(), snapshot.Plan{ID: plan, MonthlyQuota: 5, Hard: true}); err != nil {
		t.Fatal(err)
	}
}

// A restart configures the accounts it restores from the snapshot kept in
// the log, whose settled use was read at some settled mark: it counts for
// an account only if that read came after every record the account's
// checkpoint holds. It counted always: a charge settled, then refunded,
// the config changed (the snapshot kept, reading the charge's units as
// used), the refund settled, and after a restart the account counted the
// refunded units as used again until its month ended (a hard quota of 100
// with nothing used refused 95). And it still counts where it should: use
// another node settled while the account was away.
func TestRestartCountsTheKeptSnapshotOnlyWhereItIsNewer(t *testing.T) {
	ctx := context.Background()
	t.Run("refund settled after the snapshot was read", func(t *testing.T) {
		dir := t.TempDir()
		r := &restartRig{t: t, l: hardLedger(t, dir, "a1"), clock: engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), dir: dir, node: "n1"}
		r.open()
		r.refresh()
		res := r.charge("a1", 10)
		r.settle() // the ledger: used 10
		if d, err := r.e.Refund(ctx, "a1", res.EventID, res.Receipt); err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund: %s, %v", d.Reason, err)
		}
		bumpConfig(t, r.l, "other")
		r.refresh() // kept: used 10, the refund not settled
		r.settle()  // the account's checkpoint: used 0
		r.close()
		r.open()
		defer r.close()
		if u, _, _ := r.e.Usage("a1"); u.Used != 0 {
			t.Errorf("after the restart a1 uses %d, want 0 (its one charge was refunded)", u.Used)
		}
		r.charge("a1", 95)
	})
	t.Run("another node's use settled before the snapshot was read", func(t *testing.T) {
		dir := t.TempDir()
		l := hardLedger(t, dir, "a1")
		clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
		r := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n1"}
		r.open()
		r.refresh()
		r.charge("a1", 10)
		r.settle() // a1's checkpoint: used 10
		if err := r.e.Release(ctx, "a1"); err != nil {
			t.Fatal(err)
		}
		r.settle()
		other := &restartRig{t: t, l: l, clock: clock, dir: dir, node: "n2"}
		other.open()
		other.refresh()
		other.charge("a1", 30)
		other.settle()
		other.close()
		bumpConfig(t, l, "other")
		r.refresh() // kept: used 40, read after a1's last record here
		r.close()
		r.open()
		defer r.close()
		if u, _, _ := r.e.Usage("a1"); u.Used != 40 {
			t.Errorf("after the restart a1 uses %d, want 40 (10 here, 30 at n2, all settled before the kept snapshot was read)", u.Used)
		}
	})
}
