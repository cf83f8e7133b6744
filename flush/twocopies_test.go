package flush

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// twoCopies makes a data dir of node q1 with 5 charges, copies it, and
// opens both: two processes as one node and incarnation.
func twoCopies(t *testing.T) (logA, logB *wal.Log, eA, eB *engine.Engine) {
	t.Helper()
	dirA := t.TempDir()
	log, err := wal.Open(wal.Options{Dir: dirA, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	logCharges(t, log, "orig", 5)
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	dirB := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", dirA, dirB).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	logA, eA = openEngineOn(t, wal.Options{Dir: dirA, NodeID: "q1"})
	logB, eB = openEngineOn(t, wal.Options{Dir: dirB, NodeID: "q1"})
	return logA, logB, eA, eB
}

// logCharges logs n durable one-unit charges of acct-1, ids prefix-i.
// copySettler is a settler of the engine e, naming its process.
func copySettler(t *testing.T, l Ledger, e *engine.Engine, process string) *Settler {
	t.Helper()
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Events: true, Start: NodeStart{Process: process}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func logCharges(t *testing.T, log *wal.Log, prefix string, n int) {
	t.Helper()
	for i := range n {
		rec := shard.Record{Type: shard.RecCharge, Wall: time.Now().UnixNano(), Account: "acct-1",
			EventID: fmt.Sprintf("%s-%d", prefix, i), ClientID: true, Units: 1}
		seq, err := log.Append(rec.AppendEncode(nil))
		if err == nil {
			err = log.WaitDurable(context.Background(), seq)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func eventCount(t *testing.T, l *SQLite, like string) int {
	t.Helper()
	var n int
	if err := l.db.QueryRowContext(t.Context(), `SELECT count(*) FROM events WHERE event_id LIKE ?`, like).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Two processes on copies of one data dir, both registered: the earlier
// one's settles are refused from the later one's start on, and it records
// in its dir which of its charges are in no ledger; the later one settles
// all of its own. Before, the earlier one settled first, and the later one,
// its own batch refused, took the ledger's mark as its own settle whose
// answer was lost and marked its charges under those numbers settled:
// acknowledged, in no ledger, and listed nowhere.
func TestAProcessOnACopyOfItsDirKeepsItsCharges(t *testing.T) {
	ctx := context.Background()
	l := migratedSQLite(t, nil)
	logA, logB, eA, eB := twoCopies(t)
	sA := copySettler(t, l, eA, "proc-a")
	sB := copySettler(t, l, eB, "proc-b")
	if err := sA.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sB.Register(ctx); err != nil {
		t.Fatal(err)
	}
	logCharges(t, logA, "a", 3) // seqs 6..8 at A
	logCharges(t, logB, "b", 6) // seqs 6..11 at B

	_, err := sA.SettleOnce(ctx)
	if !errors.Is(err, ErrOtherProcess) {
		t.Fatalf("A's settle after B started: %v, want ErrOtherProcess", err)
	}
	sd, ok, rerr := ReadStaleDir(logA)
	if rerr != nil || !ok || !sd.OtherProcess || sd.Billed != 0 || sd.Durable != 8 {
		t.Fatalf("A's dir records %+v (%v, %v); want records 1 to 8 as never to settle from it, for another process", sd, ok, rerr)
	}
	for range 3 {
		if _, err := sB.SettleOnce(ctx); err != nil {
			t.Fatalf("B's settle: %v", err)
		}
	}
	if got := logB.SettledSeq(); got != 11 {
		t.Errorf("B settled to %d, want 11", got)
	}
	if a, b := eventCount(t, l, "a-%"), eventCount(t, l, "b-%"); a != 0 || b != 6 {
		t.Errorf("the ledger holds %d of A's charges and %d of B's; want 0 and all 6", a, b)
	}
}

// startRace is a ledger in which another process settles right after the
// settler's first registration read, before its start is recorded.
// registeredOriginal is twoCopies with the original's settler (proc-a)
// registered on a new SQLite ledger and 3 more charges in the original's
// log: what a copy started beside a running original finds.
func registeredOriginal(t *testing.T) (l *SQLite, logA, logB *wal.Log, sA *Settler, eB *engine.Engine) {
	t.Helper()
	l = migratedSQLite(t, nil)
	logA, logB, eA, eB := twoCopies(t)
	sA = copySettler(t, l, eA, "proc-a")
	if err := sA.Register(t.Context()); err != nil {
		t.Fatal(err)
	}
	logCharges(t, logA, "a", 3)
	return l, logA, logB, sA, eB
}

// settleBeforeTheStart is l, where sA settles once between a copy's first
// read of the mark and the record of its start.
func settleBeforeTheStart(t *testing.T, l *SQLite, sA *Settler) *startRace {
	return &startRace{SQLite: l, between: func() {
		if _, err := sA.SettleOnce(t.Context()); err != nil {
			t.Errorf("A's settle before B's start is recorded: %v", err)
		}
	}}
}

type startRace struct {
	*SQLite
	between func()
}

func (r *startRace) RecordStart(ctx context.Context, node, inc string, s NodeStart) error {
	if r.between != nil {
		r.between()
		r.between = nil
	}
	return r.SQLite.RecordStart(ctx, node, inc, s)
}

// A settle by the earlier process between the later one's first read of
// the mark and the record of its start is seen: the later process reads
// the mark again after the record (from then on the earlier one is
// refused), finds the dir behind the ledger, and refuses it. Read only
// before, that mark was later taken as its own settle and its charges
// under those numbers dropped.
func TestARegistrationReadsTheMarkAfterItsStart(t *testing.T) {
	ctx := context.Background()
	l, _, logB, sA, eB := registeredOriginal(t)
	logCharges(t, logB, "b", 6)
	race := settleBeforeTheStart(t, l, sA)
	sB := copySettler(t, race, eB, "proc-b")
	err := sB.Register(ctx)
	if !errors.Is(err, ErrStaleDataDir) {
		t.Fatalf("B's registration after A settled past B's copy: %v, want ErrStaleDataDir", err)
	}
	if logB.SettledSeq() != 0 {
		t.Errorf("B marked records to %d settled", logB.SettledSeq())
	}
	if sd, ok, err := ReadStaleDir(logB); err != nil || !ok || sd.Billed != 5 || sd.LedgerMark != 8 {
		t.Errorf("B's dir records %+v (%v, %v); want it older than the ledger's mark 8 from record 6 on", sd, ok, err)
	}
}

// A copy that the ledger is ahead of is refused before its start is
// recorded: recorded, the ledger refused the settles of the process on
// the original dir from then on, for a copy that never served, and that
// process stopped with its dir marked as never to settle (a review's
// reproduction).
func TestARefusedStaleCopyLeavesTheOriginalSettling(t *testing.T) {
	ctx := context.Background()
	l, logA, _, sA, eB := registeredOriginal(t)
	if _, err := sA.SettleOnce(ctx); err != nil { // the ledger to 8, past the copy's 5
		t.Fatal(err)
	}
	recorded := false
	watch := &startRace{SQLite: l, between: func() { recorded = true }}
	sB := copySettler(t, watch, eB, "proc-b")
	if err := sB.Register(ctx); !errors.Is(err, ErrStaleDataDir) {
		t.Fatalf("the stale copy's registration: %v, want ErrStaleDataDir", err)
	}
	if recorded {
		t.Error("the stale copy recorded its start")
	}
	logCharges(t, logA, "a2", 2)
	if _, err := sA.SettleOnce(ctx); err != nil {
		t.Fatalf("the original's settle after the copy was refused: %v", err)
	}
	if _, ok, err := ReadStaleDir(logA); err != nil || ok {
		t.Fatalf("the original's dir is marked stale (%v, %v)", ok, err)
	}
	if got := logA.SettledSeq(); got != 10 {
		t.Errorf("the original settled to %d, want 10", got)
	}
}

// A settle of the original between the copy's first read of the mark and
// the record of its start leaves the copy refused and the original's start
// recorded again, so that it goes on settling.
func TestACopyOvertakenWhileItRegistersGivesTheStartBack(t *testing.T) {
	ctx := context.Background()
	l, logA, _, sA, eB := registeredOriginal(t)
	race := settleBeforeTheStart(t, l, sA)
	sB := copySettler(t, race, eB, "proc-b")
	if err := sB.Register(ctx); !errors.Is(err, ErrStaleDataDir) {
		t.Fatalf("B's registration: %v, want ErrStaleDataDir", err)
	}
	if s, err := l.LastStart(ctx, "q1"); err != nil || s.Process != "proc-a" {
		t.Fatalf("the last start after B was refused: %+v, %v; want proc-a's again", s, err)
	}
	logCharges(t, logA, "a2", 2)
	if _, err := sA.SettleOnce(ctx); err != nil {
		t.Fatalf("A's settle after B was refused: %v", err)
	}
}
