package flush

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// replayRig is two nodes, q1 and q2, on real logs and engines, settling to
// one SQLite ledger; the account acct-1 (100 units a month) is owned by
// whichever node owner names.
type replayRig struct {
	l        *SQLite
	e        map[string]*engine.Engine
	s        map[string]*Settler
	owner    atomic.Value // string: the node that owns acct-1
	now      time.Time
	receipts map[string]*shard.Receipt
}

func newReplayRig(t *testing.T) *replayRig {
	t.Helper()
	ctx := context.Background()
	r := &replayRig{e: map[string]*engine.Engine{}, s: map[string]*Settler{}, now: time.Date(2026, 6, 10, 12, 0, 0, 0, time.UTC)}
	r.owner.Store("q1")
	l := migratedSQLite(t, func() time.Time { return r.now })
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "basic", MonthlyQuota: 100}); err != nil {
		t.Fatal(err)
	}
	if err := l.UpsertAccount(ctx, "acct-1", "basic"); err != nil {
		t.Fatal(err)
	}
	snap, err := l.Snapshot(ctx, r.now)
	if err != nil {
		t.Fatal(err)
	}
	r.l = l
	for _, node := range []string{"q1", "q2"} {
		log, err := wal.Open(wal.Options{Dir: t.TempDir(), NodeID: node})
		if err != nil {
			t.Fatal(err)
		}
		e, err := engine.Open(engine.Options{Log: log, Clock: engine.NewManualClock(r.now),
			Owns: func(string) bool { return r.owner.Load() == node }})
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
		if err := s.Register(ctx); err != nil {
			t.Fatal(err)
		}
		r.e[node], r.s[node] = e, s
	}
	return r
}

// charge charges event at node, wanting reason; it returns the receipt.
func (r *replayRig) charge(t *testing.T, node, event string, units int64, want shard.Reason) *shard.Receipt {
	t.Helper()
	res, err := r.e[node].Charge(context.Background(), "acct-1", shard.Charge{EventID: event, ClientID: true, Key: "k1", Route: "POST /v1/x", Units: units})
	if err != nil || res.Reason != want || res.Receipt == nil {
		t.Fatalf("charge %s at %s: %+v, %v; want %v with a receipt", event, node, res.Decision, err, want)
	}
	return res.Receipt
}

func (r *replayRig) settle(t *testing.T, nodes ...string) {
	t.Helper()
	for _, n := range nodes {
		if _, err := r.s[n].SettleOnce(context.Background()); err != nil {
			t.Fatalf("settle %s: %v", n, err)
		}
	}
}

func (r *replayRig) used(t *testing.T) int64 {
	t.Helper()
	u, err := r.l.Usage(context.Background(), "acct-1", shard.PeriodOf(r.now.UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	return u.Units
}

// A retry answered Replayed by q1 and served, then the account moved to
// q2, and q1's front refunded its first attempt through q2 (its upstream
// had failed): the event stays billed, whichever node settles first. The
// chaos harness found such a refund un-billing the served replay (G4).
// When the replay failed too, taken back through q2, nothing is billed.
func TestReplayServedBeforeAHandoffStaysBilled(t *testing.T) {
	ctx := context.Background()
	for _, order := range [][]string{{"q1", "q2"}, {"q2", "q1"}} {
		t.Run(order[0]+"-first", func(t *testing.T) {
			r := newReplayRig(t)
			first := r.charge(t, "q1", "k", 3, shard.OK)
			replay := r.charge(t, "q1", "k", 3, shard.Replayed)
			r.owner.Store("q2")
			if d, err := r.e["q2"].RefundAttempt(ctx, "acct-1", "k", first); err != nil || d.Reason != shard.Refunded {
				t.Fatalf("the first attempt's refund through q2: %+v, %v", d, err)
			}
			r.settle(t, order...)
			if got := r.used(t); got != 3 {
				t.Fatalf("used %d after the first attempt's refund, want 3: the replay was served", got)
			}
			// The replay's upstream failed too: taken back through q2.
			if d, err := r.e["q2"].RefundReplay(ctx, "acct-1", "k", replay); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the replay taken back through q2: %+v, %v", d, err)
			}
			r.settle(t, "q2")
			if got := r.used(t); got != 0 {
				t.Fatalf("used %d once the replay was taken back too, want 0: nothing was served", got)
			}
			rows, err := ReconcileRows(ctx, r.l)
			if err != nil {
				t.Fatal(err)
			}
			for _, row := range rows {
				if row.Diff {
					t.Errorf("reconcile: %+v differs", row)
				}
			}
		})
	}
}

// q1 answered two retries Replayed and held its first attempt's refund
// for them; the first retry failed, and its take-back reached q1, which
// applied it, but the answer was lost; the account moved to q2, where the
// front's second try landed. q2 logs it for the ledger, naming the replay,
// and the ledger counts it once, whichever node settles first: the event
// stays billed, since the second retry may be served. Counted twice, the
// pending refund applied and the served retry went unbilled.
func TestATakeBackAskedAgainAtTheNextOwnerCountsOnce(t *testing.T) {
	ctx := context.Background()
	for _, order := range [][]string{{"q1", "q2"}, {"q2", "q1"}} {
		t.Run(order[0]+"-first", func(t *testing.T) {
			r := newReplayRig(t)
			first := r.charge(t, "q1", "k", 3, shard.OK)
			replays := []*shard.Receipt{r.charge(t, "q1", "k", 3, shard.Replayed), r.charge(t, "q1", "k", 3, shard.Replayed)}
			if d, err := r.e["q1"].RefundAttempt(ctx, "acct-1", "k", first); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the first attempt's refund: %+v, %v; want kept", d, err)
			}
			if d, err := r.e["q1"].RefundReplay(ctx, "acct-1", "k", replays[0]); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the first replay taken back at q1: %+v, %v", d, err)
			}
			r.owner.Store("q2")
			if d, err := r.e["q2"].RefundReplay(ctx, "acct-1", "k", replays[0]); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the same take-back at q2: %+v, %v", d, err)
			}
			r.settle(t, order...)
			if got := r.used(t); got != 3 {
				t.Fatalf("used %d, want 3: the second replay may be served", got)
			}
			// The second replay failed too: nothing was served.
			if d, err := r.e["q2"].RefundReplay(ctx, "acct-1", "k", replays[1]); err != nil || d.Reason != shard.Kept {
				t.Fatalf("the second replay taken back at q2: %+v, %v", d, err)
			}
			r.settle(t, "q2")
			if got := r.used(t); got != 0 {
				t.Fatalf("used %d once both replays were taken back, want 0", got)
			}
		})
	}
}

// countOn names replays by node: a take-back counts off its own node's
// replay, or an older build's unnamed one, and otherwise waits; names an
// older build left behind (more names than replays) are dropped, oldest
// first, so that they neither count nor hide an unnamed replay.
func TestCountOnNamesReplaysByNode(t *testing.T) {
	replay, takeBack := &Replay{Delta: 1}, &Replay{Delta: -1}
	for _, c := range []struct {
		name   string
		row    replayRow
		r      *Replay
		node   string
		want   []string
		counts bool
	}{
		{"a replay is named", replayRow{replays: 1, replayedBy: []string{"a"}}, replay, "b", []string{"a", "b"}, true},
		{"its own node's", replayRow{replays: 2, replayedBy: []string{"a", "b"}}, takeBack, "b", []string{"a"}, true},
		{"another node's waits", replayRow{replays: 1, replayedBy: []string{"a"}}, takeBack, "b", []string{"a"}, false},
		{"an unnamed one", replayRow{replays: 2, replayedBy: []string{"a"}}, takeBack, "b", []string{"a"}, true},
		{"stale names go", replayRow{replays: 1, replayedBy: []string{"a", "b"}}, takeBack, "a", []string{"b"}, false},
		{"stale names of none", replayRow{replays: 0, replayedBy: []string{"a"}}, replay, "a", []string{"a"}, true},
		{"none to count off", replayRow{replays: 0, replayedBy: []string{"a"}}, takeBack, "a", []string{}, false},
	} {
		got, counts := countOn(c.row, c.r, c.node)
		if !slices.Equal(got, c.want) || counts != c.counts {
			t.Errorf("%s: countOn(%+v, delta %d, %s) = %v, %v; want %v, %v", c.name, c.row, c.r.Delta, c.node, got, counts, c.want, c.counts)
		}
	}
}
