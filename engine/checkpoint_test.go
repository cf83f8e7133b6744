package engine

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// A settle checkpoints only the ids that changed since the last one: an
// account that remembers a thousand Idempotency-Keys and takes one more
// writes one, not a thousand and one (a reviewer measured 18 MB/s of writes
// from two busy accounts when every settle rewrote every key). A failed
// write makes the next one rewrite them all, over what was stored; and a
// restart remembers every key, whichever settle wrote it.
func TestCheckpointWritesOnlyChangedIDs(t *testing.T) {
	e, dir, clock := openRestartable(t, map[string]int64{"busy": 100_000})
	ctx := context.Background()
	l := e.Log()
	charge := func(id string) shard.Reason {
		t.Helper()
		res, err := e.Charge(ctx, "busy", shard.Charge{EventID: id, ClientID: true, Units: 1})
		if err != nil {
			t.Fatal(err)
		}
		return res.Reason
	}
	idsWritten := func() (n int, reset bool) {
		t.Helper()
		cps, maxSeq, _ := e.checkpoints()
		if len(cps) != 1 || cps[0].Account != "busy" {
			t.Fatalf("checkpoints %+v, want busy's only", cps)
		}
		if err := l.WaitDurable(ctx, maxSeq); err != nil {
			t.Fatal(err)
		}
		if err := l.Settle(l.DurableSeq(), cps); err != nil {
			t.Fatal(err)
		}
		return len(cps[0].IDs), cps[0].ResetIDs
	}
	for i := range 1000 {
		charge(fmt.Sprint("k", i))
	}
	if n, reset := idsWritten(); n != 1000 || reset {
		t.Fatalf("first checkpoint: %d ids (reset %v), want 1000", n, reset)
	}
	charge("k1000")
	if d, err := e.Refund(ctx, "busy", "k7", nil); err != nil || d.Reason != shard.Refunded {
		t.Fatalf("refund of k7: %v %v", d.Reason, err)
	}
	// k1000, and k7 twice: its dedup entry, and its refund (kept past
	// the dedup window: see shard.RefundedWindow).
	if n, reset := idsWritten(); n != 3 || reset {
		t.Fatalf("after one charge and one refund: %d ids written (reset %v), want 3", n, reset)
	}

	charge("k1001")
	if err := e.Settle(ctx, l.DurableSeq()+1); err == nil { // beyond the log: refused, nothing written
		t.Fatal("a settle beyond the durable mark succeeded")
	}
	if n, reset := idsWritten(); n != 1003 || !reset {
		t.Fatalf("after a failed settle: %d ids (reset %v), want all 1003 (1002 and k7's refund) over what was stored", n, reset)
	}
	e.Close()
	l.Close()

	e2 := openEngine(t, dir, clock, nil)
	e = e2
	for _, id := range []string{"k0", "k999", "k1000", "k1001"} {
		if r := charge(id); r != shard.Replayed {
			t.Errorf("%s after a restart: %s, want replayed", id, r)
		}
	}
	if r := charge("k7"); r != shard.OK {
		t.Errorf("k7, refunded before the restart, charged again: %s, want ok (a new charge)", r)
	}
}

// A data dir of a build that kept ids inline in the checkpoint opens with
// every id remembered, and its next checkpoint stores them apart, over
// anything stored before; so does one whose ids stored apart were left
// behind by such a build (a rollback and a roll forward).
func TestInlineIDsMoveApart(t *testing.T) {
	dir := t.TempDir()
	clock := NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	ctx := context.Background()
	s := testSnapshot(t, map[string]int64{"old": 100})
	e := openEngine(t, dir, clock, s)
	for _, id := range []string{"a", "b"} {
		if res, err := e.Charge(ctx, "old", shard.Charge{EventID: id, ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
			t.Fatal(res.Reason, err)
		}
	}
	if err := e.Settle(ctx, e.Log().DurableSeq()); err != nil { // "a" and "b" stored apart
		t.Fatal(err)
	}
	// The older build: a checkpoint with "c" inline, ids apart untouched.
	st := e.stripeFor("old")
	st.mu.Lock()
	acct := st.accounts["old"].acct
	if res := acct.Charge(&shard.Charge{EventID: "c", ClientID: true, Units: 1}, clock.Now(), &e.params, &shard.Record{}); res.Reason != shard.OK {
		t.Fatal(res.Reason)
	}
	acct.LastSeq++
	inline := acct.AppendCheckpoint(nil)
	seq := acct.LastSeq
	st.mu.Unlock()
	l := e.Log()
	e.Close()
	if err := l.PutCheckpoints([]wal.Checkpoint{{Account: "old", Seq: seq, Data: inline}}); err != nil {
		t.Fatal(err)
	}
	l.Close()

	e = openEngine(t, dir, clock, nil)
	for _, id := range []string{"a", "b", "c"} {
		if res, _ := e.Charge(ctx, "old", shard.Charge{EventID: id, ClientID: true, Units: 1}); res.Reason != shard.Replayed {
			t.Errorf("%s after the older build's checkpoint: %s, want replayed", id, res.Reason)
		}
	}
	cps, _, _ := e.checkpoints()
	if len(cps) != 1 || !cps[0].ResetIDs || len(cps[0].IDs) != 3 {
		t.Fatalf("the next checkpoint: %+v, want all three ids over what was stored", cps)
	}
}

// An account let go takes its stored ids with it: regained, it starts from
// the config snapshot, and a restart must not bring back an id the other
// owner may have refunded since (a second refund of it here, or a retry
// answered replayed for nothing). Both ways a review found: a Forget of a
// settled account (nothing changed since its checkpoint), and one
// regained before the settle that would have dropped its ids.
func TestForgottenAccountsIDsStayForgotten(t *testing.T) {
	for _, name := range []string{"settled", "regained before the settle"} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			dir := t.TempDir()
			var owns atomic.Bool
			owns.Store(true)
			clock := NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
			opts := func(l *wal.Log) Options {
				return Options{Log: l, Clock: clock, Owns: func(string) bool { return owns.Load() }}
			}
			l := openLog(t, dir)
			e, err := Open(opts(l))
			if err != nil {
				t.Fatal(err)
			}
			refreshAcme(t, e, 1, 0)
			if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k1", ClientID: true, Units: 4}); err != nil || res.Reason != shard.OK {
				t.Fatal(res.Reason, err)
			}
			if err := e.Settle(ctx, l.DurableSeq()); err != nil {
				t.Fatal(err)
			}
			refreshAcme(t, e, 2, 4)
			owns.Store(false)
			if name == "regained before the settle" {
				// A change since the checkpoint (no record: the bucket's
				// period moving on does it; here, a Usage read a month on
				// would) makes the account dirty as it is forgotten.
				st := e.stripeFor("acme")
				st.mu.Lock()
				st.accounts["acme"].dirty = true
				st.mu.Unlock()
			}
			if !e.Forget("acme") {
				t.Fatal("Forget kept a settled account")
			}
			refreshAcme(t, e, 3, 0) // the other owner refunded k1
			owns.Store(true)
			if name == "settled" {
				if err := e.Settle(ctx, l.DurableSeq()); err != nil { // the forgotten account's ids dropped
					t.Fatal(err)
				}
			}
			if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "k2", ClientID: true, Units: 1}); err != nil || res.Reason != shard.OK {
				t.Fatal(res.Reason, err)
			}
			if err := e.Settle(ctx, l.DurableSeq()); err != nil {
				t.Fatal(err)
			}
			e.Close()
			l.Close()

			l = openLog(t, dir)
			e, err = Open(opts(l))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { e.Close(); l.Close() })
			if d, err := e.Refund(ctx, "acme", "k1", nil); err != nil || d.Reason != shard.UnknownEvent {
				t.Fatalf("refund of k1, charged before the account was let go, after a restart: %v %v; want unknown_event", d.Reason, err)
			}
			if res, _ := e.Charge(ctx, "acme", shard.Charge{EventID: "k2", ClientID: true, Units: 1}); res.Reason != shard.Replayed {
				t.Fatalf("k2, charged after the account came back, after a restart: %s, want replayed", res.Reason)
			}
		})
	}
}

// An account whose record the log refused (a record over MaxBatchBytes)
// holds in memory a charge its log does not, and answers nothing more until
// a restart (entry.broken). Its state was still checkpointed at the next
// settle, so the restart counted a charge never logged nor billed, and
// remembered its id as served. Now nothing more settles from the log (the
// error says to restart), and the restart replays the account from it.
func TestAccountAheadOfItsLogStopsTheSettle(t *testing.T) {
	dir := t.TempDir()
	clock := NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC))
	open := func() (*Engine, *wal.Log) {
		l, err := wal.Open(wal.Options{Dir: dir, NodeID: "n1", MaxBatchBytes: 600})
		if err != nil {
			t.Fatal(err)
		}
		e, err := Open(Options{Log: l, Clock: clock})
		if err != nil {
			t.Fatal(err)
		}
		// Settled mark 0: the ledger has none of the log's records, as
		// here (the settle is refused), so the snapshot's use (none) is
		// not taken for the account's.
		if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 100}), 0); err != nil {
			t.Fatal(err)
		}
		return e, l
	}
	e, l := open()
	ctx := context.Background()
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "small", ClientID: true, Route: "r", Units: 1}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge: %+v %v", res, err)
	}
	if _, err := e.Charge(ctx, "acme", shard.Charge{EventID: "big", ClientID: true, Route: strings.Repeat("r", 1000), Units: 5}); err == nil {
		t.Fatal("a charge whose record is over MaxBatchBytes was logged")
	}
	if err := e.Settle(ctx, l.DurableSeq()); err == nil || !strings.Contains(err.Error(), "restart the node") {
		t.Fatalf("settle with an account ahead of its log: %v, want a refusal that says to restart", err)
	}
	e.Close()
	l.Close()
	e, l = open()
	defer func() { e.Close(); l.Close() }()
	if u, _, _ := e.Usage("acme"); u.Used != 1 {
		t.Errorf("after a restart acme uses %d, want 1 (the charge the log refused is not one)", u.Used)
	}
	if res, err := e.Charge(ctx, "acme", shard.Charge{EventID: "big", ClientID: true, Route: "r", Units: 5}); err != nil || res.Reason != shard.OK {
		t.Errorf("the refused charge's id again after a restart: %+v %v, want a new charge (ok), not a replay", res, err)
	}
}
