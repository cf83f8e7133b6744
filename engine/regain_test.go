package engine

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// An account the ring takes away and gives back before a snapshot includes
// this node's records of it (Forget deferred: a flapping member, a join
// then a leave) must not answer from what it remembered before the loss:
// meanwhile the other owner refunded k1 (its attempt's upstream failed;
// the receipt named this node). A retry of k1 here was answered Replayed,
// served for nothing, and the 4 units the ledger had freed stayed counted
// here for the rest of the month (a refresh only raises use).
func TestRegainedAccountDoesNotAnswerFromBeforeTheLoss(t *testing.T) {
	ctx := context.Background()
	e, l, owns := openOwned(t, nil)
	refreshAcme(t, e, 1, 0)
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}

	owns.Store(false) // lost (releaseLost): k1 not settled yet, so kept
	if e.Forget("acme") {
		t.Fatal("Forget dropped an account whose charge the snapshot lacks")
	}
	// The new owner refunds k1 by its receipt; the ledger has k1 refunded.
	owns.Store(true) // ...and the account comes back at once

	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason == shard.Replayed {
		t.Errorf("retry of k1 after the account came back: replayed (served unbilled) from the dedup memory of before the loss; the other owner refunded k1 meanwhile")
	}
	// Everything settles; the ledger holds k1 refunded and (when charged
	// again above) taken over: 4 used if the retry was billed, 0 if not.
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	ledgerUsed := int64(0)
	if res.Reason == shard.OK {
		ledgerUsed = 4
	}
	refreshAcme(t, e, 2, ledgerUsed)
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Remaining != 100-ledgerUsed {
		t.Errorf("after a refresh with every record settled: %+v; want %d left as the ledger says", u, 100-ledgerUsed)
	}
}

// The same with reservations on: the stale use refused units the ledger
// had free (quota_exceeded until the month ended).
func TestRegainedHardAccountGetsItsRefundedUnits(t *testing.T) {
	ctx := context.Background()
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	e, l, owns := openOwned(t, ledger)
	refreshAcme(t, e, 1, 0) // quota 100
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 100}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	owns.Store(false)
	if err := e.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	e.Forget("acme")
	owns.Store(true) // back; the other owner refunded k1 meanwhile
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	// The first refresh finds the account back: it may have been read
	// before the account came back, so its use is not taken (see
	// TestRegainedAccountIgnoresASnapshotReadBeforeItCameBack); the next
	// one's is.
	refreshAcme(t, e, 2, 0)
	refreshAcme(t, e, 3, 0) // ledger: 0 used, 100 free
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k2", ClientID: true, Units: 50})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge of 50 with the ledger at 0 of 100 used: %+v %v", res.Reason, err)
	}
}

// The same when the hand-back failed (the ledger down as the ring took
// the account): the node skipped Forget for it, so the account was never
// let go, and a regain answered from before the loss all the same. LetGo
// lets it go whatever the hand-back did.
func TestLetGoAfterAFailedHandBack(t *testing.T) {
	ctx := context.Background()
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	e, _, owns := openOwned(t, ledger)
	refreshAcme(t, e, 1, 0)
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	owns.Store(false)
	ledger.mu.Lock()
	ledger.refuse = true
	ledger.mu.Unlock()
	if err := e.LetGo(ctx, "acme"); err == nil {
		t.Fatal("LetGo with the ledger refusing the hand-back: nil, want its error")
	}
	owns.Store(true) // back; the other owner refunded k1 meanwhile
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason == shard.Replayed {
		t.Errorf("retry of k1 after the account came back (its hand-back had failed): replayed from the dedup memory of before the loss")
	}
}

// openOwned opens an engine on 10 June 2026 (reserving from ledger, when
// not nil) that owns every account while the returned switch is on (it
// starts on).
func openOwned(t *testing.T, ledger *fakeLedger) (*Engine, *wal.Log, *atomic.Bool) {
	t.Helper()
	owns := new(atomic.Bool)
	owns.Store(true)
	l := openLog(t, t.TempDir())
	opts := Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Owns: func(string) bool { return owns.Load() }}
	if ledger != nil {
		opts.Reserver = ledger
	}
	e, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	return e, l, owns
}

// The ring can take an account away and give it back before the node hears
// of the loss (its Changes are read after the fact: by then the account is
// its own again, and nothing is let go). The tenure tells: an account found
// under another tenure than its last decision's is regained, so a retry of
// k1, which the other owner refunded meanwhile, is charged, not answered
// Replayed, and the usage by route does not count k1's refunded charge.
func TestAccountBackUnderANewTenure(t *testing.T) {
	ctx := context.Background()
	tenure := new(atomic.Uint64)
	tenure.Store(1)
	e, k1 := chargeK1(t, Options{Tenure: func(string) uint64 { return tenure.Load() }})
	if res, err := e.Charge(ctx, "acme", k1); err != nil || res.Reason != shard.Replayed {
		t.Fatalf("a retry under the same tenure: %+v %v, want Replayed", res, err)
	}
	tenure.Store(2) // away and back; the other owner refunded k1
	if res, err := e.Charge(ctx, "acme", k1); err != nil || res.Reason != shard.OK {
		t.Fatalf("the retry under a new tenure: %+v %v, want OK (charged: what this node remembers of k1 is stale)", res, err)
	}
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Routes["GET /x"] != 4 {
		t.Errorf("usage under the new tenure: %+v, %v; want 4 units on GET /x (the retry's)", u, err)
	}
}

// A decision reads the ring once: the ownership it is let through under
// and the tenure it compares are one reading. Here the ring changes between
// two readings (Owns says owned under a new tenure, then the account is
// gone again: Tenure says 0). Read apart, the decision went ahead without
// noticing it had been away, and answered a retry of k1, which the other
// owner had refunded, Replayed from what it remembered from before.
func TestADecisionReadsTheTenureItIsLetThroughUnder(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects tenures
	tenures := []uint64{1}
	e, k1 := chargeK1(t, Options{Owns: func(string) bool { return true },
		Tenure: func(string) uint64 {
			mu.Lock()
			defer mu.Unlock()
			t := tenures[0]
			if len(tenures) > 1 {
				tenures = tenures[1:]
			}
			return t
		}})
	mu.Lock()
	tenures = []uint64{0, 2} // the next reading finds it gone; the one after, back
	mu.Unlock()
	res, err := e.Charge(ctx, "acme", k1)
	switch {
	case errors.Is(err, ErrNotOwner):
		res, err = e.Charge(ctx, "acme", k1) // the caller's retry, under tenure 2
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("the retry under tenure 2: %+v %v, want OK (charged: what this node remembers of k1 is stale)", res, err)
		}
	case err != nil || res.Reason != shard.OK:
		t.Fatalf("a retry of k1 decided while the ring moved: %+v %v; want ErrNotOwner or OK, never Replayed from before the account went away", res, err)
	}
}

// An account that comes to this node is seeded from the config snapshot,
// whose use may count a charge the account's last owner refunded and had
// not settled when the ledger was read: 4 used where the ledger, a moment
// later, says 0. A refresh only raises use (this node's unsettled charges
// are not in the ledger), so the 4 stayed counted for the month: usage
// showed them, and alerts read them. The first refresh that holds every
// record of this node's of the account sets its use to the ledger's.
func TestNewOwnerTakesTheLedgersUseOnceItHoldsItsRecords(t *testing.T) {
	ctx := context.Background()
	e, l, _ := openOwned(t, nil)
	refreshAcme(t, e, 1, 4) // the last owner's charge, its refund not settled yet
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k2", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	refreshAcme(t, e, 2, 0) // the refund settled; k2 has not: 5 used here stay
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 5 {
		t.Fatalf("with k2 unsettled: %+v, %v; want 5 used (raised only)", u, err)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	refreshAcme(t, e, 3, 1) // the ledger: k2 only
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 1 || u.Remaining != 99 {
		t.Errorf("once the ledger holds k2: %+v, %v; want 1 used, 99 left, as the ledger says", u, err)
	}
}

// A snapshot read before an account came back must not set its use: it
// may lack what the other owner settled before letting the account go.
// Here a refresh began while the account was away, read the ledger before
// the other owner's refund of k1 settled (4 used), and was applied after
// the account came back: it set the use to its 4 and counted the account
// reseeded, so the refund stayed counted here for the month (a refresh
// only raises use) and the retry of k1 made it 8. (Found by
// TestAccountComesBackAfterARefundElsewhere under load: the owner showed 2
// used where the ledger held 1.)
func TestRegainedAccountIgnoresASnapshotReadBeforeItCameBack(t *testing.T) {
	ctx := context.Background()
	e, l, owns := awayAfterK1(t)

	stale := e.ReadMark() // a refresh begins: the ledger has k1 charged, 4 used
	// The other owner refunds k1 and settles; the account comes back.
	owns.Store(true)
	if err := e.SetSnapshotRead(acmeSnapshot(t, 2, 4), stale); err != nil {
		t.Fatal(err)
	}

	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("retry of k1, refunded elsewhere: %+v %v; want charged", res, err)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	fresh := e.ReadMark() // the ledger: k1's first attempt refunded, the retry charged
	if err := e.SetSnapshotRead(acmeSnapshot(t, 3, 4), fresh); err != nil {
		t.Fatal(err)
	}
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 4 {
		t.Errorf("after a refresh read with every record settled: %+v %v; want 4 used as the ledger says", u, err)
	}
}

// The account's last owner may settle its last records a while after the
// account left it (a draining node announces draining, and so gives its
// accounts up, before its final settle): a refresh read after the account
// came back can still lack that owner's refund of k1. For ReseedWindow
// after the account came back, every refresh with all this node's records
// sets the use to the ledger's, so the one that holds the refund puts it
// right; after the window refreshes only raise it again. (Found by
// TestAccountComesBackAfterARefundElsewhere under load, with the fix for a
// read begun before the account came back in place.)
func TestRegainedAccountFollowsTheLedgerForTheReseedWindow(t *testing.T) {
	ctx := context.Background()
	e, l, owns := awayAfterK1(t)
	clock := e.Clock().(*ManualClock)
	owns.Store(true)        // back; the other owner's refund of k1 not settled yet
	refreshAcme(t, e, 2, 4) // finds it back (its read may be from before)
	refreshAcme(t, e, 3, 4) // read after it came back, and still 4
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("retry of k1, refunded elsewhere: %+v %v; want charged", res, err)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	clock.Advance(DefaultReseedWindow / 2)
	refreshAcme(t, e, 4, 4) // the other owner's refund settled: k1 counted once
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 4 {
		t.Fatalf("a refresh within the window, after the other owner's last settle: %+v %v; want 4 used as the ledger says", u, err)
	}

	clock.Advance(DefaultReseedWindow)
	refreshAcme(t, e, 5, 4) // the last one to set it: past the window
	refreshAcme(t, e, 6, 1) // a ledger behind (read from a lagging replica, say): not lowered
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 4 {
		t.Errorf("a lower figure after the window: %+v %v; want 4 used (refreshes only raise once the window is over)", u, err)
	}
}

// chargeK1 opens an engine with opts (its log and clock added) serving
// acme, and charges k1 (a client id, 4 units on GET /x) there.
func chargeK1(t *testing.T, opts Options) (*Engine, shard.Charge) {
	t.Helper()
	l := openLog(t, t.TempDir())
	opts.Log, opts.Clock = l, NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	e, err := Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	refreshAcme(t, e, 1, 0)
	k1 := shard.Charge{EventID: "k1", ClientID: true, Units: 4, Route: "GET /x"}
	if res, err := e.Charge(context.Background(), "acme", k1); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	return e, k1
}

// awayAfterK1 opens an engine that owns acme (openOwned), charges k1 there
// (4 units) and settles it, and takes acme away: Forget keeps it, let go,
// since the last snapshot lacks k1's charge. Store true in the returned
// owns to bring it back.
func awayAfterK1(t *testing.T) (*Engine, *wal.Log, *atomic.Bool) {
	t.Helper()
	ctx := context.Background()
	e, l, owns := openOwned(t, nil)
	refreshAcme(t, e, 1, 0)
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	owns.Store(false)
	if e.Forget("acme") {
		t.Fatal("Forget dropped an account whose charge the snapshot lacks")
	}
	return e, l, owns
}
