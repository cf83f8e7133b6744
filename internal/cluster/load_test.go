package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// load charges many accounts from many goroutines through random running
// nodes, with a unique client event id per attempt, and remembers per
// account what was acknowledged and what had an unknown outcome.
type load struct {
	tc       *testCluster
	accounts []string
	mu       sync.Mutex // protects the maps and counters below
	acked    map[string]map[string]bool
	unknown  map[string]map[string]bool
	refused  int
	reasons  map[string]int // refusals by reason
	errs     int
	lastErr  error
	cancel   context.CancelFunc
	done     chan struct{}
}

func startLoad(tc *testCluster, accounts []string, workers int, seed uint64) *load {
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{tc: tc, accounts: accounts, acked: map[string]map[string]bool{}, unknown: map[string]map[string]bool{},
		reasons: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for i := 0; ctx.Err() == nil; i++ {
				n := tc.Nodes[rng.IntN(len(tc.Nodes))]
				if !n.Running() {
					continue
				}
				acct := accounts[rng.IntN(len(accounts))]
				id := fmt.Sprintf("w%d-%d", w, i)
				o, rep, err := tc.charge(context.Background(), n, acct, id, 1)
				l.record(acct, id, o, rep.GetDecision().GetReason().String(), err)
			}
		}()
	}
	go func() { wg.Wait(); close(l.done) }()
	return l
}

func (l *load) record(acct, id string, o outcome, reason string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch o {
	case acked:
		if l.acked[acct] == nil {
			l.acked[acct] = map[string]bool{}
		}
		l.acked[acct][id] = true
	case refused:
		l.refused++
		l.reasons[reason]++
	default:
		if l.unknown[acct] == nil {
			l.unknown[acct] = map[string]bool{}
		}
		l.unknown[acct][id] = true
		l.errs++
		l.lastErr = err
	}
}

// stop ends the load and waits for it.
func (l *load) stop() {
	l.cancel()
	<-l.done
}

func (l *load) total() (acked, refused, errs int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.acked {
		acked += len(m)
	}
	return acked, l.refused, l.errs
}

// check requires, per account: no more acknowledged than the quota (G1);
// every acknowledged charge in the ledger's event log exactly once, and
// nothing else there but charges whose outcome the client did not learn
// (G2, G3); the grant's used units equal to the event log (G6); and no
// reservation left once every node is settled and stopped or drained.
func (l *load) check(t *testing.T, quota int64) {
	t.Helper()
	ctx := context.Background()
	for _, a := range l.accounts {
		acked, unknown := l.acked[a], l.unknown[a]
		if int64(len(acked)) > quota {
			t.Fatalf("G1: account %s: %d charges acknowledged against a hard quota of %d", a, len(acked), quota)
		}
		events, err := l.tc.ledger.Events(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]int{}
		var units int64
		for _, e := range events {
			seen[e.EventID]++
			if !e.Refunded {
				units += e.Units
			}
		}
		for id := range acked {
			if seen[id] != 1 {
				t.Fatalf("G2: account %s: acknowledged charge %s is in the ledger %d times", a, id, seen[id])
			}
		}
		for id, k := range seen {
			if k > 1 {
				t.Fatalf("G3: account %s: event %s billed %d times", a, id, k)
			}
			if !acked[id] && !unknown[id] {
				t.Fatalf("account %s: event %s is billed but was refused to the client", a, id)
			}
		}
		if u := l.tc.used(a); u != units || u > quota {
			t.Fatalf("account %s: ledger used %d, event log %d units, quota %d", a, u, units, quota)
		}
	}
}

func accountIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s%d", prefix, i+1)
	}
	return ids
}

// waitAcked waits until the load has acknowledged at least n more charges.
func (l *load) waitAcked(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	start, _, _ := l.total()
	l.tc.eventually(timeout, fmt.Sprintf("%d more acknowledged charges", n), func() bool {
		a, _, _ := l.total()
		return a >= start+n
	})
}
