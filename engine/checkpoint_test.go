package engine

import (
	"context"
	"fmt"
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
		cps, maxSeq := e.checkpoints()
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
	cps, _ := e.checkpoints()
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
