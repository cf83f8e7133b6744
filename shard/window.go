package shard

import (
	"cmp"
	"slices"
)

// idWindow remembers ids for a time window and up to a count, forgetting the
// oldest first. It keeps insertion order in a queue, so eviction is O(1)
// amortised; walls are assumed to arrive in (roughly) increasing order, and an
// id that arrives with an older wall than the queue's tail is simply kept a
// little longer.
//
// It also tracks what changed since its ids were last stored apart from the
// account's checkpoint (drain): the ids put, updated or dropped, or, when
// all is set, that every id must be written again over whatever is stored.
type idWindow[V any] struct {
	m    map[string]entry[V]
	q    []string // insertion order; q[head:] are live
	head int

	changed map[string]struct{} // ids changed since the last drain (unless all)
	all     bool                // the stored ids are unknown: rewrite them all
}

// touch notes that id changed since the last drain.
func (w *idWindow[V]) touch(id string) {
	if w.all {
		return
	}
	if w.changed == nil {
		w.changed = make(map[string]struct{})
	}
	w.changed[id] = struct{}{}
}

// rewriteAll makes the next drain rewrite every id, over whatever was
// stored: after a drain whose write failed, or a restore from a checkpoint
// that held the ids inline (or whose ids stored apart are not its own).
func (w *idWindow[V]) rewriteAll() {
	w.all, w.changed = true, nil
}

// drain calls fn for each id changed since the last drain: with its wall and
// value, or present false for one dropped. With all set it calls fn for
// every id, and reports reset: whatever was stored is to be dropped first.
// It then forgets what changed.
func (w *idWindow[V]) drain(fn func(id string, wall int64, v V, present bool)) (reset bool) {
	if w.all {
		w.each(func(id string, wall int64, v V) { fn(id, wall, v, true) })
		w.all = false
		return true
	}
	for id := range w.changed {
		e, ok := w.m[id]
		fn(id, e.wall, e.v, ok)
	}
	w.changed = nil
	return false
}

// restore adds ids read back from storage, which come in any order: it
// sorts them by wall, so that expire drops the oldest first, and marks
// nothing changed.
func (w *idWindow[V]) restore(ids []string, walls []int64, vs []V) {
	order := make([]int, len(ids))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(walls[a], walls[b]) })
	all, changed := w.all, w.changed
	for _, i := range order {
		w.put(ids[i], walls[i], vs[i])
	}
	w.all, w.changed = all, changed
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
	w.touch(id)
}

// update replaces the value of a remembered id, keeping its wall.
func (w *idWindow[V]) update(id string, v V) {
	if e, ok := w.m[id]; ok {
		w.m[id] = entry[V]{wall: e.wall, v: v}
		w.touch(id)
	}
}

// expire forgets ids older than window before now, and the oldest beyond max.
func (w *idWindow[V]) expire(now, window int64, max int) { w.expireFn(now, window, max, nil) }

// expireFn is expire, calling dropped (when not nil) with each id it forgets.
func (w *idWindow[V]) expireFn(now, window int64, max int, dropped func(id string, wall int64, v V)) {
	for w.head < len(w.q) {
		id := w.q[w.head]
		e, ok := w.m[id]
		if ok && now-e.wall < window && len(w.m) <= max {
			break
		}
		if ok {
			delete(w.m, id)
			w.touch(id)
			if dropped != nil {
				dropped(id, e.wall, e.v)
			}
		}
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
