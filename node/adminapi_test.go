package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/buildinfo"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// startNodesWith starts len(mods) nodes on one SQLite ledger, node i
// configured by mods[i], and waits for one ring of all of them.
func startNodesWith(t *testing.T, dsn string, mods ...func(*Config)) []*Node {
	t.Helper()
	dir := t.TempDir()
	var nodes []*Node
	t.Cleanup(func() {
		for _, nd := range nodes {
			nd.Shutdown(context.Background())
		}
	})
	for i, mod := range mods {
		cfg := startConfig(dsn, dir, fmt.Sprint("n", i+1))
		if i > 0 {
			cfg.Join = []string{nodes[0].GossipAddr()}
		}
		if mod != nil {
			mod(&cfg)
		}
		nd, err := Start(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, nd)
	}
	waitFor(t, 20*time.Second, "one ring of all nodes", func() bool {
		e := nodes[0].Ring().Epoch()
		for _, nd := range nodes {
			if nd.Ring().Epoch() != e || len(nd.Ring().View().Serving) != len(nodes) {
				return false
			}
		}
		return true
	})
	return nodes
}

const testAdminToken = "test-admin-token-0123456789abcdef"

// adminCall makes one admin API call and decodes the JSON answer into out
// (when not nil); it returns the status and the raw body.
func adminCall(t *testing.T, nd *Node, token, method, path string, body any, out any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, "http://"+nd.AdminAddr()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Header.Get(AdminAPIHeader) != "v1" {
		t.Errorf("%s %s: no %s: v1 on the answer (quotad admin tells the API from other servers by it)", method, path, AdminAPIHeader)
	}
	ct := resp.Header.Get("Content-Type")
	if resp.StatusCode >= 400 && ct != "application/problem+json" {
		t.Fatalf("%s %s: %d with Content-Type %q, want application/problem+json: %s", method, path, resp.StatusCode, ct, raw)
	}
	if out != nil && resp.StatusCode < 400 {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s %s: %v in %s", method, path, err, raw)
		}
	}
	return resp.StatusCode, raw
}

// wantProblem checks a problem answer's status and the field it names.
func wantProblem(t *testing.T, nd *Node, method, path string, body any, status int, field string) adminProblem {
	t.Helper()
	got, raw := adminCall(t, nd, testAdminToken, method, path, body, nil)
	t.Logf("%s %s -> %s", method, path, raw)
	var p adminProblem
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatalf("%s %s: not a problem: %s", method, path, raw)
	}
	if got != status || p.Status != status || p.Field != field || p.Detail == "" {
		t.Fatalf("%s %s: got %d field %q (%s), want %d naming %q", method, path, got, p.Field, raw, status, field)
	}
	return p
}

func TestAdminAPI(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	// n1 serves the admin API; n2 has no token (the API is off there).
	nodes := startNodesWith(t, dsn, func(c *Config) { c.AdminToken = testAdminToken }, nil)
	n1, n2 := nodes[0], nodes[1]
	ctx := context.Background()

	t.Run("auth", func(t *testing.T) {
		status, raw := adminCall(t, n2, testAdminToken, "GET", "/admin/v1/plans", nil, nil)
		if status != http.StatusForbidden || !strings.Contains(string(raw), "--admin-token") {
			t.Fatalf("no token configured: %d %s, want 403 saying how to enable it", status, raw)
		}
		if status, raw := adminCall(t, n1, "", "GET", "/admin/v1/plans", nil, nil); status != http.StatusUnauthorized {
			t.Fatalf("no token sent: %d %s", status, raw)
		}
		if status, raw := adminCall(t, n1, "wrong-token-wrong-token", "GET", "/admin/v1/plans", nil, nil); status != http.StatusUnauthorized {
			t.Fatalf("wrong token: %d %s", status, raw)
		}
		// Profiles take the admin token when the node has one, and a
		// profile's length is bounded; a node without one serves them.
		for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/symbol", "/debug/pprof/profile?seconds=1", "/debug/pprof/trace?seconds=1"} {
			if status, raw := adminCall(t, n1, "", "GET", path, nil, nil); status != http.StatusUnauthorized {
				t.Fatalf("%s without the token: %d %.200s, want 401", path, status, raw)
			}
		}
		if status, raw := adminCall(t, n1, testAdminToken, "GET", "/debug/pprof/", nil, nil); status != http.StatusOK || !strings.Contains(string(raw), "goroutine") {
			t.Fatalf("/debug/pprof/ with the token: %d %.200s", status, raw)
		}
		for _, q := range []string{"trace?seconds=86400", "trace?seconds=0", "trace?seconds=1.5", "profile?seconds=x", "heap?seconds=86400"} {
			if status, raw := adminCall(t, n1, testAdminToken, "GET", "/debug/pprof/"+q, nil, nil); status != http.StatusBadRequest || !strings.Contains(string(raw), "from 1 to 300") {
				t.Fatalf("/debug/pprof/%s: %d %.200s, want 400 naming the bound", q, status, raw)
			}
		}
		if res, err := http.Get("http://" + n2.AdminAddr() + "/debug/pprof/"); err != nil || res.StatusCode != http.StatusOK {
			t.Fatalf("/debug/pprof/ on a node without an admin token: %v %v, want it served", res, err)
		} else {
			res.Body.Close()
		}
		// The command line, which may hold the token, is not served.
		res, err := http.Get("http://" + n1.AdminAddr() + "/debug/pprof/cmdline")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusNotFound || strings.Contains(string(body), os.Args[0]) {
			t.Fatalf("/debug/pprof/cmdline: %d %q, want 404", res.StatusCode, body)
		}
		// Unknown paths and methods answer problems too, after the token check.
		if status, _ := adminCall(t, n1, "", "GET", "/admin/v1/nope", nil, nil); status != http.StatusUnauthorized {
			t.Fatalf("unknown path without token: %d", status)
		}
		wantProblem(t, n1, "GET", "/admin/v1/nope", nil, http.StatusNotFound, "")
		wantProblem(t, n1, "DELETE", "/admin/v1/plans", nil, http.StatusMethodNotAllowed, "")
		// /admin/v1 itself too: not ServeMux's redirect to /admin/v1/
		// ahead of the token check.
		noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		res, err = noFollow.Get("http://" + n1.AdminAddr() + "/admin/v1")
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != http.StatusUnauthorized {
			t.Fatalf("GET /admin/v1 without token: %d, want 401", res.StatusCode)
		}
		wantProblem(t, n1, "GET", "/admin/v1", nil, http.StatusNotFound, "")
	})

	t.Run("bad input", func(t *testing.T) {
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"rate": "ten", "monthly_quota": 5, "hard": true}, 400, "rate")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"id": "silver", "monthly_quota": 5, "hard": true}, 400, "id")
		// What a GET gives can be put back (README): a plan with its id, a
		// route table with its version.
		for _, path := range []string{"/admin/v1/plans/gold", "/admin/v1/routes"} {
			if path == "/admin/v1/plans/gold" {
				if st, raw := adminCall(t, n1, testAdminToken, "PUT", path, map[string]any{"rate": "10/s", "monthly_quota": 5, "hard": true}, nil); st != 200 {
					t.Fatalf("PUT %s: %d %s", path, st, raw)
				}
			}
			var got map[string]any
			if st, raw := adminCall(t, n1, testAdminToken, "GET", path, nil, &got); st != 200 {
				t.Fatalf("GET %s: %d %s", path, st, raw)
			}
			if st, raw := adminCall(t, n1, testAdminToken, "PUT", path, got, nil); st != 200 {
				t.Fatalf("a GET of %s put back: %d %s; want 200", path, st, raw)
			}
		}
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"monthly_quota": 5}, 400, "hard")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"hard": true}, 400, "monthly_quota")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"montly_quota": 5, "hard": true}, 400, "montly_quota")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"monthly_quota": "lots", "hard": true}, 400, "monthly_quota")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"monthly_quota": -1, "hard": true}, 400, "monthly_quota")
		if p := wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"rate": "10/s", "burst": int64(99999999999999), "monthly_quota": 5, "hard": true}, 400, "burst"); strings.Contains(p.Detail, "shard:") || !strings.Contains(p.Detail, "too large") {
			t.Errorf("a burst too large: %q, want it said without the package's prefix", p.Detail)
		}
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"rate": "99999999999999/h", "monthly_quota": 5, "hard": true}, 400, "rate")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", map[string]any{"monthly_quota": int64(4e18), "hard": true}, 400, "monthly_quota")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", `{"monthly_quota": 5,`, 400, "body")
		wantProblem(t, n1, "PUT", "/admin/v1/plans/gold", `{"monthly_quota": 5, "hard": true, "hard": false}`, 400, "hard")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", `{"weights": {"GET /x": 1, "GET /y": 2, "GET /x": 3}}`, 400, `weights["GET /x"]`)
		// The table is replaced whole: without weights it was emptied.
		wantProblem(t, n1, "PUT", "/admin/v1/routes", `{"default": 2}`, 400, "weights")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", `{"default": 2, "weights": null}`, 400, "weights")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", `null`, 400, "body")
		wantProblem(t, n1, "PUT", "/admin/v1/accounts/acme", map[string]any{"plan": "no-such-plan"}, 400, "plan")
		wantProblem(t, n1, "PUT", "/admin/v1/accounts/acme", map[string]any{}, 400, "plan")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"weights": map[string]int{"GET /v1/{id": 2}}, 400, `weights["GET /v1/{id"]`)
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"weights": map[string]int{"GET /x": -2}}, 400, `weights["GET /x"]`)
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"default": -1}, 400, "default")
		// A typo in a query parameter must not answer for the default.
		if p := wantProblem(t, n1, "GET", "/admin/v1/usage?month=2026-06", nil, 400, "month"); !strings.Contains(p.Detail, "takes period, after, limit, lost_node") {
			t.Errorf("?month=: %q, want it to list the parameters the endpoint takes", p.Detail)
		}
		wantProblem(t, n1, "GET", "/admin/v1/plans?verbose=1", nil, 400, "verbose")
		wantProblem(t, n1, "GET", "/admin/v1/alerts?period=2026-06&period=2026-07", nil, 400, "period")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"default": int64(shard.MaxUnits) + 1}, 400, "default")
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"weights": map[string]int64{"GET /v1/huge": shard.MaxUnits + 1}}, 400, `weights["GET /v1/huge"]`)
		wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"weights": map[string]int{"GET /v1/{a}": 1, "GET /v1/{b}": 2}}, 400, "weights")
		// Patterns ServeMux takes but no request can match.
		for pattern, detail := range map[string]string{
			"get /v1/tasks":    "did you mean GET /v1/tasks",
			"POST/v1/x":        "put a space between the method and the path",
			"BAD PATTERN /x y": "holds whitespace",
			"GET /v1/a b":      "%20",
			"GET v1/x":         `reads as a host, not part of the path (a pattern is "METHOD [HOST]/PATH"): write "GET /v1/x"`,
			"GET /v1/q?x=1":    `the query (?...) is not part of a route pattern`,
		} {
			p := wantProblem(t, n1, "PUT", "/admin/v1/routes", map[string]any{"weights": map[string]int{"POST /v1/exports": 25, pattern: 2}}, 400, fmt.Sprintf("weights[%q]", pattern))
			if !strings.Contains(p.Detail, detail) {
				t.Errorf("%q: detail %q, want it to say %q", pattern, p.Detail, detail)
			}
		}
		wantProblem(t, n1, "POST", "/admin/v1/accounts/ghost/keys", nil, 404, "")
		if p := wantProblem(t, n1, "POST", "/admin/v1/accounts/ghost/grants", map[string]any{"units": 5}, 404, ""); !strings.Contains(p.Detail, `account "ghost" does not exist: create it first`) {
			t.Errorf("a grant to a missing account: %q, want it to say how to create the account", p.Detail)
		}
		// A chunked body is read as any other: it was ignored, and junk
		// made a key.
		req, err := http.NewRequest("POST", "http://"+n1.AdminAddr()+"/admin/v1/accounts/acme/keys", io.MultiReader(strings.NewReader(`{"bogus":1}`)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+testAdminToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 400 {
			t.Errorf("a chunked body with an unknown member: %d, want 400 and no key", resp.StatusCode)
		}
		wantProblem(t, n1, "DELETE", "/admin/v1/keys/key_nope", nil, 404, "")
		wantProblem(t, n1, "GET", "/admin/v1/accounts/ghost", nil, 404, "")
	})

	// The config: a plan, an account, a key, a grant, the routes.
	var plan snapshot.Plan
	if status, raw := adminCall(t, n1, testAdminToken, "PUT", "/admin/v1/plans/gold",
		map[string]any{"rate": "100/s", "burst": 100, "monthly_quota": 60, "hard": true}, &plan); status != 200 || plan.MonthlyQuota != 60 {
		t.Fatalf("put plan: %d %s", status, raw)
	}
	if status, raw := adminCall(t, n1, testAdminToken, "PUT", "/admin/v1/accounts/acme", map[string]any{"plan": "gold"}, nil); status != 200 {
		t.Fatalf("put account: %d %s", status, raw)
	}
	var key NewKey
	if status, raw := adminCall(t, n1, testAdminToken, "POST", "/admin/v1/accounts/acme/keys", nil, &key); status != http.StatusCreated {
		t.Fatalf("create key: %d %s", status, raw)
	}
	if !strings.HasPrefix(key.Key, KeyPrefix) || len(key.Key) != len(KeyPrefix)+43 || key.Hash != snapshot.HashKey(key.Key) || key.Account != "acme" {
		t.Fatalf("new key %+v", key)
	}
	var grant struct{ ID string }
	if status, raw := adminCall(t, n1, testAdminToken, "POST", "/admin/v1/accounts/acme/grants",
		map[string]any{"units": 40, "expires_at": "2200-01-01T00:00:00Z"}, &grant); status != http.StatusCreated || grant.ID == "" {
		t.Fatalf("add grant: %d %s", status, raw)
	}
	wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "expires_at": "tomorrow"}, 400, "expires_at")
	wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "expires_at": "2999-01-01T00:00:00Z"}, 400, "expires_at")
	// A grant over before it is made was taken, and listed as spendable.
	if p := wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "starts_at": "2020-01-01T00:00:00Z", "expires_at": "2021-01-01T00:00:00Z"}, 400, "expires_at"); !strings.Contains(p.Detail, "has passed") {
		t.Errorf("a grant that expired before it was made: %q", p.Detail)
	}
	wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": -5}, 400, "units")
	wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": int64(9e18)}, 400, "units")
	wantProblem(t, n1, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": grant.ID}, 409, "id")
	var routes RoutesView
	if status, raw := adminCall(t, n1, testAdminToken, "PUT", "/admin/v1/routes",
		map[string]any{"default": 1, "weights": map[string]int{"POST /v1/exports": 25, "GET /v1/tasks": 1}}, &routes); status != 200 || routes.Version == 0 {
		t.Fatalf("put routes: %d %s", status, raw)
	}

	// The ledger keeps only the key's hash.
	snap, err := n1.Ledger().Snapshot(ctx, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	enc, _ := snap.Encode()
	if k, ok := snap.Key(key.Hash); !ok || k.ID != key.KeyID || k.Account != "acme" || bytes.Contains(enc, []byte(key.Key)) {
		t.Fatalf("ledger key %+v %v; the plaintext must not be stored", k, ok)
	}

	// Both nodes pick the change up at their next refresh.
	for _, nd := range nodes {
		waitFor(t, 10*time.Second, nd.ID()+" applying the admin changes", func() bool {
			s := nd.Engine().Snapshot()
			if s == nil || s.Routes.Version != routes.Version {
				return false
			}
			_, units := s.Routes.Match("POST", "/v1/exports")
			k, ok := s.Key(key.Hash)
			cfg, _ := s.AccountConfig("acme")
			return units == 25 && ok && k.Account == "acme" && cfg.Plan.MonthlyQuota == 60 && len(cfg.Credits) == 1
		})
	}

	// A charge for the new account works through the node without the API.
	res, err := n2.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Key: key.KeyID, Route: "POST /v1/exports", Units: 25})
	if err != nil || res.Reason != shard.OK || res.Limit != 100 || res.Remaining != 75 {
		t.Fatalf("charge: %+v %v", res, err)
	}
	for _, nd := range nodes {
		if _, err := nd.SettleNow(ctx); err != nil {
			t.Fatal(err)
		}
	}

	var acct AccountView
	if status, raw := adminCall(t, n1, testAdminToken, "GET", "/admin/v1/accounts/acme", nil, &acct); status != 200 {
		t.Fatalf("get account: %d %s", status, raw)
	} else if bytes.Contains(raw, []byte(key.Key)) {
		t.Fatal("the account view shows the key's plaintext")
	}
	var used int64
	for _, g := range acct.Grants {
		used += g.Used
	}
	if acct.Plan.ID != "gold" || len(acct.Keys) != 1 || acct.Keys[0].ID != key.KeyID || len(acct.Grants) != 2 || used != 25 ||
		acct.Usage.Units != 25 || acct.Usage.ByRoute["POST /v1/exports"] != 25 {
		t.Fatalf("account view %+v", acct)
	}

	var plans struct{ Plans []snapshot.Plan }
	if adminCall(t, n1, testAdminToken, "GET", "/admin/v1/plans", nil, &plans); len(plans.Plans) != 1 || plans.Plans[0].ID != "gold" {
		t.Fatalf("plans %+v", plans)
	}
	var ns struct{ Nodes []NodeView }
	adminCall(t, n1, testAdminToken, "GET", "/admin/v1/nodes", nil, &ns)
	build := buildinfo.Read().Short()
	if len(ns.Nodes) != 2 || ns.Nodes[0].State != "serving" || ns.Nodes[1].State != "serving" || ns.Nodes[0].Build != build || ns.Nodes[1].Build != build {
		t.Fatalf("nodes %+v, want both serving with build %q", ns, build)
	}
	if v := gaugeValue(t, n1, "quotaring_build_info"); v != 1 {
		t.Fatalf("quotaring_build_info = %v", v)
	}
	fams, err := n1.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "quotaring_build_info" {
			continue
		}
		labels := map[string]string{}
		for _, lp := range f.GetMetric()[0].GetLabel() {
			labels[lp.GetName()] = lp.GetValue()
		}
		if labels["version"] != build || labels["goversion"] != runtime.Version() {
			t.Fatalf("quotaring_build_info's labels %v, want version %q", labels, build)
		}
	}
	// The reservations, and what the node that answers holds itself: the
	// same units, grant by grant, once no top-up is on its way. (n1 holds
	// units of an account it owns once it charged it.)
	mine := ""
	for i := 0; mine == ""; i++ {
		if owner, _ := n1.Ring().Owner(fmt.Sprintf("res-%d", i)); owner.ID == "n1" {
			mine = fmt.Sprintf("res-%d", i)
		}
	}
	if status, raw := adminCall(t, n1, testAdminToken, "PUT", "/admin/v1/accounts/"+mine, map[string]any{"plan": "gold"}, nil); status != 200 {
		t.Fatalf("put %s: %d %s", mine, status, raw)
	}
	waitFor(t, 10*time.Second, "n1 charging "+mine, func() bool {
		res, err := n1.Router().Charge(ctx, router.ChargeRequest{Account: mine, Route: "GET /v1/tasks", Units: 1})
		return err == nil && res.Reason == shard.OK
	})
	type resRow struct {
		Node, Account, Grant string
		Units                int64
	}
	var rs struct {
		Reservations []resRow
		Node         string
		HeldHere     []resRow `json:"held_here"`
		InDoubtHere  int64    `json:"in_doubt_here"`
	}
	waitFor(t, 10*time.Second, "n1's allowances to equal the ledger's reservations of n1", func() bool {
		rs.Reservations, rs.HeldHere = nil, nil
		if status, raw := adminCall(t, n1, testAdminToken, "GET", "/admin/v1/reservations", nil, &rs); status != 200 {
			t.Fatalf("reservations: %d %s", status, raw)
		}
		var ledger []resRow
		for _, r := range rs.Reservations {
			if r.Node == "n1" {
				ledger = append(ledger, r)
			}
		}
		return rs.Node == "n1" && slices.ContainsFunc(ledger, func(r resRow) bool { return r.Account == mine }) &&
			slices.Equal(ledger, rs.HeldHere) && rs.InDoubtHere == 0
	})

	// Revoking the key takes it out of the nodes' snapshots.
	if status, raw := adminCall(t, n1, testAdminToken, "DELETE", "/admin/v1/keys/"+key.KeyID, nil, nil); status != 200 {
		t.Fatalf("revoke: %d %s", status, raw)
	}
	waitFor(t, 10*time.Second, "the revoked key leaving n2's snapshot", func() bool {
		_, ok := n2.Engine().Snapshot().Key(key.Hash)
		return !ok
	})

	// Without a webhook, crossing 80 % sends and records nothing.
	if res, err := n1.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "POST /v1/exports", Units: 60}); err != nil || res.Reason != shard.OK {
		t.Fatalf("charge to 85 %%: %+v %v", res, err)
	}
	if n1.alerts != nil || n2.alerts != nil {
		t.Fatal("an alerter runs without a webhook")
	}
	if recorded, err := n1.Ledger().Alerts(ctx, flush.AlertQuery{Account: "acme"}); err != nil || len(recorded) != 0 {
		t.Fatalf("alerts recorded without a webhook: %+v, %v", recorded, err)
	}
}

func TestAdminTokenTooShort(t *testing.T) {
	if err := checkAdminToken("short"); err == nil || !strings.Contains(err.Error(), "openssl rand") {
		t.Fatalf("short token: %v", err)
	}
	if checkAdminToken("") != nil || checkAdminToken(testAdminToken) != nil {
		t.Fatal("empty (disabled) and long tokens are fine")
	}
	// A client's token is read trimmed: one configured with spaces or a
	// line break around it could never be matched.
	for _, tok := range []string{" " + testAdminToken, testAdminToken + "\n", "\uFEFF" + testAdminToken} {
		if err := checkAdminToken(tok); err == nil || !strings.Contains(err.Error(), "spaces") {
			t.Errorf("token %q: %v; want refused", tok, err)
		}
	}
}

func TestRedactURLHidesTokensInPaths(t *testing.T) {
	for in, want := range map[string]string{
		"https://hooks.slack.com/services/T000/B000/XXXXSECRET": "https://hooks.slack.com/services/…",
		"https://u:pw@billing.example.com:8443/hooks?token=abc": "https://u@billing.example.com:8443/hooks?…",
		"http://127.0.0.1:9000/":                                "http://127.0.0.1:9000",
		"http://127.0.0.1:9000/quota/":                          "http://127.0.0.1:9000/quota",
	} {
		u, err := url.Parse(in)
		if err != nil {
			t.Fatal(err)
		}
		if got := redactURL(u); got != want || strings.Contains(got, "SECRET") || strings.Contains(got, "pw") {
			t.Errorf("redactURL(%s) = %s; want %s", in, got, want)
		}
	}
}

func TestNewKeyPlaintext(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		k := newKeyPlaintext()
		if !strings.HasPrefix(k, KeyPrefix) || len(k) != len(KeyPrefix)+43 || seen[k] {
			t.Fatalf("key %q (or a repeat)", k)
		}
		for _, c := range k[len(KeyPrefix):] {
			if !strings.ContainsRune(base62, c) {
				t.Fatalf("key %q has %q", k, c)
			}
		}
		seen[k] = true
	}
}

func TestAdminLedgerNotReached(t *testing.T) {
	// Not startNodesWith: a node with neither ledger nor snapshot never
	// serves (TestNodeWithoutConfigOwnsNothing), but its admin port answers.
	nd, err := Start(context.Background(), Config{ID: "n1", DataDir: filepath.Join(t.TempDir(), "n1"),
		Ledger:  "postgres://quotad@127.0.0.1:1/nowhere?connect_timeout=1",
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0",
		RingPreset: ring.PresetLocal, AdminToken: testAdminToken, LedgerRetry: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nd.Shutdown(context.Background()) })
	p := wantProblem(t, nd, "GET", "/admin/v1/plans", nil, http.StatusServiceUnavailable, "")
	if p.Type != problemBase+"ledger-unavailable" {
		t.Fatalf("problem %+v", p)
	}
}
