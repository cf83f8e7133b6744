package chaos

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/snapshot"
)

// The workload's accounts, by class:
//
//	hard  hard monthly quotas sized to run out during the run (G1 bites)
//	big   hard quotas far from exhaustion: charges go on throughout (G2, G8)
//	soft  soft quotas that run into overage
//	rl    rate limited (a few requests a second), hammered at several times
//	      their rate (G7); only through gRPC and the embedded client, whose
//	      answers name the deciding node
type accounts struct {
	hard, big, soft, rl []string
	limits              map[string]cluster.Limits
	keys                map[string]string // account -> API key plaintext
}

func (a *accounts) ids() []string {
	var out []string
	for _, s := range [][]string{a.hard, a.big, a.soft, a.rl} {
		out = append(out, s...)
	}
	return out
}

// Workload shares, as fractions of new charges.
const (
	shareHard = 0.40
	shareBig  = 0.25
	shareSoft = 0.15 // the rest goes to the rate-limited accounts

	nHard, nBig, nSoft, nRL = 100, 10, 30, 4
	rlRate, rlBurst         = 4, 4
)

// hardQuota sizes the hard quotas so that the workload exhausts them at
// about three quarters of the run.
func hardQuota(rate float64, d time.Duration) int64 {
	perAccount := rate * d.Seconds() * shareHard / nHard
	return max(20, int64(math.Round(0.75*perAccount)))
}

// seed creates the plans, accounts, keys and route weights in the ledger.
func (h *harness) seed(ctx context.Context) error {
	q := hardQuota(h.cfg.Rate, h.cfg.Duration)
	plans := []snapshot.Plan{
		{ID: "hard", MonthlyQuota: q, Hard: true},
		{ID: "big", MonthlyQuota: 1 << 40, Hard: true},
		{ID: "soft", MonthlyQuota: q, Hard: false},
		{ID: "rl", Rate: fmt.Sprintf("%d/s", rlRate), Burst: rlBurst, MonthlyQuota: 1 << 40, Hard: false},
	}
	a := &h.acct
	a.limits, a.keys = map[string]cluster.Limits{}, map[string]string{}
	for _, p := range plans {
		if err := h.ledger.UpsertPlan(ctx, p); err != nil {
			return err
		}
	}
	add := func(list *[]string, plan string, n int, lim cluster.Limits) error {
		for i := 1; i <= n; i++ {
			id := fmt.Sprintf("%s-%03d", plan, i)
			if err := h.ledger.UpsertAccount(ctx, id, plan); err != nil {
				return err
			}
			key := "sk-chaos-" + id
			if err := h.ledger.AddKey(ctx, snapshot.Key{ID: "key-" + id, Hash: snapshot.HashKey(key), Account: id}); err != nil {
				return err
			}
			*list = append(*list, id)
			a.limits[id], a.keys[id] = lim, key
		}
		return nil
	}
	for _, c := range []struct {
		list *[]string
		plan string
		n    int
		lim  cluster.Limits
	}{
		{&a.hard, "hard", nHard, cluster.Limits{Hard: true, Quota: q}},
		{&a.big, "big", nBig, cluster.Limits{Hard: true, Quota: 1 << 40}},
		{&a.soft, "soft", nSoft, cluster.Limits{Quota: q}},
		{&a.rl, "rl", nRL, cluster.Limits{Quota: 1 << 40, Rate: rlRate, Burst: rlBurst}},
	} {
		if err := add(c.list, c.plan, c.n, c.lim); err != nil {
			return err
		}
	}
	_, err := h.ledger.SetRoutes(ctx, 1, map[string]int64{"POST /v1/heavy": 3})
	return err
}
