package engine

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/quotaring/quotaring/internal/gatefs"
	"github.com/quotaring/quotaring/internal/waitfor"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// testSnapshot has one plan per account: hard monthly quota, no rate limit,
// and the weights of the README's example.
func testSnapshot(t testing.TB, quotas map[string]int64) *snapshot.Snapshot {
	s := &snapshot.Snapshot{Version: 1, Routes: snapshot.Routes{Default: 1, Weights: map[string]int64{
		"GET /v1/tasks": 1, "POST /v1/tasks": 2, "POST /v1/exports": 25,
	}}}
	for id, q := range quotas {
		s.Plans = append(s.Plans, snapshot.Plan{ID: "plan-" + id, MonthlyQuota: q, Hard: true})
		s.Accounts = append(s.Accounts, snapshot.Account{ID: id, Plan: "plan-" + id})
	}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	return s
}

func openLog(t testing.TB, dir string) *wal.Log {
	l, err := wal.Open(wal.Options{Dir: dir, NodeID: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func openEngine(t testing.TB, dir string, clock Clock, s *snapshot.Snapshot) *Engine {
	l := openLog(t, dir)
	e, err := Open(Options{Log: l, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	if s != nil {
		if err := e.SetSnapshot(s, AllSettled); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	return e
}

// openRestartable opens an engine on a new data dir at 10 June 2026 with
// accounts (hard quotas) for a test that restarts it: openEngine(t, dir,
// clock, nil) opens the dir again from what it holds.
func openRestartable(t testing.TB, accounts map[string]int64) (e *Engine, dir string, clock *ManualClock) {
	dir = t.TempDir()
	clock = NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	return openEngine(t, dir, clock, testSnapshot(t, accounts)), dir, clock
}

func countRecords(t testing.TB, l *wal.Log, typ shard.RecordType) (n int, units int64) {
	var rec shard.Record
	err := l.Scan(l.SettledSeq(), l.DurableSeq(), func(_ uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		if rec.Type == typ {
			n++
			units += rec.Units
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n, units
}

func TestExactQuotaUnderConcurrency(t *testing.T) {
	e := openEngine(t, t.TempDir(), NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), testSnapshot(t, map[string]int64{"acme": 20}))
	var wg sync.WaitGroup
	var mu sync.Mutex
	ok := 0
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Charge(context.Background(), "acme", shard.Charge{Route: "GET /v1/tasks", Units: 1})
			if err != nil {
				t.Error(err)
				return
			}
			if res.Reason == shard.OK {
				mu.Lock()
				ok++
				mu.Unlock()
			} else if res.Reason != shard.QuotaExceeded {
				t.Errorf("reason %v", res.Reason)
			}
		}()
	}
	wg.Wait()
	u, _, _ := e.Usage("acme")
	n, units := countRecords(t, e.Log(), shard.RecCharge)
	if ok != 20 || u.Used != 20 || n != 20 || units != 20 {
		t.Fatalf("%d succeeded, counter %d, %d charge records of %d units; want 20 each", ok, u.Used, n, units)
	}
}

func TestWeightsAndMonthEnd(t *testing.T) {
	clock := NewManualClock(time.Date(2026, 6, 28, 12, 0, 0, 0, time.UTC))
	s := testSnapshot(t, map[string]int64{"acme": 60})
	e := openEngine(t, t.TempDir(), clock, s)
	call := func(method, path string) Result {
		route, units := s.Routes.Match(method, path)
		res, err := e.Charge(context.Background(), "acme", shard.Charge{Route: route, Units: units})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	for i, c := range []struct {
		method, path string
		want         shard.Reason
		left         int64
	}{
		{"GET", "/v1/tasks", shard.OK, 59},
		{"POST", "/v1/tasks", shard.OK, 57},
		{"POST", "/v1/exports", shard.OK, 32},
		{"POST", "/v1/exports", shard.OK, 7},
		{"POST", "/v1/exports", shard.QuotaExceeded, 7},
		{"GET", "/v1/tasks", shard.OK, 6},
	} {
		res := call(c.method, c.path)
		if res.Reason != c.want || res.Remaining != c.left {
			t.Fatalf("step %d %s %s: %v with %d left, want %v with %d", i, c.method, c.path, res.Reason, res.Remaining, c.want, c.left)
		}
		if res.Reason == shard.QuotaExceeded && time.Duration(res.RetryAfter) != 216000*time.Second {
			t.Fatalf("retry after %v, want 216000s", time.Duration(res.RetryAfter))
		}
	}
	clock.SetWall(time.Date(2026, 6, 30, 23, 59, 59, 0, time.UTC))
	if res := call("GET", "/v1/tasks"); res.Reason != shard.OK || res.Remaining != 5 {
		t.Fatalf("23:59:59 on the 30th is still June: %+v", res.Decision)
	}
	clock.SetWall(time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC))
	if res := call("GET", "/v1/tasks"); res.Reason != shard.OK || res.Remaining != 59 {
		t.Fatalf("00:00:00 on 1 July starts at zero: %+v", res.Decision)
	}
}

func TestRetryRefundAndRestart(t *testing.T) {
	dir := t.TempDir()
	clock := NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	s := testSnapshot(t, map[string]int64{"acme": 100})
	ctx := context.Background()
	e := openEngine(t, dir, clock, s)
	l := e.Log()
	for i := 0; i < 5; i++ {
		res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "retry-me", ClientID: true, Units: 10})
		if err != nil || !res.Reason.Accepted() {
			t.Fatalf("try %d: %v %v", i, res.Reason, err)
		}
	}
	gen, _ := e.Charge(ctx, "acme", shard.Charge{Units: 7})
	if d, _ := e.Refund(ctx, "acme", gen.EventID, gen.Receipt); d.Reason != shard.Refunded {
		t.Fatalf("refund by receipt: %v", d.Reason)
	}
	if d, _ := e.Refund(ctx, "acme", "retry-me", nil); d.Reason != shard.Refunded || d.Units != 10 {
		t.Fatalf("refund: %+v", d)
	}
	if d, _ := e.Refund(ctx, "acme", "retry-me", nil); d.Reason != shard.AlreadyRefunded {
		t.Fatalf("second refund: %v", d.Reason)
	}
	if _, err := e.Charge(ctx, "acme", shard.Charge{EventID: "kept", ClientID: true, Units: 3}); err != nil {
		t.Fatal(err)
	}
	before, _, _ := e.Usage("acme")
	e.Close()
	l.Close()

	// Restart from the data dir alone: no snapshot given, the kept one is used.
	e2 := openEngine(t, dir, clock, nil)
	after, ok, err := e2.Usage("acme")
	if err != nil || !ok || fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatalf("after restart %+v (known %v, %v), before %+v", after, ok, err, before)
	}
	if res, _ := e2.Charge(ctx, "acme", shard.Charge{EventID: "kept", ClientID: true, Units: 3}); res.Reason != shard.Replayed {
		t.Fatalf("a retry after restart: %v, want replayed", res.Reason)
	}
	if d, _ := e2.Refund(ctx, "acme", "retry-me", nil); d.Reason != shard.AlreadyRefunded {
		t.Fatalf("refund after restart: %v, want already_refunded", d.Reason)
	}
}

// An Idempotency-Key names one request (Charge.Target) across the owner's
// restarts too: a key settled into the checkpoint (its id stored apart) and
// one still in the log are both refused for another request after a
// restart, and replayed for their own.
func TestAKeysRequestSurvivesRestart(t *testing.T) {
	e, dir, clock := openRestartable(t, map[string]int64{"acme": 100})
	ctx := context.Background()
	l := e.Log()
	key := func(e *Engine, id string, target uint64) shard.Reason {
		t.Helper()
		res, err := e.Charge(ctx, "acme", shard.Charge{EventID: id, ClientID: true, Route: "GET /v1/tasks/{id}", Units: 1, Target: target})
		if err != nil {
			t.Fatal(err)
		}
		return res.Reason
	}
	if r := key(e, "settled", 7); r != shard.OK {
		t.Fatal(r)
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	if r := key(e, "logged", 8); r != shard.OK {
		t.Fatal(r)
	}
	e.Close()
	l.Close()

	e2 := openEngine(t, dir, clock, nil)
	for _, c := range []struct {
		id     string
		target uint64
		want   shard.Reason
	}{{"settled", 9, shard.IDReused}, {"logged", 9, shard.IDReused}, {"settled", 7, shard.Replayed}, {"logged", 8, shard.Replayed}} {
		if r := key(e2, c.id, c.target); r != c.want {
			t.Errorf("after a restart, key %q for request %d: %v, want %v", c.id, c.target, r, c.want)
		}
	}
	if u, _, _ := e2.Usage("acme"); u.Used != 2 {
		t.Errorf("used %d after the restart, want 2", u.Used)
	}
}

// The bound on one key's served replays (shard.DefaultMaxReplays when
// Params.MaxReplays is 0) counts across the owner's restarts: replays
// settled into the checkpoint and replays only in the log both count.
// A negative MaxReplays bounds nothing.
func TestReplayBoundSurvivesRestart(t *testing.T) {
	e, dir, clock := openRestartable(t, map[string]int64{"acme": 100})
	ctx := context.Background()
	l := e.Log()
	charge := func(e *Engine) shard.Reason {
		t.Helper()
		res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "job-1", ClientID: true, Route: "*", Units: 3})
		if err != nil {
			t.Fatal(err)
		}
		return res.Reason
	}
	if r := charge(e); r != shard.OK {
		t.Fatal(r)
	}
	for i := range shard.DefaultMaxReplays {
		if i == shard.DefaultMaxReplays/2 {
			if err := e.Settle(ctx, l.DurableSeq()); err != nil {
				t.Fatal(err)
			}
		}
		if r := charge(e); r != shard.Replayed {
			t.Fatalf("retry %d: %v, want replayed", i+1, r)
		}
	}
	e.Close()
	l.Close()

	e2 := openEngine(t, dir, clock, nil)
	if r := charge(e2); r != shard.ReplayLimit {
		t.Fatalf("after a restart, retry %d: %v, want replay_limit", shard.DefaultMaxReplays+1, r)
	}
	if u, _, _ := e2.Usage("acme"); u.Used != 3 {
		t.Errorf("used %d after the restart, want 3 (billed once)", u.Used)
	}
	e2.Close()
	e2.Log().Close()

	l3 := openLog(t, dir)
	e3, err := Open(Options{Log: l3, Clock: clock, Params: shard.Params{MaxReplays: -1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e3.Close(); l3.Close() })
	if r := charge(e3); r != shard.Replayed {
		t.Fatalf("MaxReplays -1: %v, want replayed (no bound)", r)
	}
}

func TestSettleCheckpointsAndTruncates(t *testing.T) {
	dir := t.TempDir()
	clock := NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	s := testSnapshot(t, map[string]int64{"a": 1000, "b": 1000})
	ctx := context.Background()
	l := openLog(t, dir)
	e, _ := Open(Options{Log: l, Clock: clock})
	e.SetSnapshot(s, AllSettled)
	for i := 0; i < 10; i++ {
		e.Charge(ctx, "a", shard.Charge{EventID: fmt.Sprint("a", i), ClientID: true, Units: 1})
	}
	if err := e.Settle(ctx, l.DurableSeq()); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		e.Charge(ctx, "b", shard.Charge{Units: 2})
		e.Charge(ctx, "a", shard.Charge{Units: 1})
	}
	if n, _ := countRecords(t, l, shard.RecCharge); n != 10 {
		t.Fatalf("%d records left after settling the first 10, want 10", n)
	}
	ua, _, _ := e.Usage("a")
	ub, _, _ := e.Usage("b")
	e.Close()
	l.Close()
	e2 := openEngine(t, dir, clock, nil)
	ua2, _, _ := e2.Usage("a")
	ub2, _, _ := e2.Usage("b")
	if ua2.Used != ua.Used || ub2.Used != ub.Used || ua.Used != 15 || ub.Used != 10 {
		t.Fatalf("after restart a=%d b=%d, before a=%d b=%d (want 15, 10)", ua2.Used, ub2.Used, ua.Used, ub.Used)
	}
	if res, _ := e2.Charge(ctx, "a", shard.Charge{EventID: "a3", ClientID: true, Units: 1}); res.Reason != shard.Replayed {
		t.Fatalf("client id from a settled, checkpointed record: %v, want replayed", res.Reason)
	}
}

func TestUnknownAccount(t *testing.T) {
	e := openEngine(t, t.TempDir(), NewManualClock(time.Now()), testSnapshot(t, map[string]int64{"a": 1}))
	res, err := e.Charge(context.Background(), "nobody", shard.Charge{Units: 1})
	if err != nil || res.Reason != shard.UnknownAccount {
		t.Fatalf("%v %v", res.Reason, err)
	}
}

func TestNotOwnerRefuses(t *testing.T) {
	l := openLog(t, t.TempDir())
	defer l.Close()
	e, _ := Open(Options{Log: l, Clock: NewManualClock(time.Now()), Owns: func(string) bool { return false }})
	defer e.Close()
	e.SetSnapshot(testSnapshot(t, map[string]int64{"a": 1}), AllSettled)
	if _, err := e.Charge(context.Background(), "a", shard.Charge{Units: 1}); err == nil {
		t.Fatal("charged an account it does not own")
	}
}

// A retry answered Replayed waits for the charge it replays to be durable
// (G2): the answer carries the account's last record, not 0. Likewise an
// AlreadyRefunded answer waits for the refund's record. (Found by review: a
// retry arriving during the original's fsync was acknowledged at once, and
// a crash then lost a charge the client had been told about.)
func TestReplayWaitsForTheChargeItReplays(t *testing.T) {
	e := openEngine(t, t.TempDir(), NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), testSnapshot(t, map[string]int64{"acme": 20}))
	ctx := context.Background()
	first, wait, err := e.ChargeEarly(ctx, "acme", shard.Charge{EventID: "x", ClientID: true, Units: 1})
	if err != nil || first.Reason != shard.OK || first.Seq == 0 {
		t.Fatalf("first: %+v %v", first, err)
	}
	retry, wait2, err := e.ChargeEarly(ctx, "acme", shard.Charge{EventID: "x", ClientID: true, Units: 1})
	if err != nil || retry.Reason != shard.Replayed {
		t.Fatalf("retry: %+v %v", retry, err)
	}
	if retry.Seq < first.Seq {
		t.Fatalf("the replay's answer rests on seq %d, before the charge it replays (%d): it would be acknowledged before that is durable", retry.Seq, first.Seq)
	}
	if err := wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := wait2(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := e.Refund(ctx, "acme", "x", nil)
	if err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund: %+v %v", d, err)
	}
	again, err := e.Refund(ctx, "acme", "x", nil)
	if err != nil || again.Reason != shard.AlreadyRefunded || again.Seq < d.Seq {
		t.Fatalf("second refund: %+v %v; want already-refunded resting on seq >= %d", again, err, d.Seq)
	}
}

// When the log refuses a record (it failed, or is closing), the account's
// memory already holds the change: it answers errors from then on, never a
// decision resting on the unlogged change (a retry is not "replayed").
func TestUnloggedChangeIsNeverAnswered(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir)
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 20}), AllSettled); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := e.Charge(ctx, "acme", shard.Charge{EventID: "a", ClientID: true, Units: 1}); err != nil {
		t.Fatal(err)
	}
	l.Close() // the log refuses records from now on
	if _, err := e.Charge(ctx, "acme", shard.Charge{EventID: "y", ClientID: true, Units: 1}); err == nil {
		t.Fatal("a charge the log refused was answered")
	}
	res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "y", ClientID: true, Units: 1})
	if err == nil {
		t.Fatalf("the retry of a charge the log refused was answered %s", res.Reason)
	}
	if _, err := e.Refund(ctx, "acme", "a", nil); err == nil {
		t.Fatal("a refund on an account whose memory is ahead of its log was answered")
	}
}

// openGated is openEngine on a log whose WAL syncs the test holds (gatefs).
func openGated(t *testing.T, s *snapshot.Snapshot) (*Engine, *gatefs.FS) {
	t.Helper()
	fs := gatefs.New(vfs.NewMem())
	l, err := wal.Open(wal.Options{Dir: "data", NodeID: "n1", FS: fs})
	if err != nil {
		t.Fatal(err)
	}
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.SetSnapshot(s, AllSettled); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); l.Close() })
	t.Cleanup(fs.Release) // runs first: a failed test must not hang Close
	return e, fs
}

// A charge whose caller's ctx ends while its record waits for the disk
// was left charged: the record became durable and settled while the
// caller heard an error and kept no receipt to refund it with (a forwarded
// charge's owner answered INTERNAL and the front 500). It is now taken back
// by a refund logged after it, and the error says quota-unavailable; a
// retry served under its event id meanwhile keeps it.
func TestAbandonedChargeIsTakenBack(t *testing.T) {
	e, fs := openGated(t, testSnapshot(t, map[string]int64{"acme": 100}))
	charge := func(ctx context.Context, id string, units int64, many bool) error {
		req := shard.Charge{EventID: id, ClientID: id != "", Units: units}
		if many {
			return e.ChargeMany(ctx, []Request{{Account: "acme", Charge: req}})[0].Err
		}
		_, err := e.Charge(ctx, "acme", req)
		return err
	}
	used := func() int64 {
		u, _, err := e.Usage("acme")
		if err != nil {
			t.Fatal(err)
		}
		return u.Used
	}
	for _, many := range []bool{false, true} {
		fs.Arm()
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		last := e.Log().LastSeq()
		go func() { errc <- charge(ctx, "", 7, many) }()
		// The charge's record logged, and the log's syncs held (the one
		// that entered may be another WAL file's: wait for both).
		waitfor.Cond(t, 5*time.Second, "the charge to be logged", func() bool { return e.Log().LastSeq() >= last+1 })
		<-fs.Entered
		cancel()
		waitfor.Cond(t, 5*time.Second, "the take-back to be logged", func() bool { return e.Log().LastSeq() >= last+2 })
		// "Taken back" is said only once the take-back is durable: a crash
		// before would bill the charge while its caller retried.
		select {
		case err := <-errc:
			t.Fatalf("ChargeMany=%v: abandoned charge answered (%v) before its take-back was durable", many, err)
		default:
		}
		fs.Release()
		err := <-errc
		if !errors.Is(err, ErrQuotaUnavailable) || !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "it was taken back, retry") {
			t.Fatalf("ChargeMany=%v: abandoned charge: %v, want quota-unavailable wrapping context.Canceled, taken back", many, err)
		}
		if err := e.Log().WaitDurable(context.Background(), e.Log().LastSeq()); err != nil {
			t.Fatal(err)
		}
		if u := used(); u != 0 {
			t.Fatalf("ChargeMany=%v: %d units used after the abandoned charge, want 0", many, u)
		}
	}
	if n, units := countRecords(t, e.Log(), shard.RecRefund); n != 2 || units != 14 {
		t.Fatalf("refund records: %d of %d units, want 2 of 14", n, units)
	}

	// A retry answered replayed before the first attempt gave up: the
	// charge is the retry's too, and stays.
	fs.Arm()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 2)
	base := e.Log().LastSeq()
	go func() { errc <- charge(ctx, "job-1", 5, false) }()
	waitfor.Cond(t, 5*time.Second, "the charge to be logged", func() bool { return e.Log().LastSeq() >= base+1 })
	<-fs.Entered
	go func() { errc <- charge(context.Background(), "job-1", 5, false) }()
	waitfor.Cond(t, 5*time.Second, "the retry to be answered replayed, and logged", func() bool {
		return e.Stats().Replayed.Load() == 1 && e.Log().LastSeq() >= base+2
	})
	cancel()
	waitfor.Cond(t, 5*time.Second, "the first attempt's refund to be logged (kept)", func() bool { return e.Log().LastSeq() >= base+3 })
	fs.Release()
	var served, unavailable int
	for range 2 {
		switch err := <-errc; {
		case err == nil:
			served++
		case errors.Is(err, ErrQuotaUnavailable):
			unavailable++
		default:
			t.Fatalf("the first attempt or its retry: %v", err)
		}
	}
	if served != 1 || unavailable != 1 {
		t.Fatalf("%d served and %d quota-unavailable, want the retry served and the first attempt quota-unavailable", served, unavailable)
	}
	if u := used(); u != 5 {
		t.Fatalf("%d units used after a served retry, want 5 (kept)", u)
	}
}

// A checkpoint may include records above the settled mark (the account
// kept charging); recovery replays only the records above the checkpoint,
// never the one it ends at: that record is in the checkpoint already, and
// applied again it counts its charge twice.
func TestRecoveryDoesNotReplayTheCheckpointsLastRecord(t *testing.T) {
	e, dir, clock := openRestartable(t, map[string]int64{"a": 100})
	ctx := context.Background()
	l := e.Log()
	var first uint64
	for i := range 3 {
		res, err := e.Charge(ctx, "a", shard.Charge{EventID: fmt.Sprint("c", i), ClientID: true, Units: 5})
		if err != nil || res.Reason != shard.OK {
			t.Fatalf("charge %d: %v %v", i, res.Reason, err)
		}
		if first == 0 {
			first = res.Seq
		}
	}
	// Settled through the first record only: the checkpoint holds all three.
	if err := e.Settle(ctx, first); err != nil {
		t.Fatal(err)
	}
	if n, _ := countRecords(t, l, shard.RecCharge); n != 2 {
		t.Fatalf("%d charge records above the settled mark, want 2 (the checkpoint's last among them)", n)
	}
	e.Close()
	l.Close()
	e2 := openEngine(t, dir, clock, nil)
	if u, _, _ := e2.Usage("a"); u.Used != 15 || u.Remaining != 85 {
		t.Fatalf("after a restart: used %d, remaining %d; want 15, 85", u.Used, u.Remaining)
	}
}

// Settle checkpoints an account only once every record its state includes
// is durable: while a charge's record is held in fsync, a settle whose ctx
// ends first returns an error and writes nothing, rather than storing a
// checkpoint that remembers a charge (and its client id) that a crash could
// still lose. Without the wait it went straight to the log's write with the
// not yet durable charge in its checkpoint.
func TestSettleWaitsForTheRecordsItsCheckpointsHold(t *testing.T) {
	e, fs := openGated(t, testSnapshot(t, map[string]int64{"acme": 100}))
	ctx := context.Background()
	fs.Arm()
	charged := make(chan error, 1)
	go func() {
		_, err := e.Charge(ctx, "acme", shard.Charge{EventID: "held", ClientID: true, Units: 3})
		charged <- err
	}()
	<-fs.Entered // the charge's record is inside fsync, the account's state holds it
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	settled := make(chan error, 1)
	go func() { settled <- e.Settle(canceled, e.Log().SettledSeq()) }()
	var err error
	waitfor.Cond(t, 10*time.Second, "the settle to give up on the held record", func() bool {
		select {
		case err = <-settled:
			return true
		default:
			return false
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("settle while the checkpoint's record is held: %v, want context.Canceled", err)
	}
	fs.Release()
	if err := <-charged; err != nil {
		t.Fatal(err)
	}
	// Nothing was stored; the account is still to checkpoint.
	cps, _, _ := e.checkpoints()
	if len(cps) != 1 || cps[0].Account != "acme" {
		t.Fatalf("checkpoints after the failed settle: %+v, want acme's again", cps)
	}
}

// A retry answered Replayed whose caller left before its record was
// durable is taken back as a replay (RefundReplay), not refunded as the
// charge's attempt: the charge's own attempt, failing later, then gets its
// units back. Taken back as an attempt, the replay was never counted off,
// the charge was held "pending" for it, and stayed billed though no attempt
// was served.
func TestAbandonedReplayIsTakenBackAsAReplay(t *testing.T) {
	e, fs := openGated(t, testSnapshot(t, map[string]int64{"acme": 100}))
	ctx := context.Background()
	first, err := e.Charge(ctx, "acme", shard.Charge{EventID: "job", ClientID: true, Units: 5})
	if err != nil || first.Reason != shard.OK {
		t.Fatalf("first attempt: %+v %v", first, err)
	}
	fs.Arm()
	retryCtx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	last := e.Log().LastSeq()
	go func() {
		_, err := e.Charge(retryCtx, "acme", shard.Charge{EventID: "job", ClientID: true, Units: 5})
		errc <- err
	}()
	waitfor.Cond(t, 5*time.Second, "the replay to be logged", func() bool { return e.Log().LastSeq() >= last+1 })
	<-fs.Entered // syncs held
	cancel()
	waitfor.Cond(t, 5*time.Second, "the replay's take-back to be logged", func() bool { return e.Log().LastSeq() > last+1 })
	fs.Release()
	if err := <-errc; !errors.Is(err, ErrQuotaUnavailable) || !strings.Contains(err.Error(), "it was taken back, retry") {
		t.Fatalf("the abandoned retry: %v, want quota-unavailable, taken back", err)
	}
	if e.Stats().Replayed.Load() != 1 {
		t.Fatalf("replays answered: %d, want 1", e.Stats().Replayed.Load())
	}
	// The first attempt's upstream failed: its refund applies, since the
	// only retry was never served.
	d, err := e.RefundAttempt(ctx, "acme", "job", first.Receipt)
	if err != nil || d.Reason != shard.Refunded {
		t.Fatalf("the first attempt's refund: %v %v, want refunded", d.Reason, err)
	}
	if u, _, _ := e.Usage("acme"); u.Used != 0 {
		t.Fatalf("used %d, want 0: no attempt was served", u.Used)
	}
}

// A receipt names the generation of the client id it charged: an id
// refunded and charged again is its next generation, and that charge's
// attempt refund (with its receipt) applies to it. A receipt without the
// generation read as the first one's, and the refund answered Kept ("the
// id moved on") and left the second charge billed.
func TestReceiptOfALaterGenerationRefunds(t *testing.T) {
	e := openEngine(t, t.TempDir(), NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), testSnapshot(t, map[string]int64{"acme": 100}))
	ctx := context.Background()
	for gen := range 3 {
		res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "job", ClientID: true, Units: 5})
		if err != nil || res.Reason != shard.OK || res.Receipt.Gen != uint32(gen) {
			t.Fatalf("charge %d of job: %+v %v; want ok, generation %d", gen, res, err, gen)
		}
		d, err := e.RefundAttempt(ctx, "acme", "job", res.Receipt)
		if err != nil || d.Reason != shard.Refunded {
			t.Fatalf("refund of generation %d by its receipt: %v %v, want refunded", gen, d.Reason, err)
		}
	}
	if u, _, _ := e.Usage("acme"); u.Used != 0 {
		t.Fatalf("used %d after every generation was refunded, want 0", u.Used)
	}
}

// Every charge of a batch whose durability wait ended with its ctx is
// taken back, not only the first: the forwarding caller that left hears
// an error for each, and none stays billed.
func TestAbandonedBatchIsTakenBackWhole(t *testing.T) {
	e, fs := openGated(t, testSnapshot(t, map[string]int64{"acme": 100, "beta": 100}))
	fs.Arm()
	ctx, cancel := context.WithCancel(context.Background())
	outc := make(chan []Outcome, 1)
	last := e.Log().LastSeq()
	go func() {
		outc <- e.ChargeMany(ctx, []Request{
			{Account: "acme", Charge: shard.Charge{Units: 3}},
			{Account: "beta", Charge: shard.Charge{EventID: "b1", ClientID: true, Units: 4}},
			{Account: "acme", Charge: shard.Charge{EventID: "a2", ClientID: true, Units: 5}},
		})
	}()
	waitfor.Cond(t, 5*time.Second, "the batch to be logged", func() bool { return e.Log().LastSeq() >= last+3 })
	<-fs.Entered // syncs held
	cancel()
	// All three taken back before any waits for the disk: one wait for
	// all, not one fsync after another.
	waitfor.Cond(t, 5*time.Second, "the batch's take-backs to be logged", func() bool { return e.Log().LastSeq() >= last+6 })
	fs.Release()
	out := <-outc
	for i, o := range out {
		if !errors.Is(o.Err, ErrQuotaUnavailable) || !strings.Contains(o.Err.Error(), "it was taken back, retry") {
			t.Errorf("charge %d of the abandoned batch: %+v, want quota-unavailable, taken back", i, o)
		}
	}
	if err := e.Log().WaitDurable(context.Background(), e.Log().LastSeq()); err != nil {
		t.Fatal(err)
	}
	for _, acct := range []string{"acme", "beta"} {
		if u, _, _ := e.Usage(acct); u.Used != 0 {
			t.Errorf("%s: %d units used after its abandoned charges, want 0", acct, u.Used)
		}
	}
}

// While Hold holds, the engine decides nothing: a charge, a refund and a
// usage read answer ErrQuotaUnavailable (retryable) with Hold's reason, and
// nothing is logged; once it lets go, the same charge goes through.
func TestHoldDecidesNothing(t *testing.T) {
	l := openLog(t, t.TempDir())
	defer l.Close()
	why := errors.New("paused")
	var holding atomic.Bool
	holding.Store(true)
	e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Hold: func() error {
		if holding.Load() {
			return why
		}
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"a": 5}), AllSettled); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	last := l.LastSeq()
	if _, err := e.Charge(ctx, "a", shard.Charge{EventID: "e1", ClientID: true, Units: 1}); !errors.Is(err, ErrQuotaUnavailable) || !errors.Is(err, why) {
		t.Fatalf("charge while held: %v, want ErrQuotaUnavailable and the hold's reason", err)
	}
	if _, err := e.Refund(ctx, "a", "e1", nil); !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("refund while held: %v", err)
	}
	if _, _, err := e.Usage("a"); !errors.Is(err, ErrQuotaUnavailable) {
		t.Fatalf("usage while held: %v", err)
	}
	if l.LastSeq() != last {
		t.Fatalf("the log moved from %d to %d while held", last, l.LastSeq())
	}
	holding.Store(false)
	res, err := e.Charge(ctx, "a", shard.Charge{EventID: "e1", ClientID: true, Units: 1})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("charge after the hold: %+v %v", res.Reason, err)
	}
}

// A replay's receipt names it (ReplaySeq, its record's seq), and a take-back
// asked again with it (the HTTP front retries a refund whose answer was
// lost) counts it off once, before and after a restart, whether the
// restart finds the take-back in a checkpoint or in the log. Counted off
// twice, the second take-back released the attempt's held refund while the
// other replay may have been served: a served request unbilled.
func TestATakeBackAskedAgainCountsOnce(t *testing.T) {
	for _, settled := range []bool{false, true} {
		t.Run(map[bool]string{false: "from the log", true: "from a checkpoint"}[settled], func(t *testing.T) {
			ctx := context.Background()
			e, dir, clock := openRestartable(t, map[string]int64{"acme": 100})
			job := shard.Charge{EventID: "job", ClientID: true, Units: 5}
			first, err := e.Charge(ctx, "acme", job)
			if err != nil || first.Reason != shard.OK {
				t.Fatalf("first attempt: %+v %v", first, err)
			}
			var replays []*shard.Receipt
			for range 2 {
				res, err := e.Charge(ctx, "acme", job)
				if err != nil || res.Reason != shard.Replayed || res.Receipt == nil || res.Receipt.ReplaySeq != res.Seq {
					t.Fatalf("retry: %+v %v; want Replayed with a receipt naming its record", res, err)
				}
				replays = append(replays, res.Receipt)
			}
			if replays[0].ReplaySeq == replays[1].ReplaySeq {
				t.Fatalf("two replays named alike: %d", replays[0].ReplaySeq)
			}
			if d, err := e.RefundAttempt(ctx, "acme", "job", first.Receipt); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the first attempt's refund: %v %v, want kept (replays out)", d.Reason, err)
			}
			takeBack := func(e *Engine, r *shard.Receipt, want shard.Reason) {
				t.Helper()
				d, err := e.RefundReplay(ctx, "acme", "job", r)
				if err != nil || d.Reason != want {
					t.Fatalf("take-back of replay %d: %v %v, want %v", r.ReplaySeq, d.Reason, err, want)
				}
			}
			takeBack(e, replays[0], shard.Kept)
			last := e.Log().LastSeq()
			takeBack(e, replays[0], shard.Kept)
			if got := e.Log().LastSeq(); got != last {
				t.Fatalf("the take-back asked again logged %d record(s)", got-last)
			}
			if settled {
				if err := e.Settle(ctx, e.Log().DurableSeq()); err != nil {
					t.Fatal(err)
				}
			}
			l := e.Log()
			e.Close()
			l.Close()

			e2 := openEngine(t, dir, clock, nil)
			last = e2.Log().LastSeq()
			takeBack(e2, replays[0], shard.Kept)
			if got := e2.Log().LastSeq(); got != last {
				t.Fatalf("after a restart, the take-back asked again logged %d record(s)", got-last)
			}
			if u, _, _ := e2.Usage("acme"); u.Used != 5 {
				t.Fatalf("used %d, want 5: the second replay may be served", u.Used)
			}
			takeBack(e2, replays[1], shard.Refunded) // the last: the held refund applies
			takeBack(e2, replays[1], shard.AlreadyRefunded)
			if u, _, _ := e2.Usage("acme"); u.Used != 0 {
				t.Fatalf("used %d, want 0: no attempt was served", u.Used)
			}
		})
	}
}
