package shard

// idWindow remembers ids for a time window and up to a count, forgetting the
// oldest first. It keeps insertion order in a queue, so eviction is O(1)
// amortised; walls are assumed to arrive in (roughly) increasing order, and an
// id that arrives with an older wall than the queue's tail is simply kept a
// little longer.
type idWindow[V any] struct {
	m    map[string]entry[V]
	q    []string // insertion order; q[head:] are live
	head int
}

type entry[V any] struct {
	wall int64
	v    V
}

// get finds id if it was put less than window before now. (expire may not
// have dropped an older id yet when walls arrived out of order.)
func (w *idWindow[V]) get(id string, now, window int64) (V, bool) {
	e, ok := w.m[id]
	if ok && now-e.wall >= window {
		var zero V
		return zero, false
	}
	return e.v, ok
}

func (w *idWindow[V]) len() int { return len(w.m) }

// put adds id at wall, or renews it (an expired id charged again) in place:
// it stays where it was in the queue, which only delays the expiry of ids
// behind it.
func (w *idWindow[V]) put(id string, wall int64, v V) {
	if w.m == nil {
		w.m = make(map[string]entry[V])
	}
	if _, ok := w.m[id]; !ok {
		w.q = append(w.q, id)
	}
	w.m[id] = entry[V]{wall: wall, v: v}
}

// update replaces the value of a remembered id, keeping its wall.
func (w *idWindow[V]) update(id string, v V) {
	if e, ok := w.m[id]; ok {
		w.m[id] = entry[V]{wall: e.wall, v: v}
	}
}

// expire forgets ids older than window before now, and the oldest beyond max.
func (w *idWindow[V]) expire(now, window int64, max int) {
	for w.head < len(w.q) {
		id := w.q[w.head]
		e, ok := w.m[id]
		if ok && now-e.wall < window && len(w.m) <= max {
			break
		}
		delete(w.m, id)
		w.q[w.head] = ""
		w.head++
	}
	// Compact once the dead prefix is at least half of the queue.
	if w.head > 0 && w.head*2 >= len(w.q) {
		n := copy(w.q, w.q[w.head:])
		clear(w.q[n:])
		w.q, w.head = w.q[:n], 0
	}
}

// each calls fn in insertion order.
func (w *idWindow[V]) each(fn func(id string, wall int64, v V)) {
	for _, id := range w.q[w.head:] {
		if e, ok := w.m[id]; ok {
			fn(id, e.wall, e.v)
		}
	}
}
