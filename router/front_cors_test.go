package router

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
)

// With CORSOrigins, a page on a listed origin can read every answer: the
// front answers its preflights itself, and its own refusals and usage
// answers, which carried no CORS headers (a browser showed a network
// error instead of the 429), carry Access-Control-Allow-Origin and expose
// the quota headers; the API's answers too, with one Allow-Origin and the
// API's exposed headers kept. Other origins are the API's, as before.
func TestCORSOrigins(t *testing.T) {
	const app = "https://app.example"
	var served int
	api := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		served++
		w.Header().Set("Access-Control-Allow-Origin", "https://elsewhere.example")
		w.Header().Set("Access-Control-Expose-Headers", "X-Trace")
		w.WriteHeader(http.StatusOK)
	})
	opts := func() FrontOptions {
		return FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t), CORSOrigins: []string{app}, UsagePath: "/usage"}
	}
	from := func(r *http.Request, origin string) *http.Request {
		r.Header.Set("Origin", origin)
		return r
	}
	preflight := func(origin string) *http.Request {
		r := from(httptest.NewRequest("OPTIONS", "/v1/tasks", nil), origin)
		r.Header.Set("Access-Control-Request-Method", "POST")
		r.Header.Set("Access-Control-Request-Headers", "authorization, idempotency-key")
		return r
	}
	readable := func(what string, w *httptest.ResponseRecorder) {
		t.Helper()
		if got := w.Header().Values("Access-Control-Allow-Origin"); len(got) != 1 || got[0] != app {
			t.Errorf("%s: Access-Control-Allow-Origin %q, want %s once", what, got, app)
		}
		if e := strings.Join(w.Header().Values("Access-Control-Expose-Headers"), ", "); !strings.Contains(e, "X-Quota-Remaining") || !strings.Contains(e, "Retry-After") {
			t.Errorf("%s: Access-Control-Expose-Headers %q, want the quota headers", what, e)
		}
	}

	w, _ := serve(t, opts(), api, preflight(app))
	if w.Code != http.StatusNoContent || served != 0 || w.Header().Get("Access-Control-Allow-Methods") != "POST" ||
		w.Header().Get("Access-Control-Allow-Headers") != "authorization, idempotency-key" || w.Header().Get("Access-Control-Max-Age") == "" {
		t.Fatalf("preflight from %s: %d %v, API ran %d times; want 204 from the front", app, w.Code, w.Header(), served)
	}
	readable("preflight", w)
	if w, _ = serve(t, opts(), api, preflight("https://other.example")); served != 1 || w.Header().Get("Access-Control-Allow-Origin") != "https://elsewhere.example" {
		t.Fatalf("preflight from an origin not listed: API ran %d times, %v; want it the API's", served, w.Header())
	}

	unknown := from(httptest.NewRequest("GET", "/v1/tasks", nil), app)
	unknown.Header.Set("X-Api-Key", "nope")
	w, _ = serve(t, opts(), api, unknown)
	if w.Code != http.StatusUnauthorized {
		t.Fatalf("unknown key: %d", w.Code)
	}
	readable("the front's 401", w)
	w, _ = serve(t, opts(), api, from(newRequest("GET", "/usage", nil), app))
	if w.Code != http.StatusOK {
		t.Fatalf("usage: %d", w.Code)
	}
	readable("the usage endpoint", w)
	w, _ = serve(t, opts(), api, from(newRequest("POST", "/v1/tasks", nil), app))
	readable("the API's answer", w)
	if e := strings.Join(w.Header().Values("Access-Control-Expose-Headers"), ", "); !strings.Contains(e, "X-Trace") {
		t.Errorf("the API's answer exposes %q: the API's own X-Trace was dropped", e)
	}
	w, _ = serve(t, opts(), api, newRequest("POST", "/v1/tasks", nil)) // no Origin: not a browser's cross-origin call
	if got := w.Header().Get("Access-Control-Allow-Origin"); got != "https://elsewhere.example" {
		t.Errorf("a request without Origin: Allow-Origin %q, want the API's as it set it", got)
	}
}

func TestCORSOriginsChecked(t *testing.T) {
	for _, bad := range [][]string{{"app.example"}, {"https://app.example/"}, {"https://app.example/path"}, {"ftp://app.example"}, {"*", "https://app.example"}} {
		if err := (FrontOptions{CORSOrigins: bad}).Check(); err == nil {
			t.Errorf("CORS origins %q: accepted", bad)
		}
	}
	for _, good := range [][]string{{"*"}, {"https://app.example", "http://localhost:3000"}} {
		if err := (FrontOptions{CORSOrigins: good}).Check(); err != nil {
			t.Errorf("CORS origins %q: %v", good, err)
		}
	}
}

// Through the proxy the upstream's headers are copied in just before the
// answer's head: still one Allow-Origin, the front's.
func TestCORSOriginsThroughTheProxy(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Access-Control-Allow-Origin", "https://elsewhere.example")
		w.WriteHeader(http.StatusOK)
	}))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	p, err := NewProxy(u, FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t), CORSOrigins: []string{"*"}})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(p)
	defer front.Close()
	req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
	req.Header.Set("X-Api-Key", "secret")
	req.Header.Set("Origin", "https://app.example")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if got := res.Header.Values("Access-Control-Allow-Origin"); res.StatusCode != 200 || len(got) != 1 || got[0] != "*" {
		t.Fatalf("through the proxy: %d, Allow-Origin %q; want 200 and * once", res.StatusCode, got)
	}
}
