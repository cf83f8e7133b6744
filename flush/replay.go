package flush

// Replays in the ledger. An owner answers a retry of a client id it has
// charged with Replayed: billed once, served again. The HTTP front may then
// refund the first attempt (RefundAttempt: its upstream failed) while the
// replayed retry was served, and that refund must not un-bill the event. The
// owner knows, and keeps the refund pending; but when the refund reaches the
// account's next owner (the account moved), only the ledger can tell. So
// the owner logs every replay (Delta 1) and every replay taken back (Delta
// -1: the retry's own upstream failed), and the ledger counts them on the
// event as served retries (served_again), the same count the retries that
// other owners charged and served keep: an attempt's refund is kept while it
// is above zero (and applies when the last is taken back), and a replay that
// settles after the event was refunded bills it again.

import (
	"fmt"

	"github.com/quotaring/quotaring/shard"
)

// Replay is a settled replay record (shard.RecReplay), or the replay taken
// back that a released refund carries (shard.Record.Released).
type Replay struct {
	Seq     uint64
	Account string
	EventID string       // the ledger's id (shard.LedgerEventID)
	Period  shard.Period // the charge's
	Wall    int64        // Unix ns
	// Delta is 1 for a retry answered Replayed (served, unless taken back
	// later), -1 for one taken back.
	Delta int64
	// Origin: the node that answered the replay, when it is not the
	// batch's (the account moved before the replay was taken back).
	Origin string
	// Released: the take-back that released its charge's pending refund at
	// the node that answered it. That refund follows in the batch and
	// applies by itself: this one only counts the replay off.
	Released bool
}

// replayRow is what settling a replay reads of the event's row.
type replayRow struct {
	refunded, tombstone, pending bool
	servedAgain                  int64
	node                         string
	refundWall                   *int64 // Unix ns; nil: none (an attempt's refund, or none)
}

// replayOutcome is what a replay did to the event.
type replayOutcome uint8

const (
	replayCounted  replayOutcome = iota // served_again moved; billing unchanged
	replayBilled                        // the refunded event is billed again (the replay was served)
	replayRefunded                      // the last replay taken back released the pending refund
	replayCovered                       // nothing: a refund decided after the replay covers it
)

// decideReplay works out the event's next state; node is the batch's. It is
// the rule both ledgers apply:
//
//   - A replay (1) of an event billed, or refunded with a take-back counted
//     ahead of it (served_again < 0), is one served retry more. Of an event
//     an attempt's refund un-billed (no refund_wall, or one decided before
//     the replay), it bills the event again; of the tombstone that the
//     refund of this node's attempt left through another owner (refund
//     pending, node_id this node), it bills the event in the tombstone's
//     place. Either way that refund is pending again, as if the replay had
//     settled before it. An event's own refund decided after the replay
//     covers it.
//   - A replay taken back (-1) is one served retry less (below zero on a
//     refunded event: the replay itself has not settled yet). When it was
//     the last and the event's attempt's refund was pending, that refund
//     applies, unless the batch's refund record applies it (Released).
func decideReplay(row replayRow, r *Replay, node string) (replayRow, replayOutcome) {
	next := row
	if r.Delta < 0 {
		next.servedAgain--
		if !row.refunded && row.servedAgain == 1 && row.pending && !r.Released {
			next.refunded, next.pending, next.servedAgain = true, false, 0
			return next, replayRefunded
		}
		return next, replayCounted
	}
	switch {
	case !row.refunded || row.servedAgain < 0:
		next.servedAgain++
		return next, replayCounted
	case !row.tombstone && (row.refundWall == nil || r.Wall > *row.refundWall),
		row.tombstone && row.pending && row.node == node:
		// Billed for the replay, a served retry; the attempt's refund that
		// un-billed it waits for its take-back (pending) as if the replay
		// had settled first.
		next.refunded, next.tombstone, next.pending, next.refundWall = false, false, true, nil
		next.servedAgain = row.servedAgain + 1
		return next, replayBilled
	}
	return next, replayCovered
}

// rebill adds back an event a replay billed again: its units (and, for a
// tombstone that was never billed, its request).
func (p *settlePlan) rebill(account string, ev refundedEvent, requests int64) {
	p.addUsage(account, ev.key, ev.route, dayOf(ev.chargeWall), ev.units, requests)
	p.addGrants(account, ev.allocs, 1, 0)
}

func validReplay(r *Replay) error {
	if r.Account == "" || r.EventID == "" || (r.Delta != 1 && r.Delta != -1) {
		return fmt.Errorf("replay seq %d (account %q, event %q): want account and event id set and a delta of 1 or -1", r.Seq, r.Account, r.EventID)
	}
	return nil
}
