package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"
)

// quotad bench cluster on a cluster without its accounts says how to make
// them (--setup) instead of only "refused: UNKNOWN_ACCOUNT".
func TestBenchClusterWithoutItsAccounts(t *testing.T) {
	n := startAdminTestNode(t)
	_, err := runQuotad(t, "bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "1", "--duration", "1s")
	if err == nil || !strings.Contains(err.Error(), "UNKNOWN_ACCOUNT") || !strings.Contains(err.Error(), "--setup --ledger DSN") {
		t.Fatalf("bench cluster without bench accounts: %v; want the refusal and how to create them", err)
	}
}

// Calls that fail while measuring are no charges/s: the row counts only
// the calls that succeeded, and the command fails, so that a script does
// not record a run of refusals as a measurement.
func TestBenchClusterFailsWhenCallsFail(t *testing.T) {
	n := startAdminTestNode(t)
	var stdout bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"bench", "cluster", "--nodes", n.RPCAddr(), "--accounts", "10", "--concurrency", "2", "--duration", "300ms", "--warm=false"})
	root.SetOut(&stdout)
	root.SetErr(io.Discard)
	err := root.ExecuteContext(context.Background())
	out := stdout.String()
	if err == nil || !strings.Contains(err.Error(), "calls failed") {
		t.Fatalf("bench cluster whose every call is refused: %v; want it to fail\n%s", err, out)
	}
	rows := 0
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[0] == "2" {
			rows++
			if f[1] != "0" || f[2] != "0" {
				t.Fatalf("row %q: refused calls counted as charges/s or calls/s", line)
			}
		}
	}
	if rows != 1 {
		t.Fatalf("want one row for concurrency 2 in:\n%s", out)
	}
}
