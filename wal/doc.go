// Package wal is a node's local log: the records of charges and refunds that
// are not yet settled into the ledger, a checkpoint per account, and a few
// meta values, all in one Pebble DB under the node's data dir.
//
// A record's payload is opaque bytes to wal (shard encodes it); wal frames
// it, numbers it, makes it durable, hands it to the settler in order, and
// deletes it once settled.
//
// # Usage
//
//	l, err := wal.Open(wal.Options{Dir: "/var/lib/quotad", NodeID: "node-1"})
//	if err != nil {
//		return err
//	}
//	defer l.Close()
//
//	seq, err := l.Append(record) // under the account's lock: fixes the order
//	if err != nil {
//		return err
//	}
//	// release the account's lock, then:
//	if err := l.WaitDurable(ctx, seq); err != nil {
//		return err // do not acknowledge the charge
//	}
//	// acknowledge the charge
//
//	// The settler ships (SettledSeq(), DurableSeq()] and then deletes it:
//	upto := l.DurableSeq()
//	err = l.Scan(l.SettledSeq(), upto, func(seq uint64, payload []byte) error {
//		return ship(seq, payload) // payload is valid only during the call
//	})
//	// ... once the ledger committed them:
//	err = l.Settle(upto, checkpoints)
//
// Example_settle shows the whole cycle, runnable.
//
// # Layout
//
// Every key starts with a one-byte prefix naming its kind. Every value is a
// frame that carries a version and a checksum of its body.
//
//	key                                        value
//	+-----+-----------------------------+
//	| 'r' | first seq, 8 bytes, BE      |  ->  a chunk of records (below)
//	+-----+-----------------------------+
//	| 'c' | account, bytes              |  ->  frame: seq (8 bytes, BE) | data
//	+-----+-----------------------------+
//	| 'm' | name, bytes                 |  ->  frame: meta value
//	+-----+-----------------------------+
//	| 'i' | uvarint len(account),       |  ->  frame: the id's value (kind 0:
//	|     | account, kind byte, id      |      the seq of the checkpoint that
//	+-----+-----------------------------+      wrote the account's ids)
//
//	chunk: the records of one commit, consecutive from the key's seq
//	+----------------+---------------------+---------+---------------------+---------+--
//	| count, uvarint | frame len, uvarint  | frame   | frame len, uvarint  | frame   | ...
//	+----------------+---------------------+---------+---------------------+---------+--
//
// One key per commit, not per record, so a commit of thousands of charges is
// one memtable insert: that halved the CPU per charge. A settle deletes the
// chunks that end at or before the settled mark; a chunk straddling it stays
// until the next settle, and scans skip its settled records.
//
//	frame
//	+---------+------------------------+-----------------+
//	| version | crc32c(body)           | body            |
//	| 1 byte  | 4 bytes, little-endian | the rest        |
//	| = 1     | Castagnoli polynomial  |                 |
//	+---------+------------------------+-----------------+
//
// Big-endian sequence numbers make Pebble's key order the sequence order, so
// a scan is one bounded iterator and a settle is one DeleteRange. The meta
// names wal owns start with "wal.": wal.node_id, wal.incarnation (128 random
// bits in hex, made when the dir is created), wal.settled_seq (8 bytes,
// big-endian) and wal.format (the layout version, 2). PutMeta stores other
// names, such as the last good config snapshot. Layout version 2 (chunks)
// replaced version 1 (a key per record); Open refuses a dir of another version.
//
// # Durability contract
//
//   - A record is durable, and may be acknowledged, only once WaitDurable for
//     its seq returned nil. Append never waits for an fsync.
//   - The committer goroutine is the only writer of records. It commits them
//     in sequence order, each batch with pebble.Sync.
//     A record appended during a commit goes into the next one.
//   - DurableSeq advances only after Pebble's Commit returned. Pebble shows a
//     write to readers before its fsync is done, so "what an iterator sees" is
//     not durable; Scan never reads past DurableSeq.
//   - A failed commit makes the log unusable: the waiters of its records and
//     every later Append and WaitDurable get an error naming the failure.
//     Pebble itself reports a failed WAL fsync through Logger.Fatalf; the
//     logger wal gives Pebble calls Options.Exit there and never returns,
//     since Pebble would otherwise report the failed fsync as a success.
//   - On-disk corruption that Pebble finds in a read (a garbled sstable) is
//     not fatal: Pebble's default would call Logger.Fatalf and exit with a
//     stack trace. wal logs it on one line and lets the read fail, so Open,
//     Scan, GetMeta and Checkpoints return one line wrapping ErrCorrupt that
//     names the damaged file and what to do.
//   - Settle, PutCheckpoints and PutMeta commit with pebble.Sync.
//   - Options.NoSync (benchmarks only) commits records without fsync; a
//     kill -9 then loses records whose WaitDurable returned nil.
//
// After a crash Pebble replays its WAL and drops a torn final batch, so Open
// finds a prefix of the committed batches: every record acknowledged before
// the crash, and possibly some records committed but never acknowledged
// (clients retry with an event id, and replay deduplicates). Open checks the
// frame of every unsettled record and that their sequence has no gap, and
// fails with an error wrapping ErrCorrupt (see IsCorrupt) that names the data
// dir and the sequence if not. The sequence resumes after
// max(last record, settled mark), so a settled seq is never reused.
//
// # Damage that looks like a torn tail
//
// Pebble stops replaying its WAL at the first record it cannot read. It
// calls that corruption only if a later intact chunk in a later 32 KiB block
// claims an fsync past it; damage in the last block of a WAL (all of a small
// WAL) is replayed as a torn tail, silently, without the acknowledged records
// after it. So the committer writes the seq through which records are durable
// into the file wal.durable beside Pebble's (frame: incarnation | seq, 8
// bytes, big-endian), after each commit returned and before any waiter is
// woken, without an fsync of its own (Settle and Close sync it; a kill -9
// keeps it anyway). Open reads it first and, if the dir has one, opens Pebble
// read-only to check that the log recovers at least through that seq; if
// not, it fails with an error wrapping ErrCorrupt that names the WAL file and
// the offset where it stops, and the dir is left as it was (a read-write
// Pebble open would flush the replayed prefix and drop the damaged WAL).
// A torn tail is a commit whose fsync never returned, so it is past the mark
// and recovers silently. A mark of another incarnation, or one that does not
// check, is logged and ignored; a dir without one (new, or from an older
// build) gets one at Open. With NoSync the mark only moves at Open.
//
// # Concurrency
//
// All methods of Log are safe for concurrent use. Append assigns sequence
// numbers in call order under one mutex; callers that need a per-account
// order call it under their own lock and wait outside it (early lock
// release). The mutex guards the queue of pending Pebble batches, which
// Append fills and the committer takes whole; the committer commits outside
// the mutex, so appends go on during an fsync and the next commit carries
// all of them (group commit). A commit holds at most MaxBatchBytes, and
// Append blocks while MaxPendingBytes are queued or being committed.
//
// The committer owns durableSeq; Settle (serialized by its own mutex) owns
// the settled mark. Close drains the queue, so the waiters of queued records
// get their answer, waits for the committer and for calls in progress, then
// closes Pebble.
package wal
