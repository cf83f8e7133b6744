package router

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync"
	"time"
)

// errUpstreamStalled is the cause a proxied request is cancelled with when
// the upstream took none of its body, and sent no answer, for
// FrontOptions.UpstreamTimeout (uploadWatch).
var errUpstreamStalled = errors.New("router: the upstream took none of the request body and did not answer")

// errUpstreamSilent is the cause when the whole body was taken and no
// answer came within UpstreamTimeout: the wait the transport's
// ResponseHeaderTimeout bounds too, whichever fires first.
var errUpstreamSilent = errors.New("router: the upstream took the request body and did not answer in time")

// uploadWatchKey is the context key of a proxied request's *uploadWatch.
type uploadWatchKey struct{}

// uploadWatch bounds an upstream that stops taking a request's body. The
// transport's ResponseHeaderTimeout starts only once the whole body is
// written: an upstream that hangs without reading (a deadlock, a stopped
// process) fills the socket's buffers or HTTP/2 flow-control window, the
// transport blocks writing, and the timer never starts. The client got no
// answer, its charge was neither refunded nor answered, and on HTTP/1 (where
// a client that hangs up is noticed only once its body was read) the
// handler and both connections were held for as long as the upstream hung.
//
// The watch runs from the request's head being written until the first byte
// of the answer, and fires after d with no progress: it is paused while the
// transport waits for the client's next bytes (that wait is BodyIdleTimeout's
// to bound, and a slow client is not a stalled upstream) and restarted each
// time a read returns. Once the body is read to its end it is the wait for
// the answer's head, as ResponseHeaderTimeout. Firing cancels the outbound
// request with errUpstreamStalled: upstreamError answers 504 and refunds.
type uploadWatch struct {
	d      time.Duration
	cancel context.CancelCauseFunc

	mu    sync.Mutex // protects the fields below
	timer *time.Timer
	done  bool // the answer began, or the round trip returned: never fire
	eof   bool // the body was read to its end: a firing is the wait for the answer
}

// watchUpload returns out with a watch on its body when it has one to
// watch; gRPC calls (a stream may wait for its answer for hours while it
// sends) and bodiless requests are returned as they are.
func watchUpload(in, out *http.Request, d time.Duration) *http.Request {
	if d <= 0 || out.Body == nil || out.Body == http.NoBody || isGRPCCall(in) {
		return out
	}
	ctx, cancel := context.WithCancelCause(out.Context())
	w := &uploadWatch{d: d, cancel: cancel}
	ctx = context.WithValue(ctx, uploadWatchKey{}, w) // for endUploadWatch
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn:              func(string) { w.pause() }, // a new attempt: dialing is the dialer's to bound
		WroteHeaders:         w.resume,
		GotFirstResponseByte: w.stop,
	})
	out = out.WithContext(ctx)
	out.Body = &watchedBody{ReadCloser: out.Body, w: w}
	return out
}

// pause stops the timer (a read waits on the client, a new attempt dials).
func (w *uploadWatch) pause() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.timer != nil {
		w.timer.Stop()
	}
}

// resume (re)starts the timer for d, unless the answer began.
func (w *uploadWatch) resume() {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.done:
	case w.timer == nil:
		w.timer = time.AfterFunc(w.d, w.fire)
	default:
		w.timer.Reset(w.d)
	}
}

// fire cancels the round trip, unless the answer began meanwhile (a timer
// whose Stop came too late still runs this).
func (w *uploadWatch) fire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.done:
	case w.eof:
		w.cancel(errUpstreamSilent)
	default:
		w.cancel(errUpstreamStalled)
	}
}

// readEnded notes that the body was read to its end.
func (w *uploadWatch) readEnded() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.eof = true
}

// endUploadWatch stops the watch of the round trip of out, the request
// the transport was given (a response's Request, or an error's), if it
// has one: a transport that reports no httptrace events (a custom
// FrontOptions.Transport) never called GotFirstResponseByte, and the watch
// cut its answers off mid-stream.
func endUploadWatch(out *http.Request) {
	if out == nil {
		return
	}
	if w, ok := out.Context().Value(uploadWatchKey{}).(*uploadWatch); ok {
		w.stop()
	}
}

// watchEnding is the proxy's transport: it ends a request's watch when the
// round trip returns, whatever the transport below reports (a custom
// FrontOptions.Transport may report no httptrace event, and may leave a
// response's Request unset).
type watchEnding struct{ http.RoundTripper }

func (t watchEnding) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := t.RoundTripper.RoundTrip(req)
	endUploadWatch(req)
	return res, err
}

// stop ends the watch for good.
func (w *uploadWatch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done = true
	if w.timer != nil {
		w.timer.Stop()
	}
}

// watchedBody is a request body the transport reads under an uploadWatch.
// Its Close (the transport's, once the body is written) leaves the watch
// on: the wait for the answer's head that follows is the watch's too. A
// watch left on when the round trip failed fires into a request that is
// over, which nothing reads.
type watchedBody struct {
	io.ReadCloser
	w *uploadWatch
}

func (b *watchedBody) Read(p []byte) (int, error) {
	b.w.pause()
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.w.readEnded()
	}
	b.w.resume()
	return n, err
}

// stalled reports a proxied request cancelled by its uploadWatch (either
// cause).
func stalled(r *http.Request) bool {
	cause := context.Cause(r.Context())
	return errors.Is(cause, errUpstreamStalled) || errors.Is(cause, errUpstreamSilent)
}
