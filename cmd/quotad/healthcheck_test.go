package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// quotad healthcheck: exit 0 on a node's 2xx, an error saying what it got
// otherwise (the Docker HEALTHCHECK of an image without an HTTP client).
func TestHealthcheck(t *testing.T) {
	run := func(args ...string) (string, error) {
		t.Helper()
		var out bytes.Buffer
		root := newRootCmd()
		root.SetArgs(append([]string{"healthcheck"}, args...))
		root.SetOut(&out)
		root.SetErr(io.Discard)
		err := root.Execute()
		return out.String(), err
	}
	n := startAdminTestNode(t)
	for _, path := range []string{"/readyz", "/healthz"} {
		if out, err := run("--url", "http://"+n.AdminAddr()+path); err != nil || !strings.Contains(out, "200") {
			t.Errorf("healthcheck of a serving node's %s: %q, %v; want 200 and no error", path, out, err)
		}
	}
	draining := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not ready: draining", http.StatusServiceUnavailable)
	}))
	defer draining.Close()
	if _, err := run("--url", draining.URL+"/readyz"); err == nil || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "draining") {
		t.Errorf("healthcheck of a draining node: %v; want an error with the status and the reason", err)
	}
	addr := draining.Listener.Addr().String()
	draining.Close()
	if _, err := run("--url", "http://"+addr+"/readyz"); err == nil || !strings.Contains(err.Error(), "did not answer") {
		t.Errorf("healthcheck of nothing: %v; want \"did not answer\"", err)
	}
	for _, bad := range [][]string{{"--url", "127.0.0.1:9090/readyz"}, {"--url", "ftp://x/readyz"}, {"--timeout", "0s"}, {"--ca-cert", "ca.pem"}} {
		if _, err := run(bad...); err == nil {
			t.Errorf("healthcheck %v: accepted", bad)
		}
	}
}

func TestDefaultHealthURL(t *testing.T) {
	for _, c := range []struct {
		addr string
		tls  bool
		want string
	}{
		{"", false, "http://127.0.0.1:9090/readyz"},
		{":9091", false, "http://127.0.0.1:9091/readyz"},
		{"0.0.0.0:9092", true, "https://127.0.0.1:9092/readyz"},
		{"10.0.0.5:9090", false, "http://10.0.0.5:9090/readyz"},
		{"[::]:9093", false, "http://127.0.0.1:9093/readyz"},
		{"[fd00::5]:9090", false, "http://[fd00::5]:9090/readyz"},
	} {
		if got := defaultHealthURL(c.addr, c.tls); got != c.want {
			t.Errorf("defaultHealthURL(%q, %v) = %s; want %s", c.addr, c.tls, got, c.want)
		}
	}
}
