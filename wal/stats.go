package wal

import (
	"sort"
	"sync"
)

// Stats is a snapshot of a log's counters.
type Stats struct {
	Records      uint64 // durable records not yet settled
	Bytes        uint64 // approximate key and frame bytes of those records
	LastSeq      uint64 // last sequence number assigned
	DurableSeq   uint64 // records through this one are durable
	SettledSeq   uint64 // records through this one are settled and deleted
	PendingBytes uint64 // bytes queued for, or being committed by, the committer
	Commits      uint64 // record batches committed since Open
	Fsyncs       uint64 // record batches committed with pebble.Sync since Open
	AppendWaits  uint64 // times an Append blocked on MaxPendingBytes
}

// Stats returns the log's counters. The fields are read one by one, so they
// may be slightly inconsistent with each other under load.
func (l *Log) Stats() Stats {
	l.mu.Lock()
	pending := l.pendingBytes
	l.mu.Unlock()
	durable, settled := l.durableSeq.Load(), l.settledSeq.Load()
	return Stats{
		Records:      durable - min(settled, durable),
		Bytes:        l.marks.unsettled(),
		LastSeq:      l.lastSeq.Load(),
		DurableSeq:   durable,
		SettledSeq:   settled,
		PendingBytes: uint64(pending),
		Commits:      l.commits.Load(),
		Fsyncs:       l.fsyncs.Load(),
		AppendWaits:  l.appendWaits.Load(),
	}
}

// maxMarks bounds the memory of byteMarks when the log is not settled for a
// long time (the ledger is down): past it, every other mark is dropped, which
// only coarsens the estimate.
const maxMarks = 1024

// mark says that the records through seq hold cum bytes since the settled
// mark.
type mark struct{ seq, cum uint64 }

// byteMarks estimates the bytes of unsettled records from the bytes of each
// commit, without reading them back at settle time.
type byteMarks struct {
	mu sync.Mutex // protects marks
	// marks[0] is the settled point, with cum 0; seq and cum increase.
	marks []mark
}

// reset starts the marks at the settled point.
func (m *byteMarks) reset(settled uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.marks = []mark{{seq: settled}}
}

// add records that the records through seq added bytes.
func (m *byteMarks) add(seq, bytes uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	last := m.marks[len(m.marks)-1]
	if seq <= last.seq {
		return
	}
	m.marks = append(m.marks, mark{seq: seq, cum: last.cum + bytes})
	if len(m.marks) > maxMarks {
		m.thinLocked()
	}
}

// thinLocked drops every other mark, keeping the first and the last.
func (m *byteMarks) thinLocked() {
	kept := m.marks[:1]
	for i := 2; i < len(m.marks)-1; i += 2 {
		kept = append(kept, m.marks[i])
	}
	m.marks = append(kept, m.marks[len(m.marks)-1])
}

// settle moves the settled point to upto.
func (m *byteMarks) settle(upto uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	base := m.atLocked(upto)
	i := sort.Search(len(m.marks), func(i int) bool { return m.marks[i].seq > upto })
	rest := m.marks[i:]
	m.marks = make([]mark, 0, len(rest)+1)
	m.marks = append(m.marks, mark{seq: upto})
	for _, mk := range rest {
		m.marks = append(m.marks, mark{seq: mk.seq, cum: mk.cum - base})
	}
}

// atLocked estimates cum at seq by interpolating between marks.
func (m *byteMarks) atLocked(seq uint64) uint64 {
	i := sort.Search(len(m.marks), func(i int) bool { return m.marks[i].seq >= seq })
	if i == len(m.marks) {
		return m.marks[len(m.marks)-1].cum
	}
	if i == 0 || m.marks[i].seq == seq {
		return m.marks[i].cum
	}
	lo, hi := m.marks[i-1], m.marks[i]
	frac := float64(seq-lo.seq) / float64(hi.seq-lo.seq)
	return lo.cum + uint64(frac*float64(hi.cum-lo.cum))
}

// unsettled returns the estimated bytes after the settled point.
func (m *byteMarks) unsettled() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.marks[len(m.marks)-1].cum
}
