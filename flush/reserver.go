package flush

import (
	"context"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
)

// Reserver gives an engine its reservations from the ledger, as node.
type Reserver struct {
	Ledger Ledger
	Node   string
	// Incarnation is the node's log's incarnation: with the seq of the
	// record that zeroed an allowance, the key that makes its release apply
	// once (ReleaseKey).
	Incarnation string
	// Timeout bounds one call (default 2 s), whatever its context's
	// deadline. quotad serve sets it to --ledger-timeout; the engine bounds
	// a charge's wait for a reservation itself (engine.Options.ReserveTimeout,
	// 2 s) and its background calls with its LedgerTimeout.
	Timeout time.Duration
}

var _ engine.Reserver = (*Reserver)(nil)

func (r *Reserver) timeout() time.Duration {
	if r.Timeout <= 0 {
		return 2 * time.Second
	}
	return r.Timeout
}

// Reserve implements engine.Reserver.
func (r *Reserver) Reserve(ctx context.Context, req engine.ReserveRequest) (engine.ReserveResult, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout())
	defer cancel()
	res, err := r.Ledger.Reserve(ctx, r.Node, ReserveRequest{Account: req.Account, Wall: time.Unix(0, req.Wall).UTC(), Need: req.Need})
	if err != nil {
		return engine.ReserveResult{}, err
	}
	return engine.ReserveResult{Granted: res.Granted, Exhausted: res.Exhausted, HeldElsewhere: res.HeldElsewhere}, nil
}

// Release implements engine.Reserver.
func (r *Reserver) Release(ctx context.Context, account string, allocs []shard.Alloc, seq uint64) error {
	ctx, cancel := context.WithTimeout(ctx, r.timeout())
	defer cancel()
	key := ReleaseKey{}
	if seq != 0 {
		key = ReleaseKey{Incarnation: r.Incarnation, Seq: seq}
	}
	return r.Ledger.Release(ctx, r.Node, account, allocs, key)
}
