package router

import (
	"context"
	"net/http"
	"time"

	"github.com/quotaring/quotaring/snapshot"
)

// UsageReport is the usage endpoint's answer: the current period of the
// caller's account, from the owner's state (the one that enforces).
type UsageReport struct {
	Account   string `json:"account"`
	Period    string `json:"period"` // the UTC month, "2026-06"
	Used      int64  `json:"used"`
	Limit     int64  `json:"limit"` // units of the active grants (monthly quota and credits)
	Remaining int64  `json:"remaining"`
	Reset     string `json:"reset"` // end of the period, RFC 3339 UTC
	// Routes are the units used by route pattern ("*": no pattern matched).
	Routes map[string]int64 `json:"routes"`
}

// serveUsage answers UsagePath for the caller's key and returns the status.
func (f *front) serveUsage(w http.ResponseWriter, r *http.Request) int {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		p := newProblem("about:blank", "Method Not Allowed", http.StatusMethodNotAllowed, "The usage endpoint answers GET and HEAD.")
		p.write(w, r)
		return p.Status
	}
	rep, prob := f.usage(r)
	if prob != nil && prob.Status == statusClientClosed {
		return prob.Status
	}
	if prob != nil {
		prob.write(w, r)
		return prob.Status
	}
	h := w.Header()
	// The policy of every other answer: "burst" too (it was left out), and
	// no "quota" for a soft plan (rateLimitHeaders).
	policy, limit := planPolicy(rep.snap, rep.Account, rep.Limit, rep.Remaining, rep.resetUnix, f.opts.Now().Unix())
	setField(h, "RateLimit-Policy", string(policy))
	setField(h, "RateLimit", string(limit))
	setQuotaFields(h, rep.Limit, rep.Remaining, rep.resetUnix)
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	body := encodeJSON(rep.UsageReport)
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodGet {
		_, _ = w.Write(body)
	}
	return http.StatusOK
}

type usageAnswer struct {
	UsageReport
	resetUnix int64
	snap      *snapshot.Snapshot // the key was found in
}

func (f *front) usage(r *http.Request) (*usageAnswer, *Problem) {
	key, snap, prob := f.caller(r)
	if prob != nil {
		return nil, prob
	}
	ctx, cancel := context.WithTimeout(r.Context(), f.opts.ChargeTimeout)
	defer cancel()
	u, err := f.opts.Charger.Usage(ctx, key.Account)
	switch {
	case err != nil && r.Context().Err() != nil:
		// The client hung up first: nobody to answer, nothing failed.
		return nil, &Problem{Status: statusClientClosed}
	case err != nil && retryable(ctx, err):
		if ok, held := f.usageLog.Allow(time.Now(), time.Second); ok {
			f.opts.Logger.Warn("usage undecided", "account", key.Account, "err", err, "similar_lines_held_back", held)
		}
		return nil, unavailable("The quota service cannot read this account's usage now; retry in a second.")
	case err != nil:
		f.failedLog("usage failed", key.Account, err)
		return nil, internalError()
	case !u.Known:
		return nil, unavailable("The owner of this key's account has not loaded its config yet; retry in a second.")
	}
	routes := u.Routes
	if routes == nil {
		routes = map[string]int64{}
	}
	return &usageAnswer{resetUnix: u.Reset, snap: snap, UsageReport: UsageReport{Account: key.Account, Period: u.Period.String(),
		Used: u.Used, Limit: u.Limit, Remaining: max(0, u.Remaining), Reset: formatReset(u.Reset), Routes: routes}}, nil
}
