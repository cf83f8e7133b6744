package engine

import (
	"context"
	"fmt"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// Settle is called once the ledger holds every record up to upto: it writes
// a checkpoint of each account that changed since its last one, then the
// log keeps the settled mark and drops the records up to upto, in one synced
// batch.
//
// A checkpoint may include records above upto (the account kept charging);
// recovery replays only records above each account's checkpoint. It is
// written only once every record it includes is durable: a checkpoint must
// never remember a charge (or a client id) whose record could still be lost.
func (e *Engine) Settle(ctx context.Context, upto uint64) error {
	e.ckptMu.Lock() // see storeForgotten
	defer e.ckptMu.Unlock()
	cps, maxSeq, broken := e.checkpoints()
	if broken != nil {
		// Its state in memory holds a change its log refused: checkpointed,
		// a restart would count a charge never logged nor billed (and
		// remember its id as served); left out, this settle would drop
		// the records that only the checkpoint carried. The log keeps every
		// record until a restart replays them.
		e.redirty(cps)
		e.opts.Logger.Error("an account's state is ahead of its log: nothing more is settled from this log until the node restarts; restart it (the log replays the account)",
			"err", broken)
		return fmt.Errorf("engine: settle to %d: %w; restart the node", upto, broken)
	}
	if err := e.log.WaitDurable(ctx, maxSeq); err != nil {
		e.redirty(cps)
		return fmt.Errorf("engine: settle to %d: wait for checkpointed records: %w", upto, err)
	}
	if err := e.log.Settle(upto, cps); err != nil {
		e.redirty(cps)
		return fmt.Errorf("engine: settle to %d: %w", upto, err)
	}
	e.settledMu.Lock()
	e.wakeSettleWaitersLocked()
	e.settledMu.Unlock()
	return nil
}

// SettleFailed is the settler's report that a settle of the log failed
// (the ledger down, refusing, timing out): a charge waiting for a refund
// of its account to settle (waitSettled) answers at once, rather than when
// its wait for a reservation runs out.
func (e *Engine) SettleFailed(err error) {
	e.settledMu.Lock()
	e.settleFails++
	e.settleErr = err
	e.wakeSettleWaitersLocked()
	e.settledMu.Unlock()
}

// wakeSettleWaitersLocked wakes every waitSettled. REQUIRES: settledMu.
func (e *Engine) wakeSettleWaitersLocked() {
	if e.settled != nil {
		close(e.settled)
		e.settled = nil
	}
}

// waitSettled waits until the log is settled through seq, asking the
// settler to settle now (Options.SettleSoon), until a settle fails
// (SettleFailed), or until ctx ends.
func (e *Engine) waitSettled(ctx context.Context, seq uint64) error {
	e.settledMu.Lock()
	fails0 := e.settleFails
	e.settledMu.Unlock()
	for {
		e.settledMu.Lock()
		if e.settled == nil {
			e.settled = make(chan struct{})
		}
		ch, fails, lastErr := e.settled, e.settleFails, e.settleErr
		e.settledMu.Unlock()
		if e.log.SettledSeq() >= seq { // NB: read after taking ch, so a Settle between the two closes it
			return nil
		}
		if fails != fails0 {
			// Perhaps a settle that began before the one asked for; the
			// caller's retry waits again, for a settle of its own.
			return fmt.Errorf("a settle of the log failed: %w", lastErr)
		}
		if e.opts.SettleSoon != nil {
			e.opts.SettleSoon()
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-e.ctx.Done():
			return ErrClosed
		}
	}
}

// checkpoints collects the changed accounts' states and clears their dirty
// marks, and takes the states Forget kept of dropped accounts (unless the
// account is back in memory: its own state is the one to keep then).
func (e *Engine) checkpoints() (_ []wal.Checkpoint, _ uint64, broken error) {
	// The forgotten first: an account back in memory since has a state new
	// since Forget (from the config snapshot), and the ids stored for the
	// state forgotten are not its own; its checkpoint below, in the same
	// write, replaces them all. (Taken after it, a crash before the next
	// settle restored the forgotten ids under the new state's mark.)
	cps, maxSeq := e.takeForgotten()
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for id, ent := range st.accounts {
			if ent.broken != nil && broken == nil {
				broken = ent.broken // see Settle
			}
			if !ent.dirty {
				continue
			}
			ent.dirty = false
			cps = append(cps, checkpointOf(id, ent.acct))
			maxSeq = max(maxSeq, ent.acct.LastSeq)
		}
		st.mu.Unlock()
	}
	return cps, maxSeq, broken
}

// checkpointOf is acct's checkpoint for the next settle: its state, and
// the ids it remembers that changed since its last one (all of them, over
// what is stored, after a failed write or a restore). REQUIRES: the
// account's stripe lock held.
func checkpointOf(id string, acct *shard.Account) wal.Checkpoint {
	cp := wal.Checkpoint{Account: id, Seq: acct.LastSeq, Data: acct.AppendCheckpointState(nil)}
	cp.ResetIDs = acct.DrainIDs(func(s shard.StoredID) {
		cp.IDs = append(cp.IDs, wal.CheckpointID{Kind: s.Kind, ID: s.ID, Value: s.Value})
	})
	return cp
}

// takeForgotten takes the states Forget kept of accounts not back in
// memory; for one back, it marks its own state to write all its ids.
func (e *Engine) takeForgotten() (cps []wal.Checkpoint, maxSeq uint64) {
	e.forgotMu.Lock()
	forgotten := e.forgotten
	e.forgotten = nil
	e.forgotMu.Unlock()
	for id, cp := range forgotten {
		st := e.stripeFor(id)
		st.mu.Lock()
		ent, back := st.accounts[id]
		if back {
			ent.acct.RewriteIDs()
			ent.dirty = true
		}
		st.mu.Unlock()
		if !back {
			cps = append(cps, cp)
			maxSeq = max(maxSeq, cp.Seq)
		}
	}
	return cps, maxSeq
}

// storeForgotten writes the states Forget kept at once, rather than at the
// next settle that moves records (an idle log moves none for long): a
// crash before it brought back the dropped ids, and an account regained
// answered Replayed to a retry its other owner had refunded since. Their
// records are settled (Forget waits for that), so durable. ckptMu keeps a
// settle that took the account's state before Forget from writing it
// (and its ids) after the drop.
func (e *Engine) storeForgotten() {
	e.ckptMu.Lock()
	defer e.ckptMu.Unlock()
	cps, _ := e.takeForgotten()
	if len(cps) == 0 {
		return
	}
	if err := e.log.PutCheckpoints(cps); err != nil {
		e.redirty(cps) // the next settle tries again
		e.opts.Logger.Warn("storing the state of accounts let go failed; the next settle tries again", "accounts", len(cps), "err", err)
	}
}

// redirty marks accounts whose checkpoint was not written as changed again,
// and keeps the states of forgotten ones for the next try.
func (e *Engine) redirty(cps []wal.Checkpoint) {
	for _, cp := range cps {
		st := e.stripeFor(cp.Account)
		st.mu.Lock()
		ent, ok := st.accounts[cp.Account]
		if ok {
			ent.dirty = true
			ent.acct.RewriteIDs() // the changes this checkpoint drained are not stored
		}
		st.mu.Unlock()
		if !ok {
			e.keepForgotten(cp, false) // NB: a state Forget kept since is newer
		}
	}
}

// keepForgotten keeps cp, the state of an account no longer in memory, for
// the next settle to checkpoint; over one kept before only if replace.
func (e *Engine) keepForgotten(cp wal.Checkpoint, replace bool) {
	e.forgotMu.Lock()
	defer e.forgotMu.Unlock()
	if _, kept := e.forgotten[cp.Account]; kept && !replace {
		return
	}
	if e.forgotten == nil {
		e.forgotten = make(map[string]wal.Checkpoint)
	}
	e.forgotten[cp.Account] = cp
}
