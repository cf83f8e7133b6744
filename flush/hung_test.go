package flush

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/faultproxy"
	"github.com/quotaring/quotaring/internal/hang"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// hungLedger is a ledger that, while its gate is hung, answers neither a
// settle nor a heartbeat (no error, no answer: a SIGSTOPped Postgres, a lock
// held on its tables) until the caller gives up. With gate.IgnoreCtx it
// does not even see the caller give up: it waits for gate.Release. With
// settlesOnly, heartbeats answer (a lock held on grants: settles wait for
// it, heartbeats do not).
type hungLedger struct {
	Ledger
	gate        *hang.Gate
	settlesOnly bool
}

func newHungLedger(l Ledger) *hungLedger {
	return &hungLedger{Ledger: l, gate: hang.New()}
}

func (l *hungLedger) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	if err := l.gate.Wait(ctx); err != nil {
		return SettleResult{}, err
	}
	return l.Ledger.Settle(ctx, b)
}

func (l *hungLedger) Heartbeat(ctx context.Context, node, inc, process string, drainedAt time.Time) (uint64, error) {
	if l.settlesOnly {
		return l.Ledger.Heartbeat(ctx, node, inc, process, drainedAt)
	}
	if err := l.gate.Wait(ctx); err != nil {
		return 0, err
	}
	return l.Ledger.Heartbeat(ctx, node, inc, process, drainedAt)
}

// appendCharges logs n durable charges of acct-1.
func appendCharges(t *testing.T, e *engine.Engine, n int) {
	t.Helper()
	log := e.Log()
	for i := range n {
		rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: fmt.Sprint("h", log.LastSeq()+1, "-", i), Units: 1}
		if _, err := log.Append(rec.AppendEncode(nil)); err != nil {
			t.Fatal(err)
		}
	}
	if err := log.WaitDurable(context.Background(), log.LastSeq()); err != nil {
		t.Fatal(err)
	}
}

// A settle that hangs has neither failed nor succeeded: Healthy compared
// the last error with the last success and read true for as long as the
// ledger hung (quotaring_ledger_up 1 through a 60 s SIGSTOP of Postgres).
// A call that has waited CallTimeout counts as the ledger being down, even
// before it returns (here it cannot: the ledger ignores the cancel).
func TestHealthyFalseWhileALedgerCallHangs(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects now
	now := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	sq, e := ledgerRig(t, nil)
	l := newHungLedger(sq)
	l.gate.IgnoreCtx = true
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, CallTimeout: time.Minute, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	appendCharges(t, e, 3)
	l.gate.Hung.Store(true)
	done := make(chan error, 1)
	go func() { _, err := s.SettleOnce(ctx); done <- err }()
	<-l.gate.Entered
	if !s.Healthy() {
		t.Fatal("unhealthy the moment a settle started")
	}
	mu.Lock()
	now = now.Add(time.Minute - time.Nanosecond)
	mu.Unlock()
	if !s.Healthy() {
		t.Fatal("unhealthy before the settle had waited CallTimeout")
	}
	mu.Lock()
	now = now.Add(time.Nanosecond)
	mu.Unlock()
	if s.Healthy() {
		t.Fatal("healthy while a settle has waited CallTimeout (a minute) for the ledger's answer")
	}
	l.gate.Hung.Store(false)
	l.gate.Release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !s.Healthy() {
		t.Fatal("unhealthy after the settle got its answer")
	}
}

// The settle loop against a ledger that hangs: each settle and heartbeat
// is cancelled at CallTimeout and counts as a failure (retried, the
// records kept), the ledger reads down, a WARN says for how long it has not
// answered and what to check; when it answers again an INFO says so and
// the records settle. Before, the loop waited in the first settle for as
// long as the ledger hung, with nothing logged, counted or exported.
func TestSettleLoopAgainstAHungLedger(t *testing.T) {
	for _, settlesOnly := range []bool{false, true} {
		t.Run(map[bool]string{false: "all-calls", true: "settles-only"}[settlesOnly], func(t *testing.T) { testSettleLoopAgainstAHungLedger(t, settlesOnly) })
	}
}

// testSettleLoopAgainstAHungLedger: with settlesOnly, the heartbeats
// answer meanwhile (the SRE review's lock on grants): the ledger still
// reads down, and is not said to answer again until the settles do.
func testSettleLoopAgainstAHungLedger(t *testing.T, settlesOnly bool) {
	var logs logbuf.Buffer
	sq, e := ledgerRig(t, nil)
	l := newHungLedger(sq)
	l.settlesOnly = settlesOnly
	var errs atomic.Int64
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Interval: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
		Heartbeat: 10 * time.Millisecond, CallTimeout: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		OnSettle: func(r SettleReport) {
			if r.Err != nil {
				errs.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(context.Background()); err != nil {
		t.Fatal(err)
	}
	l.gate.Hung.Store(true)
	appendCharges(t, e, 5)
	s.Start()
	defer s.Close()
	waitfor.Cond(t, 10*time.Second, "the settler to count the hung ledger down and say so", func() bool {
		return !s.Healthy() && errs.Load() > 0 && strings.Contains(logs.String(), "the ledger has not answered a settle for 100ms")
	})
	if out := logs.String(); !strings.Contains(out, "what_to_check=") || !strings.Contains(out, "pg_locks") {
		t.Fatalf("the WARN of a hung ledger does not say what to check:\n%s", out)
	}
	if got := e.Log().SettledSeq(); got != 0 {
		t.Fatalf("settled to %d while the ledger hung", got)
	}
	if settlesOnly {
		// Heartbeats every 10 ms answer between the settles that hang.
		waitfor.Cond(t, 10*time.Second, "another settle to time out", func() bool { return errs.Load() >= 3 })
		if s.Healthy() {
			t.Fatal("healthy while every settle hangs, because the heartbeats answer")
		}
	}
	if strings.Contains(logs.String(), "the ledger answers again") {
		t.Fatalf("said the ledger answers again while its settles hang:\n%s", logs.String())
	}
	l.gate.Hung.Store(false)
	waitfor.Cond(t, 10*time.Second, "the settler to settle once the ledger answers", func() bool {
		return s.Healthy() && e.Log().SettledSeq() == e.Log().DurableSeq()
	})
	waitfor.Cond(t, 10*time.Second, "an INFO line that the ledger answers again", func() bool {
		return strings.Contains(logs.String(), `level=INFO msg="the ledger answers again"`)
	})
	if strings.Contains(logs.String(), hang.ErrNeverCancelled.Error()) {
		t.Fatalf("a call to the hung ledger was never cancelled:\n%s", logs.String())
	}
}

// commitThenHang is a ledger whose armed Settle commits and then does not
// answer until the caller gives up: the outcome, for the settler, unknown.
type commitThenHang struct {
	Ledger
	armed atomic.Bool
}

func (l *commitThenHang) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	if !l.armed.Swap(false) {
		return l.Ledger.Settle(ctx, b)
	}
	if _, err := l.Ledger.Settle(context.WithoutCancel(ctx), b); err != nil {
		return SettleResult{}, err
	}
	return SettleResult{}, hang.Until(ctx)
}

// A settle cancelled at CallTimeout after the ledger committed it (the
// answer was what took too long) is an error, retried with the same
// range: the ledger's mark makes the retry a no-op, and every charge is
// billed once (G2, G3), on a real Postgres.
func TestSettleTimedOutAfterTheCommitBillsOnce(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.NewDB(t)
	pg := openPG(t, dsn)
	defer pg.Close()
	if err := pg.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	clock := engine.NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	if err := pg.UpsertPlan(ctx, snapshot.Plan{ID: "m100", MonthlyQuota: 100}); err != nil {
		t.Fatal(err)
	}
	if err := pg.UpsertAccount(ctx, "acme", "m100"); err != nil {
		t.Fatal(err)
	}
	snap, err := pg.Snapshot(ctx, time.Unix(0, clock.Now().Wall))
	if err != nil {
		t.Fatal(err)
	}
	l := &commitThenHang{Ledger: pg}
	n := openTBNode(t, "n1", l, snap, clock)
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: n.e, Events: true, CallTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for i, u := range []int64{3, 4} {
		if res, err := n.e.Charge(ctx, "acme", shard.Charge{EventID: fmt.Sprint("e", i), ClientID: true, Units: u}); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge: %+v, %v", res, err)
		}
	}
	l.armed.Store(true)
	_, err = s.SettleOnce(ctx)
	if !CallTimedOut(err) {
		t.Fatalf("a settle whose answer did not come within CallTimeout: %v; want it cancelled as timed out", err)
	}
	if s.Healthy() {
		t.Fatal("healthy after a settle timed out")
	}
	if got := n.e.Log().SettledSeq(); got != 0 {
		t.Fatalf("the log marked settled to %d by a settle that timed out", got)
	}
	if _, err := s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if !s.Healthy() || n.e.Log().SettledSeq() != n.e.Log().DurableSeq() {
		t.Fatalf("after the retry: healthy %v, settled %d of %d", s.Healthy(), n.e.Log().SettledSeq(), n.e.Log().DurableSeq())
	}
	u, err := pg.Usage(ctx, "acme", shard.Period(2026*12+5))
	if err != nil {
		t.Fatal(err)
	}
	if u.Units != 7 {
		t.Errorf("usage of acme %d units after a settle timed out past its commit and was retried, want 7 (billed once)", u.Units)
	}
	if es := eventsOf(t, pg, "acme"); len(es) != 2 {
		t.Errorf("%d events, want 2", len(es))
	}
	wantReconciled(t, pg)
}

// Closing the ledger after a call to a hung server was cancelled took 15 s
// (pgx's goodbye to that connection waits for the server): a node's
// shutdown spent them after its final settle gave up, past its budget.
func TestPostgresCloseDoesNotWaitForAHungServer(t *testing.T) {
	dsn := pgtest.NewDB(t)
	srv := pgtest.PackageServer(t)
	if srv == nil {
		return
	}
	proxy, err := faultproxy.New("127.0.0.1:0", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	defer proxy.SetFrozen(false)
	l := openPG(t, strings.Replace(dsn, srv.Addr(), proxy.Addr(), 1))
	if _, err := l.Clock(t.Context()); err != nil {
		t.Fatal(err)
	}
	proxy.SetFrozen(true)
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	_, err = l.Clock(ctx)
	cancel()
	if err == nil {
		t.Fatal("a call to a frozen ledger answered")
	}
	t0 := time.Now()
	l.Close()
	if took := time.Since(t0); took > closeWait+time.Second {
		t.Fatalf("Close took %s with the server hung, want at most %s", took, closeWait)
	}
}

// hangingThenFast hangs every settle while hung (until the caller gives
// up), and otherwise takes it as applied at once, recording its size.
type hangingThenFast struct {
	Ledger
	hung  atomic.Bool
	sizes []uint64
}

func (l *hangingThenFast) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	if l.hung.Load() {
		<-ctx.Done() // NB: the settler's CallTimeout ends it
		return SettleResult{}, ctx.Err()
	}
	l.sizes = append(l.sizes, b.Next-b.Prev)
	return SettleResult{Applied: true}, nil
}

// A settle that timed out is retried at half the size, in case the ledger
// is slow rather than hung; once settles are quick again the batch grows
// back to MaxBatch, so that a ledger that hung for a minute does not cost
// ten times the round trips for ever after.
func TestSettleBatchShrinksOnTimeoutsAndGrowsBack(t *testing.T) {
	ctx := context.Background()
	sq, e := ledgerRig(t, nil)
	l := &hangingThenFast{Ledger: sq}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, MaxBatch: 4000, CallTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(t, e, 5000)
	l.hung.Store(true)
	for range 3 {
		if _, err := s.SettleOnce(ctx); !CallTimedOut(err) {
			t.Fatalf("settle against a hung ledger: %v, want it timed out", err)
		}
	}
	l.hung.Store(false)
	if _, err := s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	appendCharges(t, e, 4000)
	if _, err := s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	if want := []uint64{1000, 2000, 2000, 4000}; !slices.Equal(l.sizes, want) {
		t.Fatalf("batches %v after three timeouts, want %v (cut to 1000, then doubled back to 4000)", l.sizes, want)
	}
}

// A write to the SQLite ledger waits for the one writer only as long as its
// context lets it: a charge's reservation queued behind a settle stuck on a
// lock another process held waited past its 2 s bound (15 s in a review),
// when the writers queued on a mutex.
func TestSQLiteWriterWaitEndsWithItsContext(t *testing.T) {
	l := migratedSQLite(t, nil)
	l.writeSem <- struct{}{} // a write that hangs
	release := time.AfterFunc(5*time.Second, func() { <-l.writeSem })
	defer release.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := l.Reserve(ctx, "n1", ReserveRequest{Account: "acct-1", Wall: time.Now(), Need: 1})
	if !release.Stop() {
		t.Fatalf("the reserve returned (%v) only once the hung write let go, not at its context's end", err)
	}
	<-l.writeSem
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a reserve behind a hung write: %v, want its context's deadline", err)
	}
}
