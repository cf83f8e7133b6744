package main

import (
	"bytes"
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// quotad bench proxy against quotad bench upstream, through a reverse proxy
// that, like a node's front, wants a key: every request is answered, the
// table has both ways and the difference, and a wrong key fails at once
// with the proxy's answer.
func TestBenchProxy(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	// Every answer takes at least work: a p50 below it shows the work left
	// out, whatever a loaded machine adds on loopback.
	const work = 30 * time.Millisecond
	addr := make(chan string, 1)
	served := make(chan error, 1)
	go func() {
		served <- runBenchUpstream(ctx, &bytes.Buffer{}, benchUpstreamFlags{listen: "127.0.0.1:0", work: work}, func(a string) { addr <- a })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("bench upstream: %v", err)
		}
	})
	var up string
	select {
	case up = <-addr:
	case err := <-served:
		t.Fatalf("bench upstream did not start: %v", err)
	}
	target, _ := url.Parse("http://" + up)
	rp := httputil.NewSingleHostReverseProxy(target)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer good-key" {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusUnauthorized)
			w.Write([]byte(`{"type":"https://quotaring.dev/problems/unknown-key"}`))
			return
		}
		w.Header().Set("RateLimit-Policy", `"monthly";q=1000`) // as the quotad front's every answer
		rp.ServeHTTP(w, r)
	}))
	defer front.Close()

	f := benchProxyFlags{proxy: front.URL, direct: "http://" + up, keys: []string{"good-key"}, method: "GET", path: "/v1/tasks",
		rate: 200, round: 100 * time.Millisecond, rounds: 2, serverTiming: true, timeout: 5 * time.Second}
	var out, progress bytes.Buffer
	if err := runBenchProxy(ctx, &out, &progress, f); err != nil {
		t.Fatalf("bench proxy: %v\n%s", err, out.String())
	}
	// --proxy mistyped as the upstream's address measured the upstream
	// against itself, exit 0: refused, since its answers carry no quota
	// headers.
	wrong := f
	wrong.proxy = "http://" + up
	if err := runBenchProxy(ctx, &bytes.Buffer{}, &bytes.Buffer{}, wrong); err == nil || !strings.Contains(err.Error(), "carries no quota headers") {
		t.Errorf("bench proxy with --proxy at the upstream: %v, want it refused", err)
	}
	wrong.anyProxy, wrong.rounds = true, 1 // a bare reverse proxy, on purpose
	if err := runBenchProxy(ctx, &bytes.Buffer{}, &bytes.Buffer{}, wrong); err != nil {
		t.Errorf("bench proxy --any-proxy: %v", err)
	}
	for _, want := range []string{"direct          40", "proxied         40", "added", "round 2/2 proxied"} {
		if !strings.Contains(out.String()+progress.String(), want) {
			t.Errorf("output lacks %q:\n%s%s", want, progress.String(), out.String())
		}
	}
	// The upstream's work is left out: what remains is loopback.
	sawDirect := false
	for _, line := range strings.Split(out.String(), "\n") {
		if fs := strings.Fields(line); len(fs) == 6 && fs[0] == "direct" {
			sawDirect = true
			if p50, err := time.ParseDuration(fs[2]); err != nil || p50 >= work {
				t.Errorf("direct p50 %s (%v): the upstream's %v of work (Server-Timing) was not left out", fs[2], err, work)
			}
		}
	}
	if !sawDirect {
		t.Errorf("no direct row in the table:\n%s", out.String())
	}

	// Ctrl-C after a round: the table of the rounds before the one it
	// stopped, said so, and exit 130 (it printed nothing, exit 1).
	stopCtx, stop := context.WithTimeout(ctx, 1500*time.Millisecond)
	stopped := f
	stopped.round, stopped.rounds = 300*time.Millisecond, 20
	out.Reset()
	err := runBenchProxy(stopCtx, &out, &progress, stopped)
	stop()
	if exitCode(err) != 130 || !strings.Contains(out.String(), "(stopped in round ") || !strings.Contains(out.String(), "\nproxied ") {
		t.Fatalf("bench proxy stopped after its first round: %v (exit %d)\n%s\nwant the rounds before it and exit 130", err, exitCode(err), out.String())
	}

	f.keys = []string{"bad-key"}
	err = runBenchProxy(ctx, &out, &progress, f)
	if err == nil || !strings.Contains(err.Error(), "401") || !strings.Contains(err.Error(), "unknown-key") {
		t.Fatalf("a wrong key: %v, want the proxy's 401 unknown-key at the first request", err)
	}

	// The same front over HTTPS, with a certificate from a CA of its own:
	// refused with the flag to give, then measured with it.
	tlsFront := httptest.NewUnstartedServer(front.Config.Handler)
	tlsFront.EnableHTTP2 = true // as a node's front offers it
	tlsFront.StartTLS()
	defer tlsFront.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: tlsFront.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	f.keys, f.proxy = []string{"good-key"}, tlsFront.URL
	if err := runBenchProxy(ctx, &out, &progress, f); err == nil || !strings.Contains(err.Error(), "--ca-cert") {
		t.Fatalf("an https proxy whose CA is not trusted: %v, want an error naming --ca-cert", err)
	}
	f.caCert = ca
	out.Reset()
	if err := runBenchProxy(ctx, &out, &progress, f); err != nil || !strings.Contains(out.String(), "proxied         40") {
		t.Fatalf("an https proxy with --ca-cert: %v\n%s", err, out.String())
	}
	f.proxy = front.URL
	if err := runBenchProxy(ctx, &out, &progress, f); err == nil || !strings.Contains(err.Error(), "neither --proxy") {
		t.Fatalf("--ca-cert with plain URLs: %v, want an error", err)
	}
}

func TestServerTimingApp(t *testing.T) {
	for _, tc := range []struct {
		values []string
		want   time.Duration
	}{
		{nil, 0},
		{[]string{"app;dur=1.5"}, 1500 * time.Microsecond},
		{[]string{`db;dur=53, app;desc="the API";dur=2`}, 2 * time.Millisecond},
		{[]string{"cache;desc=hit", "app;dur=0.25"}, 250 * time.Microsecond},
		{[]string{"app;dur=oops"}, 0},
		{[]string{"app"}, 0},
	} {
		h := http.Header{}
		for _, v := range tc.values {
			h.Add("Server-Timing", v)
		}
		if got := serverTimingApp(h); got != tc.want {
			t.Errorf("Server-Timing %q: %v, want %v", tc.values, got, tc.want)
		}
	}
}
