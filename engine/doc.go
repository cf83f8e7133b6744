// Package engine is the owner of accounts on one node: lock-striped tables of
// shard.Account, the wal they log to, and the clock.
//
// It is the thin driver around the pure shard package (as raft's node.go is
// around raft.go): shard decides, engine holds the locks, reads the clock,
// logs, waits, and talks to the ledger for reservations.
//
// # A charge
//
//	lock the account's stripe
//	  decision, record := account.Charge(req, clock.Now())
//	  seq := log.Append(record)        // queued, in per-account order
//	unlock                             // early lock release
//	log.WaitDurable(seq)               // group commit: one fsync for many charges
//	answer
//
// A charge is acknowledged only after its record is durable (G2). A crash
// before that loses only unanswered charges; a kill -9 can leave one record
// durable that was never acknowledged, which is why clients retry with an
// event id and replay deduplicates. A Replayed answer waits for its own
// record (a replay, logged after the original).
//
// # Ownership of state
//
// Accounts are partitioned by a hash of their id over Stripes stripes; each
// stripe's mutex protects its accounts and its scratch record. Nothing else
// touches an Account. The snapshot pointer and counters are atomics. Engine
// starts one goroutine (the reservation top-up loop, when a Reserver is
// set), stopped by Close.
//
// # Recovery
//
// Open loads the last good config snapshot from the log's meta, restores each
// account's checkpoint, and replays the records above it. Settle (called by
// the settler after the ledger committed a batch) writes checkpoints of the
// accounts that changed and truncates the log.
//
// # Reservations
//
// With Options.Reserver set, hard-limited accounts spend only what the ledger
// reserved for this node (shard.Params.Reservations). A charge whose account
// lacks allowance asks the Reserver once, logs what it got, and decides
// again; when about half of an account's last reservation is spent, a
// background loop tops it up, so steady traffic never waits for the ledger.
//
// A refund's units go back to the grant in the ledger when its record
// settles, never to the allowance: only the ledger knows whether a refund
// counted (two owners can refund one event during a handoff), so units
// credited here first could be spent twice. A charge that lacks units while
// a refund of its account is unsettled waits for that settle
// (Options.SettleSoon asks for it) before it asks for a reservation.
//
// # Clocks
//
// A decision reads Clock once: a wall reading, which names the month, and a
// monotonic one, which refills buckets (G9). SystemClock is the real one;
// SteadyClock wraps it so that a step of the wall clock does not carry the
// node into another month until its caller confirmed the step (the node
// checks with the ledger's clock); ManualClock is the tests'.
package engine
