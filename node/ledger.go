package node

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
)

// connectLedger reaches the ledger once: open, migrate, register, settle
// what the log holds, free this node's old reservations (only before
// serving: see resetReservations), read the snapshot, and start the settle
// and refresh loops. It reports whether it succeeded.
func (n *Node) connectLedger(ctx context.Context, beforeServing bool) bool {
	ok, _ := n.tryLedger(ctx, beforeServing)
	return ok
}

// tryLedger is connectLedger with the reason it failed. A node in the ring
// already (the ledger reached late) proves the ledger is its peers'
// (checkSharedLedger) between the two halves: before it settles anything
// into it or reads anything from it.
func (n *Node) tryLedger(ctx context.Context, beforeServing bool) (bool, error) {
	p, err := n.reachPeersLedger(ctx, beforeServing)
	if err != nil {
		return false, err
	}
	return n.useLedger(ctx, p, beforeServing)
}

// reachPeersLedger is reachLedger and, for a node in the ring, the proof
// that the ledger is its peers' (checkSharedLedger): what tryLedger and a
// stop's last try (reachAtStop) do before using it.
func (n *Node) reachPeersLedger(ctx context.Context, beforeServing bool) (*reachedLedger, error) {
	p, err := n.reachLedger(ctx, beforeServing)
	if err != nil {
		return nil, err
	}
	if !beforeServing && len(n.cfg.Join) > 0 && n.Ring() == nil { // NB: the ring is stored after the router (joinRing)
		// A retry begun while Start still joins the ring: no peer to ask
		// yet, so nothing is settled into this ledger; the next try asks.
		p.l.Close()
		return nil, errors.New("node: not in the ring yet: the ledger is used once the peers can say it is theirs")
	}
	if err := n.checkSharedLedger(ctx, p.l); err != nil {
		p.l.Close()
		n.ledgerFailed(err, beforeServing)
		return nil, err
	}
	return p, nil
}

// reachedLedger is a ledger reachLedger opened and registered this node
// with (its start recorded), that nothing has been settled into or read
// from yet.
type reachedLedger struct {
	l       flush.Ledger
	settler *flush.Settler
}

// reachLedger is the first half of connectLedger: open, migrate, check the
// node id, register and record this start. Nothing is settled into the
// ledger, and nothing read from it is used, until useLedger.
func (n *Node) reachLedger(parent context.Context, beforeServing bool) (*reachedLedger, error) {
	timeout := 10*time.Second + nodeLease // checkNodeIDFree may wait that long
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	l, err := flush.Open(ctx, n.cfg.Ledger, n.log.With("component", "ledger"))
	if err == nil && n.cfg.wrapLedger != nil {
		l = n.cfg.wrapLedger(l)
	}
	if errors.Is(err, flush.ErrInvalid) {
		// A --ledger that does not parse, as opposed to one not reached:
		// waiting will not fix it, and Start refuses to go on.
		return nil, fmt.Errorf("%w: %w", errLedgerAddress, err)
	}
	if err == nil {
		// Migrate only a ledger behind this quotad: migrating takes DDL
		// rights (and schema_migrations' CREATE IF NOT EXISTS asks for them
		// even when there is nothing to do), which a least-privilege role
		// for the nodes does not have; quotad migrate, run as the ledger's
		// owner, has them.
		if err = flush.CheckSchema(ctx, l); err != nil && !errors.Is(err, flush.ErrSchemaTooNew) {
			// Not under the start's budget: a migration of a large ledger
			// (a backfill of millions of rows) ran past it, was cancelled
			// with its table lock still held by the server, and ran again
			// every 2 s, for ever, stalling every node's settles. It stops
			// with the node.
			n.log.Info("the ledger's schema is behind this quotad: migrating it (on a large ledger this takes a while; quotad migrate, run first, does the same)", "schema", err)
			if err = l.Migrate(parent); err == nil {
				n.log.Info("ledger migrated")
				rest, cancelRest := context.WithTimeout(parent, timeout) // the start's budget, anew
				defer cancelRest()
				ctx = rest
			}
		}
		if err != nil {
			l.Close()
		}
	}
	switch {
	case errors.Is(err, flush.ErrSchemaTooNew) && !beforeServing:
		// Reached late (it was down at start), migrated meanwhile by a
		// newer build: this node can never settle into it. It was retried
		// every 2 s for ever while the node took charges; it stops, as a
		// fenced node does, its log keeping what it took for a newer
		// quotad started on this data dir.
		n.fenceWith(err, "the ledger, reached late (it was down when this node started), was migrated by a newer quotad: this node cannot settle into it, "+
			"so it stops taking charges and exits; its log keeps what it took: start a newer quotad on this data dir (never roll back below the ledger's schema)", "err", err)
		return nil, err
	case errors.Is(err, flush.ErrSchemaTooNew):
		// Waiting will not fix it: Start refuses to go on.
		n.log.Error("the ledger was migrated by a newer quotad: upgrade this node (never roll back below the ledger's schema)", "err", err)
		return nil, err
	case err != nil && ctx.Err() != nil:
		return nil, err // stopping: not the ledger's fault
	case err != nil:
		// Once a minute at most, with the count held back: every 2 s (each
		// try) filled the log of a node whose ledger stayed away.
		if ok, held := n.unreachedLog.Allow(time.Now(), time.Minute); ok {
			n.log.Warn("ledger not reached; trying again", "err", err,
				"what_to_check", flush.WhatToCheck(err), "retry_every", n.cfg.LedgerRetry, "similar_lines_held_back", held)
		}
		return nil, err
	}
	// NB: before Register (which writes this node's heartbeat) and
	// before resetReservations frees what the node id holds. Also when the
	// ledger is first reached late (it was down at start): this process has
	// served from its data dir meanwhile, and one that runs as its id may
	// have started since.
	err = n.checkNodeIDFree(ctx, l, !beforeServing)
	if err == nil {
		// Also when reached late: registered then, the new incarnation
		// would be known at the next start, and its drain (releaseStranded)
		// or next start would free the earlier one's reservations.
		err = n.checkEarlierIncarnations(ctx, l)
	}
	if err != nil {
		l.Close()
		n.ledgerFailed(err, beforeServing)
		return nil, err
	}
	settler, err := flush.NewSettler(flush.SettlerOptions{Ledger: l, Engine: n.eng, Interval: n.cfg.SettleInterval,
		Events: !n.cfg.EventsOff, CallTimeout: n.cfg.LedgerTimeout, Logger: n.log.With("component", "settler"), OnSettle: n.metrics.onSettle,
		AfterCommit: n.afterCommitFailpoint, Start: n.startToRecord(), Process: n.process, OnRefused: n.settleRefused})
	if err == nil {
		err = settler.Register(ctx)
	}
	if err != nil {
		n.ledgerFailed(err, beforeServing)
		l.Close()
		return nil, err
	}
	return &reachedLedger{l: l, settler: settler}, nil
}

// useLedger is the second half of connectLedger, on a ledger reachLedger
// reached: settle what the log holds, free this node's old reservations
// (before serving), read the snapshot, and start the loops.
func (n *Node) useLedger(ctx context.Context, p *reachedLedger, beforeServing bool) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second+nodeLease)
	defer cancel()
	l, settler := p.l, p.settler
	_, err := settler.SettleOnce(ctx)
	if err == nil && beforeServing {
		err = n.resetReservations(ctx, l)
	}
	refresher := &flush.Refresher{Ledger: l, Engine: n.eng, Interval: n.cfg.SnapshotInterval, Logger: n.log.With("component", "snapshot")}
	if err == nil {
		err = refresher.RefreshOnce(ctx)
		if errors.Is(err, flush.ErrInvalid) {
			// A config row the ledger holds does not validate (a hand edit,
			// another tool): the connection is good, and settles and
			// reservations need it. Thrown away, the node ran as if the
			// ledger were down (every hard account quota-unavailable once
			// its units ran out, a node with an empty dir never ready) and
			// said so, and a rolling restart took every hard account down.
			// It serves the config it has (kept in the data dir: none on a
			// new dir, not ready until the row is fixed), as a running node
			// does, and the refresher reads again every interval.
			n.log.Error("the ledger's config does not validate: serving the config this node has until it is fixed "+
				"(none on a new data dir: not ready until then); settles and reservations go on. Fix or replace the row the error names "+
				"(quotad admin plans/accounts/keys/routes, or the admin API); the node reads the config again every --snapshot-interval", "err", err)
			err = nil
		}
	}
	if err == nil && !beforeServing {
		n.countInheritedReservations(ctx, l)
	}
	if err != nil {
		n.ledgerFailed(err, beforeServing)
		l.Close()
		return false, err
	}
	n.startRecorded.Store(true)
	n.ledger.Store(&ledgerBox{l: l})
	// NB: the loops start under n.mu, and only while the node is not
	// stopping: stopLoops cancels n.ctx, then reads these under n.mu to
	// close them. Started after that read (a stop that came while the
	// ledger was reached), they ran on for the life of the process against
	// a closed log and ledger. Stored all the same: finalSettle uses the
	// settler, as after reachAtStop.
	n.mu.Lock()
	n.settler, n.refresher = settler, refresher
	if n.ctx.Err() == nil {
		settler.Start()
		refresher.Start()
	}
	n.mu.Unlock()
	if !beforeServing {
		// Reached late: accounts that moved away while the ledger was down
		// still hold the allowance this node replayed; hand it back.
		n.releaseNotOwned(ctx)
	}
	n.log.Info("ledger connected", "settled", n.wal.SettledSeq())
	return true, nil
}

// settleRefused stops a serving node whose settles the ledger refuses for
// good (flush.SettlerOptions.OnRefused): every charge it takes from then on
// can never be settled, and it was retried for ever while the node served.
// It stops as a fenced node does; the other nodes take its accounts, and
// its log keeps what it took for the remedy the error gives.
func (n *Node) settleRefused(err error) {
	if errors.Is(err, flush.ErrOtherProcess) {
		n.ledgerRefused.Store(&err)
		n.fenceWith(err, "another process started as this node id after this one, on a copy of its data dir, and the ledger refuses this one's settles: "+
			"this one stops taking charges and exits; the charges it took that are not settled are in no ledger (the error names them). "+
			"Give each process a --node-id and data dir of its own (a StatefulSet's pod names and volumes, not a Deployment's shared config)", "err", err)
		return
	}
	n.fenceMarkConflict(err, "by a settle while it served (a ledger restored from a backup older than this node's log, or another cluster's ledger)")
}

// fenceMarkConflict stops a serving node whose log and ledger disagree on
// what was settled (flush.ErrMarkConflict), found as found says: every
// charge it takes from here on gets a sequence number the ledger settled
// for another, and is billed only by hand. It stops, as a fenced node does,
// and the other nodes take its accounts.
func (n *Node) fenceMarkConflict(err error, found string) {
	n.ledgerRefused.Store(&err)
	n.fenceWith(err, "the ledger and this node's log disagree on what was settled, found "+found+
		": this node can never settle what it takes, so it stops taking charges and exits "+
		"without settling; the other nodes take its accounts. Follow the error's remedy", "err", err)
}

// ledgerFailed logs why reaching or using the ledger failed. What waiting
// will not fix is an ERROR before serving (Start refuses to go on), and
// fences a node that is serving already (the ledger was down at start).
func (n *Node) ledgerFailed(err error, beforeServing bool) {
	switch {
	case errors.Is(err, errEarlierIncarnationHolds) && beforeServing:
		n.log.Error("an earlier incarnation of this node id may hold unsettled charges: refusing to start", "err", err)
	case errors.Is(err, errEarlierIncarnationHolds):
		// Serving already (from nothing: a new dir has no config
		// snapshot and owned no hard account's units): stop.
		n.fenceWith(err, "an earlier incarnation of this node id may hold unsettled charges, found when the ledger was first reached "+
			"(it was down when this one started): this one stops taking charges and exits", "err", err)
	case errors.Is(err, errNodeIDInUse) && beforeServing:
		n.log.Error("another process runs as this node id: refusing to start", "err", err)
	case errors.Is(err, errNodeIDInUse):
		// Serving already: stop as a process that a later one fenced.
		n.fence("another process runs as this node id, found when the ledger was first reached (it was down when this one started): "+
			"this one stops taking charges and exits; two processes with one --node-id charge the same accounts twice and free each other's reservations. "+
			"Give each process a --node-id of its own", "err", err)
	case errors.Is(err, errWrongLedger) && beforeServing:
		// Start returns it; quotad prints it.
	case errors.Is(err, errWrongLedger):
		n.fenceWith(err, "this node's ledger, reached late (it was down at start), is not the one its peers settle into: this node stops taking charges and exits; "+
			"its log keeps what it took, unsettled, for a start with the right --ledger", "err", err)
	case errors.Is(err, flush.ErrMarkConflict):
		// Retrying will not fix it; the records stay in the log, unsettled.
		if beforeServing {
			n.ledgerRefused.Store(&err)
			n.log.Error("the ledger and this node's log disagree on what was settled: nothing is marked settled; follow the error's remedy", "err", err)
			return
		}
		// Serving already (the ledger was down at start); its allowances
		// are the copy's, which the ledger may no longer back.
		n.fenceMarkConflict(err, "when the ledger was first reached (it was down when this node started)")
	default:
		n.log.Warn("ledger reached but not usable yet", "err", err)
	}
}

// logEarlierIncarnations logs an ERROR for each earlier incarnation of
// this node id that did not stop cleanly, for a node started on a data dir
// new to the ledger (checkEarlierIncarnations). After a lost disk (and
// quotad revoke) that is expected; after a mistyped --data-dir, or a
// volume not mounted, the old dir still holds whatever it had not settled,
// which is billed only if that dir is started again. One that stopped
// cleanly left nothing unsettled in its dir and is not named.
func (n *Node) logEarlierIncarnations(earlier []flush.NodeRow) {
	for _, r := range earlier {
		n.log.Error("this data dir is new, and the ledger knows an earlier incarnation of this node id that did not stop cleanly: if its data dir still exists (a mistyped --data-dir, a volume not mounted), stop this node and start it on that dir; its unsettled charges are billed only from there",
			"data_dir", n.cfg.DataDir, "incarnation", n.wal.Incarnation(), "earlier_incarnation", r.Incarnation,
			"earlier_last_heard", r.Heartbeat.UTC().Format(time.RFC3339), "earlier_settled_seq", r.Settled)
	}
}

// errEarlierIncarnationHolds marks a new data dir started for a node id
// whose earlier incarnation did not stop cleanly and still holds
// reservations (checkEarlierIncarnations).
var errEarlierIncarnationHolds = errors.New("an earlier incarnation of this node id did not stop cleanly and holds reservations")

// checkEarlierIncarnations refuses to start this node on a data dir the
// ledger has never seen (a new incarnation) while an earlier incarnation of
// its id did not stop cleanly and still holds reservations. A new
// incarnation frees what its id holds before it serves; that earlier dir
// may still exist (a mistyped --data-dir, a volume not mounted) with
// acknowledged charges it never settled, which those reservations back, and
// freeing them let other nodes spend the same units again: hard quotas went
// over when that dir was started again. A lost disk is an operator's call,
// as for any lost node: quotad revoke frees the reservations (saying what
// that may let through twice), and then this start goes on. Before
// Register, so that a refused start leaves no trace in the ledger and the
// next one refuses the same way.
func (n *Node) checkEarlierIncarnations(ctx context.Context, l flush.Ledger) error {
	rows, err := l.Nodes(ctx)
	if err != nil {
		return err
	}
	var earlier []flush.NodeRow
	for _, r := range rows {
		switch {
		case r.Node != n.cfg.ID:
		case r.Incarnation == n.wal.Incarnation():
			return nil // this dir's incarnation is known: not new
		case r.Running():
			earlier = append(earlier, r)
		}
	}
	if len(earlier) == 0 {
		return nil
	}
	held, err := n.reservedInLedger(ctx, l)
	if err != nil {
		return err
	}
	if held == 0 {
		// Nothing to spend twice (a lost disk revoked, say), but that dir
		// is billed only if it is started again: say so, here, since a
		// start refused before registered nothing and the dir is no longer
		// fresh at the next try.
		if !n.warnedIncarnations.Swap(true) {
			n.logEarlierIncarnations(earlier)
		}
		return nil
	}
	var names []string
	for _, r := range earlier {
		names = append(names, fmt.Sprintf("%s (last heard from %s, settled to seq %d)", r.Incarnation, r.Heartbeat.UTC().Format(time.RFC3339), r.Settled))
	}
	return fmt.Errorf("%w: this data dir (%s) is new to the ledger, and node id %s has an earlier incarnation that did not stop cleanly, %s, "+
		"with %d units reserved: its data dir may hold acknowledged charges it never settled, which those units back, and a new "+
		"incarnation frees them, so that other nodes could spend them again. If that data dir still exists (a mistyped --data-dir, "+
		"a volume not mounted), start the node on it. If it is lost for good, run `quotad revoke --node %s` (it says what that may "+
		"let through twice) and start this one again",
		errEarlierIncarnationHolds, n.cfg.DataDir, n.cfg.ID, strings.Join(names, ", "), held, n.cfg.ID)
}

// errNodeIDInUse marks another process that runs as this node's id.
var errNodeIDInUse = errors.New("another process runs as this node id")

// nodeLease is how long after the ledger last heard from a node id (a
// heartbeat, every flush.HeartbeatEvery, or a settle) a process of that id
// may still be running: two heartbeats and a margin.
const nodeLease = 2*flush.HeartbeatEvery + time.Second

// checkNodeIDFree returns once no other process runs as this node id, or
// errNodeIDInUse. A second process with a running node's id (a second
// cluster on the same ledger, a reused hostname, a copy of a data dir) freed
// the running node's reservations at start (resetReservations) and charged
// its accounts beside it: hard quotas went over. When the ledger heard from
// the id within nodeLease, this waits until the lease runs out: a heartbeat
// newer than the one seen means a live process (this one has written
// nothing yet). A node restarted after kill -9 waits out the rest of its
// lease, a few seconds; after a clean stop (SIGTERM, recorded in the
// ledger) it does not wait. With watch (a node that served while
// the ledger was down and reaches it now: the id's last heartbeat may be
// from before the outage while another process runs), it watches a whole
// lease from now whatever the last heartbeat.
func (n *Node) checkNodeIDFree(ctx context.Context, l flush.Ledger, watch bool) error {
	last, row, err := lastHeard(ctx, l, n.cfg.ID)
	if err != nil || last.IsZero() && !watch {
		return err
	}
	now, err := l.Clock(ctx)
	if err != nil {
		return err
	}
	deadline := last.Add(nodeLease)
	if watch {
		deadline = now.Add(nodeLease)
	}
	if !now.Before(deadline) {
		return nil
	}
	msg := "the ledger heard from this node id moments ago: making sure no other process runs as it before starting"
	if watch {
		msg = "the ledger is reached for the first time since this node started: making sure no other process started as its id meanwhile"
	}
	n.log.Info(msg, "last_heard", last.UTC().Format(time.RFC3339Nano), "incarnation", row.Incarnation, "wait", deadline.Sub(now).Round(time.Millisecond))
	t := time.NewTicker(nodeLease / 20)
	defer t.Stop()
	for now.Before(deadline) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("node: check that no other process runs as node %s: %w", n.cfg.ID, ctx.Err())
		case <-t.C:
		}
		again, row, err := lastHeard(ctx, l, n.cfg.ID)
		if err != nil {
			return err
		}
		if again.After(last) {
			return fmt.Errorf("%w: the ledger heard from node id %s (incarnation %s) at %s, after this process started: "+
				"another quotad runs with --node-id %s (a second cluster on this ledger, a node id used twice, or a copy of its data dir); "+
				"two processes with one id charge the same accounts twice and free each other's reservations: "+
				"stop one of them, or give this one a --node-id of its own",
				errNodeIDInUse, n.cfg.ID, row.Incarnation, again.UTC().Format(time.RFC3339Nano), n.cfg.ID)
		}
		if now, err = l.Clock(ctx); err != nil {
			return err
		}
	}
	return nil
}

// lastHeard is the latest heartbeat of any incarnation of node in the
// ledger that has not stopped cleanly since, and its row; zero when none
// may be running (never heard from, or every one stopped cleanly: a node
// restarted after SIGTERM need not wait out its old lease).
func lastHeard(ctx context.Context, l flush.Ledger, node string) (time.Time, flush.NodeRow, error) {
	rows, err := l.Nodes(ctx)
	if err != nil {
		return time.Time{}, flush.NodeRow{}, err
	}
	last := flush.LatestRunning(rows)[node]
	return last.Heartbeat, last, nil
}

// isReconciler reports whether this node runs the periodic reconcile: the
// serving member with the smallest id in its ring view. Two views that
// disagree for a moment run it twice, which is only load.
func (n *Node) isReconciler() bool {
	r := n.Ring()
	if r == nil {
		return false
	}
	serving := r.View().Serving
	return len(serving) > 0 && slices.Min(serving) == n.cfg.ID
}

// errLedgerAddress marks a --ledger that cannot be used as written.
var errLedgerAddress = errors.New("the --ledger cannot be used as given")

// resetReservations frees every reservation this node holds in the ledger,
// after zeroing the local allowances (logged first, so a crash in between
// only strands units). Units reserved by a top-up whose local record was
// lost in a crash come back this way. It runs only when the log is settled
// and before serving: while charges are unsettled, their units still sit in
// the reservation, and freeing them would let another node spend them.
func (n *Node) resetReservations(ctx context.Context, l flush.Ledger) error {
	if n.wal.DurableSeq() != n.wal.SettledSeq() {
		return fmt.Errorf("node: %d records still unsettled; not resetting reservations", n.wal.DurableSeq()-n.wal.SettledSeq())
	}
	if err := n.eng.ZeroAllowances(ctx); err != nil {
		return err
	}
	freed, err := l.ReleaseNode(ctx, n.cfg.ID)
	if err != nil {
		return fmt.Errorf("node: free this node's old reservations: %w", err)
	}
	var units int64
	for _, f := range freed {
		units += f.Units
	}
	if units > 0 {
		n.log.Info("freed reservations this node held before it started", "units", units, "grants", len(freed))
	}
	return nil
}

// countInheritedReservations is for a node that reached its ledger late
// (it was down at start, and the node served from its data dir, so
// resetReservations did not run): what the ledger reserves for this node
// id beyond what this process holds is counted in doubt
// (quotaring_reservations_uncertain_units) and logged. Those are units of
// the process before it: a reserve whose record its crash lost, a
// hand-back it zeroed and never sent. They stay reserved, spendable by
// nobody, until this node's next stop or start frees them all (or quotad
// revoke). No reservation is made meanwhile (the ledger is not in use
// yet); charges going on, and charges not settled yet, only make the
// count larger.
func (n *Node) countInheritedReservations(ctx context.Context, l flush.Ledger) {
	units, err := n.reservedInLedger(ctx, l)
	if err != nil {
		n.log.Warn("could not read this node's reservations in the ledger, reached late; units an earlier process reserved may stay reserved until this node stops, uncounted", "err", err)
		return
	}
	if extra := units - n.eng.AllowanceHeld(); extra > 0 {
		n.eng.Stats().UncertainUnits.Add(extra)
		n.log.Warn("the ledger, reached late (it was down at start), reserves more for this node than this process holds: "+
			"units of the process before it (a reservation or a hand-back its crash cut off); they stay reserved, spendable by nobody, "+
			"until this node's next stop or start frees them (or quotad revoke)", "units", extra)
	}
}

// reservedInLedger is the units the ledger reserves for this node id, over
// every account and grant.
func (n *Node) reservedInLedger(ctx context.Context, l flush.Ledger) (int64, error) {
	rs, err := l.Reservations(ctx)
	if err != nil {
		return 0, err
	}
	var units int64
	for _, r := range rs {
		if r.Node == n.cfg.ID {
			units += r.Units
		}
	}
	return units, nil
}

// retryLedger keeps trying to reach the ledger while it is down at start.
func (n *Node) retryLedger(ctx context.Context) {
	t := time.NewTicker(n.cfg.LedgerRetry)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.fenced:
			return
		case <-t.C:
			if n.connectLedger(ctx, false) {
				return
			}
			select {
			case <-n.fenced: // the ledger refused this node: no more tries
				return
			default:
			}
		}
	}
}

// nodeReserver is the engine's Reserver: the ledger's when reached,
// unavailable before.
type nodeReserver Node

func (r *nodeReserver) reserver() (*flush.Reserver, error) {
	n := (*Node)(r)
	l := n.Ledger()
	if l == nil {
		return nil, fmt.Errorf("%w: the ledger has not been reached yet", flush.ErrUnavailable)
	}
	// NB: Timeout is the outer bound of every call: the engine bounds a
	// charge's wait shorter (ReserveTimeout) and its background calls with
	// this same --ledger-timeout.
	return &flush.Reserver{Ledger: l, Node: n.cfg.ID, Incarnation: n.wal.Incarnation(), Timeout: n.cfg.LedgerTimeout}, nil
}

func (r *nodeReserver) Reserve(ctx context.Context, req engine.ReserveRequest) (engine.ReserveResult, error) {
	rs, err := r.reserver()
	if err != nil {
		return engine.ReserveResult{}, err
	}
	return rs.Reserve(ctx, req)
}

func (r *nodeReserver) Release(ctx context.Context, account string, allocs []shard.Alloc, seq uint64) error {
	rs, err := r.reserver()
	if err != nil {
		return err
	}
	return rs.Release(ctx, account, allocs, seq)
}

// Settler is the node's settler, or nil before the ledger was reached.
func (n *Node) Settler() *flush.Settler {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.settler
}

// configRead is when this node last read its config snapshot from the
// ledger (plans, accounts, keys, route weights), zero if it has read none:
// changes made since are not enforced here.
func (n *Node) configRead() time.Time {
	if t := n.lastConfigRead(); !t.IsZero() {
		return t
	}
	// None read by this process: when an earlier one last read it, as kept
	// in the data dir with the snapshot (a node restarted with the ledger
	// down serves that snapshot, maybe days old; its age read as the time
	// since this start).
	return n.keptConfigRead
}

// lastConfigRead is when this process last read the config snapshot from
// the ledger (zero: never).
func (n *Node) lastConfigRead() time.Time {
	n.mu.Lock()
	r := n.refresher
	n.mu.Unlock()
	if r == nil {
		return time.Time{}
	}
	return r.LastSuccess()
}

// metaConfigRead keeps, in the data dir, when this node last read its
// config snapshot from the ledger (Unix ns), at most configReadKeepEvery
// behind.
const metaConfigRead = "node.config_read_at"

// configReadKeepEvery is how often the time of the last config read is
// written to the data dir (one synced write).
const configReadKeepEvery = time.Minute

// loadConfigRead reads the kept time of the last config read.
func (n *Node) loadConfigRead() {
	v, ok, err := n.wal.GetMeta(metaConfigRead)
	if err != nil || !ok || len(v) != 8 {
		return
	}
	n.keptConfigRead = time.Unix(0, int64(binary.BigEndian.Uint64(v)))
}

// keepConfigReadLoop writes the time of the last config read to the data
// dir every configReadKeepEvery while it moves, until ctx ends.
func (n *Node) keepConfigReadLoop(ctx context.Context) {
	t := time.NewTicker(configReadKeepEvery)
	defer t.Stop()
	var kept time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n.keepConfigRead(&kept)
	}
}

// keepConfigRead writes the last config read's time when it is later than
// kept.
func (n *Node) keepConfigRead(kept *time.Time) {
	last := n.lastConfigRead()
	if !last.After(*kept) {
		return
	}
	if err := n.wal.PutMeta(metaConfigRead, binary.BigEndian.AppendUint64(nil, uint64(last.UnixNano()))); err != nil {
		n.log.Debug("the time of the last config read could not be kept in the data dir", "err", err)
		return
	}
	*kept = last
}

// configStale says a config snapshot of age (or none, since the start that
// long ago) is older than a few failed refreshes: the status page marks it.
func (n *Node) configStale(age time.Duration) bool {
	return age > max(30*time.Second, 10*n.cfg.SnapshotInterval)
}

// SettleNow settles what is durable now (tests and shutdown).
func (n *Node) SettleNow(ctx context.Context) (int, error) {
	s := n.Settler()
	if s == nil {
		return 0, fmt.Errorf("%w: the ledger has not been reached", flush.ErrUnavailable)
	}
	return s.SettleOnce(ctx)
}

// reconcileLoop checks the ledger's counters against its event log every
// ReconcileInterval (at a random offset) and exports the number of
// differences for the alert rule; quotad reconcile names them. One node
// runs it (isReconciler): it reads the whole event log, and every node
// doing so every interval multiplied that load on the ledger by the size of
// the cluster. The others export 0 differences, so that the alert follows
// the node that runs it now.
func (n *Node) reconcileLoop(ctx context.Context) {
	every := n.cfg.ReconcileInterval
	t := time.NewTimer(time.Duration(rand.Int64N(int64(every))) + every/10)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		t.Reset(every)
		l := n.Ledger()
		if l == nil {
			continue
		}
		if !n.isReconciler() {
			n.metrics.reconcileDiffs.Set(0)
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, every/2)
		diffs := 0
		err := l.Reconcile(rctx, func(r flush.ReconcileRow) error {
			if r.Diff {
				diffs++
			}
			return nil
		})
		cancel()
		if err != nil {
			n.metrics.reconcileErrors.Inc()
			n.log.Warn("periodic reconcile failed", "err", err)
			continue
		}
		n.metrics.reconcileLast.SetToCurrentTime()
		n.metrics.reconcileDiffs.Set(float64(diffs))
		if diffs > 0 {
			n.log.Error("the ledger's counters differ from its event log; run quotad reconcile to see where", "differences", diffs)
		}
	}
}

// checkNotStale refuses a data dir in which a node found the ledger settled
// beyond what the dir held when it opened (flush.StaleDir): a copy older
// than the ledger, whose later records sit under sequence numbers the
// ledger settled for other charges. Whether the ledger is up or not: a
// start with it down served again from the copy's allowances, and a start
// with it up vouched for every record the dir holds now and marked the
// charges taken under reused numbers settled, dropping them.
func (n *Node) checkNotStale() error {
	sd, ok, err := flush.ReadStaleDir(n.wal)
	if err != nil {
		return fmt.Errorf("node: %w", err)
	}
	if !ok {
		return nil
	}
	return fmt.Errorf("node: refusing to start: %w", flush.StaleDirError(n.cfg.DataDir, sd))
}
