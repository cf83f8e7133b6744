package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
)

// announceTimeout bounds the wait for the "draining" announcement to go out.
const announceTimeout = 3 * time.Second

// Shutdown stops the node gracefully (see the package doc). It returns an
// error when the final settle failed: the records stay in the log for the
// next start.
func (n *Node) Shutdown(ctx context.Context) error {
	t0 := time.Now()
	n.draining.Store(true)
	r := n.Ring()
	// The last node standing keeps its accounts through the drain: nobody
	// could take them over, and a request cut off at the drain timeout is
	// refunded by the account's owner, which would be nobody ("refund
	// failed: the charge stands"). It stops taking connections all the
	// same, and announces draining after.
	last := r != nil && n.lastServing(r)
	if r != nil && !last {
		n.announceDraining(ctx, r)
	}
	n.drain(ctx)
	if last {
		n.announceDraining(ctx, r)
	}
	var errs []error
	// The hand-back and the final settle share --settle-timeout, and all
	// the ledger work ends early enough to leave the ring and close within
	// ctx (quotad serve's budget): against a ledger that hangs, each step
	// took its own bound, and then closing waited on the ledger too (1m34s
	// of a 40 s budget, past the pod's grace period).
	wctx, wcancel := ledgerWorkContext(ctx)
	defer wcancel()
	sctx, scancel := context.WithTimeout(wctx, n.cfg.SettleTimeout)
	defer scancel()
	n.releaseAll(sctx)
	n.stopLoops()
	n.reachAtStop(sctx)
	settleErr := n.finalSettle(sctx)
	if settleErr != nil {
		errs = append(errs, settleErr)
	} else {
		n.releaseStranded(wctx)
		n.markStopped(wctx)
	}
	if r != nil {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := r.Leave(lctx); err != nil && !errors.Is(err, ring.ErrLeft) {
			n.log.Warn("leaving the ring", "err", err)
		}
		cancel()
	}
	errs = append(errs, n.closeAll())
	n.log.Info("stopped", "took", time.Since(t0).Round(time.Millisecond), "final_settle_ok", settleErr == nil)
	return errors.Join(errs...)
}

// stopReserve is what the ledger work of a shutdown leaves of the
// caller's deadline for what comes after it: leaving the ring, closing the
// ledger (at most 2 s: flush.Postgres.Close) and the log.
const stopReserve = 5 * time.Second

// ledgerWorkContext is ctx ending stopReserve before ctx's deadline, if
// it has one.
func ledgerWorkContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok {
		return context.WithDeadline(ctx, d.Add(-stopReserve))
	}
	return context.WithCancel(ctx)
}

// announceDraining tells the ring this node drains: it owns nothing more.
// Best effort, and bounded: when every peer is going away too (the whole
// cluster drained at once), nobody is left to take the broadcast, and
// waiting on it with ctx ate the whole budget and left an expired context
// for the settle and the releases.
func (n *Node) announceDraining(ctx context.Context, r *ring.Ring) {
	n.drainTable.Store(r.Table()) // what it owned: see drainOwns
	n.leaving.Store(true)
	actx, cancel := context.WithTimeout(ctx, announceTimeout)
	defer cancel()
	if err := r.SetState(actx, ring.StateDraining); err != nil {
		n.log.Warn("could not announce draining", "err", err)
	}
}

// lastServing reports whether no other member serves in this node's view.
func (n *Node) lastServing(r *ring.Ring) bool {
	for _, id := range r.View().Serving {
		if id != n.cfg.ID {
			return false
		}
	}
	return true
}

// releaseAll hands every reservation back so the new owners find the units
// free, unless the ledger looks down (a call to it failed, or has waited
// --ledger-timeout for its answer): then the node keeps them (its log
// replays them at the next start, and the ledger still holds them for it),
// rather than zeroing them here and stranding them there. It gets a
// quarter of SettleTimeout, out of ctx (the settle phase's): it had all of
// it, and then a slow ledger left the final settle, which matters more, a
// few seconds of the shutdown's budget (quotad serve's drain + settle +
// 10 s). What it could not hand back, releaseStranded frees once the log
// is settled.
func (n *Node) releaseAll(ctx context.Context) {
	s := n.Settler()
	if n.eng == nil || s == nil || !s.Healthy() {
		n.log.Warn("the ledger looks down: keeping this node's reservations for its next start")
		return
	}
	rctx, cancel := context.WithTimeout(ctx, n.cfg.SettleTimeout/4)
	defer cancel()
	if err := n.eng.ReleaseAll(rctx); err != nil {
		n.log.Warn("handing back reservations failed; they return at the next start or with quotad revoke", "err", err)
	}
}

// releaseStranded frees whatever this node still holds in the ledger once
// its log is settled: units of reservations whose commit reply was lost (a
// slow ledger: the node never learned it held them), that a top-up got
// after releaseAll, or that releaseAll kept because the ledger looked down
// (it was back by the final settle), could not hand back, or left queued
// until a refund settled (engine.Engine.Release). The engine is
// closed first, so nothing reserves or spends any more.
//
// Every allowance left in the log is zeroed, durably, before the ledger
// frees the node's reservations, as at start (resetReservations): freed
// first, a restart with the ledger out of reach would serve from
// allowances in its log that the ledger no longer backs, while other nodes
// reserve the same units. Zeroed first, a stop before the free strands the
// units in the ledger until the next start frees them, which is safe. The
// zeroing records are settled after, so that the log ends settled.
func (n *Node) releaseStranded(ctx context.Context) {
	l := n.Ledger()
	if l == nil || n.eng == nil {
		return
	}
	n.eng.Close() // stops top-ups; closeAll's Close is then a no-op
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	held := n.eng.AllowanceHeld()
	if err := n.eng.ZeroAllowances(rctx); err != nil {
		n.log.Warn("could not zero this node's allowances in its log; its reservations stay in the ledger until its next start or quotad revoke", "err", err)
		return
	}
	freed, err := l.ReleaseNode(rctx, n.cfg.ID)
	if err != nil {
		n.log.Warn("could not free what this node still holds in the ledger; it returns at its next start or with quotad revoke", "err", err)
		return
	}
	var units int64
	for _, f := range freed {
		units += f.Units
	}
	if units > 0 {
		n.log.Info("freed the reservations this node still held (kept while the ledger looked down, lost commit replies, late top-ups, hand-backs waiting for a refund to settle)",
			"units", units, "grants", len(freed), "allowance_zeroed", held)
	}
	// Settled whenever anything is left unsettled, not only when units
	// were held: an allowance below zero (a refund of an older version
	// taken back in the final settle, engine.Engine.TakeBack) is zeroed
	// too, and its record was left unsettled after the drain when the
	// sum read zero or less (quotad chaos --seed 12: SEQ, "1 records
	// durable but not settled after the final drain").
	if s := n.Settler(); s != nil && n.wal.DurableSeq() > n.wal.SettledSeq() {
		if _, err := s.SettleOnce(rctx); err != nil {
			n.log.Warn("could not settle the log's last records (allowances zeroed); the next start settles them", "err", err)
		}
	}
}

// markStopped tells the ledger that this incarnation stopped with nothing
// unsettled, once the engine is closed and its log settled, so that the
// months it was heard from in are final without it coming back (a node
// scaled down for good held its last month's billing back, and quotad
// prune's). Best effort: without the mark such a month waits for the node,
// or for an operator, as before.
func (n *Node) markStopped(ctx context.Context) { n.markStoppedOn(ctx, n.Ledger()) }

// markStoppedOn is markStopped on the ledger l (nil: none reached).
func (n *Node) markStoppedOn(ctx context.Context, l flush.Ledger) {
	if l == nil || n.wal == nil || n.wal.DurableSeq() != n.wal.SettledSeq() {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ok, err := l.NodeStopped(sctx, n.cfg.ID, n.wal.Incarnation(), n.process, n.wal.SettledSeq())
	switch {
	case err != nil:
		n.log.Warn("could not record in the ledger that this node stopped with everything settled; its last month waits for it to come back to be final", "err", err)
	case !ok:
		n.log.Warn("the ledger's settled mark of this node differs from its log's, or another process started as this node since; not recording a clean stop", "settled_seq", n.wal.SettledSeq())
	}
}

// drain stops taking requests and waits for in-flight ones.
func (n *Node) drain(ctx context.Context) {
	dctx, cancel := context.WithTimeout(ctx, n.cfg.DrainTimeout)
	defer cancel()
	if n.httpSrv != nil {
		if err := n.httpSrv.Shutdown(dctx); err != nil {
			n.cutOff(ctx)
		}
	}
	if n.grpcSrv != nil {
		done := make(chan struct{})
		go func() { n.grpcSrv.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-dctx.Done():
			n.grpcSrv.Stop()
		}
	}
}

// cutOffWait bounds the wait for requests cut off at the drain timeout to
// refund their charges.
const cutOffWait = 5 * time.Second

// cutOff ends the requests still running when --drain-timeout ran out.
// Shutdown alone leaves their handlers running while the node settles and
// exits, so a request cut off mid-upstream stayed billed with nobody told.
// Closing the connections cancels their contexts: the upstream calls fail
// and the front refunds them (unless --bill-on always); this waits for that,
// within cutOffWait, and says what happened.
func (n *Node) cutOff(ctx context.Context) {
	left := n.httpInflight.Load()
	n.log.Warn("the drain timeout ran out: cutting off the requests still running; their charges are refunded as their upstream calls fail",
		"requests", left, "drain_timeout", n.cfg.DrainTimeout, "what_to_do", "raise --drain-timeout above your slowest upstream request")
	n.cutHTTP(router.ErrCutOff) // NB: first, so that the front tells this from clients that left
	n.httpSrv.Close()
	wctx, cancel := context.WithTimeout(ctx, cutOffWait)
	defer cancel()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for n.httpInflight.Load() > 0 {
		select {
		case <-wctx.Done():
			n.log.Error("requests cut off at the drain timeout did not finish: their charges stand (billed)", "requests", n.httpInflight.Load())
			return
		case <-t.C:
		}
	}
	n.log.Info("the requests cut off at the drain timeout have finished", "requests", left)
}

// stopLoops stops the settle and refresh loops and the node's goroutines.
func (n *Node) stopLoops() {
	n.cancel()
	n.mu.Lock()
	s, rf := n.settler, n.refresher
	n.mu.Unlock()
	if s != nil {
		s.Close()
	}
	if rf != nil {
		rf.Close()
	}
	n.wg.Wait()
}

// reachAtStop is the last try at a ledger this process has not reached
// (it was down at the start), once the background tries have stopped, so
// that the final settle has one to settle into. A ledger back moments
// before the stop (a node scaled down right after an outage; a first try
// still waiting out the node id's lease when the drain cancelled it) left
// every record this process took in its data dir, which nothing may start
// again, and its reservations held. It takes the same checks as any late
// reach (the node id free, no earlier incarnation holding units, the
// peers' ledger), within ctx, and starts no loop: finalSettle and
// releaseStranded use the ledger, and closeAll closes it.
func (n *Node) reachAtStop(ctx context.Context) {
	if n.wal == nil || n.Settler() != nil || n.ledgerRefused.Load() != nil || n.wal.DurableSeq() == n.wal.SettledSeq() {
		return
	}
	select {
	case <-n.fenced:
		return
	default:
	}
	n.log.Info("stopping with the ledger never reached since the start: trying it once more for the final settle",
		"unsettled", n.wal.DurableSeq()-n.wal.SettledSeq())
	p, err := n.reachPeersLedger(ctx, false)
	if err != nil {
		n.log.Warn("the ledger could not be used at the stop either", "err", err)
		return
	}
	n.startRecorded.Store(true)
	n.ledger.Store(&ledgerBox{l: p.l})
	n.mu.Lock()
	n.settler = p.settler
	n.mu.Unlock()
}

// finalSettle settles everything durable, within ctx (Shutdown's settle
// phase) and SettleTimeout.
func (n *Node) finalSettle(ctx context.Context) error {
	if n.wal == nil {
		return nil
	}
	s := n.Settler()
	left := n.wal.DurableSeq() - n.wal.SettledSeq()
	if s == nil {
		if left == 0 {
			return nil
		}
		if refused := n.ledgerRefused.Load(); refused != nil {
			// NB: the conflict's own text is logged, and returned by
			// StopFenced as its cause; this names it only.
			err := fmt.Errorf("node: final settle: none, the ledger was reached and refused this data dir (%w); %d records stay in %s, unsettled, and never settle from it: "+
				"quotad reconcile --data-dir %s tells the ones the ledger billed already from the ones to bill by hand", flush.ErrMarkConflict, left, n.cfg.DataDir, n.cfg.DataDir)
			n.log.Error("final settle: none; the ledger refused this data dir (settled mark conflict)", "unsettled", left, "data_dir", n.cfg.DataDir)
			return err
		}
		return fmt.Errorf("node: final settle: the ledger was never reached; %d records stay in %s for the next start", left, n.cfg.DataDir)
	}
	sctx, cancel := context.WithTimeout(ctx, n.cfg.SettleTimeout)
	defer cancel()
	if _, err := s.SettleOnce(sctx); err != nil {
		left = n.wal.DurableSeq() - n.wal.SettledSeq()
		if errors.Is(err, flush.ErrMarkConflict) {
			// NB: not "for the next start": the dir never settles (a start
			// on it is refused where the settler recorded so).
			n.log.Error("final settle: refused by the ledger (settled mark conflict); the records stay in the log and never settle from it",
				"unsettled", left, "data_dir", n.cfg.DataDir, "err", err)
			return fmt.Errorf("node: final settle refused, %d records stay in %s and never settle from it: quotad reconcile --data-dir %s tells "+
				"the ones the ledger billed already from the ones to bill by hand: %w", left, n.cfg.DataDir, n.cfg.DataDir, err)
		}
		n.log.Error("final settle failed; the records stay in the log for the next start", "unsettled", left, "err", err)
		return fmt.Errorf("node: final settle failed, %d records stay in %s for the next start: %w", left, n.cfg.DataDir, err)
	}
	n.log.Info("final settle done", "settled_seq", n.wal.SettledSeq())
	return nil
}

// closeAll closes everything that is open, in reverse order of opening.
func (n *Node) closeAll() error {
	var errs []error
	if n.admin != nil {
		n.admin.Close()
	}
	if n.router != nil {
		n.router.Close()
	}
	if r := n.Ring(); r != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := r.Close(ctx); err != nil && !errors.Is(err, ring.ErrClosed) {
			errs = append(errs, err)
		}
		cancel()
	}
	if n.eng != nil {
		n.eng.Close()
	}
	if n.wal != nil {
		errs = append(errs, n.wal.Close())
	}
	if l := n.Ledger(); l != nil {
		l.Close()
	}
	for _, l := range []interface{ Close() error }{n.lis.rpc, n.lis.http, n.lis.admin} {
		if l != nil {
			l.Close()
		}
	}
	return errors.Join(errs...)
}

// abort undoes a Start that failed half way.
func (n *Node) abort() {
	n.stopLoops()
	n.stopServersNow()
	n.closeAll()
}

// abortStart undoes a Start that failed. One that failed after it
// registered with the ledger (joining the ring, serving) records a clean
// stop when its log is settled, as a stopped node does: otherwise the
// ledger knew an incarnation heard from and never stopped, the next node
// to start waited for it as for a running peer, and its months were not
// final until an operator named it lost.
func (n *Node) abortStart() {
	n.stopLoops()
	n.stopServersNow()
	if n.eng != nil {
		n.eng.Close() // nothing is appended to the log from here on
	}
	n.markStopped(context.Background())
	n.closeAll()
}

// stopServersNow closes the RPC and HTTP servers without waiting for the
// calls in flight.
func (n *Node) stopServersNow() {
	if n.grpcSrv != nil {
		n.grpcSrv.Stop()
	}
	if n.httpSrv != nil {
		n.httpSrv.Close()
	}
}

// Kill stops the node abruptly, without draining or settling: the records
// stay in the log (tests of crash recovery in one process).
func (n *Node) Kill() {
	n.abort()
}
