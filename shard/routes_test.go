package shard

import (
	"maps"
	"testing"
)

// The usage split by route follows the ledger's settled split
// (AccountConfig.RouteUsed) as the grants follow their settled use: a new
// owner starts from it; a refresh raises each route to it, never from a
// config read before this owner's records settled (UseBehind); a reseed
// sets it; another period's split is not this one's.
func TestRoutesFollowTheLedgersSplit(t *testing.T) {
	p := DefaultParams()
	now := at("2026-06-10T00:00:00Z")
	cfg := AccountConfig{ID: "a", Plan: hardPlan(1000), RouteUsed: map[string]map[string]int64{
		"2026-06": {"GET /x": 5, "POST /v1/exports": 25},
		"2026-05": {"GET /old": 9},
	}}
	a := NewAccount(cfg)
	want := func(what string, routes map[string]int64) {
		t.Helper()
		if got := a.Usage(now).Routes; !maps.Equal(got, routes) {
			t.Fatalf("%s: routes %v, want %v", what, got, routes)
		}
	}
	want("a new owner", map[string]int64{"GET /x": 5, "POST /v1/exports": 25})
	charge(a, "e1", 2, now, &p) // GET /x
	want("after its own charge", map[string]int64{"GET /x": 7, "POST /v1/exports": 25})

	behind := cfg
	behind.RouteUsed = map[string]map[string]int64{"2026-06": {"GET /x": 30}}
	behind.UseBehind = true
	a.Configure(behind)
	want("a config read before its charge settled", map[string]int64{"GET /x": 7, "POST /v1/exports": 25})
	behind.UseBehind = false
	a.Configure(behind)
	want("a later one (another owner's late charges)", map[string]int64{"GET /x": 30, "POST /v1/exports": 25})

	reseed := cfg
	reseed.RouteUsed = map[string]map[string]int64{"2026-06": {"GET /x": 4}}
	reseed.Reseed = true
	a.Configure(reseed)
	want("a reseed (the exports refunded elsewhere)", map[string]int64{"GET /x": 4})

	july := at("2026-07-01T00:00:01Z")
	if got := a.Usage(july).Routes; len(got) != 0 {
		t.Fatalf("July: routes %v, want none", got)
	}
}
