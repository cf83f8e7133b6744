package snapshot

import (
	"fmt"
	"strings"
	"testing"
)

// Patterns with a host part match requests to that host (any port), as in
// net/http; patterns without one match every host.
func TestMatchHost(t *testing.T) {
	s := Snapshot{Routes: Routes{Default: 1, Weights: map[string]int64{
		"api.example.com/v1/exports": 25, "POST /v1/exports": 10, "GET api.example.com/v1/tasks/{id}": 3,
		"POST /v1/exports/{name}": 50, "GET /v1/reports/{id}/{format}": 40}}}
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
func TestCheckPattern(t *testing.T) {
	for p, want := range map[string]string{
		"get /v1/tasks":             `method "get" is not upper case and matches no request (methods are case-sensitive): did you mean GET /v1/tasks?`,
		"Post /v1/exports":          "did you mean POST /v1/exports?",
		"POST/v1/x":                 `route "POST/v1/x": "POST" reads as a host, not a method: put a space between the method and the path ("POST /v1/x")`,
		"post/v1/x":                 `("POST /v1/x")`,
		"GET DELETE/v1/x":           `"DELETE" reads as a host, not a second method: write "GET /v1/x"`,
		"BAD PATTERN /x y":          `the host "PATTERN " holds whitespace`,
		"GET /v1/a b":               `the path "/v1/a b" holds whitespace: write a space in a path as %20`,
		"GET /v1/tasks ":            `the path "/v1/tasks " holds whitespace`,
		"GET api.example .com/v1/x": `the host "api.example .com" holds whitespace`,
		"GET v1/x":                  `"v1" reads as a host, not part of the path (a pattern is "METHOD [HOST]/PATH"): write "GET /v1/x"`,
		"v1/tasks/{id}":             `write "/v1/tasks/{id}"`,
		"GET API.example.com/v1/x":  `write the host "API.example.com" in lower case without a final dot ("api.example.com")`,
		"GET api.example.com./v1/x": `write the host "api.example.com." in lower case without a final dot ("api.example.com")`,
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
		"api.example.com/v1/x", "POST api.example.com/v1/x", "localhost/v1/x", "PURGE /cache/{key...}", "GET /files/my%20doc",
		"POST /pkg.Service/Method", "GET /{$}", "GET /v1/{id}/posts", "GET api:8080/v1/x", "GET 127.0.0.1/x", "GET [::1]/x"} {
		if err := CheckPattern(p); err != nil {
			t.Errorf("CheckPattern(%q): %v", p, err)
		}
	}
}
