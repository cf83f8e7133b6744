package engine

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/hang"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
)

// hungReserver grants what is asked until its gate is hung; then it
// answers nothing, no error and no units (a SIGSTOPped Postgres, a lock
// held on grants), until the caller gives up.
type hungReserver struct {
	fakeLedger
	gate *hang.Gate
}

func (h *hungReserver) Reserve(ctx context.Context, req ReserveRequest) (ReserveResult, error) {
	if err := h.gate.Wait(ctx); err != nil {
		return ReserveResult{}, err
	}
	return h.fakeLedger.Reserve(ctx, req)
}

func newHungReserver() *hungReserver {
	return &hungReserver{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}, gate: hang.New()}
}

// openHung opens an engine on account "acme" (hard, 1,000) whose
// reservations come from r, with the given timeouts.
func openHung(t *testing.T, r Reserver, logs *logbuf.Buffer, ledgerTimeout, reserveTimeout time.Duration) *Engine {
	t.Helper()
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: r,
		LedgerTimeout: ledgerTimeout, ReserveTimeout: reserveTimeout, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	return e
}

// chargeUntilTopUp charges acme 1 unit at a time, from its allowance, until
// the engine has queued top-up number n.
func chargeUntilTopUp(t *testing.T, e *Engine, n int64) {
	t.Helper()
	for i := 0; e.Stats().TopUps.Load() < n; i++ {
		if i == 100 {
			t.Fatalf("100 charges and %d top-ups; want %d", e.Stats().TopUps.Load(), n)
		}
		if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %d: %+v %v", i, res, err)
		}
		if e.AllowanceHeld() == 0 {
			waitfor.Cond(t, 5*time.Second, "top-up queued", func() bool { return e.Stats().TopUps.Load() >= n })
		}
	}
}

// A background top-up the ledger never answers is cancelled at
// LedgerTimeout (quotad serve --ledger-timeout), counted, and logged at
// WARN, and the top-up loop goes on: before, the engine put no bound of its
// own on it, so a Reserver that hung held the loop (every later top-up and
// release retry) for as long as it hung.
func TestBackgroundTopUpAgainstAHungLedgerTimesOut(t *testing.T) {
	var logs logbuf.Buffer
	r := newHungReserver()
	e := openHung(t, r, &logs, 200*time.Millisecond, time.Minute)
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("first charge: %+v %v", res, err)
	}
	r.gate.Hung.Store(true)
	chargeUntilTopUp(t, e, 1)
	<-r.gate.Entered
	waitfor.Cond(t, 3*time.Second, "the hung top-up counted as timed out", func() bool {
		return e.Stats().ReserveTimeouts.Load() == 1 && e.Stats().ReserveErrors.Load() == 1
	})
	waitfor.Cond(t, 3*time.Second, "a WARN naming --ledger-timeout", func() bool {
		return strings.Contains(logs.String(), "level=WARN") && strings.Contains(logs.String(), "within --ledger-timeout")
	})
	// The loop is free: the next charge queues a second top-up, which
	// times out in its turn.
	chargeUntilTopUp(t, e, 2)
	waitfor.Cond(t, 3*time.Second, "the second top-up timed out too", func() bool { return e.Stats().ReserveTimeouts.Load() == 2 })
	r.gate.Hung.Store(false)
	chargeUntilTopUp(t, e, 3)
	waitfor.Cond(t, 3*time.Second, "a top-up once the ledger answers", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.reserved["acme"] > 0 && e.Stats().Reservations.Load() == 4
	})
	if got := e.Stats().ReserveTimeouts.Load(); got != 2 {
		t.Errorf("%d timeouts counted, want 2", got)
	}
}

// A charge that needs units while a background top-up of its account
// hangs shares that round trip, but waits for it at most ReserveTimeout and
// answers ErrQuotaUnavailable: the top-up itself may wait LedgerTimeout.
func TestChargeJoiningAHungTopUpWaitsReserveTimeout(t *testing.T) {
	var logs logbuf.Buffer
	r := newHungReserver()
	e := openHung(t, r, &logs, time.Minute, 300*time.Millisecond)
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("first charge: %+v %v", res, err)
	}
	r.gate.Hung.Store(true)
	chargeUntilTopUp(t, e, 1)
	<-r.gate.Entered // the top-up hangs
	held := e.AllowanceHeld()
	t0 := time.Now()
	_, err := e.Charge(context.Background(), "acme", shard.Charge{Units: held + 1})
	took := time.Since(t0)
	if !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("charge past the allowance while the top-up hangs: %v; want ErrQuotaUnavailable", err)
	}
	if took > 5*time.Second {
		t.Errorf("the charge waited %s for the hung top-up; want about ReserveTimeout (300ms)", took.Round(time.Millisecond))
	}
	if e.Stats().ReserveTimeouts.Load() != 1 {
		t.Errorf("%d timeouts counted, want 1", e.Stats().ReserveTimeouts.Load())
	}
}

// Reserving names an account while its reservation is on its way (the
// ledger may hold the units for this node before the answer is in the
// allowance), and no longer once the answer is in: the reservation audit
// leaves such accounts alone (node/audit.go).
func TestReservingListsAReservationOnItsWay(t *testing.T) {
	var logs logbuf.Buffer
	r := newHungReserver()
	e := openHung(t, r, &logs, time.Minute, time.Minute)
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("first charge: %+v %v", res, err)
	}
	if got := e.Reserving(); len(got) != 0 {
		t.Fatalf("Reserving %v with the reservation answered, want none", got)
	}
	r.gate.Hung.Store(true)
	chargeUntilTopUp(t, e, 1)
	<-r.gate.Entered
	if got := e.Reserving(); len(got) != 1 || got[0] != "acme" {
		t.Fatalf("Reserving %v with a top-up of acme held at the ledger, want [acme]", got)
	}
	held := e.AllowanceHeld()
	r.gate.Release()
	waitfor.Cond(t, 3*time.Second, "the top-up's units in the allowance", func() bool { return e.AllowanceHeld() > held })
	waitfor.Cond(t, 3*time.Second, "acme no longer reserving", func() bool { return len(e.Reserving()) == 0 })
}

// A reservation answered after its account was let go hands its units back
// and leaves no state behind: it made the account's entry again from the
// config snapshot, not owned and never dropped, and if the account came
// back it was decided from that snapshot's use instead of the ledger's.
func TestAReservationAnsweredAfterALetGoLeavesNoEntry(t *testing.T) {
	r := newHungReserver()
	var owns atomic.Bool
	owns.Store(true)
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: r,
		LedgerTimeout: time.Minute, ReserveTimeout: time.Minute, Owns: func(string) bool { return owns.Load() }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	snap := testSnapshot(t, map[string]int64{"acme": 1000})
	if err := e.SetSnapshot(snap, AllSettled); err != nil {
		t.Fatal(err)
	}
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("first charge: %+v %v", res, err)
	}
	r.gate.Hung.Store(true)
	chargeUntilTopUp(t, e, 1)
	<-r.gate.Entered

	owns.Store(false)
	if err := e.SetSnapshot(snap, AllSettled); err != nil { // every record of acme settled: Forget may drop it
		t.Fatal(err)
	}
	if err := e.LetGo(context.Background(), "acme"); err != nil {
		t.Fatal(err)
	}
	if ids := e.AccountIDs(); len(ids) != 0 {
		t.Fatalf("after the let-go the engine holds %v, want nothing", ids)
	}
	r.mu.Lock()
	released := r.released["acme"]
	r.mu.Unlock()
	r.gate.Release()
	waitfor.Cond(t, 3*time.Second, "the late reservation handed back", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.released["acme"] > released && len(e.Reserving()) == 0
	})
	if ids := e.AccountIDs(); len(ids) != 0 {
		t.Fatalf("the late reservation left state for %v, an account this node does not own", ids)
	}
}

// A config snapshot kept in the data dir that this build cannot decode (a
// newer build wrote it, and the node was rolled back) is left out with a
// WARN: it is a cache of the ledger's config, and the start refused
// before, telling to move the data dir aside, unsettled records and all.
func TestAnUndecodableKeptSnapshotIsLeftOut(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir)
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	e.Close()
	if err := l.PutMeta(metaSnapshot, []byte("a snapshot of a newer build")); err != nil {
		t.Fatal(err)
	}
	var logs logbuf.Buffer
	e, err = Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatalf("open with an undecodable kept snapshot: %v", err)
	}
	defer e.Close()
	if e.Snapshot() != nil || !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "does not decode") {
		t.Fatalf("snapshot %v, log %q: want none kept and a WARN", e.Snapshot(), logs.String())
	}
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), 0); err != nil { // read before the charge settled
		t.Fatal(err)
	}
	if u, ok, err := e.Usage("acme"); err != nil || !ok || u.Used != 1 {
		t.Fatalf("acme after the snapshot is read again: %+v %v %v; want its charge recovered from the log", u, ok, err)
	}
}
