package router

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkMiddleware is the front's own work per request (key lookup,
// route match, headers, bookkeeping) around a charge that costs nothing:
//
//	go test -run '^$' -bench BenchmarkMiddleware -benchmem ./router/
func BenchmarkMiddleware(b *testing.B) {
	ch := &fakeCharger{decision: okDecision()}
	mw, err := Middleware(FrontOptions{Charger: ch, Config: testConfig(&testing.T{})})
	if err != nil {
		b.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(200) }))
	req := newRequest("POST", "/v1/tasks", nil)
	b.ReportAllocs()
	for b.Loop() {
		h.ServeHTTP(httptest.NewRecorder(), req)
		ch.charges = ch.charges[:0]
	}
}
