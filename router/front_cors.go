package router

import (
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// CORS for browser callers (FrontOptions.CORSOrigins).
//
// Without it the front leaves CORS to the API: preflights go to it, and its
// answers carry what it sets. But the answers the front writes itself (a
// 429, a 401, the usage endpoint's) carried no Access-Control-Allow-Origin,
// so a page on another origin could not read them (the browser reports a
// network error instead of the refusal), and the quota headers were
// readable only when the API listed them in Access-Control-Expose-Headers.
// With it, for a request from one of the origins listed, the front answers
// the preflight itself (the API never sees it) and puts its CORS headers on
// every final answer, the API's included (they replace the API's own
// Access-Control-Allow-Origin: the operator named the origins here).

// corsExposed are the headers a page may read of a front's answer.
const corsExposed = "RateLimit-Policy, RateLimit, X-Quota-Limit, X-Quota-Remaining, X-Quota-Reset, Retry-After"

// corsMaxAge is how long a browser may keep a preflight's answer, seconds.
const corsMaxAge = "600"

// checkCORSOrigins refuses an entry of FrontOptions.CORSOrigins that cannot
// match a browser's Origin header: "*", or scheme://host[:port] alone.
func checkCORSOrigins(origins []string) error {
	for _, o := range origins {
		if o == "*" {
			if len(origins) > 1 {
				return fmt.Errorf("router: CORS origins %q: * allows every origin and stands alone", strings.Join(origins, ","))
			}
			continue
		}
		u, err := url.Parse(o)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Path != "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
			return fmt.Errorf("router: CORS origin %q: want scheme://host[:port] as a browser sends it in Origin, such as https://app.example.com (no path, no final slash), or * for any", o)
		}
	}
	return nil
}

// corsOrigin is the Access-Control-Allow-Origin value for r: "*", r's
// Origin when it is listed, or "" (not allowed, or no Origin).
func (f *front) corsOrigin(r *http.Request) string {
	if len(f.opts.CORSOrigins) == 0 {
		return ""
	}
	origin := r.Header.Get("Origin")
	switch {
	case origin == "":
		return ""
	case f.opts.CORSOrigins[0] == "*":
		return "*"
	case slices.ContainsFunc(f.opts.CORSOrigins, func(o string) bool { return strings.EqualFold(o, origin) }):
		return origin
	}
	return ""
}

// answerPreflight answers a CORS preflight from an allowed origin: any
// method and the headers it asks for (the request itself still needs its
// API key, and is charged as usual).
func answerPreflight(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Access-Control-Allow-Methods", r.Header.Get("Access-Control-Request-Method"))
	if hs := r.Header.Values("Access-Control-Request-Headers"); len(hs) > 0 {
		h.Set("Access-Control-Allow-Headers", strings.Join(hs, ", "))
	}
	h.Set("Access-Control-Max-Age", corsMaxAge)
	h.Add("Vary", "Access-Control-Request-Method")
	h.Add("Vary", "Access-Control-Request-Headers")
	w.WriteHeader(http.StatusNoContent)
}

// corsWriter puts the front's CORS headers on the final answer (not on a
// 1xx) to a request from an allowed origin, whoever wrote it.
type corsWriter struct {
	http.ResponseWriter
	origin string // Access-Control-Allow-Origin
	done   bool
}

// set puts the CORS headers on, once, keeping the headers the API exposed
// itself beside the front's.
func (w *corsWriter) set() {
	if w.done {
		return
	}
	w.done = true
	h := w.Header()
	exposed := corsExposed
	if own := h.Values("Access-Control-Expose-Headers"); len(own) > 0 {
		exposed += ", " + strings.Join(own, ", ")
	}
	h.Set("Access-Control-Expose-Headers", exposed)
	h.Set("Access-Control-Allow-Origin", w.origin)
	if w.origin != "*" {
		h.Add("Vary", "Origin")
	}
}

func (w *corsWriter) WriteHeader(code int) {
	if code >= 200 {
		w.set()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *corsWriter) Write(b []byte) (int, error) {
	w.set()
	return w.ResponseWriter.Write(b)
}

// FlushError (which http.ResponseController.Flush calls) and Flush put the
// CORS headers on an answer whose head a flush sends first (an event
// stream): through Unwrap they went out without them.
func (w *corsWriter) FlushError() error {
	w.set()
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *corsWriter) Flush() { _ = w.FlushError() }

func (w *corsWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
