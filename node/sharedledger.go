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
// So a node proves it before it takes accounts: it has just recorded its
// start in its ledger under a random process name (flush.NodeStart), and it
// asks a serving peer to read this node id's latest start from the peer's
// ledger (the LedgerStart RPC). The same process name comes back only if
// both settle into one database; any other answer (none, or an earlier
// process) means the ledgers differ, and the node refuses to start. A peer
// that cannot read its ledger now, or runs a build without the RPC, proves
// nothing either way: the next one is asked, and a node that none could
// answer starts as before, with a warning.

// errWrongLedger marks a node whose ledger is not its peers'.
var errWrongLedger = errors.New("this node's ledger is not the one the other nodes of its cluster settle into")

// sharedLedgerTimeout bounds one peer's answer.
const sharedLedgerTimeout = 6 * time.Second

// checkSharedLedger asks the serving peers, one after another until one
// can answer, whether their ledger holds this process's start. It returns
// errWrongLedger (wrapped, saying what to check) when one says it does
// not, and nil when one says it does, when there is no serving peer, or
// when no peer could tell (logged). It needs this start recorded
// (startRecorded) and the ring joined; otherwise there is nothing to prove
// yet, and it returns nil.
func (n *Node) checkSharedLedger(ctx context.Context) error {
	r := n.Ring()
	if r == nil || n.router == nil || !n.startRecorded.Load() {
		return nil
	}
	var peers []ring.Meta
	for _, m := range r.View().Members {
		if m.ID != n.cfg.ID && m.State == ring.StateServing && m.RPCAddr != "" {
			peers = append(peers, m)
		}
	}
	var unanswered []string
	for _, m := range peers {
		cctx, cancel := context.WithTimeout(ctx, sharedLedgerTimeout)
		process, _, err := n.router.PeerLedgerStart(cctx, m.RPCAddr, n.cfg.ID)
		cancel()
		switch {
		case status.Code(err) == codes.Unimplemented:
			unanswered = append(unanswered, m.ID+": an older build")
			continue
		case err != nil:
			unanswered = append(unanswered, fmt.Sprintf("%s: %v", m.ID, err))
			continue
		case process == n.process:
			n.log.Info("the ledger is the cluster's: a peer reads this start in its own", "peer", m.ID)
			return nil
		}
		seen := "no start of this node id at all"
		if process != "" {
			seen = fmt.Sprintf("a start of this node id by another process (%q; this one is %q)", process, n.process)
		}
		return fmt.Errorf("%w: node %s (at %s) reads, in its ledger, %s: --ledger %s names another database than the one the cluster settles into "+
			"(a restored backup, a copy, another cluster's ledger, or an empty database), so this node would serve accounts from the wrong rows and bill "+
			"their charges where no bill finds them. Give it the other nodes' --ledger; if they are the ones that are wrong, stop them instead. "+
			"(If another process started as this node id in the meantime, that is the other thing to check.)",
			errWrongLedger, m.ID, m.RPCAddr, seen, flush.RedactDSN(n.cfg.Ledger))
	}
	if len(unanswered) > 0 {
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
