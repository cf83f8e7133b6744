package flush

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// lostSettleAnswer is a ledger whose next Settle commits and then reports
// an error, as when the connection drops after the COMMIT went out.
type lostSettleAnswer struct {
	Ledger
	lose atomic.Bool
}

func (l *lostSettleAnswer) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	res, err := l.Ledger.Settle(ctx, b)
	if err == nil && l.lose.Swap(false) {
		return SettleResult{}, errors.New("connection reset after COMMIT: outcome unknown")
	}
	return res, err
}

// tbNode is one node of the test below: its log, engine and settler.
type tbNode struct {
	e *engine.Engine
	s *Settler
}

func openTBNode(t *testing.T, id string, l Ledger, snap *snapshot.Snapshot, clock engine.Clock) tbNode {
	t.Helper()
	log, err := wal.Open(wal.Options{Dir: filepath.Join(t.TempDir(), id), NodeID: id})
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.Open(engine.Options{Log: log, Clock: clock, Reserver: &Reserver{Ledger: l, Node: id, Incarnation: log.Incarnation()}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); log.Close() })
	if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Events: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(context.Background()); err != nil {
		t.Fatal(err)
	}
	return tbNode{e: e, s: s}
}

// An event refunded at two owners (a handover) is credited back to the
// reservation of the first refund the ledger settles; the second is a
// duplicate, whose units the settler takes back from its node's allowance.
// When that settle's answer was lost, the retry finds the batch applied and
// learned nothing of the duplicate: the node kept units in its allowance
// that the ledger did not back, and spent them past the quota (a review
// found 110 acknowledged on a hard quota of 100). Now every reserved
// refund of a range settled without an answer is taken back: retried
// as it was (the ledger says applied before), or with more records after
// it (the ledger's mark is ahead: the settler catches up).
//
// A refund that was not a duplicate is taken back too (the node cannot
// tell): the ledger then holds its units reserved for the node, unused
// until the node hands everything back, and the node counts them in
// doubt (Stats.UncertainUnits), which the chaos harness's RES allows for.
func TestDuplicateRefundTakenBackWhenTheSettleAnswerIsLost(t *testing.T) {
	t.Run("same-range", func(t *testing.T) { testLostSettleAnswer(t, false, true) })
	t.Run("longer-range", func(t *testing.T) { testLostSettleAnswer(t, true, true) })
	t.Run("not-a-duplicate", func(t *testing.T) { testLostSettleAnswer(t, false, false) })
}

func testLostSettleAnswer(t *testing.T, more, dup bool) {
	ctx := context.Background()
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	base := migratedSQLite(t, func() time.Time { return time.Unix(0, clock.Now().Wall) })
	if err := base.UpsertPlan(ctx, snapshot.Plan{ID: "m100", MonthlyQuota: 100, Hard: true}); err != nil {
		t.Fatal(err)
	}
	if err := base.UpsertAccount(ctx, "acme", "m100"); err != nil {
		t.Fatal(err)
	}
	snap, err := base.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	lossy := &lostSettleAnswer{Ledger: base}
	n1 := openTBNode(t, "n1", lossy, snap, clock)
	n2 := openTBNode(t, "n2", base, snap, clock)

	res, err := n1.e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 10})
	if err != nil || res.Reason != shard.OK || res.Receipt == nil {
		t.Fatalf("charge: %+v, %v", res, err)
	}
	if _, err := n1.s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	// The event is refunded at n2 (it owns acme now) and settled there
	// first, then at n1 too.
	if dup {
		if d, err := n2.e.Refund(ctx, "acme", "e1", res.Receipt); err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund at n2: %+v, %v", d, err)
		}
		if _, err := n2.s.SettleOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if d, err := n1.e.Refund(ctx, "acme", "e1", res.Receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund at n1: %+v, %v", d, err)
	}
	lossy.lose.Store(true)
	if _, err := n1.s.SettleOnce(ctx); err == nil {
		t.Fatal("the settle whose answer was lost reported no error")
	}
	if more {
		if res, err := n1.e.Charge(ctx, "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge after the lost answer: %+v, %v", res, err)
		}
	}
	if _, err := n1.s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}

	rs, err := base.Reservations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]int64{}
	for _, r := range rs {
		held[r.Node] += r.Units
	}
	for id, n := range map[string]tbNode{"n1": n1, "n2": n2} {
		if a := n.e.AllowanceHeld(); a > held[id] {
			t.Errorf("%s may spend an allowance of %d; the ledger reserves %d for it: %d units not backed (spent past the quota)", id, a, held[id], a-held[id])
		} else if doubt := n.e.Stats().UncertainUnits.Load(); held[id] > a+doubt {
			t.Errorf("the ledger reserves %d for %s, which holds %d and counts %d in doubt: %d units stranded unaccounted", held[id], id, a, doubt, held[id]-a-doubt)
		}
	}
	if got := n1.e.Stats().UncertainUnits.Load(); got != 10 {
		t.Errorf("n1 counts %d units in doubt, want the 10 of the refund it took back", got)
	}
}

// A ledger behind a node's log (--ledger naming another cluster's ledger,
// or one restored from an older backup) is refused with a message that
// says so, not "another process settles as this node".
func TestLedgerBehindTheLogIsNamed(t *testing.T) {
	ctx := context.Background()
	l := migratedSQLite(t, nil)
	if _, err := l.RegisterNode(ctx, "n1", "inc-1"); err != nil {
		t.Fatal(err)
	}
	_, err := l.Settle(ctx, &Batch{Node: "n1", Incarnation: "inc-1", Prev: 40, Next: 50})
	if !errors.Is(err, ErrMarkConflict) || !strings.Contains(err.Error(), "the ledger is behind the log") ||
		!strings.Contains(err.Error(), "--ledger") || strings.Contains(err.Error(), "another process settles as this node") {
		t.Fatalf("a batch (40, 50] on a ledger that has the node at 0: %v, want ErrMarkConflict saying the ledger is behind", err)
	}
}

// failingSettles is a ledger whose settles fail while its heartbeats go
// through (a statement timeout, a slow ledger that times out the large
// settle transaction but not the small heartbeat).
type failingSettles struct {
	Ledger
	fail atomic.Bool
}

func (l *failingSettles) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	if l.fail.Load() {
		return SettleResult{}, errors.New("canceling statement due to statement timeout")
	}
	return l.Ledger.Settle(ctx, b)
}

// A month is final once every node heard from in it has settled since it
// ended. That was read off heartbeat_at, which a node's heartbeats keep
// fresh while its settles fail: June read final, in the billing export
// and for quotad prune, with a June charge still in a node's log. Now a
// node on this build is judged by settled_through, which only a settle
// that took everything, or a heartbeat with nothing to settle, moves.
func TestMonthNotFinalWhileSettlesFail(t *testing.T) {
	ctx := context.Background()
	clock := engine.NewManualClock(time.Date(2026, 6, 30, 23, 59, 30, 0, time.UTC))
	now := func() time.Time { return time.Unix(0, clock.Now().Wall).UTC() }
	base := migratedSQLite(t, now)
	if err := base.UpsertPlan(ctx, snapshot.Plan{ID: "soft", MonthlyQuota: 100}); err != nil {
		t.Fatal(err)
	}
	if err := base.UpsertAccount(ctx, "acme", "soft"); err != nil {
		t.Fatal(err)
	}
	snap, err := base.Snapshot(ctx, now())
	if err != nil {
		t.Fatal(err)
	}
	l := &failingSettles{Ledger: base}
	log, err := wal.Open(wal.Options{Dir: filepath.Join(t.TempDir(), "q1"), NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	e, err := engine.Open(engine.Options{Log: log, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Events: true, Heartbeat: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if err := base.RecordStart(ctx, "q1", log.Incarnation(), NodeStart{Build: "v-test", Process: "p"}); err != nil {
		t.Fatal(err)
	}
	if res, err := e.Charge(ctx, "acme", shard.Charge{Units: 5}); err != nil || res.Reason != shard.OK {
		t.Fatalf("June charge: %+v, %v", res, err)
	}
	l.fail.Store(true)
	if _, err := s.SettleOnce(ctx); err == nil {
		t.Fatal("the settle did not fail")
	}
	june, _ := shard.ParsePeriod("2026-06")
	clock.SetWall(time.Date(2026, 7, 1, 0, 5, 0, 0, time.UTC))
	if err := s.heartbeat(ctx); err != nil { // the settle loop's heartbeat goes on
		t.Fatal(err)
	}
	rows, err := base.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if final, unsettled := SettledMonth(rows, june, now()); final || len(unsettled) != 1 {
		t.Fatalf("June with a June charge unsettled in q1's log: final %v, unsettled %v; want not final, naming q1", final, unsettled)
	}
	// Once its settles go through, the month is final.
	l.fail.Store(false)
	if _, err := s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if rows, err = base.Nodes(ctx); err != nil {
		t.Fatal(err)
	}
	clock.SetWall(time.Date(2026, 7, 1, 0, 7, 0, 0, time.UTC))
	if final, unsettled := SettledMonth(rows, june, now()); !final {
		t.Fatalf("June after q1 settled everything: not final, unsettled %v", unsettled)
	}
}
