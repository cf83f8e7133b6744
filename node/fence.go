package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/quotaring/quotaring/flush"
)

// Two processes as one node id.
//
// A node refuses to start while the ledger heard from its id moments ago
// (checkNodeIDFree), but two processes that start within seconds of each
// other (a Deployment of two replicas given one --node-id, a copy of a
// data dir started beside the original) both pass that check, and then
// charge the same accounts twice and free each other's reservations. So
// each process names itself in the ledger when it registers
// (flush.Ledger.RecordStart), and every fenceEvery checks that the latest
// process to start as its id is itself. The one that started first finds
// the other's name, says so, and stops (Fenced, StopFenced): it takes no
// charge any more and hands nothing back (the reservations under the id
// are the other process's now), and settles what its log holds. A process
// that started while the ledger was down, and so never checked, checks as
// a starting one does when it first reaches the ledger, and stops the same
// way if another process runs as its id.

// fenceEvery is how often a node checks that it is still the latest
// process started as its id.
const fenceEvery = flush.HeartbeatEvery

// ErrFenced is StopFenced's error: another process runs as this node id.
var ErrFenced = errors.New("another process started as this node id after this one")

// startToRecord is what the ledger records of this process when the
// settler registers: on the first registration only, so that a node whose
// ledger came back after another process started as its id does not
// overwrite that process's start and make it stop instead.
func (n *Node) startToRecord() flush.NodeStart {
	if n.startRecorded.Load() {
		return flush.NodeStart{}
	}
	return flush.NodeStart{Build: n.build.Short(), Process: n.process}
}

// Fenced is closed when a process that started after this one runs as its
// node id: call StopFenced (quotad serve does, and exits 1).
func (n *Node) Fenced() <-chan struct{} { return n.fenced }

// fenceLoop checks, every fenceEvery while the ledger is reached, that the
// latest process started as this node id is this one.
func (n *Node) fenceLoop(ctx context.Context) {
	t := time.NewTicker(fenceEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.fenced:
			return
		case <-t.C:
		}
		l := n.Ledger()
		if l == nil || !n.startRecorded.Load() {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		last, err := l.LastStart(cctx, n.cfg.ID)
		cancel()
		if err != nil {
			continue // the settler reports the ledger's errors
		}
		n.fenceChecks.Add(1)
		if last.Process == "" || last.Process == n.process {
			continue
		}
		n.fence("another process started as this node id after this one: this one stops taking charges and exits; "+
			"two processes with one --node-id charge the same accounts twice and free each other's reservations. "+
			"Give each process a --node-id of its own (a StatefulSet's pod names, not a Deployment's shared config)",
			"other_process_incarnation", last.Incarnation, "other_process_build", last.Build)
	}
}

// fence makes this node own nothing from now on, logs why (once), and
// closes Fenced; StopFenced then returns ErrFenced.
func (n *Node) fence(why string, attrs ...any) { n.fenceWith(ErrFenced, why, attrs...) }

// fenceWith is fence with the error StopFenced returns.
func (n *Node) fenceWith(cause error, why string, attrs ...any) {
	n.fenceOnce.Do(func() {
		n.fenceCause = cause
		n.leaving.Store(true)
		n.log.Error(why, append(attrs, "this_incarnation", n.wal.Incarnation())...)
		close(n.fenced)
	})
}

// StopFenced stops a node that Fenced: it takes no charge any more, cuts
// its connections, settles what its log holds (within ctx), and hands
// nothing back, since the reservations under its id are the other
// process's now. It returns ErrFenced, with the settle's error if any.
func (n *Node) StopFenced(ctx context.Context) error {
	n.draining.Store(true)
	n.leaving.Store(true)
	n.stopServersNow()
	n.stopLoops()
	cause := ErrFenced
	select {
	case <-n.fenced: // fenceCause was written before fenced closed
		if n.fenceCause != nil {
			cause = n.fenceCause
		}
	default: // stopped as fenced without being fenced: say the usual
	}
	var err error
	if !errors.Is(cause, errWrongLedger) { // NB: not into a ledger that is not the cluster's
		err = n.finalSettle(ctx)
	}
	n.closeAll()
	if err != nil {
		return fmt.Errorf("node %s: %w; %w", n.cfg.ID, cause, err)
	}
	return fmt.Errorf("node %s: %w", n.cfg.ID, cause)
}
