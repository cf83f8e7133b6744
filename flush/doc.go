// Package flush owns the ledger: the shared SQL store every node settles
// into, exactly once, and reserves from.
//
// # Pieces
//
//   - Ledger: the store, with two implementations that pass one conformance
//     suite (RunConformance): Postgres through pgx (production, and every
//     cluster of more than one host) and SQLite through modernc.org/sqlite
//     (pure Go; the embedded default for one machine, so quotad demo runs
//     with nothing installed). Migrations are embedded SQL applied under a
//     lock (Migrate; quotad migrate runs them alone).
//   - Settler: ships a node's durable log records to the ledger. Its loop is
//     a ticker with backoff around the exported synchronous step SettleOnce,
//     which tests call directly.
//   - Reserver: the engine's reservations, in the ledger.
//   - Refresher: reads the config snapshot every few seconds and hands it
//     to the engine, which keeps the last good one in the log.
//
// # Exactly once
//
// A node's records are numbered by its log; the ledger keeps, per (node,
// incarnation), the sequence settled so far. A settle of (prev, next] runs
// in one transaction that begins with
//
//	UPDATE nodes SET settled_seq = next WHERE node = $1 AND incarnation = $2 AND settled_seq = prev
//
// so applying the same batch twice (a commit whose reply was lost, a crash
// between the commit and the local mark) changes nothing the second time.
// Only after the commit does the node mark the range settled in its log and
// truncate it. A node whose data dir was wiped has a new incarnation and
// starts at sequence 1 without its records being taken for settled ones.
//
// # Order of a settle
//
//	log.Scan(prev, durable]  ──► Batch{charges, refunds}
//	Ledger.Settle(batch)      (one transaction, constant round trips)
//	engine.Settle(next)       (checkpoints + settled mark + DeleteRange, one synced batch)
//
// A failure before the ledger commits leaves everything as it was; after
// it, the retry finds the mark and skips to the local step.
package flush
