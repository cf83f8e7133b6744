package engine

import (
	"encoding/binary"
	"fmt"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// recover rebuilds the accounts: last good snapshot, checkpoints, then the
// records above each account's checkpoint.
func (e *Engine) recover() error {
	data, ok, err := e.log.GetMeta(metaSnapshot)
	if err != nil {
		return fmt.Errorf("engine: read the kept snapshot: %w", err)
	}
	var s *snapshot.Snapshot
	if ok {
		// NB: the kept snapshot is a cache of the ledger's config, not a
		// record: one this build cannot read (a newer build wrote it, and
		// the node was rolled back) is left out, and the node starts as on
		// a new dir, ready once it reads the config from the ledger. The
		// start refused, telling to move the data dir aside, unsettled
		// records and all.
		if s, err = snapshot.Decode(data); err != nil {
			e.opts.Logger.Warn("the config snapshot kept in the data dir does not decode (a newer quotad wrote it, or the file is damaged: err says which): starting without it; "+
				"this node serves once it reads the config from the ledger, which writes a good copy again (nothing to remove by hand)", "dir", e.log.Dir(), "err", err)
			s = nil
		}
	}
	if s != nil {
		e.snap.Store(s)
		e.kept.Store(true)
		mark, ok, err := e.log.GetMeta(metaSnapshotSettled)
		if err != nil {
			return fmt.Errorf("engine: read the kept snapshot's settled mark: %w", err)
		}
		if ok && len(mark) == 8 {
			e.snapSettled.Store(binary.BigEndian.Uint64(mark))
			e.keptMarkKnown = true
		}
	}
	if err := e.log.Checkpoints(e.restore); err != nil {
		return fmt.Errorf("engine: restore checkpoints: %w", err)
	}
	var rec shard.Record
	err = e.log.Scan(e.log.SettledSeq(), e.log.DurableSeq(), func(seq uint64, payload []byte) error {
		if err := rec.Decode(payload); err != nil {
			return fmt.Errorf("%w: record %d in %s: %v", wal.ErrCorrupt, seq, e.log.Dir(), err)
		}
		ent := e.recoveredEntry(rec.Account)
		if seq > ent.acct.LastSeq {
			ent.acct.ApplyRecord(seq, &rec, &e.params)
			ent.dirty = true
		}
		ent.noteRefund(seq, &rec, e.params.Reservations) // unsettled: a hand-back or a reservation waits for it too
		return nil
	})
	if err != nil {
		return fmt.Errorf("engine: replay: %w", err)
	}
	e.countKeptSnapshot()
	return nil
}

// countKeptSnapshot configures, from the kept snapshot, the accounts whose
// every record here is at or below the mark kept with it: its settled use
// counts for them (use another owner settled while the account was away).
// Not for an account with records above the mark, checkpointed or
// replayed: the mark is a lower bound (read before the ledger), and the
// snapshot may count those records already (a settle the ledger committed
// whose local half a crash cut off), or lack a refund among them. See
// recoveredEntry, and SetSnapshot's UseBehind.
func (e *Engine) countKeptSnapshot() {
	s := e.snap.Load()
	if s == nil || !e.keptMarkKnown {
		return
	}
	mark := e.snapSettled.Load()
	for i := range e.stripes {
		for id, ent := range e.stripes[i].accounts {
			if ent.acct.LastSeq > mark {
				continue
			}
			if cfg, ok := s.AccountConfig(id); ok {
				ent.acct.Configure(cfg)
			}
		}
	}
}

func (e *Engine) restore(cp wal.Checkpoint) error {
	ent := e.recoveredEntry(cp.Account)
	if err := ent.acct.RestoreCheckpoint(cp.Data); err != nil {
		return fmt.Errorf("%w: in %s: %v", wal.ErrCorrupt, e.log.Dir(), err)
	}
	if cp.IDsStale {
		ent.acct.RewriteIDs() // stored with another checkpoint: replaced at the next
		ent.dirty = true
		return nil
	}
	if len(cp.IDs) == 0 {
		return nil
	}
	ids := make([]shard.StoredID, len(cp.IDs))
	for i, id := range cp.IDs {
		ids[i] = shard.StoredID{Kind: id.Kind, ID: id.ID, Value: id.Value}
	}
	if err := ent.acct.RestoreIDs(ids); err != nil {
		return fmt.Errorf("%w: in %s: %v", wal.ErrCorrupt, e.log.Dir(), err)
	}
	return nil
}

// recoveredEntry finds or makes the entry for an account found in the log,
// configured from the snapshot if it has the account (the state is kept even
// if the account is gone from the config: its records still settle). The
// snapshot's settled use does not raise the account's (UseBehind): it was
// read at some settled mark, and a checkpoint or records past it may hold a
// refund whose charge it counts (a restart counted refunded units again for
// the rest of the month); restore lets it count where the mark, kept with
// the snapshot, says it is newer. A node's first refresh counts it anyway.
func (e *Engine) recoveredEntry(account string) *entry {
	st := e.stripeFor(account)
	if ent, ok := st.accounts[account]; ok {
		return ent
	}
	cfg := shard.AccountConfig{ID: account}
	if s := e.snap.Load(); s != nil {
		if c, ok := s.AccountConfig(account); ok {
			cfg = c
		}
	}
	cfg.UseBehind = true
	// reseed: the use restored may count what another owner refunded while
	// the account was away (its state is kept on disk when Forget drops
	// it); the snapshots read after this that include all its records set
	// it (armReseed).
	ent := &entry{acct: shard.NewAccount(cfg)}
	e.armReseed(ent)
	st.accounts[account] = ent
	return ent
}
