package flush

// Served retries and debts by node (events.served_by and events.owed; see
// Batch). served_by names the nodes whose retries, charged while the event
// stood billed, count as served again under it (one entry per retry); owed
// names the nodes whose late charges the event is owed (one entry per debt:
// the refund of a retry another node charged, settled before that charge).
// A late charge pays back only its own node's debt, and another node's
// attempt's refund counts off only that node's served retry: counted on one
// number, node X's late charge paid node Y's debt (and Y's failed retry then
// took the event over, billed), and X's served retry was cancelled by Y's
// debt (and the event's own refund then un-billed it).
//
// served_again stays the net count (len(served_by) - len(owed)), so that
// rows of older builds, which have no names, keep working: what
// served_again holds beyond the names (unnamed) is an older build's count,
// served retries (above zero) that any attempt's refund counts off, or
// debts (below zero) that any late charge pays and that keep every charge
// from taking the event over, as before. The served retries standing
// (standing: what the rules that keep a refund pending read) are
// served_again + len(owed).

import (
	"encoding/json"
	"fmt"
	"slices"
)

// againRow is an event's served_again with its names.
type againRow struct {
	served         int64 // served_again
	servedBy, owed []string
}

// unnamed is served_again's part that no name accounts for (an older
// build's): above zero served retries, below zero debts.
func (a againRow) unnamed() int64 {
	return a.served - int64(len(a.servedBy)) + int64(len(a.owed))
}

// standing is the count of retries served under the event.
func (a againRow) standing() int64 { return a.served + int64(len(a.owed)) }

// decodeNodes reads SQLite's events.served_by or events.owed (a JSON array
// of node ids).
func decodeNodes(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var out []string
	err := json.Unmarshal([]byte(s), &out)
	return out, err
}

// encodeNodes writes SQLite's events.served_by or events.owed.
func encodeNodes(nodes []string) string {
	if len(nodes) == 0 {
		return "[]"
	}
	b, _ := json.Marshal(nodes)
	return string(b)
}

// takeOne removes one entry of node from nodes; false: there is none.
func takeOne(nodes []string, node string) ([]string, bool) {
	i := slices.Index(nodes, node)
	if i < 0 {
		return nodes, false
	}
	return slices.Delete(slices.Clone(nodes), i, i+1), true
}

// decode reads SQLite's served_by and owed into a.
func (a *againRow) decode(servedBy, owed string) error {
	var err error
	if a.servedBy, err = decodeNodes(servedBy); err != nil {
		return fmt.Errorf("served_by: %w", err)
	}
	if a.owed, err = decodeNodes(owed); err != nil {
		return fmt.Errorf("owed: %w", err)
	}
	return nil
}

// refunded is served_again once the event is refunded: no served retries
// (served_by empties), its debts still owed.
func (a againRow) refunded() int64 {
	return min(a.served-int64(len(a.servedBy)), -int64(len(a.owed)))
}
