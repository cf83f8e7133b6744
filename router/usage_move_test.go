package router_test

import (
	"maps"
	"testing"
	"time"

	"github.com/quotaring/quotaring/router"
)

// The usage endpoint's split by route covers the month after the account
// moves: three in-process nodes on one SQLite ledger, a read, a write and
// an export through a node that does not own the account, then the owner
// shuts down (it settles and leaves) and a node that did not charge any of
// them owns the account: its usage shows all three routes, and its own
// read on top. Before, it showed only the charges it made itself.
func TestUsageRoutesSurviveAnOwnershipChange(t *testing.T) {
	up := newUpstream(t)
	acme := account{id: "acme", key: keyOf("acme"), plan: monthly("m60", 60)}
	c := startCluster(t, []account{acme}, clusterOptions{nodes: 3, upstream: up.URL})
	via := c.notOwner(t, acme.id)
	proxy := "http://" + via.HTTPAddr()
	for _, r := range [][2]string{{"GET", "/v1/tasks"}, {"POST", "/v1/tasks"}, {"POST", "/v1/exports"}} {
		if a := do(t, proxy, r[0], r[1], acme.key, nil); a.status != 200 {
			t.Fatalf("%s %s: %d %s", r[0], r[1], a.status, a.body)
		}
	}
	c.stop(t, c.owner(t, acme.id))

	// The proxy's node may own the account now, or forward to the one that does.
	proxy = "http://" + c.nodes[0].HTTPAddr()
	want := map[string]int64{"GET /v1/tasks": 1, "POST /v1/tasks": 2, "POST /v1/exports": 25}
	var u router.UsageReport
	waitFor(t, 10*time.Second, "the new owner's usage to show every route", func() bool {
		u = do(t, proxy, "GET", "/v1/usage", acme.key, nil).usage(t)
		return maps.Equal(u.Routes, want)
	})
	if u.Used != 28 || u.Remaining != 32 {
		t.Fatalf("usage after the move: %+v, want used 28, remaining 32", u)
	}
	if a := do(t, proxy, "GET", "/v1/tasks", acme.key, nil); a.status != 200 {
		t.Fatalf("a read at the new owner: %d %s", a.status, a.body)
	}
	want["GET /v1/tasks"] = 2
	if u = do(t, proxy, "GET", "/v1/usage", acme.key, nil).usage(t); !maps.Equal(u.Routes, want) || u.Used != 29 {
		t.Fatalf("usage after a read at the new owner: %+v, want routes %v, used 29", u, want)
	}
}
