package wal

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// pendingBatch is a run of consecutive records waiting for the committer.
// It becomes one chunk: one Pebble key for the whole run (see doc.go), so a
// commit costs one memtable insert however many records it carries.
type pendingBatch struct {
	buf         []byte // the chunk's entries: uvarint frame length, frame
	first, last uint64 // sequence numbers of the first and last record
	n           int    // records
	bytes       int    // key and frame bytes of the records
}

// Append frames payload, assigns it the next sequence number (1, 2, 3, ... in
// call order) and queues it for the committer. It copies payload. It returns
// without waiting for an fsync: the record is durable only once
// WaitDurable(ctx, seq) returns nil, and must not be acknowledged before.
//
// Append blocks while MaxPendingBytes are queued. It fails if the log failed
// or Close began, or if payload is larger than MaxBatchBytes.
func (l *Log) Append(payload []byte) (seq uint64, err error) {
	if l.readOnly {
		return 0, errReadOnly(l.opts.Dir)
	}
	if len(payload) > l.opts.MaxBatchBytes {
		return 0, fmt.Errorf("wal: payload of %d bytes exceeds MaxBatchBytes (%d)",
			len(payload), l.opts.MaxBatchBytes)
	}
	crc := checksum(payload) // outside the lock: it reads the whole payload
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.waitSpaceLocked(); err != nil {
		return 0, err
	}
	return l.addLocked(payload, crc), nil
}

// addLocked assigns the next seq to payload and writes its key and frame
// into the tail batch of the queue.
func (l *Log) addLocked(payload []byte, crc uint32) uint64 {
	seq := l.lastSeq.Load() + 1
	size := recordKeyLen + frameHeaderLen + len(payload)
	pb := l.tailLocked(size)
	pb.buf = binary.AppendUvarint(pb.buf, uint64(frameHeaderLen+len(payload)))
	pb.buf = appendFrame(pb.buf, crc, payload)
	if pb.n == 0 {
		pb.first = seq
	}
	pb.last, pb.n, pb.bytes = seq, pb.n+1, pb.bytes+size
	l.pendingBytes += size
	l.lastSeq.Store(seq)
	l.work.Signal()
	return seq
}

// waitSpaceLocked blocks while MaxPendingBytes are pending, and returns an
// error if the log failed or is closing.
func (l *Log) waitSpaceLocked() error {
	for {
		if l.failure != nil {
			return l.failure
		}
		if l.closing {
			return ErrClosed
		}
		if l.pendingBytes < l.opts.MaxPendingBytes {
			return nil
		}
		l.appendWaits.Add(1)
		l.space.Wait()
	}
}

// tailLocked returns the batch to append a record of size bytes to: the last
// queued batch, or a new one if it would pass MaxBatchBytes.
func (l *Log) tailLocked(size int) *pendingBatch {
	if n := len(l.queue); n > 0 {
		if pb := l.queue[n-1]; pb.bytes+size <= l.opts.MaxBatchBytes {
			return pb
		}
	}
	pb := &pendingBatch{}
	if n := len(l.spare); n > 0 {
		pb.buf, l.spare = l.spare[n-1][:0], l.spare[:n-1]
	}
	l.queue = append(l.queue, pb)
	return pb
}

// run is the committer: the only goroutine that writes records to Pebble. It
// exits when Close has begun and the queue is empty, or after a failure.
func (l *Log) run() {
	defer close(l.done)
	for {
		pb := l.next()
		if pb == nil {
			return
		}
		if err := l.commit(pb); err != nil {
			l.fail(pb, err)
			return
		}
	}
}

// next waits for a batch and takes it off the queue; nil means stop.
func (l *Log) next() *pendingBatch {
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.queue) == 0 && !l.closing {
		l.work.Wait()
	}
	if len(l.queue) == 0 {
		return nil
	}
	pb := l.queue[0]
	l.queue[0] = nil
	l.queue = l.queue[1:]
	return pb
}

// commit commits pb outside the lock, then publishes it: the byte marks,
// then durableSeq, then the wake-up of waiters. Nothing is published before
// Commit returned.
func (l *Log) commit(pb *pendingBatch) error {
	start := time.Now()
	b := l.db.NewBatch()
	op := b.SetDeferred(recordKeyLen, uvarintLen(uint64(pb.n))+len(pb.buf))
	putRecordKey(op.Key, pb.first)
	copy(op.Value[binary.PutUvarint(op.Value, uint64(pb.n)):], pb.buf)
	_ = op.Finish() // only adds to a batch index; batches from NewBatch have none
	err := l.commitBatch(b)
	_ = b.Close() // returns the batch to Pebble's pool; never fails
	if err != nil {
		return err
	}
	took := time.Since(start)
	if !l.opts.NoSync {
		// Before any waiter is woken: an acknowledged record is always
		// within the mark, so the next Open can tell its loss from a torn
		// tail.
		l.writeMark(pb.last)
	}
	l.marks.add(pb.last, uint64(pb.bytes))
	l.durableSeq.Store(pb.last)
	l.wake()
	l.commits.Add(1)
	if !l.opts.NoSync {
		l.fsyncs.Add(1)
	}
	l.mu.Lock()
	l.pendingBytes -= pb.bytes
	if len(l.spare) < maxSpareBuffers && cap(pb.buf) <= 2*l.opts.MaxBatchBytes {
		l.spare = append(l.spare, pb.buf)
	}
	l.space.Broadcast()
	l.mu.Unlock()
	if l.opts.OnCommit != nil {
		l.opts.OnCommit(pb.n, pb.bytes, took)
	}
	return nil
}

// writeMark writes seq into the durable mark. A failure loses evidence, not
// records: the mark keeps an older seq, which makes the next Open less
// strict, never wrong. It is logged once.
func (l *Log) writeMark(seq uint64) {
	if err := l.mark.write(seq); err != nil {
		if !l.mark.failed {
			l.mark.failed = true
			l.log.Error("cannot write the durable mark; a damaged log may then go unnoticed at the next start",
				"file", l.mark.path, "err", err)
		}
		return
	}
	l.mark.failed = false
}

// commitBatch calls Commit, turning the panic of pebbleLogger.Fatalf into an
// error. That panic happens only when Options.Exit returned (tests): in
// production Exit ends the process inside Fatalf.
func (l *Log) commitBatch(b *pebble.Batch) (err error) {
	defer recoverFatal(&err)
	return b.Commit(l.writeOpts)
}

// recoverFatal, deferred, turns a fatalError panic into *err and lets any
// other panic go on.
func recoverFatal(err *error) {
	if r := recover(); r != nil {
		fe, ok := r.(fatalError)
		if !ok {
			panic(r)
		}
		*err = fe
	}
}

// fail makes the log unusable after the commit of pb failed: the queue is
// dropped, and every waiter and every later call gets an error naming the
// failure.
func (l *Log) fail(pb *pendingBatch, cause error) {
	err := fmt.Errorf("wal: commit of records %d..%d in %s failed, log unusable: %w",
		pb.first, pb.last, l.opts.Dir, cause)
	l.log.Error("commit failed", "first", pb.first, "last", pb.last, "err", cause)
	l.mu.Lock()
	l.failure = err
	l.stopLocked(err)
	l.queue = nil
	l.pendingBytes = 0
	l.space.Broadcast()
	l.mu.Unlock()
	l.wake()
}

// maxSpareBuffers bounds the chunk buffers kept for reuse.
const maxSpareBuffers = 4

// uvarintLen is the length of v's uvarint encoding.
func uvarintLen(v uint64) int {
	n := 1
	for ; v >= 0x80; v >>= 7 {
		n++
	}
	return n
}
