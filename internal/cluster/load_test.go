package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/waitfor"
)

// load charges many accounts from many goroutines through random running
// nodes, with a unique client event id per attempt, and records every
// charge in a History for the checkers (check.go).
type load struct {
	tc       *testCluster
	accounts []string
	hist     *History
	mu       sync.Mutex // protects the counters below
	acked    int
	refused  int
	reasons  map[string]int // refusals by reason
	decided  map[string]int // acknowledged and refused charges by deciding node
	errs     int
	lastErr  string
	cancel   context.CancelFunc
	done     chan struct{}
}

func startLoad(tc *testCluster, accounts []string, workers int, seed uint64) *load {
	ctx, cancel := context.WithCancel(context.Background())
	l := &load{tc: tc, accounts: accounts, hist: NewHistory(), reasons: map[string]int{}, decided: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for i := 0; ctx.Err() == nil; i++ {
				nodes := tc.List() // AddNode may run meanwhile
				n := nodes[rng.IntN(len(nodes))]
				if !n.Running() {
					continue
				}
				acct := accounts[rng.IntN(len(accounts))]
				start := l.hist.Now()
				op := tc.chargeOp(context.Background(), n, acct, fmt.Sprintf("w%d-%d", w, i), 1).Op
				op.Worker, op.Start, op.End = w, start, l.hist.Now()
				l.record(op)
			}
		}()
	}
	go func() { wg.Wait(); close(l.done) }()
	return l
}

func (l *load) record(op Op) {
	l.hist.Add(op)
	l.mu.Lock()
	defer l.mu.Unlock()
	switch op.Status {
	case StatusOK:
		l.acked++
		l.decided[op.Decider]++
	case StatusRefused:
		l.refused++
		l.reasons[op.Reason]++
		l.decided[op.Decider]++
	default:
		l.errs++
		l.lastErr = op.Reason + ": " + op.Err
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
	return l.acked, l.refused, l.errs
}

// check runs the checkers of G1 (no account acknowledged more than its hard
// quota), G2 (every acknowledged charge in the ledger's event log exactly
// once), G3 (nothing else there but charges whose outcome the client did not
// learn) and G6 (the grants' used units equal the event log) over the
// history and the settled ledger.
func (l *load) check(t *testing.T, quota int64) {
	t.Helper()
	st, err := ReadLedger(context.Background(), l.tc.ledger, l.accounts)
	if err != nil {
		t.Fatal(err)
	}
	in := &CheckInput{Ops: l.hist.Ops(), Accounts: map[string]Limits{}, Ledger: st}
	for _, a := range l.accounts {
		in.Accounts[a] = Limits{Hard: true, Quota: quota}
	}
	for _, r := range Check(in, "G1", "G2", "G3", "G6") {
		t.Logf("%s %s: %s", r.ID, r.Verdict, r.Summary)
		if r.Verdict == Violated {
			for _, v := range r.Violations {
				t.Errorf("%s: account %s event %s: %s", r.ID, v.Account, v.Event, v.Detail)
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

func accountIDs(prefix string, n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s%d", prefix, i+1)
	}
	return ids
}

// waitAcked waits until the load has acknowledged at least n more charges:
// for accounts whose limits the load cannot use up.
func (l *load) waitAcked(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	start, refused, errs := l.total()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(waitfor.Every)
	defer tick.Stop()
	for {
		a, r, e := l.total()
		if a >= start+n {
			return
		}
		if time.Now().After(deadline) {
			l.mu.Lock()
			reasons, lastErr := fmt.Sprint(l.reasons), l.lastErr
			l.mu.Unlock()
			t.Fatalf("timed out after %s waiting for %d more acknowledged charges: %d acknowledged, %d refused (all along: %s), %d failed (last: %s) meanwhile",
				timeout, n, a-start, r-refused, reasons, e-errs, lastErr)
		}
		<-tick.C
	}
}

// waitDecided waits until the owners have decided at least n more charges,
// and each of deciders at least one of them. A refusal counts as much as an
// acknowledgement: the accounts run near their limits, and how many charges
// fit before they run out depends on how fast the load ran while the test
// waited for the cluster (waiting for acknowledgements alone failed when a
// slow restart let the load use every account up).
func (l *load) waitDecided(t *testing.T, n int, timeout time.Duration, deciders ...string) {
	t.Helper()
	snap := func() (acked, refused, errs int, by map[string]int) {
		l.mu.Lock()
		defer l.mu.Unlock()
		by = map[string]int{}
		for k, v := range l.decided {
			by[k] = v
		}
		return l.acked, l.refused, l.errs, by
	}
	a0, r0, e0, by0 := snap()
	done := func() bool {
		a, r, _, by := snap()
		if a+r < a0+r0+n {
			return false
		}
		for _, d := range deciders {
			if by[d] == by0[d] {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(waitfor.Every)
	defer tick.Stop()
	for !done() {
		if time.Now().After(deadline) {
			a, r, e, by := snap()
			l.mu.Lock()
			lastErr := l.lastErr
			l.mu.Unlock()
			t.Fatalf("timed out after %s waiting for %d more decided charges (each of %v deciding some): %d acknowledged, %d refused, %d failed (last: %s) meanwhile; decided by node, all along: %v",
				timeout, n, deciders, a-a0, r-r0, e-e0, lastErr, by)
		}
		<-tick.C
	}
}
