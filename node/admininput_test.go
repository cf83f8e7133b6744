package node

import (
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// startAdminNode starts one node with the admin API on a fresh SQLite
// ledger, with the plan pro and the account acme.
func startAdminNode(t *testing.T) *Node {
	t.Helper()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	nd := startNodesWith(t, dsn, func(c *Config) { c.AdminToken = testAdminToken })[0]
	if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/plans/pro", map[string]any{"monthly_quota": 100, "hard": true}, nil); status != 200 {
		t.Fatalf("put plan: %d %s", status, raw)
	}
	if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/acme", map[string]any{"plan": "pro"}, nil); status != 200 {
		t.Fatalf("put account: %d %s", status, raw)
	}
	return nd
}

func TestAdminAPIInput(t *testing.T) {
	nd := startAdminNode(t)

	// Ids that list as another ("acme\u200b" as acme) or do not read back
	// as stored (0xFF comes back as U+FFFD) are refused for new plans,
	// accounts and grants, naming the character and where it is.
	t.Run("ids", func(t *testing.T) {
		for path, want := range map[string]string{
			"/admin/v1/accounts/acme%E2%80%8B": "character 5 (U+200B, at byte 5) is a format character",
			"/admin/v1/accounts/acme%C2%A0":    "character 5 (U+00A0, at byte 5) is a space",
			"/admin/v1/accounts/acme%C2%85":    "character 5 (U+0085, at byte 5) is a control character",
			"/admin/v1/accounts/acme%FF":       "byte 5 (0xFF) is not UTF-8",
		} {
			if p := wantProblem(t, nd, "PUT", path, map[string]any{"plan": "pro"}, 400, "id"); !strings.Contains(p.Detail, want) {
				t.Errorf("PUT %s: %q, want it to say %q", path, p.Detail, want)
			}
		}
		wantProblem(t, nd, "PUT", "/admin/v1/plans/pro%E2%80%8B", map[string]any{"monthly_quota": 1, "hard": true}, 400, "id")
		wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order\u200b1"}, 400, "id")
		wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order\u00a01"}, 400, "id")
		// The 1970-2261 bound is on the instant, not on the year an offset
		// writes it in: these are 1969 and 2262 in UTC.
		for field, at := range map[string]string{"starts_at": "1970-01-01T00:00:00+14:00", "expires_at": "2261-12-31T23:00:00-14:00"} {
			if p := wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order-t", field: at}, 400, field); !strings.Contains(p.Detail, "from 1970 to 2261") {
				t.Errorf("%s %s: %q", field, at, p.Detail)
			}
		}
		var accounts struct{ Accounts []struct{ ID string } }
		if adminCall(t, nd, testAdminToken, "GET", "/admin/v1/accounts", nil, &accounts); len(accounts.Accounts) != 1 {
			t.Fatalf("accounts %+v, want acme alone", accounts)
		}
	})

	// A NUL byte or a byte that is not UTF-8 in a path segment, a query
	// parameter or a JSON string is a 400 naming it: Postgres refuses them
	// in text, and the API answered 500 with Postgres's error.
	t.Run("unstorable text", func(t *testing.T) {
		for _, c := range []struct{ method, path, field string }{
			{"POST", "/admin/v1/accounts/a%FFb/keys", "id"},
			{"POST", "/admin/v1/accounts/a%00b/grants", "id"},
			{"DELETE", "/admin/v1/keys/k%00", "key_id"},
			{"GET", "/admin/v1/alerts?account=%FF", "account"},
			{"GET", "/admin/v1/usage?after=%00", "after"},
			{"POST", "/admin/v1/alerts/a%00/2026-06/80/resend", "account"},
		} {
			wantProblem(t, nd, c.method, c.path, nil, 400, c.field)
		}
		wantProblem(t, nd, "PUT", "/admin/v1/accounts/acme", `{"plan":"pro\u0000"}`, 400, "body")
		wantProblem(t, nd, "PUT", "/admin/v1/routes", `{"default":1,"weights":{"GET /a\u0000":1}}`, 400, "body")
		// An escaped backslash before "u0000" is no NUL.
		if _, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/acme", `{"plan":"pro\\u0000"}`, nil); strings.Contains(string(raw), "NUL") {
			t.Errorf("an escaped backslash read as a NUL: %s", raw)
		}
		// encoding/json reads a byte that is not UTF-8 and a lone
		// surrogate escape as U+FFFD: grant ids "order\xff1" and
		// "order\xfe1" were one id, the second grant answered as a retry
		// of the first and never granted.
		for body, want := range map[string]string{
			"{\"units\":1,\"id\":\"order\xff1\"}": "byte 23 (0xFF) is not UTF-8",
			`{"units":1,"id":"lone\ud800"}`:       `the escape \ud800 is half of a UTF-16 surrogate pair`,
			`{"units":1,"id":"lone\udc00x"}`:      `the escape \udc00 is half`,
			`{"units":1,"id":"hi\ud83d\u0041"}`:   `the escape \ud83d is half`,
			"\xEF\xBB\xBF{\"units\":1}":           "byte-order mark",
		} {
			if p := wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", body, 400, "body"); !strings.Contains(p.Detail, want) {
				t.Errorf("%q: %q, want it to say %q", body, p.Detail, want)
			}
		}
		wantProblem(t, nd, "PUT", "/admin/v1/routes", "{\"default\":1,\"weights\":{\"GET /caf\xe9\":3}}", 400, "body")
		// A whole pair is a character, and an escaped backslash before
		// "ud800" no escape.
		if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/text", map[string]any{"plan": "pro"}, nil); status != 200 {
			t.Fatalf("put account: %d %s", status, raw)
		}
		for _, id := range []string{`smile\ud83d\ude00`, `lone\\ud800`} {
			if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/text/grants", `{"units":1,"id":"`+id+`"}`, nil); status != 201 {
				t.Errorf("grant id %s: %d %s, want 201", id, status, raw)
			}
		}
	})

	// A threshold is digits and an optional %: "+80" and " 80" were read
	// as 80.
	t.Run("thresholds", func(t *testing.T) {
		for _, th := range []string{"+80", "%2080", "0x50", "80.0", "0", "101", "%25"} {
			wantProblem(t, nd, "POST", "/admin/v1/alerts/acme/2026-06/"+th+"/resend", nil, 400, "threshold")
		}
	})

	// Months past 2261 wrapped around (9999-12 showed 1816-02): every
	// period parameter has the bounds of /admin/v1/usage.
	t.Run("periods", func(t *testing.T) {
		for _, period := range []string{"9999-12", "2262-05", "2262-01", "1969-12", "0000-01"} {
			for _, path := range []string{"/admin/v1/accounts/acme?period=" + period, "/admin/v1/alerts?period=" + period, "/admin/v1/usage?period=" + period} {
				if p := wantProblem(t, nd, "GET", path, nil, 400, "period"); !strings.Contains(p.Detail, "from 1970-01 to 2261-12") {
					t.Errorf("GET %s: %q, want it to give the bounds", path, p.Detail)
				}
			}
			wantProblem(t, nd, "POST", "/admin/v1/alerts/acme/"+period+"/80/resend", nil, 400, "period")
		}
		// An empty one is not the default: ?period=$UNSET exported the
		// running month.
		for _, path := range []string{"/admin/v1/accounts/acme?period=", "/admin/v1/usage?period=", "/admin/v1/usage?limit=", "/admin/v1/alerts?account="} {
			_, field, _ := strings.Cut(path, "?")
			if p := wantProblem(t, nd, "GET", path, nil, 400, strings.TrimSuffix(field, "=")); !strings.Contains(p.Detail, "empty") {
				t.Errorf("GET %s: %q", path, p.Detail)
			}
		}
		for _, period := range []string{"1970-01", "2261-12"} {
			var v AccountView
			if status, raw := adminCall(t, nd, testAdminToken, "GET", "/admin/v1/accounts/acme?period="+period, nil, &v); status != 200 || v.Usage.Period != period {
				t.Errorf("GET account ?period=%s: %d %s", period, status, raw)
			}
		}
	})

	// Each grant is at most 10^15 units and the owner sums an account's
	// grants: ~9,300 of the largest wrapped the sum around to a negative
	// limit. A thousand of them fill the account; the next is refused,
	// naming the total, while a retry of one already held still answers.
	t.Run("grant total", func(t *testing.T) {
		if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/big", map[string]any{"plan": "pro"}, nil); status != 200 {
			t.Fatalf("create account big: %d %s", status, raw)
		}
		grant := func(i int) map[string]any {
			return map[string]any{"units": int64(shard.MaxUnits), "id": fmt.Sprint("g-", i)}
		}
		for i := range 1000 {
			if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/big/grants", grant(i), nil); status != 201 {
				t.Fatalf("grant %d: %d %s", i, status, raw)
			}
		}
		if p := wantProblem(t, nd, "POST", "/admin/v1/accounts/big/grants", grant(1000), 400, "units"); !strings.Contains(p.Detail, "1000000000000000000 units in grants") {
			t.Errorf("grant 1000: %q, want it to name the total held", p.Detail)
		}
		if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/big/grants", grant(7), nil); status != 200 {
			t.Errorf("grant 7 again (a retry): %d %s, want 200", status, raw)
		}
	})

	// The 201 shows the times as stored: Postgres keeps microseconds, and
	// the answer showed nanoseconds that a retry's 200 did not.
	t.Run("grant times as stored", func(t *testing.T) {
		var a struct {
			StartsAt  time.Time `json:"starts_at"`
			ExpiresAt time.Time `json:"expires_at"`
		}
		if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/ns", map[string]any{"plan": "pro"}, nil); status != 200 {
			t.Fatalf("put account: %d %s", status, raw)
		}
		if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/ns/grants",
			map[string]any{"units": 5, "id": "order-ns", "starts_at": "2026-01-01T00:00:00.999999999Z", "expires_at": "2200-01-01T00:00:00.000000999Z"}, &a); status != 201 ||
			a.StartsAt.Nanosecond() != 999999000 || a.ExpiresAt.Nanosecond() != 0 {
			t.Errorf("add grant with nanoseconds: %d %s; want them cut to microseconds", status, raw)
		}
	})

	// A grant's id makes a retry safe: the same grant again answers 200
	// and changes nothing; another under the id is a 409 (it was a 400).
	t.Run("grant retries", func(t *testing.T) {
		grant := map[string]any{"units": 5, "id": "order-1", "starts_at": "2026-01-01T00:00:00.123456Z", "expires_at": "2200-01-01T00:00:00Z"}
		type answer struct {
			ID      string
			Units   int64
			Created bool
		}
		var a answer
		if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", grant, &a); status != 201 || !a.Created {
			t.Fatalf("add grant: %d %s", status, raw)
		}
		for _, retry := range []map[string]any{grant, {"units": 5, "id": "order-1", "expires_at": "2200-01-01T00:00:00Z"}} {
			a = answer{}
			if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", retry, &a); status != 200 || a.Created || a.Units != 5 {
				t.Fatalf("the same grant again %v: %d %s, want 200 with created false", retry, status, raw)
			}
		}
		for _, other := range []map[string]any{
			{"units": 6, "id": "order-1", "expires_at": "2200-01-01T00:00:00Z"},
			{"units": 5, "id": "order-1"},
			{"units": 5, "id": "order-1", "expires_at": "2200-01-01T00:00:00Z", "starts_at": "2026-01-02T00:00:00Z"},
		} {
			if p := wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", other, 409, "id"); !strings.Contains(p.Detail, `already has a grant "order-1", of 5 units`) {
				t.Errorf("another grant under the id: %q", p.Detail)
			}
		}
		rows, err := nd.Ledger().Grants(t.Context(), "acme")
		if err != nil || len(rows) != 1 || rows[0].Units != 5 {
			t.Fatalf("grants %+v %v, want order-1 once", rows, err)
		}
	})
}

// A member given empty is refused, as quotad admin refuses an empty flag:
// from a script with the variable unset, {"id": ""} granted again on each
// retry, {"expires_at": ""} made a grant that never lapses and
// {"rate": ""} a plan without a rate limit.
func TestAdminAPIEmptyMembers(t *testing.T) {
	nd := startAdminNode(t)
	for _, c := range []struct {
		path, field string
		body        map[string]any
	}{
		{"/admin/v1/accounts/acme/grants", "id", map[string]any{"units": 100, "id": ""}},
		{"/admin/v1/accounts/acme/grants", "starts_at", map[string]any{"units": 100, "id": "o-1", "starts_at": ""}},
		{"/admin/v1/accounts/acme/grants", "expires_at", map[string]any{"units": 100, "id": "o-1", "expires_at": ""}},
		{"/admin/v1/plans/pro", "rate", map[string]any{"rate": "", "monthly_quota": 10, "hard": true}},
	} {
		method := "POST"
		if c.field == "rate" {
			method = "PUT"
		}
		if p := wantProblem(t, nd, method, c.path, c.body, 400, c.field); !strings.Contains(p.Detail, "empty: give") {
			t.Errorf("%v: %q, want it to say it is empty", c.body, p.Detail)
		}
	}
	if rows, err := nd.Ledger().Grants(t.Context(), "acme"); err != nil || len(rows) != 0 {
		t.Fatalf("grants %+v %v, want none", rows, err)
	}
	var p snapshot.Plan
	if status, raw := adminCall(t, nd, testAdminToken, "GET", "/admin/v1/plans/pro", nil, &p); status != 200 || p.MonthlyQuota != 100 {
		t.Fatalf("plan pro %d %s, want it unchanged", status, raw)
	}
	// Left out, they keep their meaning: a made-up id, now, never, no
	// rate limit.
	if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 1}, nil); status != 201 {
		t.Fatalf("grant without an id: %d %s", status, raw)
	}
}

// A retry of a grant stored before its expires_at passed is answered as any
// retry; it was a 400 blaming a starts_at the caller never sent.
func TestAdminAPIGrantRetryAfterItLapsed(t *testing.T) {
	clock := engine.NewManualClock(time.Now())
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	nd := startNodesWith(t, dsn, func(c *Config) { c.AdminToken, c.Clock = testAdminToken, clock })[0]
	for _, put := range []struct {
		path string
		body map[string]any
	}{ // NB: in order: the plan before the account on it
		{"/admin/v1/plans/pro", map[string]any{"monthly_quota": 100, "hard": true}},
		{"/admin/v1/accounts/acme", map[string]any{"plan": "pro"}},
	} {
		if status, raw := adminCall(t, nd, testAdminToken, "PUT", put.path, put.body, nil); status != 200 {
			t.Fatalf("PUT %s: %d %s", put.path, status, raw)
		}
	}
	expires := time.Unix(0, clock.Now().Wall).Add(time.Hour).UTC().Format(time.RFC3339)
	grant := map[string]any{"units": 5, "id": "order-1", "expires_at": expires}
	if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", grant, nil); status != 201 {
		t.Fatalf("add grant: %d %s", status, raw)
	}
	clock.SetWall(time.Unix(0, clock.Now().Wall).Add(2 * time.Hour))
	var a struct{ Created bool }
	if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", grant, &a); status != 200 || a.Created {
		t.Fatalf("the same grant again after it lapsed: %d %s, want 200 with created false", status, raw)
	}
	wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 6, "id": "order-1", "expires_at": expires}, 409, "id")
	for _, body := range []map[string]any{
		{"units": 5, "id": "order-2", "expires_at": expires},
		{"units": 5, "expires_at": "2020-01-01T00:00:00Z"},
	} {
		if p := wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", body, 400, "expires_at"); !strings.Contains(p.Detail, "has passed") {
			t.Errorf("%v: %q, want it to say expires_at has passed", body, p.Detail)
		}
	}
}

// An id stored before a rule it breaks (an account in NFD, as macOS writes
// names) can still be changed, and its grant retried; a new such id is
// refused. The rules refused every change to it.
func TestAdminAPIStoredIDsBeforeTheRules(t *testing.T) {
	nd := startAdminNode(t)
	nfd := "mu\u0308ller"
	l := nd.Ledger()
	if err := l.UpsertAccount(t.Context(), nfd, "pro"); err != nil {
		t.Fatal(err)
	}
	if err := l.AddGrant(t.Context(), "acme", snapshot.Grant{ID: "order-u\u0308", Units: 5, StartsAt: time.Now().Add(-time.Hour).Truncate(time.Microsecond)}); err != nil {
		t.Fatal(err)
	}
	if status, raw := adminCall(t, nd, testAdminToken, "PUT", "/admin/v1/accounts/"+url.PathEscape(nfd), map[string]any{"plan": "pro"}, nil); status != 200 {
		t.Errorf("PUT of an account stored in NFD: %d %s, want 200", status, raw)
	}
	var a struct{ Created bool }
	if status, raw := adminCall(t, nd, testAdminToken, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "order-u\u0308"}, &a); status != 200 || a.Created {
		t.Errorf("a retry of a grant stored with an NFD id: %d %s, want 200 created false", status, raw)
	}
	wantProblem(t, nd, "PUT", "/admin/v1/accounts/"+url.PathEscape("schu\u0308tz"), map[string]any{"plan": "pro"}, 400, "id")
	wantProblem(t, nd, "POST", "/admin/v1/accounts/acme/grants", map[string]any{"units": 5, "id": "other-u\u0308"}, 400, "id")
}
