package flush

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/gatefs"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// An idle node still writes its heartbeat to the ledger (quotad revoke
// tells a running node from a lost one by it).
func TestIdleSettlerHeartbeats(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects now
	now := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	l, s := settlerRig(t, clock, SettlerOptions{Heartbeat: time.Nanosecond})
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	heartbeat := func() time.Time {
		t.Helper()
		nodes, err := l.Nodes(ctx)
		if err != nil || len(nodes) != 1 {
			t.Fatalf("nodes %v, %v", nodes, err)
		}
		return nodes[0].Heartbeat
	}
	if h := heartbeat(); !h.Equal(now) {
		t.Fatalf("heartbeat %s after Register, want %s", h, now)
	}
	mu.Lock()
	now = now.Add(time.Minute)
	mu.Unlock()
	if n, err := s.SettleOnce(ctx); err != nil || n != 0 {
		t.Fatalf("settle of an empty log: %d, %v", n, err)
	}
	if h := heartbeat(); !h.Equal(clock()) {
		t.Fatalf("heartbeat %s after an idle settle a minute on, want %s", h, clock())
	}
}

// With a settle interval longer than the heartbeat's, the loop still
// heartbeats (revoke would otherwise take a running node for a lost one).
func TestSettlerLoopHeartbeatsBetweenSettles(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex // protects now
	now := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); now = now.Add(time.Second); return now }
	l, s := settlerRig(t, clock, SettlerOptions{Interval: time.Hour, Heartbeat: 10 * time.Millisecond})
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	first := lastHeartbeat(t, l)
	s.Start()
	defer s.Close()
	deadline := time.Now().Add(10 * time.Second)
	for !lastHeartbeat(t, l).After(first) {
		if time.Now().After(deadline) {
			t.Fatal("no heartbeat within 10 s with a settle interval of an hour")
		}
		time.Sleep(5 * time.Millisecond) // NB: polls a condition, bounded by the deadline
	}
}

func lastHeartbeat(t *testing.T, l Ledger) time.Time {
	t.Helper()
	nodes, err := l.Nodes(context.Background())
	if err != nil || len(nodes) != 1 {
		t.Fatalf("nodes %v, %v", nodes, err)
	}
	return nodes[0].Heartbeat
}

// settlerRig opens a migrated SQLite ledger on clock, a log and an engine
// of node q1 (ledgerRig), and a settler with opts (Ledger and Engine filled
// in); all are closed when the test ends.
func settlerRig(t *testing.T, clock func() time.Time, opts SettlerOptions) (*SQLite, *Settler) {
	t.Helper()
	l, e := ledgerRig(t, clock)
	opts.Ledger, opts.Engine = l, e
	s, err := NewSettler(opts)
	if err != nil {
		t.Fatal(err)
	}
	return l, s
}

// migratedSQLite opens a migrated SQLite ledger on clock (nil: the wall
// clock), closed when the test ends.
func migratedSQLite(t *testing.T, clock func() time.Time) *SQLite {
	t.Helper()
	l, err := OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "ledger.db"), SQLiteOptions{Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return l
}

// ledgerRig opens a migrated SQLite ledger on clock (nil: the wall clock)
// and a log and an engine of node q1, closed when the test ends.
func ledgerRig(t *testing.T, clock func() time.Time) (*SQLite, *engine.Engine) {
	t.Helper()
	return ledgerRigOn(t, clock, wal.Options{Dir: t.TempDir(), NodeID: "q1"})
}

// ledgerRigOn is ledgerRig with the log opened with opts.
func ledgerRigOn(t *testing.T, clock func() time.Time, opts wal.Options) (*SQLite, *engine.Engine) {
	t.Helper()
	l := migratedSQLite(t, clock)
	_, e := openEngineOn(t, opts)
	return l, e
}

// openEngineOn opens a log with opts and an engine over it, both closed
// when the test ends.
func openEngineOn(t *testing.T, opts wal.Options) (*wal.Log, *engine.Engine) {
	t.Helper()
	log, err := wal.Open(opts)
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.Open(engine.Options{Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); log.Close() })
	return log, e
}

// A data dir restored from a copy older than the ledger, started while the
// ledger was out of reach: the log held records 1..5 when it opened, took
// 7 more charges (6..12), and the ledger has this incarnation settled to 10
// (other records, from the dir's later life). Catching the local mark up
// to 10 would drop 6..10, acknowledged charges the ledger never saw: the
// settler refuses, marking nothing.
func TestSettlerRefusesToMarkRecordsTheLedgerNeverSaw(t *testing.T) {
	ctx := context.Background()
	l := migratedSQLite(t, nil)
	dir := t.TempDir()
	appendN := func(log *wal.Log, n int) {
		t.Helper()
		for range n {
			rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: "e", Units: 1}
			seq, err := log.Append(rec.AppendEncode(nil))
			if err == nil {
				err = log.WaitDurable(ctx, seq)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	appendN(log, 5)
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	log, err = wal.Open(wal.Options{Dir: dir, NodeID: "q1"}) // the restored copy, started
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.Open(engine.Options{Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { e.Close(); log.Close() }()
	appendN(log, 7) // served while the ledger was down
	mark, err := l.RegisterNode(ctx, "q1", log.Incarnation())
	if err != nil {
		t.Fatal(err)
	}
	if res, err := l.Settle(ctx, &Batch{Node: "q1", Incarnation: log.Incarnation(), Prev: mark, Next: 10, Events: true}); err != nil || !res.Applied {
		t.Fatalf("the ledger's later settles of this incarnation: %+v, %v", res, err)
	}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e})
	if err != nil {
		t.Fatal(err)
	}
	err = s.Register(ctx)
	if !errors.Is(err, ErrMarkConflict) || !errors.Is(err, ErrStaleDataDir) || !strings.Contains(err.Error(), "records 6 to 12 are charges taken since it opened") {
		t.Fatalf("Register: %v; want ErrMarkConflict and ErrStaleDataDir naming records 6 to 12", err)
	}
	if got := log.SettledSeq(); got != 0 {
		t.Fatalf("the local settled mark is %d after the refusal, want 0 (nothing marked)", got)
	}
	// The dir says which records the ledger billed (1..5, the copy's,
	// settled from the original dir) and which it never saw (6..12): only
	// now can that be told, since a restart vouches for all it holds.
	sd, ok, err := ReadStaleDir(log)
	if err != nil || !ok {
		t.Fatalf("the data dir's stale note: %+v, %v, %v; want one", sd, ok, err)
	}
	if sd.Node != "q1" || sd.Incarnation != log.Incarnation() || sd.LedgerMark != 10 || sd.Billed != 5 || sd.Durable != 12 {
		t.Fatalf("stale note %+v; want node q1, ledger mark 10, billed through 5, durable 12", sd)
	}
	// Found again with more records (a retry), the first boundary stands.
	appendN(log, 3)
	if err := s.Register(ctx); !errors.Is(err, ErrStaleDataDir) {
		t.Fatalf("Register again: %v", err)
	}
	if again, _, _ := ReadStaleDir(log); again.Billed != 5 || again.Durable != 12 {
		t.Fatalf("the stale note moved to %+v; want billed through 5 kept", again)
	}
}

// timeoutLedger is a ledger whose server cancels any settle of more than
// max records for time (SQLSTATE 57014, as a role's statement_timeout
// shorter than one settle does); smaller ones it takes as applied.
type timeoutLedger struct {
	Ledger
	max     uint64
	settled []uint64 // the sizes it took
}

func (l *timeoutLedger) Settle(_ context.Context, b *Batch) (SettleResult, error) {
	if b.Next-b.Prev > l.max {
		return SettleResult{}, &pgconn.PgError{Code: "57014", Message: "canceling statement due to statement timeout"}
	}
	l.settled = append(l.settled, b.Next-b.Prev)
	return SettleResult{Applied: true}, nil
}

// A settle the ledger cancels for time was retried at the same size for
// ever (a role with statement_timeout=150ms stalled settling until its
// connections were killed): the settler halves its batch each time, down
// to minBatch, and gets through.
func TestSettlerShrinksBatchesTheLedgerTimesOut(t *testing.T) {
	ctx := context.Background()
	sq, e := ledgerRig(t, nil)
	log := e.Log()
	appendCharges(t, e, 5000)
	l := &timeoutLedger{Ledger: sq, max: 1500}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, MaxBatch: 4000})
	if err != nil {
		t.Fatal(err)
	}
	for try := 0; log.SettledSeq() < 5000; try++ {
		if try == 10 {
			t.Fatalf("settled to %d of 5000 after 10 tries, in batches of %v: the batch does not shrink", log.SettledSeq(), l.settled)
		}
		_, _ = s.SettleOnce(ctx)
	}
	if want := []uint64{1000, 1000, 1000, 1000, 1000}; !slices.Equal(l.settled, want) {
		t.Fatalf("batches %v, want %v (4000 halved twice)", l.settled, want)
	}
}

// stallLedger is a ledger on a clock of its own: a settle takes perRecord
// a record, but the next stalls ones wait on a lock until the server's
// statement_timeout (timeout) cancels them.
type stallLedger struct {
	Ledger
	perRecord, timeout time.Duration
	stalls             int
	now                atomic.Int64 // ns since the clock's zero
	settled            []uint64     // the sizes it took
}

func (l *stallLedger) Settle(_ context.Context, b *Batch) (SettleResult, error) {
	if l.stalls > 0 {
		l.stalls--
		l.now.Add(int64(l.timeout))
		return SettleResult{}, &pgconn.PgError{Code: "57014", Message: "canceling statement due to statement timeout"}
	}
	l.now.Add(int64(time.Duration(b.Next-b.Prev) * l.perRecord))
	l.settled = append(l.settled, b.Next-b.Prev)
	return SettleResult{Applied: true}, nil
}

func (l *stallLedger) clock() time.Time { return time.Unix(0, l.now.Load()) }

// Two settles cancelled by the role's statement_timeout while they waited
// on a lock (a migration's, say) cut the batch to a quarter, and it stayed
// there until the node restarted (a backlog of millions settled 1,000
// records a round trip). It grows back, doubling after each settle that
// took less than a quarter of the time the cancelled one ran.
func TestSettlerGrowsBatchesBackAfterAStatementTimeout(t *testing.T) {
	ctx := context.Background()
	sq, e := ledgerRig(t, nil)
	log := e.Log()
	l := &stallLedger{Ledger: sq, perRecord: 10 * time.Microsecond, timeout: time.Second, stalls: 2}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, MaxBatch: 8000, Now: l.clock})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(t, e, 30000)
	for try := 0; log.SettledSeq() < 30000; try++ {
		if try == 20 {
			t.Fatalf("settled to %d of 30000 after 20 tries, in batches of %v", log.SettledSeq(), l.settled)
		}
		_, _ = s.SettleOnce(ctx)
	}
	// 2,000 records take 20 ms, under a quarter of the second the
	// cancelled settles ran: the next one doubles, and so on to MaxBatch.
	if want := []uint64{2000, 4000, 8000, 8000, 8000}; !slices.Equal(l.settled, want) {
		t.Fatalf("batches %v, want %v (8000 halved twice, then doubled back)", l.settled, want)
	}
}

// downLedger fails every call of RegisterNode (a heartbeat) while down.
type downLedger struct {
	Ledger
	down atomic.Bool
}

func (l *downLedger) RegisterNode(ctx context.Context, node, inc string) (uint64, error) {
	return l.Heartbeat(ctx, node, inc, "", time.Time{})
}

func (l *downLedger) Heartbeat(ctx context.Context, node, inc, process string, drainedAt time.Time) (uint64, error) {
	if l.down.Load() {
		return 0, errors.New("connection refused")
	}
	return l.Ledger.Heartbeat(ctx, node, inc, process, drainedAt)
}

// A node with nothing to settle learns that the ledger is down from its
// heartbeats: Healthy turned false only on a failed settle of records, so an
// idle node's drain handed its reservations back to a ledger that refused
// them (and stranded them), and quotaring_ledger_up read 1 in the outage.
func TestHeartbeatFailureMakesTheSettlerUnhealthy(t *testing.T) {
	ctx := context.Background()
	sq, e := ledgerRig(t, nil)
	l := &downLedger{Ledger: sq}
	s, err := NewSettler(SettlerOptions{Ledger: l, Engine: e, Heartbeat: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if !s.Healthy() {
		t.Fatal("unhealthy after Register")
	}
	l.down.Store(true)
	if err := s.heartbeat(ctx); err == nil {
		t.Fatal("a heartbeat to a ledger that is down succeeded")
	}
	if s.Healthy() {
		t.Fatal("healthy after a failed heartbeat, with nothing to settle")
	}
	l.down.Store(false)
	if err := s.heartbeat(ctx); err != nil {
		t.Fatal(err)
	}
	if !s.Healthy() {
		t.Fatal("unhealthy after the heartbeat reached the ledger again")
	}
}

// drainLedger records each batch's range and DrainedAt.
type drainLedger struct {
	Ledger
	batches []*Batch     // read once the settles return
	sent    atomic.Int64 // the batches settled
}

func (l *drainLedger) Settle(ctx context.Context, b *Batch) (SettleResult, error) {
	l.batches = append(l.batches, b)
	res, err := l.Ledger.Settle(ctx, b)
	l.sent.Add(1)
	return res, err
}

// drainSettler is a registered Settler with opts, its Ledger wrapped to
// keep the batches it is sent.
func drainSettler(t *testing.T, opts SettlerOptions) (*Settler, *drainLedger) {
	t.Helper()
	dl := &drainLedger{Ledger: opts.Ledger}
	opts.Ledger = dl
	s, err := NewSettler(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s, dl
}

// settleInBatches registers a Settler with opts (its Ledger wrapped to
// keep the batches it is sent) and settles the engine's log to its end in
// at most tries SettleOnce calls, and returns the batches.
func settleInBatches(t *testing.T, opts SettlerOptions, tries int) []*Batch {
	t.Helper()
	ctx := context.Background()
	s, dl := drainSettler(t, opts)
	log := opts.Engine.Log()
	for try := 0; log.SettledSeq() < log.DurableSeq(); try++ {
		if try == tries {
			t.Fatalf("settled to %d of %d after %d tries", log.SettledSeq(), log.DurableSeq(), tries)
		}
		if _, err := s.SettleOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return dl.batches
}

// Only a batch that took everything the log held says so (DrainedAt, which
// moves the node's settled_through, and with it the point up to which the
// billing export calls a month final): a log settled in three batches
// sends DrainedAt with the last one only. Sent with every batch, a month
// read final while records of it still waited in the log.
func TestOnlyTheBatchThatDrainsTheLogSaysSo(t *testing.T) {
	sq, e := ledgerRig(t, nil)
	appendCharges(t, e, 2500)
	var got []string
	for _, b := range settleInBatches(t, SettlerOptions{Ledger: sq, Engine: e, MaxBatch: 1000}, 5) {
		got = append(got, fmt.Sprintf("(%d,%d] drained=%v", b.Prev, b.Next, !b.DrainedAt.IsZero()))
	}
	if want := []string{"(0,1000] drained=false", "(1000,2000] drained=false", "(2000,2500] drained=true"}; !slices.Equal(got, want) {
		t.Fatalf("batches %v, want %v", got, want)
	}
}

// A charge, its refund and the same event charged again (its id forgotten
// by the node: the dedup window passed, or DedupMax evicted it), all in
// one month and one settle range: settled as one batch, Postgres took the
// second charge for a duplicate of the first (its charges go in before its
// refunds) and then refunded the event, billing nothing for a request that
// was served. The settler now ends the batch before such a charge: two
// batches, 3 units billed, on both ledgers.
func TestRetryOfARefundedEventSettlesInTheNextBatch(t *testing.T) {
	onBothLedgers(t, func(t *testing.T, l Ledger) {
		ctx := context.Background()
		confSetup(t, l, 100, "acct-1")
		log, e := openEngineOn(t, wal.Options{Dir: t.TempDir(), NodeID: "q1"})
		june10 := time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC).UnixNano()
		june11 := june10 + int64(24*time.Hour)
		period := shard.PeriodOf(june10)
		grant := shard.MonthlyGrantID(period)
		for _, rec := range []shard.Record{
			{Type: shard.RecCharge, Account: "acct-1", EventID: "e1", ClientID: true, Key: "k1", Route: "POST /x", Units: 2, Period: period, Wall: june10,
				Allocs: []shard.Alloc{{Grant: grant, Units: 2}}},
			{Type: shard.RecRefund, Account: "acct-1", EventID: "e1", Key: "k1", Route: "POST /x", Units: 2, Period: period, Wall: june10, ChargeWall: june10,
				Allocs: []shard.Alloc{{Grant: grant, Units: 2}}},
			{Type: shard.RecCharge, Account: "acct-1", EventID: "e1", ClientID: true, Key: "k1", Route: "POST /x", Units: 3, Period: period, Wall: june11,
				Allocs: []shard.Alloc{{Grant: grant, Units: 3}}},
		} {
			if _, err := log.Append(rec.AppendEncode(nil)); err != nil {
				t.Fatal(err)
			}
		}
		if err := log.WaitDurable(ctx, log.LastSeq()); err != nil {
			t.Fatal(err)
		}
		var ranges []string
		for _, b := range settleInBatches(t, SettlerOptions{Ledger: l, Engine: e, Events: true}, 3) {
			ranges = append(ranges, fmt.Sprintf("(%d,%d]", b.Prev, b.Next))
		}
		if want := []string{"(0,2]", "(2,3]"}; !slices.Equal(ranges, want) {
			t.Errorf("batches %v, want %v (cut before the retry)", ranges, want)
		}
		var billed int64
		for _, ev := range eventsOf(t, l, "acct-1") {
			if !ev.Refunded {
				billed += ev.Units
			}
		}
		if billed != 3 {
			t.Fatalf("billed %d units, want 3 (the retry): %+v", billed, eventsOf(t, l, "acct-1"))
		}
		wantReconciled(t, l)
	})
}

// A batch claims the log drained (DrainedAt) only once it reaches every
// record made before the time it claims, durable then or not: a charge in
// the middle of its fsync when a settle read the log (a disk that stalls
// across midnight) was made before that time and settled after it, and
// the settle that read the log's durable end claimed it had nothing
// unsettled: the month read final, then the charge was billed into it.
func TestDrainedOnlyPastRecordsStillWaitingForTheDisk(t *testing.T) {
	ctx := context.Background()
	fs := gatefs.New(vfs.NewMem())
	l, e := ledgerRigOn(t, nil, wal.Options{Dir: "data", NodeID: "q1", FS: fs})
	t.Cleanup(fs.Release) // runs first: a failed test must not hang Close
	log := e.Log()
	s, dl := drainSettler(t, SettlerOptions{Ledger: l, Engine: e})
	appendCharges(t, e, 1)
	fs.Arm()
	rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: "in-flight", Units: 1}
	made := time.Now()
	if _, err := log.Append(rec.AppendEncode(nil)); err != nil {
		t.Fatal(err)
	}
	<-fs.Entered // its commit is inside fsync
	// The settle reaches the ledger; marking its records settled here then
	// waits for the disk too.
	errc := make(chan error, 1)
	go func() { _, err := s.SettleOnce(ctx); errc <- err }()
	waitfor.Cond(t, 10*time.Second, "the first batch to reach the ledger", func() bool { return dl.sent.Load() == 1 })
	fs.Release()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if err := log.WaitDurable(ctx, log.LastSeq()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SettleOnce(ctx); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range dl.batches {
		got = append(got, fmt.Sprintf("(%d,%d] drained=%v", b.Prev, b.Next, !b.DrainedAt.IsZero()))
	}
	if want := []string{"(0,1] drained=false", "(1,2] drained=true"}; !slices.Equal(got, want) {
		t.Fatalf("batches %v, want %v (the first left a record made before it unsettled)", got, want)
	}
	if at := dl.batches[1].DrainedAt; at.After(made) {
		t.Errorf("the batch that settled the record claims the log drained at %v, after the record was made (%v)", at, made)
	}
}

// restoredLedger is a ledger restored from a backup older than the node's
// log: it refuses every settle as a mark conflict, and has the node at 0.
type restoredLedger struct{ Ledger }

func (restoredLedger) Settle(context.Context, *Batch) (SettleResult, error) {
	return SettleResult{}, fmt.Errorf("%w: the ledger is behind the log (a test's)", ErrMarkConflict)
}

func (restoredLedger) RegisterNode(context.Context, string, string) (uint64, error) { return 0, nil }

// A settle the ledger refuses for good, found by the loop while the node
// serves (the ledger restored from an older backup), is told to OnRefused
// once, so that the node stops taking charges it can never settle: it was
// retried for ever.
func TestSettleLoopReportsARefusalForGood(t *testing.T) {
	ctx := context.Background()
	sq, e := ledgerRig(t, nil)
	refused := make(chan error, 4)
	s, err := NewSettler(SettlerOptions{Ledger: sq, Engine: e, Interval: time.Millisecond,
		OnRefused: func(err error) { refused <- err }})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx); err != nil {
		t.Fatal(err)
	}
	s.opts.Ledger = restoredLedger{sq} // restored while the node ran
	rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: "e", Units: 1}
	seq, err := e.Log().Append(rec.AppendEncode(nil))
	if err == nil {
		err = e.Log().WaitDurable(ctx, seq)
	}
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	defer s.Close()
	select {
	case err := <-refused:
		if !errors.Is(err, ErrMarkConflict) {
			t.Fatalf("OnRefused heard %v, want the mark conflict", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the loop never reported the refusal")
	}
}
