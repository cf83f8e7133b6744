package chaos

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
)

// holdsWait bounds the wait for every node's reservations to agree with
// the ledger's once the logs are settled: a hand-back waiting for its
// refunds to settle goes out at the next second's retry, and a top-up the
// last charges asked for may still be on its way.
const holdsWait = 15 * time.Second

// readHolds reads what each running node holds reserved and what the
// ledger reserves for it, again until they agree or holdsWait passes, and
// returns the last reading for CheckReservations to judge (RES). The
// final drain frees all a node holds in the ledger, so a reservation
// stranded while the node ran shows here only. nil when nothing could be
// read (noted in the report).
func (h *harness) readHolds(ctx context.Context) []cluster.NodeHold {
	ctx, cancel := context.WithTimeout(ctx, holdsWait)
	defer cancel()
	var last []cluster.NodeHold
	var lastErr error
	_ = cluster.Poll(ctx, 200*time.Millisecond, func() (bool, error) {
		holds, err := h.holdsOnce(ctx)
		if err != nil {
			lastErr = err
			return false, nil
		}
		last, lastErr = holds, nil
		for _, x := range holds {
			if !x.Agrees() {
				return false, nil
			}
		}
		return true, nil
	})
	if last == nil {
		h.note("the nodes' reservations before the drain could not be read: %v", lastErr)
	}
	var disagree []string
	for _, x := range last {
		if !x.Agrees() {
			disagree = append(disagree, x.Node)
		}
	}
	if len(disagree) > 0 {
		h.keepHoldEvidence(ctx, disagree)
	}
	return last
}

// keepHoldEvidence writes, for each node whose reservations disagree with
// the ledger's, what both sides show per account before the drain erases
// it: the node's status page (each owned account's grants, with the units
// its allowance holds as "reserved") and the ledger's reservation rows of
// the node, to NODE-status.html and NODE-reservations.txt in the run's dir.
func (h *harness) keepHoldEvidence(ctx context.Context, nodes []string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	rs, err := h.ledger.Reservations(ctx)
	if err != nil {
		h.note("the ledger's reservations could not be kept for %v: %v", nodes, err)
		return
	}
	for _, node := range nodes {
		for _, n := range h.c.Nodes {
			if n.ID != node || !n.Running() {
				continue
			}
			if _, body, err := n.AdminGet(ctx, "/status"); err == nil {
				_ = os.WriteFile(filepath.Join(h.dir, node+"-status.html"), []byte(body), 0o644)
			}
		}
		var b strings.Builder
		fmt.Fprintf(&b, "# the ledger's reservations of %s before the drain: account grant units\n", node)
		for _, r := range rs {
			if r.Node == node && r.Units != 0 {
				fmt.Fprintf(&b, "%s %s %d\n", r.Account, r.Grant, r.Units)
			}
		}
		_ = os.WriteFile(filepath.Join(h.dir, node+"-reservations.txt"), []byte(b.String()), 0o644)
		h.note("%s's reservations disagree with the ledger's before the drain: its status page and the ledger's rows are kept in %s (%s-status.html, %s-reservations.txt)", node, h.dir, node, node)
	}
}

// holdsOnce is one reading: each running node's metrics, then the
// ledger's reservations.
func (h *harness) holdsOnce(ctx context.Context) ([]cluster.NodeHold, error) {
	var holds []cluster.NodeHold
	for _, n := range h.c.Nodes {
		if !n.Running() {
			continue
		}
		code, body, err := n.AdminGet(ctx, "/metrics")
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("answered %d", code)
		}
		if err != nil {
			return nil, fmt.Errorf("%s /metrics: %w", n.ID, err)
		}
		held, ok1 := cluster.MetricValue(body, "quotaring_reservations_held_units")
		doubt, ok2 := cluster.MetricValue(body, "quotaring_reservations_uncertain_units")
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%s /metrics has no quotaring_reservations_held_units or quotaring_reservations_uncertain_units (a quotad of another build?)", n.ID)
		}
		holds = append(holds, cluster.NodeHold{Node: n.ID, Held: int64(held), Uncertain: int64(doubt)})
	}
	rs, err := h.ledger.Reservations(ctx)
	if err != nil {
		return nil, fmt.Errorf("the ledger's reservations: %w", err)
	}
	for i := range holds {
		for _, r := range rs {
			if r.Node == holds[i].Node {
				holds[i].Ledger += r.Units
			}
		}
	}
	return holds, nil
}
