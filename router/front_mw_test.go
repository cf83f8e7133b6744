package router

import (
	"context"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// mwServer serves h behind Middleware(opts) on loopback; codes hears each
// answer's status once the front is done with it (refund included).
func mwServer(t *testing.T, opts FrontOptions, h http.Handler) (url string, codes chan int) {
	t.Helper()
	codes = make(chan int, 16)
	opts.OnRequest = func(code int, _ time.Duration) { codes <- code }
	mw, err := Middleware(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mw(h))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the panics below are on purpose
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL, codes
}

func waitCode(t *testing.T, codes chan int) int {
	t.Helper()
	select {
	case c := <-codes:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("the front never finished the request")
		return 0
	}
}

// A handler that panics after it wrote its whole answer (in a deferred
// call, say) sent that answer as a complete 200 OK, with the charge
// refunded: the front flushed it before the refund. net/http sends
// nothing of a buffered answer whose handler panicked; neither does the
// front, and the refund stands.
func TestMiddlewarePanicAfterWriteSendsNothing(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	url, codes := mwServer(t, FrontOptions{Charger: ch, Config: testConfig(t)}, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Length", "6")
		w.Write([]byte("hello\n"))
		panic("a deferred audit call failed")
	}))
	req, _ := http.NewRequest("POST", url+"/v1/tasks", nil)
	req.Header.Set("Authorization", "Bearer secret")
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Errorf("the client got %d %q from a handler that panicked, refunded; want no answer", resp.StatusCode, body)
	}
	waitCode(t, codes)
	if _, refunds := ch.counts(); refunds != 1 {
		t.Errorf("%d refunds, want 1", refunds)
	}
}

// A client that hangs up before the answer's head keeps its charge, though
// the handler then answers 5xx (http.Error on a cancelled context is a
// common pattern): it was refunded, so a client could start work and hang
// up to have it free.
func TestMiddlewareClientGoneBeforeA5xxIsBilled(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	entered := make(chan struct{})
	url, codes := mwServer(t, FrontOptions{Charger: ch, Config: testConfig(t)}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-r.Context().Done()
		http.Error(w, "canceled", http.StatusInternalServerError)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/tasks", nil)
	req.Header.Set("Authorization", "Bearer secret")
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-entered
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("the client's request: %v, want it cancelled", err)
	}
	waitCode(t, codes)
	if _, refunds := ch.counts(); refunds != 0 {
		t.Errorf("%d refunds of a request whose client hung up before the answer, want 0", refunds)
	}
}

// A Charger closed (the process shutting down) is answered
// quota-unavailable, which a client retries elsewhere: it was 500
// internal-error.
func TestMiddlewareClosedChargerIsUnavailable(t *testing.T) {
	ch := &fakeCharger{err: ErrClosed}
	w, _ := serve(t, FrontOptions{Charger: ch, Config: testConfig(t)}, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		t.Error("the handler ran without a charge")
	}), newRequest("POST", "/v1/tasks", nil))
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") == "" || !strings.Contains(w.Body.String(), "quota-unavailable") {
		t.Errorf("a closed Charger: %d %q (Retry-After %q), want 503 quota-unavailable", w.Code, w.Body.String(), w.Header().Get("Retry-After"))
	}
}

// The options of NewProxy alone are refused by Middleware (they did
// nothing there: StripAPIKeyHeader left the key in the handler's request),
// and a nil handler when it is wrapped, not at every request.
func TestMiddlewareRefusesProxyOptionsAndANilHandler(t *testing.T) {
	base := FrontOptions{Charger: &fakeCharger{decision: okDecision()}, Config: testConfig(t)}
	for name, mod := range map[string]func(*FrontOptions){
		"StripAPIKeyHeader": func(o *FrontOptions) { o.StripAPIKeyHeader = true },
		"NoUpgrades":        func(o *FrontOptions) { o.NoUpgrades = true },
		"UpstreamTimeout":   func(o *FrontOptions) { o.UpstreamTimeout = time.Second },
		"BodyTimeout":       func(o *FrontOptions) { o.BodyTimeout = time.Second },
		"TrustForwarded":    func(o *FrontOptions) { o.TrustForwarded = true },
	} {
		o := base
		mod(&o)
		if _, err := Middleware(o); err == nil || !strings.Contains(err.Error(), "FrontOptions."+name+" apply to NewProxy only") {
			t.Errorf("%s: %v, want it refused", name, err)
		}
	}
	mw, err := Middleware(base)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if p := recover(); p == nil || !strings.Contains(p.(string), "nil http.Handler") {
			t.Errorf("wrapping a nil handler: %v, want a panic naming it", p)
		}
	}()
	mw(nil)
}

// With CORSOrigins, an answer whose head a flush sends (an event stream)
// and one the handler never wrote carry the CORS headers too: they went
// out without them, and a page could read neither.
func TestMiddlewareCORSOnStreamsAndEmptyAnswers(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	mux := http.NewServeMux()
	mux.HandleFunc("/stream", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		http.NewResponseController(w).Flush()
		w.Write([]byte("data: x\n\n"))
	})
	mux.HandleFunc("/nothing", func(http.ResponseWriter, *http.Request) {})
	url, codes := mwServer(t, FrontOptions{Charger: ch, Config: testConfig(t), CORSOrigins: []string{"https://app.example.com"}}, mux)
	for _, path := range []string{"/stream", "/nothing"} {
		req, _ := http.NewRequest("GET", url+path, nil)
		req.Header.Set("Authorization", "Bearer secret")
		req.Header.Set("Origin", "https://app.example.com")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		waitCode(t, codes)
		if got := resp.Header.Get("Access-Control-Allow-Origin"); resp.StatusCode != 200 || got != "https://app.example.com" ||
			!strings.Contains(resp.Header.Get("Access-Control-Expose-Headers"), "RateLimit") {
			t.Errorf("%s: %d, Access-Control-Allow-Origin %q, exposed %q; want the CORS headers", path, resp.StatusCode, got, resp.Header.Get("Access-Control-Expose-Headers"))
		}
	}
}

// errFlusher is a ResponseWriter whose flush fails, as on a broken pipe.
type errFlusher struct{ http.ResponseWriter }

var errBrokenPipe = errors.New("write: broken pipe (a test's)")

func (errFlusher) FlushError() error { return errBrokenPipe }

// http.ResponseController.Flush through the middleware returns the flush's
// error: it reached the writer below by Unwrap, past the recorder, and a
// handler streaming to a client gone never heard of it there.
func TestRecorderFlushError(t *testing.T) {
	rec := &recorder{ResponseWriter: errFlusher{httptest.NewRecorder()}}
	if err := http.NewResponseController(rec).Flush(); !errors.Is(err, errBrokenPipe) {
		t.Errorf("Flush through the recorder: %v, want the writer's error", err)
	}
	if !errors.Is(rec.writeErr, errBrokenPipe) {
		t.Errorf("the recorder noted %v, want the flush's error", rec.writeErr)
	}
}

// A server-side timeout (an outer middleware's deadline) is not the client
// leaving: the handler's 504 on it is refunded, as before.
func TestMiddlewareServerTimeoutIsRefunded(t *testing.T) {
	ch := &fakeCharger{decision: okDecision()}
	mw, err := Middleware(FrontOptions{Charger: ch, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		http.Error(w, "timed out", http.StatusGatewayTimeout)
	}))
	withTimeout := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 50*time.Millisecond)
		defer cancel()
		h.ServeHTTP(w, r.WithContext(ctx))
	})
	w := httptest.NewRecorder()
	withTimeout.ServeHTTP(w, newRequest("POST", "/v1/tasks", nil))
	if _, refunds := ch.counts(); w.Code != http.StatusGatewayTimeout || refunds != 1 {
		t.Errorf("a 504 on the server's own deadline: %d, %d refunds; want it refunded once", w.Code, refunds)
	}
}
