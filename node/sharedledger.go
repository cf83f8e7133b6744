package node

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/ring"
)

// One ledger for the whole cluster.
//
// A node pointed at another database than its peers' (a restored backup,
// a staging clone, an empty database a typo named) reached it, migrated it
// if empty, and served: it owned its share of the accounts, answered them
// from a ledger that was not the cluster's (hard quotas served again from
// the copy's use), and settled their charges where no bill would find
// them. Nothing told the nodes apart: a copy holds the same rows.
//
// So a node proves it before it settles anything into its ledger or reads
// anything from it: it has just recorded its start there under a random
// process name (flush.NodeStart), and it asks every serving peer to read
// this node id's latest start from the peer's ledger (the LedgerStart
// RPC). The same process name comes back only if both settle into one
// database. When at least as many peers answer otherwise as read it, the
// node refuses to start; so one peer on a wrong ledger neither keeps the
// others' nodes out nor lets another node in. A peer that cannot read its
// ledger now, or runs a build without the RPC, proves nothing either way;
// a node that no peer could answer starts as before, with a warning. A
// cluster's first node has no peer to ask: a whole cluster started cold
// on a wrong ledger is not caught.

// errWrongLedger marks a node whose ledger is not its peers'.
var errWrongLedger = errors.New("this node's ledger is not the one the other nodes of its cluster settle into")

// sharedLedgerTimeout bounds one peer's answer.
const sharedLedgerTimeout = 6 * time.Second

// sharedLedgerPeerWait is how long a node that has just joined waits for
// its ring to show a serving peer to ask.
const sharedLedgerPeerWait = 3 * time.Second

// checkSharedLedger asks every serving peer at once whether its ledger
// holds this process's start (waiting up to sharedLedgerPeerWait, with
// --join, for the ring to show one). It returns errWrongLedger (wrapped,
// saying what to check) when at least as many say it does not as say it
// does; errNodeIDInUse when what they read instead is a later start of
// this id that own reads too (a twin); and nil when more read it, when
// there is no serving peer, or when none could tell (logged). own is
// this node's ledger. Call it once this start is recorded in
// the ledger (reachLedger) and before anything is settled into it
// (useLedger). Before the ring is joined there is no peer to ask, and it
// returns nil: Start asks once it has joined.
func (n *Node) checkSharedLedger(ctx context.Context, own flush.Ledger) error {
	if n.Ring() == nil { // NB: stored after n.router (joinRing)
		return nil
	}
	peers := n.servingPeers()
	if len(peers) == 0 && len(n.cfg.Join) > 0 {
		// Just joined: the ring learns the members from gossip events a
		// moment after the join returns. A first node of a cluster, or
		// one whose peers are not serving yet, waits this long for nothing.
		deadline := time.NewTimer(sharedLedgerPeerWait)
		defer deadline.Stop()
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
	wait:
		for len(peers) == 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-deadline.C:
				break wait
			case <-tick.C:
				peers = n.servingPeers()
			}
		}
	}
	// Every serving peer at once; the answers decide by majority, so that
	// one peer on a wrong ledger (started while none could tell) neither
	// refuses the nodes on the right one nor vouches for another on its own.
	type answer struct {
		m       ring.Meta
		process string
		err     error
	}
	answers := atOnce(peers, func(m ring.Meta) answer { // within sharedLedgerTimeout
		cctx, cancel := context.WithTimeout(ctx, sharedLedgerTimeout)
		defer cancel()
		process, _, err := n.router.PeerLedgerStart(cctx, m.RPCAddr, n.cfg.ID)
		return answer{m: m, process: process, err: err}
	})
	var unanswered, agree []string
	var disagree []answer
	for _, a := range answers {
		switch {
		case status.Code(a.err) == codes.Unimplemented:
			unanswered = append(unanswered, a.m.ID+": an older build")
		case a.err != nil:
			unanswered = append(unanswered, fmt.Sprintf("%s: %v", a.m.ID, a.err))
		case a.process == n.process:
			agree = append(agree, a.m.ID)
		default:
			disagree = append(disagree, a)
		}
	}
	if len(disagree) > 0 && len(disagree) >= len(agree) {
		a := disagree[0]
		if a.process != "" {
			// The peers read a later start of this node id by another
			// process: if this node's own ledger reads it too, the ledger
			// is shared, and that process is a twin started as this id.
			if s, err := own.LastStart(ctx, n.cfg.ID); err == nil && s.Process == a.process {
				return fmt.Errorf("%w: another process started as this node id after this one (process %q, incarnation %s): refusing to start; "+
					"two processes with one --node-id charge the same accounts twice and free each other's reservations. Give each process a --node-id of its own",
					errNodeIDInUse, s.Process, s.Incarnation)
			}
		}
		seen := "no start of this node id at all"
		if a.process != "" {
			seen = fmt.Sprintf("a start of this node id by another process (%q; this one is %q)", a.process, n.process)
		}
		others := ""
		if len(disagree) > 1 || len(agree) > 0 {
			others = fmt.Sprintf(" (%d of the %d peers that answered say so; %d read this start)", len(disagree), len(disagree)+len(agree), len(agree))
		}
		return fmt.Errorf("%w: node %s (at %s) reads, in its ledger, %s%s: --ledger %s names another database than the one the cluster settles into "+
			"(a restored backup, a copy, another cluster's ledger, or an empty database), so this node would serve accounts from the wrong rows and bill "+
			"their charges where no bill finds them. Give it the other nodes' --ledger; if they are the ones that are wrong, stop them instead. "+
			"(If another process started as this node id in the meantime, that is the other thing to check.)",
			errWrongLedger, a.m.ID, a.m.RPCAddr, seen, others, flush.RedactDSN(n.cfg.Ledger))
	}
	for _, a := range disagree {
		n.log.Error("a peer reads another ledger than this node and most of its peers: check that node's --ledger", "peer", a.m.ID, "peer_rpc", a.m.RPCAddr)
	}
	switch {
	case len(agree) > 0:
		n.log.Info("the ledger is the cluster's: peers read this start in their own", "peers", strings.Join(agree, ", "))
	case len(unanswered) > 0:
		n.log.Warn("could not check that this node's ledger is the one its peers settle into: none of them could answer; starting as before",
			"peers", strings.Join(unanswered, "; "))
	}
	return nil
}

// ledgerStart answers a peer's LedgerStart: the process this node's
// ledger recorded at node's latest start.
func (n *Node) ledgerStart(ctx context.Context, node string) (string, error) {
	l := n.Ledger()
	if l == nil {
		return "", errors.New("this node has not reached its ledger yet")
	}
	s, err := l.LastStart(ctx, node)
	if err != nil {
		return "", err
	}
	return s.Process, nil
}
