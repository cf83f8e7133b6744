package node

import (
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestDecodeBodyMemberNames: encoding/json matches member names regardless
// of case and keeps the last, so a member in another case silently
// overrode the real one ({"units":5,"Units":500000} granted 500000).
func TestDecodeBodyMemberNames(t *testing.T) {
	decode := func(body string, v any) *adminProblem {
		t.Helper()
		err := decodeBody(httptest.NewRecorder(), httptest.NewRequest("POST", "/admin/v1/x", strings.NewReader(body)), v)
		var p *adminProblem
		if err != nil && !errors.As(err, &p) {
			t.Fatalf("%s: %v, want a problem", body, err)
		}
		return p
	}
	for _, c := range []struct {
		body   string
		v      any
		field  string
		detail []string
	}{
		{`{"units":5,"Units":500000}`, &grantBody{}, "units", []string{`"units" and "Units"`, "give it once"}},
		{`{"Units":500000,"units":5}`, &grantBody{}, "units", []string{`"Units" and "units"`}},
		{`{"monthly_quota":1,"hard":true,"Hard":false}`, &planBody{}, "hard", []string{`"hard" and "Hard"`}},
		{`{"units":5,"unitſ":6}`, &grantBody{}, "units", []string{`"units" and "unitſ"`}}, // ſ folds to s, as in encoding/json
		{`{"units":5,"units":6}`, &grantBody{}, "units", []string{"given twice: give each member once"}},
		{`{"Units":5}`, &grantBody{}, "Units", []string{"case-sensitive", `did you mean "units"?`}},
		{`{"monthly_quota":1,"HARD":true}`, &planBody{}, "HARD", []string{`did you mean "hard"?`}},
		{`{"Weights":{"GET /x":1}}`, &routesBody{}, "Weights", []string{`did you mean "weights"?`}},
		{`{"weights":{"GET /x":1,"GET /y":2,"GET /x":3}}`, &routesBody{}, `weights["GET /x"]`, []string{"given twice"}},
		{`{"montly_quota":1,"hard":true}`, &planBody{}, "montly_quota", []string{"unknown member"}},
		// null decoded into nothing: every member at its zero (an empty
		// route table, from jq printing a missing key).
		{`null`, &routesBody{}, "body", []string{"want a JSON object ({...}), got null"}},
		{` [1]`, &grantBody{}, "body", []string{"want a JSON object"}},
	} {
		p := decode(c.body, c.v)
		if p == nil || p.Status != 400 || p.Field != c.field {
			t.Errorf("%s: %+v, want a 400 naming %q", c.body, p, c.field)
			continue
		}
		for _, d := range c.detail {
			if !strings.Contains(p.Detail, d) {
				t.Errorf("%s: detail %q, want it to say %s", c.body, p.Detail, d)
			}
		}
	}
	// Map keys are matched exactly: patterns that differ in case are two.
	var rb routesBody
	if p := decode(`{"default":1,"weights":{"GET /a":1,"GET /A":2}}`, &rb); p != nil || len(rb.Weights) != 2 {
		t.Errorf("two patterns differing in case: %+v %v, want both taken", p, rb.Weights)
	}
	var gb grantBody
	if p := decode(`{"units":5,"id":"order-1","starts_at":"2026-07-01T00:00:00Z"}`, &gb); p != nil || *gb.Units != 5 {
		t.Errorf("a good grant: %+v", p)
	}
}
