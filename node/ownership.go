package node

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/ring"
)

// followRing applies ownership changes. On losing partitions the node stops
// deciding for their accounts at once (the engine checks the ring under each
// account's lock, so in-flight charges finish and new ones are refused),
// then hands their reservations back and settles, so the new owner finds
// the units free. On gaining partitions it reserves ahead, in the
// background, for their accounts that an owner handed back recently (the
// ledger's handoffs, with the units the old owner held), so their first
// charges do not wait for the ledger; other accounts reserve on their first
// charge (one round trip), and the engine tops up from then on.
func (n *Node) followRing(ctx context.Context, changes <-chan ring.Change) {
	for {
		select {
		case <-ctx.Done():
			return
		case c, ok := <-changes:
			if !ok {
				return
			}
			n.metrics.ringChange(c)
			if len(c.Lost) > 0 {
				n.releaseLost(ctx, c.Lost)
			}
			if len(c.Gained) > 0 {
				// In the background: it looks for handoffs for a few
				// seconds, and a loss queued behind it must not wait.
				n.goLoop(func(ctx context.Context) { n.prefetchGained(ctx, c.Gained) })
			}
		}
	}
}

// releaseNotOwned hands back the allowance of every account this node holds
// state for but does not own now. It first waits until the node serves (the
// ledger may answer before the ring is joined, when nothing looks owned).
func (n *Node) releaseNotOwned(ctx context.Context) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !n.ready.Load() {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
	for _, id := range n.eng.AccountIDs() {
		if n.owns(id) {
			continue
		}
		// Let go (see Engine.Forget) even when the hand-back fails: its
		// state here goes stale as the new owner charges; if the account
		// comes back it starts again from the ledger's settled use (once a
		// snapshot includes this node's records of it).
		if err := n.eng.LetGo(ctx, id); err != nil {
			n.log.Warn("handing back the reservation of an account owned elsewhere failed", "account", id, "err", err)
		}
	}
}

// forgetNotOwned lets go, once the node serves, of the accounts its log and
// checkpoints brought back that another node owns now, as a partition lost
// while running does (releaseLost): kept, every account the node ever
// owned stayed in memory, dedup windows and all, and was loaded again at
// each start. Their allowances were handed back before serving (or are by
// releaseNotOwned once a late ledger answers); an account still holding
// one, or with records the config snapshot does not include yet, stays
// until it may go (Engine.Forget). It ends once it has looked, or with ctx.
func (n *Node) forgetNotOwned(ctx context.Context) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for !n.isServing() {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
	forgot := 0
	for _, id := range n.eng.AccountIDs() {
		if !n.owns(id) {
			n.eng.Forget(id)
			forgot++
		}
	}
	if forgot > 0 {
		n.log.Info("let go of accounts owned by other nodes now", "accounts", forgot)
	}
}

func (n *Node) releaseLost(ctx context.Context, lost []int) {
	if s := n.Settler(); n.draining.Load() && (s == nil || !s.Healthy()) {
		// As releaseAll: a hand-back to a ledger that is down fails after
		// the allowance is zeroed in the log, and its retry ends with this
		// process. The units stayed reserved in the ledger for nobody, and
		// a next start with the ledger still down found no allowance to
		// serve its accounts from (a SIGTERM did worse than a kill -9). The
		// log keeps them: a next start replays them, or, with the ledger
		// up, frees them before serving.
		n.log.Warn("lost partitions while draining with the ledger down: keeping their reservations for this node's next start", "partitions", len(lost))
		return
	}
	r := n.Ring()
	set := make(map[int]bool, len(lost))
	for _, p := range lost {
		set[p] = true
	}
	released, failed := 0, 0
	var firstErr error
	for _, id := range n.eng.AccountIDs() {
		if !set[r.Partition(id)] || n.owns(id) {
			continue
		}
		// Let go (see Engine.Forget) even when the hand-back fails: its
		// state here goes stale as the new owner charges; if the account
		// comes back it starts again from the ledger's settled use (once a
		// snapshot includes this node's records of it).
		if err := n.eng.LetGo(ctx, id); err != nil {
			// One line for all of them: with the ledger down this is every
			// account the node held.
			if failed++; firstErr == nil {
				firstErr = err
			}
			if n.draining.Load() {
				// Each failed hand-back waited its bound (5 s) for a ledger
				// that may hang: one after another they took a drain far
				// past its budget. The rest keep their allowances, as the
				// ledger looking down does (above).
				break
			}
			continue
		}
		released++
	}
	if s := n.Settler(); s != nil {
		s.Kick()
	}
	switch {
	case failed > 0:
		n.log.Warn("lost partitions: some accounts' reservations could not be handed back; they stay reserved in the ledger until the hand-back succeeds (retried while this node runs, else at its next start or with quotad revoke)",
			"partitions", len(lost), "accounts_let_go", released, "accounts_failed", failed, "first_err", firstErr)
	case released > 0:
		n.log.Info("lost partitions: accounts let go, their reservations handed back", "partitions", len(lost), "accounts", released)
	}
}

// handoffWindow is how far back a handoff counts as recent activity.
const handoffWindow = 10 * time.Minute

// prefetchConcurrency bounds the reservations a gain sends at once.
const prefetchConcurrency = 8

// prefetchGained reserves ahead for the accounts of the gained partitions
// that an owner handed back recently, with the units it held (see
// followRing). It runs in its own goroutine and ends within 5 s.
func (n *Node) prefetchGained(ctx context.Context, gained []int) {
	l := n.Ledger()
	if l == nil {
		return
	}
	// Bounded: the looks below take 3 s, the prefetches a little more.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r := n.Ring()
	set := make(map[int]bool, len(gained))
	for _, p := range gained {
		set[p] = true
	}
	sem := make(chan struct{}, prefetchConcurrency)
	var wg sync.WaitGroup
	done := map[string]bool{}
	var reserved atomic.Int64                      // accounts reserved for, still owned
	since := ledgerNow(ctx, l).Add(-handoffWindow) // handoffs carry the ledger's times
	// The old owner records its handoff after it announced it is draining,
	// which is what moved the ring here: look again a few times, so that a
	// handoff written just after this node gained is still prefetched.
	for i, wait := range [...]time.Duration{0, 200 * time.Millisecond, 800 * time.Millisecond, 2 * time.Second} {
		if i > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
			if ctx.Err() != nil {
				break
			}
		}
		hs, err := l.Handoffs(ctx, since)
		if err != nil {
			n.log.Debug("no handoffs to prefetch for", "err", err)
			break
		}
		for _, h := range hs {
			if done[h.Account] || !set[r.Partition(h.Account)] {
				continue
			}
			done[h.Account] = true
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				if n.draining.Load() {
					return // leaving: what it gained goes on to others
				}
				if err := n.eng.Prefetch(ctx, h.Account, h.Units); err != nil {
					n.log.Debug("prefetch for a gained account failed; its first charge will reserve", "account", h.Account, "err", err)
				} else if n.owns(h.Account) {
					reserved.Add(1)
				}
			}()
		}
	}
	wg.Wait()
	// NB: the accounts reserved for, not those looked at: a draining node
	// logged that it had reserved ahead for partitions it had lost.
	if k := reserved.Load(); k > 0 && !n.draining.Load() {
		n.log.Info("gained partitions: reserved ahead for recently handed-off accounts", "partitions", len(gained), "accounts", k)
	}
}
