package chaos

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
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
// the ledger's, what both sides show per grant before the drain erases
// it, and notes the grants that differ: the node's status page (each
// owned account's grants, with the units its allowance holds as
// "reserved") to NODE-status.html, and the node's answer of GET
// /admin/v1/reservations (the ledger's rows beside the allowances it
// holds, of every account it has state for) to NODE-reservations.txt.
func (h *harness) keepHoldEvidence(ctx context.Context, nodes []string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	for _, node := range nodes {
		for _, n := range h.c.Nodes {
			if n.ID != node || !n.Running() {
				continue
			}
			if _, body, err := n.AdminGet(ctx, "/status"); err == nil {
				_ = os.WriteFile(filepath.Join(h.dir, node+"-status.html"), []byte(body), 0o644)
			}
			diff, table, err := holdsByGrant(ctx, n)
			if err != nil {
				h.note("%s's reservations disagree with the ledger's before the drain, and its own could not be read grant by grant: %v", node, err)
				continue
			}
			_ = os.WriteFile(filepath.Join(h.dir, node+"-reservations.txt"), []byte(table), 0o644)
			more := ""
			if len(diff) > 10 {
				diff, more = diff[:10], fmt.Sprintf(" and %d more", len(diff)-10)
			}
			h.note("%s's reservations disagree with the ledger's before the drain; the grants that differ (account grant: ledger, node): %s%s. Its status page and both sides' rows are kept in %s (%s-status.html, %s-reservations.txt)",
				node, strings.Join(diff, "; "), more, h.dir, node, node)
		}
	}
}

// holdsByGrant reads node n's GET /admin/v1/reservations and returns the
// grants where the ledger's reservation of n and n's allowance differ
// ("account grant: ledger L, node N"), and a table of both for every
// grant either side has.
func holdsByGrant(ctx context.Context, n *cluster.Node) (diff []string, table string, err error) {
	code, body, err := n.AdminGet(ctx, "/admin/v1/reservations")
	if err == nil && code != http.StatusOK {
		err = fmt.Errorf("answered %d: %.200s", code, body)
	}
	if err != nil {
		return nil, "", fmt.Errorf("%s /admin/v1/reservations: %w", n.ID, err)
	}
	type row struct {
		Node, Account, Grant string
		Units                int64
	}
	var ans struct {
		Reservations []row
		HeldHere     []row `json:"held_here"`
		InDoubtHere  int64 `json:"in_doubt_here"`
	}
	if err := json.Unmarshal([]byte(body), &ans); err != nil {
		return nil, "", fmt.Errorf("%s /admin/v1/reservations: %w", n.ID, err)
	}
	type key struct{ account, grant string }
	ledger, held := map[key]int64{}, map[key]int64{}
	for _, r := range ans.Reservations {
		if r.Node == n.ID {
			ledger[key{r.Account, r.Grant}] += r.Units
		}
	}
	for _, r := range ans.HeldHere {
		held[key{r.Account, r.Grant}] += r.Units
	}
	keys := slices.Collect(maps.Keys(ledger))
	for k := range held {
		if _, ok := ledger[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b key) int { return cmp.Or(cmp.Compare(a.account, b.account), cmp.Compare(a.grant, b.grant)) })
	var b strings.Builder
	fmt.Fprintf(&b, "# %s before the drain, per grant: account grant ledger-reserved node-held (%d units in doubt at the node)\n", n.ID, ans.InDoubtHere)
	for _, k := range keys {
		mark := ""
		if ledger[k] != held[k] {
			mark = " differs"
			diff = append(diff, fmt.Sprintf("%s %s: ledger %d, node %d", k.account, k.grant, ledger[k], held[k]))
		}
		fmt.Fprintf(&b, "%s %s %d %d%s\n", k.account, k.grant, ledger[k], held[k], mark)
	}
	return diff, b.String(), nil
}

// reservationAudit is the nodes' --reservation-audit: often, so that a
// run of a minute audits a dozen times.
const reservationAudit = 5 * time.Second

// auditFinding starts the message of a node's reservation audit's finding
// (node/audit.go).
const auditFinding = "the ledger reserves "

// auditStrands reads the findings of the nodes' reservation audits from
// their logs (every incarnation's: a node's log is appended to across
// restarts), for RES.
func (h *harness) auditStrands() []cluster.Strand {
	var out []cluster.Strand
	for _, n := range h.c.List() {
		b, err := os.ReadFile(n.LogPath)
		if err != nil {
			h.note("%s's log could not be read for its reservation audits: %v", n.ID, err)
			continue
		}
		out = append(out, parseStrands(n.ID, b)...)
	}
	return out
}

// parseStrands picks a node's reservation audit findings out of its JSON
// log.
func parseStrands(node string, log []byte) []cluster.Strand {
	var out []cluster.Strand
	for _, line := range bytes.Split(log, []byte("\n")) {
		if !bytes.Contains(line, []byte(auditFinding)) {
			continue
		}
		var l struct {
			Time     string   `json:"time"`
			Msg      string   `json:"msg"`
			Units    int64    `json:"units"`
			Accounts []string `json:"accounts"`
		}
		if json.Unmarshal(line, &l) != nil || !strings.HasPrefix(l.Msg, auditFinding) || !strings.Contains(l.Msg, "on accounts it neither owns") {
			continue
		}
		out = append(out, cluster.Strand{Node: node, At: l.Time, Units: l.Units, Accounts: l.Accounts})
	}
	return out
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
