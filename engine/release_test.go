package engine

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/gatefs"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// fakeLedger grants what is asked and records what is handed back; while
// refuse is set it refuses hand-backs, as a ledger that is down or too slow.
type fakeLedger struct {
	mu                 sync.Mutex // protects the fields below
	reserved, released map[string]int64
	refuse             bool
}

func (f *fakeLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reserved[req.Account] += req.Need
	return ReserveResult{Granted: []shard.Alloc{{Grant: shard.MonthlyGrantID(shard.PeriodOf(req.Wall)), Units: req.Need}}}, nil
}

func (f *fakeLedger) Release(_ context.Context, account string, allocs []shard.Alloc, _ uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse {
		return errors.New("fake ledger: unavailable")
	}
	for _, a := range allocs {
		f.released[account] += a.Units
	}
	return nil
}

// openReserving opens an engine whose reservations come from ledger, with
// one charge of 1 made on account "acme", and returns the units it holds.
func openReserving(t *testing.T, ledger *fakeLedger) (*Engine, int64) {
	t.Helper()
	e := openWithReserver(t, ledger)
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	ledger.mu.Lock()
	defer ledger.mu.Unlock()
	held := ledger.reserved["acme"] - 1 // what the node holds after one charge of 1
	if held <= 0 {
		t.Fatal("the charge reserved nothing ahead; the test needs an allowance to hand back")
	}
	return e, held
}

// openWithReserver opens an engine on 10 June 2026 whose reservations come
// from r, with account "acme" (a hard quota of 1,000), closed when the test
// ends.
func openWithReserver(t *testing.T, r Reserver) *Engine {
	t.Helper()
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: r})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	return e
}

func (f *fakeLedger) releasedUnits(account string) int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.released[account]
}

// A hand-back the ledger refuses (down, or too slow) is retried until it
// goes through, instead of leaving the units reserved for nobody until the
// node restarts. (Found by the chaos harness: a slow ledger during a ring
// change left reservations behind after every node drained.)
func TestRefusedReleaseIsRetried(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}, refuse: true}
	e, held := openReserving(t, ledger)
	if err := e.Release(context.Background(), "acme"); err == nil {
		t.Fatal("a release the ledger refused returned no error")
	}
	if err := e.RetryReleases(context.Background()); err == nil {
		t.Fatal("a retry the ledger refused again returned no error")
	}
	ledger.mu.Lock()
	ledger.refuse = false
	ledger.mu.Unlock()
	if err := e.RetryReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := ledger.releasedUnits("acme"); got != held {
		t.Fatalf("the ledger got %d units back, want the %d the node held", got, held)
	}
	if err := e.ReleaseAll(context.Background()); err != nil || ledger.releasedUnits("acme") != held {
		t.Fatalf("a second hand-back: %v, %d units released in all, want %d", err, ledger.releasedUnits("acme"), held)
	}
}

// A release whose caller's context ends after the allowance was zeroed in
// the log still hands the units back to the ledger: otherwise they stay
// reserved there for nobody. (Found by the chaos harness: a node sent
// SIGTERM while it handed back the accounts a ring change took from it
// left their reservations in the ledger after it exited.)
func TestReleaseFinishesWhenTheCallerGivesUp(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	e, held := openReserving(t, ledger)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the node is shutting down
	e.Release(ctx, "acme")
	if got := ledger.releasedUnits("acme"); got != held {
		t.Fatalf("the ledger got %d units back of the %d the node zeroed locally", got, held)
	}
}

// An account that a node whose clock ran ahead billed in a later month
// starts there on this node (a period never goes back, G9), and its
// reservations come from that month's grant: asked at this node's own wall
// they came from a grant the account no longer spends, and every charge
// answered quota-unavailable until the real month caught up. (Found by the
// chaos harness: after a clock jump, accounts the jumped node had billed
// refused every charge for minutes.)
func TestReservesInTheAccountsLaterMonth(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: ledger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	s := testSnapshot(t, map[string]int64{"acme": 1000})
	s.Accounts[0].MonthlyUsed = map[string]int64{"m:2026-07": 5}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(s, AllSettled); err != nil {
		t.Fatal(err)
	}
	res, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge of an account billed in July on a node in June: %+v %v, want ok", res, err)
	}
	if want := time.Date(2026, 8, 1, 0, 0, 0, 0, time.UTC).Unix(); res.Reset != want {
		t.Errorf("reset %s, want %s (the account is in July)", time.Unix(res.Reset, 0).UTC(), time.Unix(want, 0).UTC())
	}
	if res.Remaining != 1000-5-1 {
		t.Errorf("remaining %d, want %d", res.Remaining, 1000-5-1)
	}
}

// barrierLedger answers a Reserve only once `want` of them are in flight
// together (or fails after a deadline): a batch that asked the ledger one
// account after the other would never get there.
type barrierLedger struct {
	fakeLedger
	want int

	arrivedMu sync.Mutex // protects arrived
	arrived   int
	all       chan struct{} // closed when want have arrived
}

func (b *barrierLedger) Reserve(ctx context.Context, req ReserveRequest) (ReserveResult, error) {
	b.arrivedMu.Lock()
	if b.arrived++; b.arrived == b.want {
		close(b.all)
	}
	b.arrivedMu.Unlock()
	select {
	case <-b.all:
		return b.fakeLedger.Reserve(ctx, req)
	case <-time.After(10 * time.Second):
		return ReserveResult{}, errors.New("barrier ledger: the other reservations never came while this one was in flight")
	}
}

// One account's ledger round trip does not hold up the rest of a batch:
// the accounts of a batch that need reservations ask for them together, so
// a batch waits for its slowest round trip, not for their sum. (Callers
// coalesce the requests of many accounts into one batch per owner.) Within
// an account the batch's order holds, and the charges behind the first are
// paid from its reservation without asking the ledger again.
func TestChargeManyReservesConcurrently(t *testing.T) {
	ledger := &barrierLedger{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}},
		want: 3, all: make(chan struct{})}
	l := openLog(t, t.TempDir())
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: ledger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"a": 1000, "b": 1000, "c": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	reqs := []Request{
		{Account: "a", Charge: shard.Charge{EventID: "a1", ClientID: true, Units: 1}},
		{Account: "nobody", Charge: shard.Charge{EventID: "n1", ClientID: true, Units: 1}},
		{Account: "b", Charge: shard.Charge{EventID: "b1", ClientID: true, Units: 2}},
		{Account: "c", Charge: shard.Charge{Units: 3}},
		{Account: "a", Charge: shard.Charge{EventID: "a1", ClientID: true, Units: 1}}, // a retry in the same batch
		{Account: "a", Charge: shard.Charge{EventID: "a2", ClientID: true, Units: 4}},
	}
	out := e.ChargeMany(ctx, reqs)
	want := []shard.Reason{shard.OK, shard.UnknownAccount, shard.OK, shard.OK, shard.Replayed, shard.OK}
	for i, o := range out {
		if o.Err != nil {
			t.Fatalf("charge %d (%s): %v", i, reqs[i].Account, o.Err)
		}
		if o.Reason != want[i] {
			t.Errorf("charge %d (%s %s): %s, want %s", i, reqs[i].Account, reqs[i].Charge.EventID, o.Reason, want[i])
		}
	}
	if out[3].EventID == "" {
		t.Error("a charge without an event id got none")
	}
	var last uint64
	for _, o := range out {
		last = max(last, o.Seq)
	}
	if d := l.DurableSeq(); d < last {
		t.Errorf("ChargeMany returned before its records were durable (durable %d, last %d)", d, last)
	}
	for a, want := range map[string]int64{"a": 5, "b": 2, "c": 3} {
		u, _, err := e.Usage(a)
		if err != nil {
			t.Fatal(err)
		}
		if u.Used != want {
			t.Errorf("%s used %d, want %d", a, u.Used, want)
		}
	}
	ledger.arrivedMu.Lock()
	defer ledger.arrivedMu.Unlock()
	if ledger.arrived != 3 {
		t.Errorf("%d reservations asked for, want 3 (one per account: a's later charges fit in its first)", ledger.arrived)
	}
}

// An account dropped from memory (Forget) with changes not yet checkpointed
// has its last state written at the next settle: the settle deletes the
// records of those changes, and a restart must not bring back the older
// checkpoint (here: an allowance already handed back to the ledger, which
// the node would spend again if the account came back to it while the
// ledger was down).
func TestForgottenAccountIsCheckpointed(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	dir := t.TempDir()
	var owns atomic.Bool
	owns.Store(true)
	open := func() (*Engine, *wal.Log) {
		l := openLog(t, dir)
		e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: ledger,
			Owns: func(string) bool { return owns.Load() }})
		if err != nil {
			t.Fatal(err)
		}
		return e, l
	}
	e, l := open()
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil { // checkpoint: an allowance held
		t.Fatal(err)
	}
	if e.AllowanceHeld() == 0 {
		t.Fatal("no allowance held after a charge; the test needs one")
	}
	owns.Store(false) // the account moved away
	if err := e.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if !e.Forget("acme") {
		t.Fatal("Forget kept the account")
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	e.Close()
	l.Close()

	owns.Store(true)
	e, l = open()
	defer func() { e.Close(); l.Close() }()
	if held := e.AllowanceHeld(); held != 0 {
		t.Fatalf("after a restart the node holds %d units it handed back before forgetting the account", held)
	}
}

// needLedger grants nothing and records the Need it was asked for.
type needLedger struct{ need atomic.Int64 }

func (n *needLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	n.need.Store(req.Need)
	return ReserveResult{}, nil
}

func (n *needLedger) Release(context.Context, string, []shard.Alloc, uint64) error { return nil }

// A reservation for a shortfall near the int64 limit asks for as much as
// can be had, never a Need that wrapped around to a negative number.
func TestReservationNeedSaturates(t *testing.T) {
	ledger := &needLedger{}
	e := openWithReserver(t, ledger)
	if err := e.reserve(context.Background(), "acme", math.MaxInt64); err != nil {
		t.Fatal(err)
	}
	if got := ledger.need.Load(); got != math.MaxInt64 {
		t.Fatalf("asked the ledger for %d units, want %d", got, int64(math.MaxInt64))
	}
}

// Zeroing the allowances a node kept (at its start) and handing them back
// never move an account to its clock's month: at start they ran before the
// node checked its clock against the ledger's, and a node restarted with
// its clock a month ahead billed every account it held an allowance of in
// that month from then on (G9: a period never goes back), beside the other
// nodes' this month (chaos --faults all --seed 7, G3).
func TestZeroingAllowancesKeepsTheAccountsMonth(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	e, _ := openReserving(t, ledger)
	e.clock.(*ManualClock).SetWall(time.Date(2026, 7, 5, 0, 0, 0, 0, time.UTC)) // the clock a month ahead
	if err := e.ZeroAllowances(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(context.Background(), "acme"); err != nil {
		t.Fatal(err)
	}
	st := e.stripeFor("acme")
	st.mu.Lock()
	p := st.accounts["acme"].acct.Period()
	st.mu.Unlock()
	if want := shard.PeriodOf(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC).UnixNano()); p != want {
		t.Fatalf("the account is in %v after its allowance was zeroed with the clock in July, want %v", p, want)
	}
}

// durabilityLedger is a fakeLedger that notes every hand-back it got before
// the log record that zeroed its allowance was durable.
type durabilityLedger struct {
	fakeLedger
	log   atomic.Pointer[wal.Log]
	early atomic.Int64 // hand-backs whose zeroing record was not durable yet
}

func (d *durabilityLedger) Release(ctx context.Context, account string, allocs []shard.Alloc, seq uint64) error {
	if l := d.log.Load(); l != nil && l.DurableSeq() < seq {
		d.early.Add(1)
	}
	return d.fakeLedger.Release(ctx, account, allocs, seq)
}

// A hand-back reaches the ledger only once the record that zeroed the
// allowance here is durable: handed back first, a crash before that record
// is durable restarts the node with the allowance still in its log, and it
// spends units the ledger has given to others (G1). While the record is
// held in fsync the release gives up (its own timeout) without asking the
// ledger, and the hand-back goes once the record is durable: given up for
// good, the account was let go with its units reserved in the ledger for
// a node that held none (quotad chaos --faults pause,kill --seed 21: a
// node stopped by SIGSTOP while it handed back the accounts it lost).
func TestReleaseWaitsForItsZeroingRecord(t *testing.T) {
	ledger := &durabilityLedger{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}}
	fs := gatefs.New(vfs.NewMem())
	l, err := wal.Open(wal.Options{Dir: "data", NodeID: "n1", FS: fs})
	if err != nil {
		t.Fatal(err)
	}
	ledger.log.Store(l)
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Reserver: ledger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	t.Cleanup(fs.Release) // runs first: a failed test must not hang Close
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 1000}), AllSettled); err != nil {
		t.Fatal(err)
	}
	if res, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	ledger.mu.Lock()
	held := ledger.reserved["acme"] - 1
	ledger.mu.Unlock()
	fs.Arm() // the zeroing record's fsync is held until fs.Release
	err = e.Release(context.Background(), "acme")
	if err == nil || ledger.releasedUnits("acme") != 0 {
		t.Fatalf("release with its zeroing record held in fsync: %v, %d units handed back; want an error, none", err, ledger.releasedUnits("acme"))
	}
	if err := e.RetryReleases(context.Background()); err != nil || ledger.releasedUnits("acme") != 0 {
		t.Fatalf("a retry while the record is still held: %v, %d units handed back; want no error (it waits), none", err, ledger.releasedUnits("acme"))
	}
	fs.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.WaitDurable(ctx, l.LastSeq()); err != nil {
		t.Fatal(err)
	}
	if err := e.RetryReleases(ctx); err != nil {
		t.Fatal(err)
	}
	if got := ledger.releasedUnits("acme"); got != held {
		t.Fatalf("once the zeroing record was durable the ledger got %d units back, want the %d the node held", got, held)
	}
	if n := ledger.early.Load(); n != 0 {
		t.Fatalf("%d hand-backs reached the ledger before the record that zeroed them was durable", n)
	}
}

// scarceLedger has only a unit to grant per round trip, the rest of the
// grant being reserved by other nodes (HeldElsewhere).
type scarceLedger struct {
	fakeLedger
	calls atomic.Int64
}

func (s *scarceLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	s.calls.Add(1)
	id := shard.MonthlyGrantID(shard.PeriodOf(req.Wall))
	return ReserveResult{Granted: []shard.Alloc{{Grant: id, Units: 1}}, HeldElsewhere: []string{id}}, nil
}

// A charge short of units that other nodes hold reserved (an owner handing
// over, a lost node) answers quota-unavailable after one round trip that
// could not cover it, even when the ledger found a few units: it does not
// go back for the rest one round trip at a time.
func TestShortfallHeldElsewhereIsUnavailableAfterOneRoundTrip(t *testing.T) {
	ledger := &scarceLedger{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}}
	e := openWithReserver(t, ledger)
	_, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 5})
	if !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("a charge of 5 with 1 free and the rest held elsewhere: %v, want quota-unavailable", err)
	}
	if n := ledger.calls.Load(); n != 1 {
		t.Fatalf("the ledger was asked %d times, want once", n)
	}
}

// exhaustedLedger has nothing free: every grant asked about is exhausted.
type exhaustedLedger struct {
	fakeLedger
	calls atomic.Int64
}

func (x *exhaustedLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	x.calls.Add(1)
	return ReserveResult{Exhausted: []string{shard.MonthlyGrantID(shard.PeriodOf(req.Wall))}}, nil
}

// An account whose grant the ledger calls exhausted is refused
// quota-exceeded (429, retry at the period's end) after one round trip, not
// quota-unavailable (503, retry shortly); and until the backoff ends its
// next charges are refused without asking the ledger again.
func TestExhaustedGrantIsQuotaExceeded(t *testing.T) {
	ledger := &exhaustedLedger{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}}
	e := openWithReserver(t, ledger)
	for i := range 3 {
		res, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1})
		if err != nil || res.Reason != shard.QuotaExceeded {
			t.Fatalf("charge %d on an exhausted grant: %v %v, want quota_exceeded", i, res.Reason, err)
		}
	}
	if n := ledger.calls.Load(); n != 1 {
		t.Fatalf("the ledger was asked %d times, want once (then the backoff)", n)
	}
}

// strangerLedger grants units of a grant the node's snapshot does not have
// yet (the ledger's config is newer).
type strangerLedger struct{ fakeLedger }

func (s *strangerLedger) Reserve(_ context.Context, req ReserveRequest) (ReserveResult, error) {
	return ReserveResult{Granted: []shard.Alloc{{Grant: "credit-new", Units: 5}}}, nil
}

// Units the ledger reserved on a grant this node does not know are handed
// straight back, and the charge answers quota-unavailable (retry shortly):
// kept, they stayed reserved in the ledger for nobody until the node
// restarted or was revoked.
func TestUnknownGrantsUnitsAreHandedBack(t *testing.T) {
	ledger := &strangerLedger{fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}}
	e := openWithReserver(t, ledger)
	if _, err := e.Charge(context.Background(), "acme", shard.Charge{Units: 1}); !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("a charge whose reservation came on an unknown grant: %v, want quota-unavailable", err)
	}
	if got := ledger.releasedUnits("acme"); got != 5 {
		t.Fatalf("%d units handed back, want the 5 of the unknown grant", got)
	}
	if held := e.AllowanceHeld(); held != 0 {
		t.Fatalf("allowance held %d, want 0", held)
	}
}

// doubtLedger is a fakeLedger whose next Reserve reports its outcome
// unknown (a commit cut off) after granting, or grants units of a grant
// the engine does not know, per its fields.
type doubtLedger struct {
	fakeLedger
	cutCommit    atomic.Bool // the next Reserve reserves Need and reports its outcome unknown
	unknownGrant atomic.Bool // the next Reserve grants Need of a grant the engine has not heard of
}

func (d *doubtLedger) Reserve(ctx context.Context, req ReserveRequest) (ReserveResult, error) {
	res, err := d.fakeLedger.Reserve(ctx, req)
	switch {
	case err != nil:
		return res, err
	case d.cutCommit.Swap(false):
		return ReserveResult{}, &ReserveUncertainError{Units: req.Need, Err: errors.New("commit: connection reset (outcome unknown)")}
	case d.unknownGrant.Swap(false):
		res.Granted[0].Grant = "credit-of-tomorrow"
	}
	return res, nil
}

// Stats.UncertainUnits counts what the ledger may hold reserved for the
// node beyond its allowances: a reservation whose outcome is unknown, and
// units the node could not use whose hand-back the ledger refused. The
// chaos harness compares it with the ledger before the drain.
func TestUncertainUnitsCounted(t *testing.T) {
	d := &doubtLedger{fakeLedger: fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}}
	e := openWithReserver(t, d)
	d.cutCommit.Store(true)
	res, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e1", ClientID: true, Units: 1})
	if !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("charge whose reservation's outcome is unknown: %+v, %v; want ErrQuotaUnavailable", res, err)
	}
	d.mu.Lock()
	inDoubt := d.reserved["acme"]
	d.mu.Unlock()
	if got := e.Stats().UncertainUnits.Load(); got != inDoubt || got == 0 {
		t.Fatalf("UncertainUnits = %d after a reservation of %d units with its outcome unknown", got, inDoubt)
	}
	if held := e.AllowanceHeld(); held != 0 {
		t.Fatalf("the node holds %d units of a reservation it never saw answered", held)
	}

	d.mu.Lock()
	d.refuse = true
	d.mu.Unlock()
	d.unknownGrant.Store(true)
	if _, err := e.Charge(context.Background(), "acme", shard.Charge{EventID: "e2", ClientID: true, Units: 1}); !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("charge whose reservation was all of an unknown grant: %v; want ErrQuotaUnavailable", err)
	}
	d.mu.Lock()
	total := d.reserved["acme"]
	d.mu.Unlock()
	if got := e.Stats().UncertainUnits.Load(); got != total {
		t.Errorf("UncertainUnits = %d after a hand-back the ledger refused; want %d, every unit reserved and not held", got, total)
	}
}

// TakeBack (a refund the ledger found a duplicate) after a hand-back
// overdraws the allowance, which owes the unit: the hand-back gave it back
// with the rest. The next hand-back must not send that -1 to the ledger:
// it added a unit to the node's reservation that nobody held (quotad chaos
// --seed 12, RES before the drain). The unit overdrawn counts in doubt.
func TestTakeBackAfterAHandBack(t *testing.T) {
	ledger := &fakeLedger{reserved: map[string]int64{}, released: map[string]int64{}}
	e, held := openReserving(t, ledger)
	ctx := context.Background()
	if err := e.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if err := e.TakeBack(ctx, "acme", []shard.Alloc{{Grant: "m:2026-06", Units: 1}}); err != nil {
		t.Fatal(err)
	}
	if got := e.AllowanceHeld(); got != -1 {
		t.Fatalf("allowance %d after a take-back from a handed-back allowance, want -1 (owed)", got)
	}
	if got := e.Stats().UncertainUnits.Load(); got != 1 {
		t.Errorf("UncertainUnits = %d, want the 1 unit overdrawn", got)
	}
	if err := e.Release(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if got := e.AllowanceHeld(); got != 0 {
		t.Errorf("allowance %d after the second hand-back, want 0", got)
	}
	ledger.mu.Lock()
	defer ledger.mu.Unlock()
	if got := ledger.released["acme"]; got != held {
		t.Errorf("the ledger got %d units back in all, want the %d held: the second hand-back sent the -1", got, held)
	}
}
