package snapshot

import (
	"testing"
)

// Patterns with a host part match requests to that host (any port), as in
// net/http; patterns without one match every host.
func TestMatchHost(t *testing.T) {
	s := Snapshot{Routes: Routes{Default: 1, Weights: map[string]int64{
		"api.example.com/v1/exports": 25, "POST /v1/exports": 10, "GET api.example.com/v1/tasks/{id}": 3}}}
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
	} {
		if route, units := s.Routes.MatchHost(c.method, c.host, c.path); route != c.route || units != c.units {
			t.Errorf("MatchHost(%q, %q, %q) = %q, %d; want %q, %d", c.method, c.host, c.path, route, units, c.route, c.units)
		}
	}
	if route, units := s.Routes.Match("POST", "/v1/exports"); route != "POST /v1/exports" || units != 10 {
		t.Errorf("Match without a host: %q, %d", route, units)
	}
}
