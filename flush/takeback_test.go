package flush

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/waitfor"
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
	return openTBNodeWith(t, id, l, snap, clock, false)
}

// openTBNodeWith is openTBNode; onKick also runs the settle loop, which
// settles only when the engine asks it to (engine.Options.SettleSoon) or
// the test calls SettleOnce.
func openTBNodeWith(t *testing.T, id string, l Ledger, snap *snapshot.Snapshot, clock engine.Clock, onKick bool) tbNode {
	t.Helper()
	return openTBNodeIn(t, filepath.Join(t.TempDir(), id), id, l, snap, clock, onKick)
}

// openTBNodeIn is openTBNodeWith on the log in dir (a restart: the engine
// recovers what the log holds).
func openTBNodeIn(t *testing.T, dir, id string, l Ledger, snap *snapshot.Snapshot, clock engine.Clock, onKick bool) tbNode {
	t.Helper()
	log, err := wal.Open(wal.Options{Dir: dir, NodeID: id})
	if err != nil {
		t.Fatal(err)
	}
	var settler atomic.Pointer[Settler]
	opts := engine.Options{Log: log, Clock: clock, Reserver: &Reserver{Ledger: l, Node: id, Incarnation: log.Incarnation()}}
	if onKick {
		opts.SettleSoon = func() {
			if s := settler.Load(); s != nil {
				s.Kick()
			}
		}
	}
	e, err := engine.Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); log.Close() })
	if err := e.SetSnapshot(snap, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Events: true, Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(context.Background()); err != nil {
		t.Fatal(err)
	}
	if onKick {
		settler.Store(s)
		s.Start()
		t.Cleanup(s.Close) // NB: registered after the engine's: runs first
	}
	return tbNode{e: e, s: s}
}

// mustRefund refunds acme's event id at n, which must answer Refunded.
func (n tbNode) mustRefund(t *testing.T, id string, receipt *shard.Receipt) {
	t.Helper()
	if d, err := n.e.Refund(t.Context(), "acme", id, receipt); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund of %s: %+v, %v", id, d, err)
	}
}

// chargeAcme charges acme units at n, under client id id (none when
// empty), waiting at most 10 s.
func (n tbNode) chargeAcme(t *testing.T, id string, units int64) (engine.Result, error) {
	cctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	return n.e.Charge(cctx, "acme", shard.Charge{EventID: id, ClientID: id != "", Units: units})
}

// mustSettle settles n's log once.
func (n tbNode) mustSettle(t *testing.T) {
	t.Helper()
	if _, err := n.s.SettleOnce(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// reservedFor sums the ledger's reservations by node.
func reservedFor(t *testing.T, l Ledger) map[string]int64 {
	t.Helper()
	rs, err := l.Reservations(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]int64{}
	for _, r := range rs {
		held[r.Node] += r.Units
	}
	return held
}

// hardAcme is a SQLite ledger with one account, acme, on a hard plan of
// quota units a month, its config snapshot, and the clock both read
// (10 June 2026).
func hardAcme(t *testing.T, quota int64) (*SQLite, *snapshot.Snapshot, *engine.ManualClock) {
	t.Helper()
	ctx := t.Context()
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	l := migratedSQLite(t, func() time.Time { return time.Unix(0, clock.Now().Wall) })
	plan := snapshot.Plan{ID: fmt.Sprintf("m%d", quota), MonthlyQuota: quota, Hard: true}
	if err := l.UpsertPlan(ctx, plan); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acme", plan.ID); err != nil {
		t.Fatal(err)
	}
	snap, err := l.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	return l, snap, clock
}

// An event refunded at two owners (a handover): the ledger refunds it once.
// Refunds used to credit the refunding node's allowance, and the settler
// took a duplicate's units back; when that settle's answer was lost, the
// retry learned nothing of the duplicate and the node spent units the
// ledger did not back (a review found 110 acknowledged on a hard quota of
// 100). Refunds now give their units back to the ledger's grant, never to
// an allowance: whether the answer is lost, the range retried as it was
// or with more records after it (the settler catches up), each node holds
// exactly what the ledger reserves for it, and nothing is in doubt.
func TestDuplicateRefundTakenBackWhenTheSettleAnswerIsLost(t *testing.T) {
	t.Run("same-range", func(t *testing.T) { testLostSettleAnswer(t, false, true) })
	t.Run("longer-range", func(t *testing.T) { testLostSettleAnswer(t, true, true) })
	t.Run("not-a-duplicate", func(t *testing.T) { testLostSettleAnswer(t, false, false) })
}

func testLostSettleAnswer(t *testing.T, more, dup bool) {
	ctx := context.Background()
	base, snap, clock := hardAcme(t, 100)
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
		n2.mustRefund(t, "e1", res.Receipt)
		n2.mustSettle(t)
	}
	n1.mustRefund(t, "e1", res.Receipt)
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

	held := reservedFor(t, base)
	for id, n := range map[string]tbNode{"n1": n1, "n2": n2} {
		if a := n.e.AllowanceHeld(); a > held[id] {
			t.Errorf("%s may spend an allowance of %d; the ledger reserves %d for it: %d units not backed (spent past the quota)", id, a, held[id], a-held[id])
		} else if doubt := n.e.Stats().UncertainUnits.Load(); held[id] > a+doubt {
			t.Errorf("the ledger reserves %d for %s, which holds %d and counts %d in doubt: %d units stranded unaccounted", held[id], id, a, doubt, held[id]-a-doubt)
		}
	}
	if got := n1.e.Stats().UncertainUnits.Load(); got != 0 {
		t.Errorf("n1 counts %d units in doubt, want 0: a refund gives nothing to the allowance, so there is nothing to take back", got)
	}
}

// Two owners refund one event during a handoff (the event charged at both:
// a retry served again by the new owner, a duplicate the ledger did not
// bill and whose units it freed), and the ledger refunds it once. A refund
// credited to the allowance at once left the node whose refund turned out
// the duplicate units the ledger did not back until its next settle took
// them back, and it spent them meanwhile while the ledger reserved the
// same units for others (25 acknowledged here; quotad chaos --seed 12: 21
// on a hard quota of 20). Now each unit of the quota is acknowledged
// exactly once across both nodes: no more (G1), no fewer (the refund's
// units come back through the ledger; a charge that lacks them waits for
// the refund's settle, which it asks for).
func TestDuplicateRefundLeavesNothingToSpendTwice(t *testing.T) {
	ctx := t.Context()
	l, snap, clock := hardAcme(t, 20)
	n1 := openTBNodeWith(t, "n1", l, snap, clock, true)
	n2 := openTBNodeWith(t, "n2", l, snap, clock, true)
	charge := func(n tbNode, id string, units int64) (engine.Result, error) { return n.chargeAcme(t, id, units) }

	r1, err := charge(n1, "e1", 5)
	if err != nil || r1.Reason != shard.OK {
		t.Fatalf("charge e1 at n1: %+v, %v", r1, err)
	}
	n1.mustSettle(t)
	if err := n1.e.Release(ctx, "acme"); err != nil { // the handoff: n1 hands its units back
		t.Fatal(err)
	}
	r2, err := charge(n2, "e1", 5) // the retry, served again at the new owner
	if err != nil || r2.Reason != shard.OK {
		t.Fatalf("charge e1 at n2: %+v, %v", r2, err)
	}
	n2.mustSettle(t) // a duplicate: not billed, its units free in the ledger
	// The refund at n1 settles first and applies; n2's is the duplicate.
	n1.mustRefund(t, "e1", r1.Receipt)
	n1.mustSettle(t)
	n2.mustRefund(t, "e1", r2.Receipt)

	// n2 spends all it holds before its own settle has told it anything,
	// then both nodes spend one unit at a time until the ledger has none.
	var ok int64
	for n2.e.AllowanceHeld() > 0 {
		if res, err := charge(n2, "", 1); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge at n2 within its allowance: %+v, %v", res, err)
		}
		ok++
	}
	for round := 0; ; round++ {
		if round == 100 {
			t.Fatalf("still charging after %d rounds (%d acknowledged)", round, ok)
		}
		exceeded := 0
		for _, n := range []tbNode{n2, n1} {
			res, err := charge(n, "", 1)
			switch {
			case err == nil && res.Reason == shard.OK:
				ok++
			case err == nil && res.Reason == shard.QuotaExceeded:
				exceeded++
			case errors.Is(err, engine.ErrQuotaUnavailable):
			default:
				t.Fatalf("charge: %+v, %v", res, err)
			}
		}
		for _, n := range []tbNode{n1, n2} {
			n.mustSettle(t)
		}
		if exceeded == 2 {
			break
		}
	}
	if ok != 20 {
		t.Fatalf("%d single units acknowledged after e1 was refunded, on a hard quota of 20: want exactly 20", ok)
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

// A refund's units go back to the ledger's grant, not to the allowance: a
// charge that needs them right after the refund, on an account that had
// used its quota up, must still get them, by waiting for the refund to
// settle (it asks the settler to settle now) and reserving them then. Asked
// before that settle, the ledger answered the grant exhausted: quota
// exceeded while the node showed units left.
func TestRefundedUnitsSpendableAtOnce(t *testing.T) {
	ctx := t.Context()
	l, snap, clock := hardAcme(t, 10)
	n := openTBNodeWith(t, "n1", l, snap, clock, true)
	charge := func(units int64) (engine.Result, error) { return n.chargeAcme(t, "", units) }
	first, err := charge(3)
	if err != nil || first.Reason != shard.OK {
		t.Fatalf("charge 3: %+v, %v", first, err)
	}
	if res, err := charge(7); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge 7: %+v, %v", res, err)
	}
	if res, err := charge(1); err != nil || res.Reason != shard.QuotaExceeded {
		t.Fatalf("charge past the quota: %+v, %v; want quota exceeded", res, err)
	}
	if d, err := n.e.Refund(ctx, "acme", first.EventID, first.Receipt); err != nil || d.Reason != shard.Refunded || d.Remaining != 3 {
		t.Fatalf("refund of 3: %+v, %v; want refunded, 3 left", d, err)
	}
	res, err := charge(3)
	if err != nil || res.Reason != shard.OK || res.Remaining != 0 {
		t.Fatalf("charge of the 3 refunded units: %+v, %v; want ok, 0 left", res, err)
	}
	n.mustSettle(t)
	june := shard.MonthlyGrantID(shard.PeriodOf(clock.Now().Wall))
	if g := grantOf(t, l, "acme", june); g.Used != 10 || g.Reserved != 0 {
		t.Fatalf("the ledger's grant: used %d, reserved %d; want 10 used, none reserved", g.Used, g.Reserved)
	}
}

// The HTTP front refunds an attempt whose upstream failed through the
// account's owner, which may be a new one since the charge (Record.Origin):
// the refund applies in the ledger, and the new owner, whose use was seeded
// from the ledger with that charge in it, must let the units be spent
// again. It kept counting them used, and refused them (quota exceeded)
// until the account moved again.
func TestForeignAttemptRefundFreesTheUnitsAtTheNewOwner(t *testing.T) {
	ctx := t.Context()
	l, snap, clock := hardAcme(t, 10)
	n1 := openTBNodeWith(t, "n1", l, snap, clock, true)
	n2 := openTBNodeWith(t, "n2", l, snap, clock, true)
	charge := func(n tbNode, units int64) (engine.Result, error) { return n.chargeAcme(t, "", units) }
	first, err := charge(n1, 4)
	if err != nil || first.Reason != shard.OK {
		t.Fatalf("charge 4 at n1: %+v, %v", first, err)
	}
	// The charge spent all n1 had reserved, so n1 tops up in the
	// background (the 6 units left): wait for it, or it may land after the
	// hand-back below and hold the units n2 needs. (A real node stops
	// owning the account first, and a late top-up is handed back.)
	waitfor.Cond(t, 10*time.Second, "n1's top-up after its charge", func() bool { return n1.e.AllowanceHeld() == 6 })
	n1.mustSettle(t)
	if err := n1.e.Release(ctx, "acme"); err != nil { // the account moves to n2
		t.Fatal(err)
	}
	seeded, err := l.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	if err := n2.e.SetSnapshot(seeded, engine.AllSettled); err != nil {
		t.Fatal(err)
	}
	if res, err := charge(n2, 6); err != nil || res.Reason != shard.OK || res.Remaining != 0 {
		t.Fatalf("charge 6 at n2: %+v, %v; want ok, 0 left", res, err)
	}
	d, err := n2.e.RefundAttempt(ctx, "acme", first.EventID, first.Receipt)
	if err != nil || d.Reason != shard.Refunded || d.Remaining != 4 {
		t.Fatalf("n1's attempt refunded through n2: %+v, %v; want refunded, 4 left", d, err)
	}
	if res, err := charge(n2, 4); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge of the 4 refunded units at n2: %+v, %v; want ok", res, err)
	}
	n2.mustSettle(t)
	june := shard.MonthlyGrantID(shard.PeriodOf(clock.Now().Wall))
	if g := grantOf(t, l, "acme", june); g.Used != 10 {
		t.Fatalf("the ledger's grant: used %d, want 10", g.Used)
	}
}

// A node upgraded with unsettled records in its log may hold refunds an
// older version logged, which gave their units back into the allowance
// (Reserved). They still settle as they did: the ledger credits them to
// the node's reservation, or, when another owner's refund of the event
// settled first, the node takes the units back from its allowance. Either
// way the node holds exactly what the ledger reserves for it.
func TestOlderVersionsReservedRefundStillSettles(t *testing.T) {
	for _, dup := range []bool{false, true} {
		t.Run(map[bool]string{false: "applied", true: "duplicate"}[dup], func(t *testing.T) {
			ctx := t.Context()
			l, snap, clock := hardAcme(t, 20)
			dir := t.TempDir()
			n1 := openTBNodeIn(t, dir, "n1", l, snap, clock, false)
			res, err := n1.e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 5})
			if err != nil || res.Reason != shard.OK {
				t.Fatalf("charge: %+v, %v", res, err)
			}
			n1.mustSettle(t)
			if dup {
				n2 := openTBNode(t, "n2", l, snap, clock)
				n2.mustRefund(t, "e1", res.Receipt)
				n2.mustSettle(t)
			}
			// The refund as an older version logged it, then a restart on
			// the new version, which replays it.
			r := res.Receipt
			old := shard.Record{Type: shard.RecRefund, Wall: clock.Now().Wall, Account: "acme", EventID: "e1", Reserved: true,
				Units: r.Units, Period: r.Period, ChargeWall: r.Wall, Key: r.Key, Route: r.Route, Gen: r.Gen, Allocs: r.Allocs}
			seq, err := n1.e.Log().Append(old.AppendEncode(nil))
			if err != nil {
				t.Fatal(err)
			}
			if err := n1.e.Log().WaitDurable(ctx, seq); err != nil {
				t.Fatal(err)
			}
			n1.e.Close()
			n1.e.Log().Close()
			n1 = openTBNodeIn(t, dir, "n1", l, snap, clock, false)
			heldBefore := n1.e.AllowanceHeld()
			n1.mustSettle(t)
			if held, reserved := n1.e.AllowanceHeld(), reservedFor(t, l)["n1"]; held != reserved {
				t.Fatalf("n1 holds %d (before the settle %d), the ledger reserves %d for it: want the same", held, heldBefore, reserved)
			}
			june := shard.MonthlyGrantID(shard.PeriodOf(clock.Now().Wall))
			if g := grantOf(t, l, "acme", june); g.Used != 0 {
				t.Fatalf("the ledger's grant: used %d, want 0 (e1 refunded once)", g.Used)
			}
		})
	}
}

// A charge that waits for a refund of its account to settle answers as
// soon as that settle fails (the ledger refusing it): quota-unavailable,
// with the ledger's error. It waited out its 2 s for a reservation instead,
// which also marked the ledger stalled, so every charge that needed units
// was then refused at once until a reservation succeeded again. Once the
// ledger settles again, the refunded units are there.
func TestWaitForARefundsSettleEndsWhenTheSettleFails(t *testing.T) {
	l, snap, clock := hardAcme(t, 10)
	fl := &failingSettles{Ledger: l}
	n := openTBNodeWith(t, "n1", fl, snap, clock, true)
	charge := func(units int64) (engine.Result, error) { return n.chargeAcme(t, "", units) }
	res, err := charge(10)
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge 10: %+v, %v", res, err)
	}
	n.mustRefund(t, res.EventID, res.Receipt)
	fl.fail.Store(true)
	if res, err := charge(3); !errors.Is(err, engine.ErrQuotaUnavailable) || !strings.Contains(err.Error(), "statement timeout") {
		t.Fatalf("a charge of refunded units while the ledger refuses settles: %+v, %v; want quota unavailable naming the settle's error", res, err)
	}
	if got := n.e.Stats().ReserveTimeouts.Load(); got != 0 {
		t.Fatalf("%d reservations timed out: the charge waited out its bound", got)
	}
	fl.fail.Store(false)
	if res, err := charge(3); err != nil || res.Reason != shard.OK {
		t.Fatalf("the same charge once the ledger settles again: %+v, %v; want ok", res, err)
	}
}
