package snapshot

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// Patterns with a host part match requests to that host (any port), as in
// net/http; patterns without one match every host.
func TestMatchHost(t *testing.T) {
	s := Snapshot{Routes: Routes{Default: 1, Weights: map[string]int64{
		"api.example.com/v1/exports": 25, "POST /v1/exports": 10, "GET api.example.com/v1/tasks/{id}": 3,
		"POST /v1/exports/{name}": 50, "GET /v1/reports/{id}/{format}": 40, "GET [::1]/v1/tasks/{id}": 4}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		method, host, path string
		route              string
		units              int64
	}{
		{"POST", "api.example.com", "/v1/exports", "api.example.com/v1/exports", 25},
		{"POST", "api.example.com:8080", "/v1/exports", "api.example.com/v1/exports", 25},
		{"POST", "other.example.com", "/v1/exports", "POST /v1/exports", 10},
		{"GET", "api.example.com", "/v1/tasks/7", "GET api.example.com/v1/tasks/{id}", 3},
		{"GET", "", "/v1/tasks/7", DefaultRoute, 1},
		// Hostnames are case-insensitive, and a final dot names the same host.
		{"POST", "API.Example.com", "/v1/exports", "api.example.com/v1/exports", 25},
		{"POST", "api.example.com.", "/v1/exports", "api.example.com/v1/exports", 25},
		{"POST", "Api.Example.Com.:443", "/v1/exports", "api.example.com/v1/exports", 25},
		// An IPv6 host on any port too (its port once took its brackets,
		// and then it matched only without a port).
		{"GET", "[::1]", "/v1/tasks/7", "GET [::1]/v1/tasks/{id}", 4},
		{"GET", "[::1]:8080", "/v1/tasks/7", "GET [::1]/v1/tasks/{id}", 4},
		// The escaped path, as ServeMux matches it: %2F stays in its segment
		// and %2e%2e is no dot-segment (the decoded path billed the default).
		{"POST", "", "/v1/exports/a%2Fb", "POST /v1/exports/{name}", 50},
		{"GET", "", "/v1/reports/42/%2e%2e", "GET /v1/reports/{id}/{format}", 40},
		{"GET", "", "/v1/reports/%2e%2e/pdf", "GET /v1/reports/{id}/{format}", 40},
		{"GET", "", "/v1/reports/4%202/pdf", "GET /v1/reports/{id}/{format}", 40},
	} {
		if route, units := s.Routes.MatchHost(c.method, c.host, c.path); route != c.route || units != c.units {
			t.Errorf("MatchHost(%q, %q, %q) = %q, %d; want %q, %d", c.method, c.host, c.path, route, units, c.route, c.units)
		}
	}
	if route, units := s.Routes.Match("POST", "/v1/exports"); route != "POST /v1/exports" || units != 10 {
		t.Errorf("Match without a host: %q, %d", route, units)
	}
}

// MatchRedirect names the requests a Go ServeMux would only redirect (a
// path not in canonical form, a subtree's root without its slash), priced
// as the route they redirect to.
func TestMatchRedirect(t *testing.T) {
	s := Snapshot{Routes: Routes{Default: 1, Weights: map[string]int64{"POST /v1/exports": 50, "POST /v1/jobs/": 20}}}
	if err := s.Build(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path     string
		route    string
		redirect bool
	}{
		{"/v1/exports", "POST /v1/exports", false},
		{"/v1/jobs/", "POST /v1/jobs/", false},
		{"/v1/jobs/7", "POST /v1/jobs/", false},
		{"/v1/tasks/../exports", "POST /v1/exports", true},
		{"//v1/exports", "POST /v1/exports", true},
		{"/v1/exports/.", "POST /v1/exports", true},
		{"/v1/jobs", "POST /v1/jobs/", true},
		{"/v1/other", DefaultRoute, false},
	} {
		route, _, redirect := s.Routes.MatchRedirect("POST", "", c.path)
		if route != c.route || redirect != c.redirect {
			t.Errorf("MatchRedirect(POST %s) = %q, redirect %v; want %q, %v", c.path, route, redirect, c.route, c.redirect)
		}
	}
}

// CheckPattern refuses what ServeMux takes but no request can match, with
// the fix in the error, and keeps every other valid pattern.
// A pattern is at most MaxPatternLen bytes: every charge carries it, and
// router.Client refuses a longer route.
func TestCheckPatternLength(t *testing.T) {
	ok := "GET /" + strings.Repeat("a", MaxPatternLen-5)
	if err := CheckPattern(ok); err != nil {
		t.Errorf("a pattern of %d bytes: %v", len(ok), err)
	}
	if err := CheckPattern(ok + "b"); err == nil || !strings.Contains(err.Error(), "the pattern is 1025 bytes: want at most 1024") {
		t.Errorf("a pattern of %d bytes: %v; want it refused", len(ok)+1, err)
	}
}

func TestCheckPattern(t *testing.T) {
	for p, want := range map[string]string{
		"get /v1/tasks":              `method "get" is not upper case and matches no request (methods are case-sensitive): did you mean GET /v1/tasks?`,
		"Post /v1/exports":           "did you mean POST /v1/exports?",
		"POST/v1/x":                  `route "POST/v1/x": "POST" reads as a host, not a method: put a space between the method and the path ("POST /v1/x")`,
		"post/v1/x":                  `("POST /v1/x")`,
		"GET DELETE/v1/x":            `"DELETE" reads as a host, not a second method: write "GET /v1/x"`,
		"BAD PATTERN /x y":           `the host "PATTERN " holds whitespace`,
		"GET /v1/a b":                `the path "/v1/a b" holds whitespace: write a space in a path as %20`,
		"GET /v1/tasks ":             `the path "/v1/tasks " holds whitespace`,
		"GET api.example .com/v1/x":  `the host "api.example .com" holds whitespace`,
		"GET v1/x":                   `"v1" reads as a host, not part of the path (a pattern is "METHOD [HOST]/PATH"): write "GET /v1/x"`,
		"v1/tasks/{id}":              `write "/v1/tasks/{id}"`,
		"GET API.example.com/v1/x":   `write the host "API.example.com" in lower case without a final dot ("api.example.com")`,
		"GET api.example.com./v1/x":  `write the host "api.example.com." in lower case without a final dot ("api.example.com")`,
		"GET /v1/q?x=1":              `the path "/v1/q?x=1" holds '?': the query (?...) is not part of a route pattern: a pattern matches the path alone, whatever the query; write "GET /v1/q" (a '?' that is part of the path itself is written %3F)`,
		"GET /v1/q?":                 `write "GET /v1/q"`,
		"/v1/files/?":                `write "/v1/files/"`,
		"POST api.example.com/x?y":   `write "POST api.example.com/x"`,
		"GET api.example.com:8443/x": `the host "api.example.com:8443" names a port (8443): a request's host is matched without its port, so this pattern matches no request; write "GET api.example.com/x"`,
		"localhost:8080/v1/x":        `write "localhost/v1/x"`,
		"GET [::1]:8080/x":           `write "GET [::1]/x"`,
		"GET /%zz":                   `the path "/%zz" holds a % that starts no escape of two hex digits`,
		"GET /v1/100%":               `write a % in a path as %25`,
		"GET /v1/page#top":           `the path "/v1/page#top" holds '#': a fragment (#...) is never sent to a server, so no request holds it; write "GET /v1/page" (a '#' that is part of the path itself is written %23)`,
	} {
		err := CheckPattern(p)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), fmt.Sprintf("route %q", p)) {
			t.Errorf("CheckPattern(%q) = %v, want an error naming it and saying %q", p, err, want)
		}
		// ServeMux takes it: a stored table holding it still builds.
		s := Snapshot{Routes: Routes{Weights: map[string]int64{p: 1}}}
		if err := s.Build(); err != nil {
			t.Errorf("Build with %q: %v; a stored table must still load", p, err)
		} else if errs := s.Routes.Unmatchable(); len(errs) != 1 {
			t.Errorf("Unmatchable with %q: %v", p, errs)
		}
	}
	for _, p := range []string{"POST /v1/exports", "GET /v1/tasks/{id}", "/v1/files/", "GET\t/v1/tasks", "GET  /v1/tasks",
		"api.example.com/v1/x", "POST api.example.com/v1/x", "localhost/v1/x", "PURGE /cache/{key...}", "GET /files/my%20doc", "GET /v1/q%3Fx", "GET /v1/c%23", "GET /v1/100%25",
		"POST /pkg.Service/Method", "GET /{$}", "GET /v1/{id}/posts", "GET 127.0.0.1/x", "GET [::1]/x"} {
		if err := CheckPattern(p); err != nil {
			t.Errorf("CheckPattern(%q): %v", p, err)
		}
	}
}

// TestParseRate: a rate is read whole. Before, only the leading digits of
// the count were read, so "1e3/s" was enforced as 1/s.
func TestParseRate(t *testing.T) {
	for s, want := range map[string]shard.Rate{
		"10/s": {Tokens: 10, Per: time.Second}, "600/m": {Tokens: 600, Per: time.Minute}, "5/h": {Tokens: 5, Per: time.Hour},
		"100/1m30s": {Tokens: 100, Per: 90 * time.Second}, "600/1m": {Tokens: 600, Per: time.Minute}, "100/1m0s": {Tokens: 100, Per: time.Minute},
		"3/500ms": {Tokens: 3, Per: 500 * time.Millisecond}, "": {},
	} {
		if got, err := ParseRate(s); err != nil || got != want {
			t.Errorf("ParseRate(%q) = %+v, %v; want %+v", s, got, err, want)
		}
	}
	for s, why := range map[string]string{
		"1e3/s": "not a whole number in digits", "1_000/s": "not a whole number in digits", "1.9/s": "not a whole number in digits",
		"10abc/s": "not a whole number in digits", "+5/s": "not a whole number in digits", " 10/s": "not a whole number in digits",
		"10 /s": "not a whole number in digits", "-5/s": "not a whole number in digits", "/s": "not a whole number in digits",
		"0/s": "not from 1 to", "99999999999999999999/s": "not from 1 to", "1000000000000001/s": "not from 1 to",
		"10": "no /", "ten": "no /", "10/ s": `period " s"`, "10/S": `period "S"`, "10/sec": `period "sec"`, "10/1.5s": `period "1.5s"`,
		"10/+1s": `period "+1s"`, "10/0s": `period "0s"`, "10/s ": `period "s "`, "10/-1m": `period "-1m"`, "10/": `period ""`,
		// 10/1ns is 10^10 a second, no limit at all: a typo for ms.
		"10/1ns": `period "1ns"`, "10/500us": `period "500us"`, "10/500µs": `period "500µs"`, "10/1s1ns": `period "1s1ns"`,
	} {
		_, err := ParseRate(s)
		if err == nil || !strings.Contains(err.Error(), why) || !strings.Contains(err.Error(), fmt.Sprintf("rate %q", s)) ||
			!strings.Contains(err.Error(), "want TOKENS/PERIOD such as 10/s") {
			t.Errorf("ParseRate(%q) = %v; want an error naming it, saying %q and the form wanted", s, err, why)
		}
	}
}

// TestStoredLegacyRate: a plan stored before ParseRate was strict still
// loads, with the rate it was enforced at, while a new plan with it is
// refused (Plan.Shard, which the admin API and the ledger's writes use).
func TestStoredLegacyRate(t *testing.T) {
	s, err := Decode([]byte(`{"plans":[{"id":"old","rate":"1e3/s","monthly_quota":5,"hard":true},{"id":"new","rate":"10/s","monthly_quota":5}],
		"accounts":[{"id":"acme","plan":"old"}],"keys":[],"routes":{"default":1}}`))
	if err != nil {
		t.Fatalf("a snapshot with a stored legacy rate: %v; want it loaded", err)
	}
	if cfg, _ := s.AccountConfig("acme"); cfg.Plan.Rate != (shard.Rate{Tokens: 1, Per: time.Second}) || cfg.Plan.Burst != 1 {
		t.Errorf("legacy plan loads as %+v, want 1/s with burst 1 as before", cfg.Plan)
	}
	if _, err := s.Plans[0].Shard(); err == nil {
		t.Error("Plan.Shard takes 1e3/s: a new plan must be refused")
	}
	if _, err := Decode([]byte(`{"plans":[{"id":"bad","rate":"ten","monthly_quota":5}],"accounts":[],"keys":[],"routes":{}}`)); err == nil {
		t.Error("a rate neither parser reads loads")
	}
}

// TestCheckID: ids that differ by what no one sees, or that do not read
// back as stored, are refused for new plans, accounts and grants; a stored
// one still loads.
func TestCheckID(t *testing.T) {
	for _, id := range []string{"acme", "order-1234", "team#42", "Ünïcødé", "日本", "q\u0307x" /* NFC: no one character for both */, "\u0915\u094d\u0937", "a:b", strings.Repeat("x", MaxIDLen)} {
		if err := CheckID(id); err != nil {
			t.Errorf("CheckID(%q): %v", id, err)
		}
	}
	for id, want := range map[string]string{
		"acme\u200b":                    "character 5 (U+200B, at byte 5) is a format character",
		"acme\u00a0":                    "character 5 (U+00A0, at byte 5) is a space",
		"acme\u0085":                    "character 5 (U+0085, at byte 5) is a control character",
		"ac\u202eme":                    "character 3 (U+202E, at byte 3) is a format character",
		"acme\xff":                      "byte 5 (0xFF) is not UTF-8",
		"é\xffx":                        "byte 3 (0xFF) is not UTF-8",
		"ac me":                         "character 3 (U+0020, at byte 3) is a space",
		"a\tb":                          "is a control character",
		"a/b":                           "is a slash",
		"a\x7f":                         "is a control character",
		"a\u2028":                       "is a space",
		"a\U000E0001":                   "is a format character",
		"a\ue000":                       "is not printable", // private use
		"acme\u3164":                    "character 5 (U+3164, at byte 5) is a letter that shows as blank",
		"acme\u2800":                    "is a letter that shows as blank",
		"\u0301acme":                    "character 1 (U+0301, at byte 1) is a combining mark with no character before it",
		"u\u0308ber":                    `is not in Unicode normal form NFC (a letter and its accent written as two characters, which looks like the one character): write it as "über"`,
		"":                              "an id is 1 to 200",
		strings.Repeat("x", MaxIDLen+1): "201 bytes",
	} {
		if err := CheckID(id); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("CheckID(%q) = %v, want it to say %q", id, err, want)
		}
	}
	// Build does not check ids: one stored before CheckID still loads.
	s, err := Decode([]byte(`{"plans":[{"id":"p\u200b","monthly_quota":5}],"accounts":[{"id":"acme\u200b","plan":"p\u200b"}],"keys":[],"routes":{}}`))
	if err != nil || !s.HasAccount("acme\u200b") {
		t.Fatalf("a stored account id CheckID refuses: %v; want it loaded", err)
	}
}
