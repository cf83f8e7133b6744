package ring

import (
	"slices"
	"sync"
)

// Change tells a subscriber how this node's partitions moved. A subscriber
// keeps a set of owned partitions, starting empty, and applies each Change
// in order: first remove Lost, then add Gained. The set then always equals
// the partitions this node owns on the ring of Epoch.
//
// Lost and Gained are ascending. Lost only names partitions the set holds,
// and Gained only partitions it does not hold once Lost is removed. A
// partition can be in both: it was lost and regained within one coalesced
// Change (another node may have owned it in between), so the subscriber must
// drop its state for that partition and start it again.
type Change struct {
	Epoch  uint64
	Gained []int
	Lost   []int
}

// diffChange returns the Change from old to new for node id.
func diffChange(old, new *Table, id string) Change {
	c := Change{Epoch: new.Epoch()}
	for p := range new.layout.PartitionCount {
		was := ownerID(old, p) == id
		is := ownerID(new, p) == id
		switch {
		case was && !is:
			c.Lost = append(c.Lost, p)
		case is && !was:
			c.Gained = append(c.Gained, p)
		}
	}
	return c
}

func ownerID(t *Table, p int) string {
	if m, ok := t.OwnerOfPartition(p); ok {
		return m.ID
	}
	return ""
}

// compose returns the single Change equivalent to a followed by b, keeping
// every loss: a partition lost in either and owned again at the end is in
// both Lost and Gained.
//
//	Lost   = a.Lost ∪ (b.Lost \ a.Gained)
//	Gained = b.Gained ∪ (a.Gained \ b.Lost)
//
// A partition gained in a and lost in b never reached the subscriber, so it
// is in neither.
func compose(a, b Change) Change {
	return Change{
		Epoch:  b.Epoch,
		Lost:   union(a.Lost, minus(b.Lost, a.Gained)),
		Gained: union(b.Gained, minus(a.Gained, b.Lost)),
	}
}

// union and minus work on ascending slices and return ascending slices.
func union(a, b []int) []int {
	out := make([]int, 0, len(a)+len(b))
	out = append(out, a...)
	out = append(out, b...)
	slices.Sort(out)
	out = slices.Compact(out)
	if len(out) == 0 {
		return nil
	}
	return out
}

func minus(a, b []int) []int {
	var out []int
	for _, p := range a {
		if _, found := slices.BinarySearch(b, p); !found {
			out = append(out, p)
		}
	}
	return out
}

// subscriber is one Subscribe call. Its channel has one sender, the ring's
// rebuild goroutine (and Subscribe itself for the first Change), always
// under Ring.subMu, which also guards closing it.
type subscriber struct {
	ch        chan Change
	closeOnce sync.Once
}

// deliver hands c to the subscriber without blocking. When the channel is
// full it takes back every Change still queued, composes them with c into
// one, and queues that: the subscriber falls behind in granularity, never in
// correctness, and the ring never waits for it.
//
// REQUIRES: Ring.subMu held (single sender).
func (s *subscriber) deliver(c Change) {
	select {
	case s.ch <- c:
		return
	default:
	}
	var merged Change
	first := true
drain:
	for {
		select {
		case old := <-s.ch:
			if first {
				merged, first = old, false
			} else {
				merged = compose(merged, old)
			}
		default:
			break drain
		}
	}
	if first {
		merged = c
	} else {
		merged = compose(merged, c)
	}
	// The channel is empty now (we are its only sender and just drained it),
	// so this cannot block; the default case is unreachable.
	select {
	case s.ch <- merged:
	default:
	}
}

func (s *subscriber) close() {
	s.closeOnce.Do(func() { close(s.ch) })
}
