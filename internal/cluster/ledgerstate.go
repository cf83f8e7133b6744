package cluster

import (
	"context"
	"fmt"

	"github.com/quotaring/quotaring/flush"
)

// ReadLedger reads what the checkers need from the ledger: the event log and
// grants of the given accounts, reconcile, the nodes' settled marks and the
// reservations held.
func ReadLedger(ctx context.Context, l flush.Ledger, accounts []string) (*LedgerState, error) {
	st := &LedgerState{Events: map[string][]flush.EventRow{}, Grants: map[string][]flush.GrantRow{}}
	for _, a := range accounts {
		evs, err := l.Events(ctx, a)
		if err != nil {
			return nil, fmt.Errorf("cluster: events of %s: %w", a, err)
		}
		if len(evs) > 0 {
			st.Events[a] = evs
		}
		gs, err := l.Grants(ctx, a)
		if err != nil {
			return nil, fmt.Errorf("cluster: grants of %s: %w", a, err)
		}
		if len(gs) > 0 {
			st.Grants[a] = gs
		}
	}
	var err error
	if st.Reconcile, err = flush.ReconcileRows(ctx, l); err != nil {
		return nil, fmt.Errorf("cluster: reconcile: %w", err)
	}
	if st.Nodes, err = l.Nodes(ctx); err != nil {
		return nil, fmt.Errorf("cluster: nodes: %w", err)
	}
	if st.Reservations, err = l.Reservations(ctx); err != nil {
		return nil, fmt.Errorf("cluster: reservations: %w", err)
	}
	return st, nil
}
