package main

import (
	"bytes"
	"strings"
	"testing"
)

// A misspelt QUOTAD_* variable is reported, a real one is not.
func TestWarnUnknownEnv(t *testing.T) {
	var w bytes.Buffer
	warnUnknownEnv(&w, newRootCmd(), []string{"QUOTAD_SETTLE_INTRVAL=1s", "QUOTAD_SETTLE_INTERVAL=1s", "QUOTAD_ADMIN_TOKEN=x", "HOME=/root"})
	if got := w.String(); !strings.Contains(got, "QUOTAD_SETTLE_INTRVAL") || strings.Count(got, "\n") != 1 {
		t.Fatalf("warnings:\n%s\nwant one, for QUOTAD_SETTLE_INTRVAL", got)
	}
}

// Commands that take no arguments refuse them; variadic ones still work.
func TestStrayArguments(t *testing.T) {
	root := newRootCmd()
	for _, args := range [][]string{{"migrate", "extra"}, {"reconcile", "x"}, {"serve", "x"}} {
		c, rest, err := root.Find(args)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Args(c, rest); err == nil {
			t.Errorf("quotad %s: stray argument accepted", strings.Join(args, " "))
		}
	}
	c, rest, err := root.Find([]string{"admin", "routes", "set", "GET /a=1", "POST /b=2"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Args(c, rest); err != nil {
		t.Errorf("admin routes set with patterns: %v", err)
	}
}
