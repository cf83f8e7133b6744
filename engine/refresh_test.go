package engine

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// refreshAcme applies what the refresher would read from a ledger holding
// used units of acme's June quota: snapshot version, with the log's settled
// mark read first.
func refreshAcme(t *testing.T, e *Engine, version, used int64) {
	t.Helper()
	mark := e.ReadMark()
	if err := e.SetSnapshotRead(acmeSnapshot(t, version, used), mark); err != nil {
		t.Fatal(err)
	}
}

// acmeSnapshot is version of a snapshot of one account, acme, with a
// quota of 100 and used settled in June 2026.
func acmeSnapshot(t *testing.T, version, used int64) *snapshot.Snapshot {
	t.Helper()
	s := testSnapshot(t, map[string]int64{"acme": 100})
	s.Version = version
	s.Accounts[0].MonthlyUsed = map[string]int64{"m:2026-06": used}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	return s
}

// A config refresh raises an account's use to the ledger's settled use only
// when the ledger holds every record this node logged for the account. A
// refund whose charge had settled when the ledger was read, and which had
// not settled itself, counted the charge again: the account showed 4 units
// fewer left than it had, for the rest of the month, and a hard account was
// refused them. (Found by TestProxyBadInput under load: the front's answer
// after a refund read 96 left, not 100.)
func TestRefreshDoesNotCountAnUnsettledRefundAgain(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, t.TempDir(), NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), testSnapshot(t, map[string]int64{"acme": 100}))
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 4})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	d, err := e.Refund(ctx, "acme", "e1", nil)
	if err != nil || d.Reason != shard.Refunded || d.Remaining != 100 {
		t.Fatalf("refund: %+v %v; want refunded, 100 left", d, err)
	}
	// The settler has put the charge in the ledger, not yet the refund.
	if err := e.Settle(ctx, res.Seq); err != nil {
		t.Fatal(err)
	}
	if settled := e.Log().SettledSeq(); settled != res.Seq || d.Seq <= settled {
		t.Fatalf("settled mark %d, charge %d, refund %d", settled, res.Seq, d.Seq)
	}
	remaining := func() int64 {
		t.Helper()
		u, ok, err := e.Usage("acme")
		if err != nil || !ok {
			t.Fatalf("usage: %v %v", ok, err)
		}
		return u.Remaining
	}
	refreshAcme(t, e, 2, 4)
	if got := remaining(); got != 100 {
		t.Fatalf("after a refresh that saw the charge and not its refund: %d left, want 100", got)
	}
	// Once the refund settled too, the ledger's figure is a lower bound of
	// the use again: another node's 3 units, settled, are counted.
	if err := e.Settle(ctx, d.Seq); err != nil {
		t.Fatal(err)
	}
	refreshAcme(t, e, 3, 3)
	if got := remaining(); got != 97 {
		t.Fatalf("after a refresh with every record settled and 3 units of another node's: %d left, want 97", got)
	}
}

// An account let go while its refund had not settled is kept until a
// snapshot includes the refund: dropped at once, it came back (the ring
// moved it away and back within a settle interval) seeded from a snapshot
// that held the charge and not the refund, and read 4 units used for good.
func TestForgetWaitsForASnapshotWithTheAccountsRecords(t *testing.T) {
	ctx := context.Background()
	var owns atomic.Bool
	owns.Store(true)
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Owns: func(string) bool { return owns.Load() }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	refreshAcme(t, e, 1, 0)
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 4})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	d, err := e.Refund(ctx, "acme", "e1", nil)
	if err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund: %+v %v", d, err)
	}
	if err := e.Settle(ctx, res.Seq); err != nil { // the charge settled, not the refund
		t.Fatal(err)
	}
	refreshAcme(t, e, 2, 4)

	owns.Store(false) // the account moves away...
	if e.Forget("acme") {
		t.Fatal("Forget dropped an account whose refund the snapshot lacks")
	}
	owns.Store(true) // ...and back
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Remaining != 100 {
		t.Fatalf("usage after the account came back: %+v %v %v; want 100 left", u, ok, err)
	}

	owns.Store(false) // away again; the refund settles and a snapshot shows it
	if e.Forget("acme") {
		t.Fatal("Forget dropped the account before a snapshot included its refund")
	}
	if err := e.Settle(ctx, d.Seq); err != nil {
		t.Fatal(err)
	}
	refreshAcme(t, e, 3, 0)
	if ids := e.AccountIDs(); len(ids) != 0 {
		t.Fatalf("accounts in memory after a snapshot with every record: %v, want the one let go dropped", ids)
	}
}
