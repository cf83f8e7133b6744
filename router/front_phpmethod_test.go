package router

import (
	"net/http"
	"testing"

	"github.com/quotaring/quotaring/snapshot"
)

// PHP (so Symfony and Laravel, which read _method from the query) turns
// dots and spaces in a parameter's name into underscores and drops leading
// spaces: ?.method=DELETE is $_GET['_method'] there, and a POST with it
// runs as a DELETE. It was priced as the POST.
func TestPHPMangledMethodOverrideIsPriced(t *testing.T) {
	s, err := snapshot.Decode([]byte(`{"version":1,"plans":[{"id":"p","monthly_quota":100,"hard":true}],
		"accounts":[{"id":"acme","plan":"p"}],"keys":[{"id":"k1","hash":"` + snapshot.HashKey("secret") + `","account":"acme"}],
		"routes":{"version":1,"default":1,"weights":{"POST /v1/things":2,"DELETE /v1/things":10}}}`))
	if err != nil {
		t.Fatal(err)
	}
	ch := &fakeCharger{decision: okDecision()}
	ok := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	for _, q := range []string{".method=DELETE", "%2Emethod=DELETE", "+_method=DELETE", "%20.method=DELETE", "a=1&.method=delete"} {
		serve(t, FrontOptions{Charger: ch, Config: staticConfig{s}}, ok, newRequest("POST", "/v1/things?"+q, nil))
		ch.mu.Lock()
		got := ch.charges[len(ch.charges)-1]
		ch.mu.Unlock()
		if got.Route != "DELETE /v1/things" || got.Units != 10 {
			t.Errorf("POST /v1/things?%s: charged %d units as %q, want 10 as DELETE (PHP reads the name as _method)", q, got.Units, got.Route)
		}
	}
	// Not an override anywhere: priced as the POST.
	for _, q := range []string{"x_method=DELETE", "method=DELETE", "_method_=DELETE"} {
		serve(t, FrontOptions{Charger: ch, Config: staticConfig{s}}, ok, newRequest("POST", "/v1/things?"+q, nil))
		if got := ch.charges[len(ch.charges)-1]; got.Route != "POST /v1/things" {
			t.Errorf("POST /v1/things?%s: charged as %q, want POST", q, got.Route)
		}
	}
}

// RequestTarget is the same for the same request however many spellings
// of _method it holds (a retry must not read as another request).
func TestRequestTargetIsStableWithManyOverrides(t *testing.T) {
	want := RequestTarget(newRequest("POST", "/v1/things?_method=PUT&.method=DELETE&+_method=PATCH", nil))
	for i := 0; i < 50; i++ {
		if got := RequestTarget(newRequest("POST", "/v1/things?_method=PUT&.method=DELETE&+_method=PATCH", nil)); got != want {
			t.Fatalf("RequestTarget changed between two reads of one request")
		}
	}
}
