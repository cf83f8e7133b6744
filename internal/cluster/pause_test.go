package cluster

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/snapshot"
)

// An owner paused (SIGSTOP) for longer than the failure timeout comes back
// believing it still owns its accounts, while the others have taken them.
// The charges queued in its sockets meanwhile (and any that reach it before
// gossip corrects its view) must not be decided there: it answers them
// quota-unavailable until a peer has confirmed its ring view, and the
// accounts are decided only by the owner the cluster agrees on.
//
// Before the pause guard, the woken node decided every queued charge at
// once from the state it had before the pause: a full token bucket of its
// own beside the one the new owner started with (the rate-limited account
// got two bursts through in a moment), and charges against an account
// another node owned (node/pause.go).
func TestPausedOwnerDecidesNothingUntilItsRingIsConfirmed(t *testing.T) {
	tc := newTestCluster(t, 3)
	const quota, burst = 40, 5
	hard := accountIDs("pz-", 30)
	limited := accountIDs("pzr-", 30)
	tc.hardAccounts(snapshot.Plan{ID: "pz", MonthlyQuota: quota, Hard: true}, hard...)
	tc.hardAccounts(snapshot.Plan{ID: "pzr", Rate: "1/m", Burst: burst, MonthlyQuota: 1 << 40}, limited...)
	ctx := context.Background()

	// Both accounts on one owner, the node to pause.
	v, err := tc.Nodes[0].RingView(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h := hard[0]
	owner := tc.nodeByID(ownerOf(v, h))
	var r string
	for _, id := range limited {
		if ownerOf(v, id) == owner.ID {
			r = id
			break
		}
	}
	if r == "" {
		t.Fatalf("no account of %v on %s, the owner of %s", limited, owner.ID, h)
	}
	var other *Node
	for _, n := range tc.Nodes {
		if n != owner {
			other = n
			break
		}
	}
	direct := tc.client(owner) // connected before the pause: queued calls sit in its socket

	// Before the pause the owner decides both (one of the rate-limited
	// account's burst).
	before := map[string]int{}
	chargeVia := func(n *Node, account string, k int) (ok, no, undecided int) {
		for i := 0; i < k; i++ {
			switch o, _, _ := tc.charge(ctx, n, account, "", 1); o {
			case acked:
				ok++
			case refused:
				no++
			default:
				undecided++
			}
		}
		return
	}
	ok, _, _ := chargeVia(owner, h, 5)
	before[h] += ok
	ok, _, _ = chargeVia(owner, r, 1)
	before[r] += ok
	if before[h] != 5 || before[r] != 1 {
		t.Fatalf("before the pause: %d of 5 charges of %s and %d of 1 of %s acknowledged", before[h], h, before[r], r)
	}

	if err := owner.Pause(); err != nil {
		t.Fatal(err)
	}
	resumed := false
	defer func() {
		if !resumed {
			owner.Resume()
		}
	}()
	tc.eventually(30*time.Second, "the others to declare the paused "+owner.ID+" dead", func() bool {
		vo, err := other.RingView(ctx)
		return err == nil && servingCount(vo) == 2
	})

	// Calls sent straight to the paused owner (as an embedded client with
	// its last ring view does) wait in its socket.
	type answer struct {
		account string
		rep     *pb.ChargeReply
		err     error
	}
	answers := make(chan answer, 20)
	var wg sync.WaitGroup
	for i := 0; i < 10; i++ {
		for _, account := range []string{h, r} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				rep, err := direct.Charge(cctx, &pb.ChargeBatch{Charges: []*pb.ChargeRequest{{Account: account, Route: "POST /test", Units: 1,
					EventId: fmt.Sprintf("queued-%s-%d", account, i), ClientId: true}}})
				a := answer{account: account, err: err}
				if err == nil {
					a.rep = rep.Replies[0]
				}
				answers <- a
			}()
		}
	}

	// Meanwhile the new owner decides them: a full bucket of its own, and
	// what the ledger has free of the hard quota.
	newOK := map[string]int{}
	ok, _, _ = chargeVia(other, r, burst+2)
	newOK[r] += ok
	ok, _, _ = chargeVia(other, h, quota)
	newOK[h] += ok
	t.Logf("while %s was paused the others admitted %d of %s (burst %d) and acknowledged %d units of %s (hard quota %d, %d acknowledged before)",
		owner.ID, newOK[r], r, burst, newOK[h], h, quota, before[h])

	if err := owner.Resume(); err != nil {
		t.Fatal(err)
	}
	resumed = true
	wg.Wait()
	close(answers)
	stale := map[string]int{}
	undecided, unavail := 0, 0
	for a := range answers {
		switch {
		case a.err == nil && a.rep.Error.GetCode() == pb.Error_QUOTA_UNAVAILABLE:
			unavail++
		case a.err != nil || a.rep.Error != nil || a.rep.WrongOwner != nil:
			undecided++
		case a.rep.Decision.GetReason() == pb.Reason_OK && a.rep.Node == owner.ID:
			stale[a.account]++
		}
	}
	t.Logf("after SIGCONT %s admitted %d queued charges of %s and acknowledged %d of %s; %d answered quota-unavailable, %d otherwise undecided",
		owner.ID, stale[r], r, stale[h], h, unavail, undecided)

	tc.converge(30 * time.Second)
	// Back on the ring, the woken node decides its accounts again once a
	// peer has confirmed its view (quota-unavailable until then).
	var after *pb.ChargeReply
	tc.eventually(30*time.Second, owner.ID+" deciding again", func() bool {
		o, rep, _ := tc.charge(ctx, other, r, "", 1)
		after = rep
		return o != unavailable
	})
	t.Logf("%s after the ring converged: %s by %s", r, after.Decision.GetReason(), after.Node)
	tc.settleAll(30 * time.Second)
	total := before[h] + newOK[h] + stale[h]
	if u := tc.used(h); int64(total) != u {
		t.Errorf("%s: %d units acknowledged, the ledger used %d", h, total, u)
	}
	if total > quota {
		t.Errorf("%s: %d units acknowledged past its hard quota of %d (G1)", h, total, quota)
	}
	if u, err := tc.client(owner).Usage(ctx, &pb.UsageRequest{Account: h}); err != nil || u.WrongOwner != nil {
		t.Logf("%s: usage at %s: %v %v", h, owner.ID, err, u.GetWrongOwner())
	} else {
		t.Logf("%s: %s's usage in memory after the ring converged: used %d; the ledger: %d", h, owner.ID, u.Used, tc.used(h))
	}
	admitted := before[r] + newOK[r] + stale[r]
	t.Logf("%s: %d admitted in all at 1/m with a burst of %d (one owner allows %d, one owner move %d)", r, admitted, burst, burst+1, 2*burst+1)
	if stale[h]+stale[r] > 0 {
		t.Fatalf("%s, woken from a pause the others took its accounts in, decided %d queued charges of accounts it no longer owned (%s: %d, %s: %d)",
			owner.ID, stale[h]+stale[r], h, stale[h], r, stale[r])
	}
	if unavail != 20 {
		t.Errorf("%d of the 20 queued charges answered quota-unavailable, want all", unavail)
	}
	if !strings.Contains(owner.LogTail(400), "did not run for") {
		t.Errorf("%s's log does not say it noticed its pause", owner.ID)
	}
}
