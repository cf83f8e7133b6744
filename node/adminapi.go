package node

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// The admin API: JSON over HTTP on the admin port, under /admin/v1/, behind
// a bearer token (Config.AdminToken). It changes the config in the ledger;
// every node applies a change at its next snapshot refresh
// (Config.SnapshotInterval, 3 s by default), so an answer means "stored",
// not "in force everywhere yet".
//
//	GET    /admin/v1/plans                     list plans
//	GET    /admin/v1/plans/{id}                one plan
//	PUT    /admin/v1/plans/{id}                {rate, burst, monthly_quota, hard}
//	GET    /admin/v1/accounts                  list accounts and their plans
//	GET    /admin/v1/accounts/{id}             plan, keys, grants, settled usage (?period=2026-06)
//	PUT    /admin/v1/accounts/{id}             {plan}
//	POST   /admin/v1/accounts/{id}/keys        a new API key: the plaintext is in this answer only
//	DELETE /admin/v1/keys/{key_id}             revoke a key
//	POST   /admin/v1/accounts/{id}/grants      {units, starts_at, expires_at, id}: credits
//	GET    /admin/v1/routes                    the active route weights
//	PUT    /admin/v1/routes                    {default, weights}: a new version
//	GET    /admin/v1/reservations              units each node holds
//	GET    /admin/v1/nodes                     nodes, settled marks, ring state
//	GET    /admin/v1/usage                     a month's settled usage of every account, for billing
//	                                           (?period=2026-06, after=ID, limit=N: pages by account id)
//	GET    /admin/v1/alerts                    quota alerts and their delivery (?account, period, state, limit)
//	POST   /admin/v1/alerts/{account}/{period}/{threshold}/resend
//	                                           a delivered or given-up alert pending again
//	POST   /admin/v1/alerts/test               a signed test alert to this node's webhook, now
//
// Errors are RFC 9457 problem+json: 400 bad input (the "field" member names
// it), 401 missing or wrong token, 403 API disabled (no token configured),
// 404 not found, 405 wrong method, 409 a request the state does not allow
// (resending a pending alert, a test alert without a webhook), 413 body
// too large, 503 ledger not reached or unavailable (with Retry-After).

// adminTokenMin is the shortest admin token accepted: a short token can be
// guessed.
const adminTokenMin = 16

// checkAdminToken refuses a token too short to be safe; empty disables the
// API.
func checkAdminToken(token string) error {
	switch {
	case token != "" && len(token) < adminTokenMin:
		return fmt.Errorf("node: --admin-token is %d characters; use at least %d random ones (openssl rand -hex 32)", len(token), adminTokenMin)
	case NotASecretAlone(token):
		// A client's token is read trimmed: with spaces around it, no
		// call could ever match it.
		return fmt.Errorf("node: --admin-token has spaces or a line break around it, or control characters: give the token alone, as clients send it")
	}
	return nil
}

// NotASecretAlone reports whether v holds more than a secret: spaces around
// it, a line break or other control characters, a byte-order mark. Kept,
// they would make a token no client can send, or a key the other side
// does not have, found only when calls fail. The node's checks of its
// admin token and alert secret and quotad's of secrets read from the
// environment or files share it.
func NotASecretAlone(v string) bool {
	return strings.TrimSpace(v) != v || strings.ContainsFunc(v, unicode.IsControl) || strings.HasPrefix(v, "\uFEFF")
}

// adminFunc is an endpoint: it gets a reached ledger and returns either
// nothing (it answered) or an error adminProblem turns into an answer.
type adminFunc func(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error

// adminAPI registers the admin API on mux.
func (n *Node) adminAPI(mux *http.ServeMux) {
	routes := []struct {
		method, path string
		h            adminFunc
		query        []string // the query parameters it reads; any other is refused
	}{
		{"GET", "/admin/v1/plans", n.listPlans, nil},
		{"GET", "/admin/v1/plans/{id}", n.getPlan, nil},
		{"PUT", "/admin/v1/plans/{id}", n.putPlan, nil},
		{"GET", "/admin/v1/accounts", n.listAccounts, nil},
		{"GET", "/admin/v1/accounts/{id}", n.getAccount, []string{"period"}},
		{"PUT", "/admin/v1/accounts/{id}", n.putAccount, nil},
		{"POST", "/admin/v1/accounts/{id}/keys", n.createKey, nil},
		{"DELETE", "/admin/v1/keys/{key_id}", n.revokeKey, nil},
		{"POST", "/admin/v1/accounts/{id}/grants", n.addGrant, nil},
		{"GET", "/admin/v1/routes", n.getRoutes, nil},
		{"PUT", "/admin/v1/routes", n.putRoutes, nil},
		{"GET", "/admin/v1/reservations", n.listReservations, nil},
		{"GET", "/admin/v1/nodes", n.listNodes, nil},
		{"GET", "/admin/v1/usage", n.listUsage, []string{"period", "after", "limit", "lost_node"}},
		{"GET", "/admin/v1/alerts", n.listAlerts, []string{"account", "period", "state", "limit"}},
		{"POST", "/admin/v1/alerts/{account}/{period}/{threshold}/resend", n.resendAlert, nil},
		{"POST", "/admin/v1/alerts/test", n.testAlert, nil},
	}
	allow := map[string][]string{}
	for _, rt := range routes {
		mux.Handle(rt.method+" "+rt.path, n.adminEndpoint(checkQuery(rt.query, rt.h)))
		allow[rt.path] = append(allow[rt.path], rt.method)
	}
	// Every other method on a known path, and every unknown path, answers a
	// problem too (after the token check, so the API's shape is not shown
	// to strangers), not ServeMux's plain text.
	for path, methods := range allow {
		methods := strings.Join(methods, ", ")
		mux.Handle(path, n.adminAuth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", methods)
			writeProblem(w, r, &adminProblem{Status: http.StatusMethodNotAllowed, Type: "method-not-allowed",
				Detail: fmt.Sprintf("%s %s is not supported; use %s", r.Method, r.URL.Path, methods)})
		})))
	}
	notFound := n.adminAuth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeProblem(w, r, &adminProblem{Status: http.StatusNotFound, Type: "not-found",
			Detail: fmt.Sprintf("no admin endpoint %s %s (see the README's admin API section)", r.Method, r.URL.Path)})
	}))
	mux.Handle("/admin/v1/", notFound)
	mux.Handle("/admin/v1", notFound) // else ServeMux redirects it to /admin/v1/, token or none
}

// checkQuery refuses a query parameter h does not read, one given twice,
// or one given empty (but ?after=, the first page), as unknown JSON members
// are refused: a typo (?month= for ?period=) or an unset variable
// (?period=) must not quietly answer for the default.
func checkQuery(known []string, h adminFunc) adminFunc {
	return func(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
		q := r.URL.Query()
		for _, k := range slices.Sorted(maps.Keys(q)) {
			switch {
			case !slices.Contains(known, k) && len(known) == 0:
				return badInput(k, "unknown query parameter: %s %s takes none", r.Method, r.URL.Path)
			case !slices.Contains(known, k):
				return badInput(k, "unknown query parameter: %s %s takes %s", r.Method, r.URL.Path, strings.Join(known, ", "))
			case len(q[k]) > 1:
				return badInput(k, "given %d times: give it once", len(q[k]))
			case q[k][0] == "" && k != "after":
				// ?period= from an unset shell variable answered for the
				// current month: a billing job exported the running one.
				return badInput(k, "empty: give a value, or leave the parameter out for its default")
			}
		}
		return h(ctx, w, r, l)
	}
}

// adminAuth checks the bearer token in constant time.
func (n *Node) adminAuth(h http.Handler) http.Handler {
	want := sha256.Sum256([]byte(n.cfg.AdminToken))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(AdminAPIHeader, "v1")
		if n.cfg.AdminToken == "" {
			writeProblem(w, r, &adminProblem{Status: http.StatusForbidden, Type: "admin-disabled",
				Detail: "the admin API is disabled on this node: start quotad serve with --admin-token TOKEN (or QUOTAD_ADMIN_TOKEN), then send Authorization: Bearer TOKEN"})
			return
		}
		scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
		if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="quotaring-admin"`)
			writeProblem(w, r, &adminProblem{Status: http.StatusUnauthorized, Type: "unauthorized",
				Detail: "send the admin token as Authorization: Bearer TOKEN (quotad admin reads it from --token or QUOTAD_ADMIN_TOKEN)"})
			return
		}
		// Hash both sides so the comparison takes the same time whatever
		// the length of the token sent.
		got := sha256.Sum256([]byte(strings.TrimSpace(token)))
		if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			n.log.Warn("admin API: wrong token", "remote", r.RemoteAddr, "method", r.Method, "path", r.URL.Path)
			w.Header().Set("WWW-Authenticate", `Bearer realm="quotaring-admin", error="invalid_token"`)
			writeProblem(w, r, &adminProblem{Status: http.StatusUnauthorized, Type: "unauthorized",
				Detail: "the admin token is wrong: use the one the node was started with (--admin-token)"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

// AdminLedgerTimeout bounds an admin API call's work with the ledger: a
// ledger that does not answer in time gets a 503. quotad admin waits
// longer by default (--timeout), so that it gets that answer rather than
// time out not knowing what happened.
const AdminLedgerTimeout = 30 * time.Second

// adminEndpoint wraps an endpoint: token, reached ledger, time bound
// (AdminLedgerTimeout), errors as problems.
func (n *Node) adminEndpoint(h adminFunc) http.Handler {
	return n.adminAuth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l := n.Ledger()
		if l == nil {
			w.Header().Set("Retry-After", "5")
			writeProblem(w, r, &adminProblem{Status: http.StatusServiceUnavailable, Type: "ledger-unavailable",
				Detail: "this node has not reached the ledger yet (it keeps trying); retry in a few seconds, or ask another node"})
			return
		}
		if p := checkRequestText(r); p != nil {
			writeProblem(w, r, p)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), AdminLedgerTimeout)
		defer cancel()
		if err := h(ctx, w, r, l); err != nil {
			p := n.problemOf(r, err)
			if p.Status == http.StatusServiceUnavailable {
				w.Header().Set("Retry-After", "5")
			}
			writeProblem(w, r, p)
		}
	}))
}

// checkRequestText refuses a path or query parameter holding a NUL byte or
// bytes that are not UTF-8 (%00, %FF): no id holds them, and Postgres
// refuses them in text, which answered 500 with its own error.
func checkRequestText(r *http.Request) *adminProblem {
	for _, seg := range strings.Split(r.Pattern, "/") {
		if name, ok := strings.CutPrefix(seg, "{"); ok {
			name = strings.TrimSuffix(strings.TrimSuffix(name, "}"), "...")
			if why := unstorable(r.PathValue(name)); why != "" {
				return badInput(name, "%q: %s", r.PathValue(name), why)
			}
		}
	}
	if why := unstorable(r.URL.Path); why != "" {
		return badInput("path", "%q: %s", r.URL.EscapedPath(), why)
	}
	for k, vs := range r.URL.Query() {
		for _, v := range append([]string{k}, vs...) {
			if why := unstorable(v); why != "" {
				return badInput(strings.ToValidUTF8(strings.ReplaceAll(k, "\x00", ""), "?"), "%q: %s", v, why)
			}
		}
	}
	return nil
}

// unstorable says what keeps s from being text the ledger stores (a NUL
// byte, a byte that is not UTF-8), or "".
func unstorable(s string) string {
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			return fmt.Sprintf("byte %d (0x%02X) is not UTF-8", i+1, s[i])
		case r == 0:
			return fmt.Sprintf("byte %d is a NUL", i+1)
		}
		i += n
	}
	return ""
}

// jsonTextProblem says what in JSON text data (valid JSON) encoding/json
// would let through silently though no stored text may hold it, or "": a
// \u0000 escape (a NUL in a string, which Postgres refuses in text; a raw
// NUL byte is not JSON), a byte that is not UTF-8, or an escaped UTF-16
// surrogate without its other half ("\ud800"). encoding/json turns the last
// two into U+FFFD without a word, so grant ids "order\xff1" and
// "order\xfe1" became one id, the second grant taken for a retry of the
// first and never granted. In valid JSON a backslash occurs only inside a
// string and always starts an escape, so one pass over the bytes reads
// every escape.
func jsonTextProblem(data []byte) string {
	if !utf8.Valid(data) {
		return unstorable(string(data)) + ": send the text as UTF-8" // NB: a raw NUL is no JSON, refused before
	}
	hex4 := func(i int) (rune, bool) { // the \uXXXX escape at data[i:], if any
		if i+6 > len(data) || data[i] != '\\' || data[i+1] != 'u' {
			return 0, false
		}
		v, err := strconv.ParseUint(string(data[i+2:i+6]), 16, 16)
		return rune(v), err == nil
	}
	for i := 0; i < len(data); i++ {
		if data[i] != '\\' {
			continue
		}
		r, ok := hex4(i)
		if !ok {
			i++ // an escape of one character: skip it
			continue
		}
		switch {
		case r == 0:
			return "a string holds a NUL character (\\u0000), which the ledger cannot store: leave it out"
		case utf16.IsSurrogate(r) && r < 0xDC00:
			if lo, ok := hex4(i + 6); ok && lo >= 0xDC00 && lo <= 0xDFFF {
				i += 6 // the pair's low half read with it
				break
			}
			fallthrough
		case utf16.IsSurrogate(r):
			return fmt.Sprintf("byte %d: the escape %s is half of a UTF-16 surrogate pair without its other half, which is no character: send the text as UTF-8", i+1, data[i:i+6])
		}
		i += 5
	}
	return ""
}

// adminProblem is an RFC 9457 problem. Field, when set, names the input at
// fault (a JSON member, a path segment or a query parameter).
type adminProblem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail"`
	Instance string `json:"instance,omitempty"`
	Field    string `json:"field,omitempty"`
}

func (p *adminProblem) Error() string { return p.Detail }

// badInput is a 400 naming the field at fault.
func badInput(field, format string, args ...any) *adminProblem {
	return &adminProblem{Status: http.StatusBadRequest, Type: "invalid-request", Field: field,
		Detail: field + ": " + fmt.Sprintf(format, args...)}
}

// problemOf maps an endpoint's error to a problem: its own, or the ledger's
// sentinels.
func (n *Node) problemOf(r *http.Request, err error) *adminProblem {
	var p *adminProblem
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &p):
		return p
	case errors.As(err, &tooBig):
		return &adminProblem{Status: http.StatusRequestEntityTooLarge, Type: "body-too-large",
			Detail: fmt.Sprintf("the body is larger than %d bytes", tooBig.Limit)}
	case errors.Is(err, flush.ErrInvalid):
		return &adminProblem{Status: http.StatusBadRequest, Type: "invalid-request", Detail: ledgerDetail(err)}
	case errors.Is(err, flush.ErrNotFound):
		return &adminProblem{Status: http.StatusNotFound, Type: "not-found", Detail: ledgerDetail(err)}
	case errors.Is(err, flush.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		n.log.Warn("admin API: ledger unavailable", "method", r.Method, "path", r.URL.Path, "err", err)
		return &adminProblem{Status: http.StatusServiceUnavailable, Type: "ledger-unavailable",
			Detail: "the ledger did not answer (" + err.Error() + "); nothing was changed unless a retry shows otherwise: retry in a few seconds"}
	}
	n.log.Error("admin API: internal error", "method", r.Method, "path", r.URL.Path, "err", err)
	return &adminProblem{Status: http.StatusInternalServerError, Type: "internal-error", Detail: err.Error()}
}

// ledgerDetail strips the package prefixes from a ledger error.
func ledgerDetail(err error) string {
	s := err.Error()
	for _, p := range []string{"flush: invalid: ", "flush: not found: ", "flush: "} {
		s = strings.ReplaceAll(s, p, "")
	}
	return s
}

func writeProblem(w http.ResponseWriter, r *http.Request, p *adminProblem) {
	if p.Title == "" {
		p.Title = http.StatusText(p.Status)
	}
	// The same namespace as the HTTP front's problem types.
	if !strings.HasPrefix(p.Type, problemBase) {
		p.Type = problemBase + p.Type
	}
	p.Instance = r.URL.Path
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(p.Status)
	json.NewEncoder(w).Encode(p)
}

// AdminAPIHeader is set on every answer of the admin API (to "v1"), so
// that a client (quotad admin) can tell it from another server that
// answers JSON at the address it was given.
const AdminAPIHeader = "Quotaring-Admin-Api"

// problemBase prefixes problem types, as the HTTP front's do
// (router/front_headers.go).
const problemBase = "https://quotaring.dev/problems/"

func writeJSON(w http.ResponseWriter, status int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// maxAdminBody bounds a request body.
const maxAdminBody = 1 << 20

// decodeBody reads one JSON object into v, refusing unknown members (a typo
// such as "montly_quota" would otherwise be silently ignored), members
// given twice and members spelt in another case (checkMembers).
func decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody))
	var tooBig *http.MaxBytesError
	if errors.As(err, &tooBig) {
		return err
	} else if err != nil {
		return badInput("body", "%v", err)
	}
	if bytes.HasPrefix(data, []byte("\xEF\xBB\xBF")) {
		// Some Windows editors and PowerShell write one; it does not show
		// when the body is printed back.
		return badInput("body", "starts with a UTF-8 byte-order mark (bytes EF BB BF), which JSON does not allow: send the body without it")
	}
	if t := bytes.TrimLeft(data, " \t\r\n"); len(t) > 0 && t[0] != '{' {
		// null decoded into nothing and set every member to its zero.
		return badInput("body", "want a JSON object ({...}), got %s", strings.Fields(string(t[:min(len(t), 20)]))[0])
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	err = dec.Decode(v)
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case err == nil:
		if _, err := dec.Token(); err != io.EOF {
			return badInput("body", "one JSON object expected, found more after it")
		}
		if p := jsonTextProblem(data); p != "" {
			return badInput("body", "%s", p)
		}
		// NB: encoding/json keeps the last of a member given twice, and
		// matches names regardless of case: a body with {"hard": true,
		// ..., "Hard": false} is a mistake.
		if p := checkMembers(data, reflect.TypeOf(v)); p != nil {
			return p
		}
		return nil
	case errors.Is(err, io.EOF):
		return badInput("body", "empty: send a JSON object")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badInput("body", "the JSON ends too early (a missing } or value?)")
	case errors.As(err, &syntax):
		return badInput("body", "not valid JSON at byte %d: %v", syntax.Offset, err)
	case errors.As(err, &typ):
		field := typ.Field
		if field == "" {
			return badInput("body", "want a JSON object, got %s", typ.Value)
		}
		return badInput(field, "want %s, got %s", jsonKind(typ.Type.Kind().String()), typ.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		field := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
		return badInput(field, "unknown member (check its spelling)")
	}
	return badInput("body", "%v", err)
}

// checkMembers walks data (valid JSON) along t, the type it was decoded
// into, for what encoding/json lets through silently: a member given twice
// in one object, at any depth, and a member of a struct spelled otherwise
// than its documented name. encoding/json matches a member to a field
// regardless of case (strings.EqualFold: "Units", "UNITS" and "unitſ" all
// set units) and keeps the last of those given, so {"units":5,"Units":500000}
// granted 500000 units. Names are compared as encoding/json does: equal
// under case folding is the same member. The keys of a map (route
// patterns) are matched exactly, as encoding/json does. The problem names
// the member as badInput's field does ("hard", `weights["GET /x"]`).
func checkMembers(data []byte, t reflect.Type) *adminProblem {
	dec := json.NewDecoder(bytes.NewReader(data))
	var walk func(path string, t reflect.Type) *adminProblem
	walk = func(path string, t reflect.Type) *adminProblem {
		for t != nil && t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		switch tok {
		case json.Delim('{'):
			var fields []string // the struct's member names, when t is one
			if t != nil && t.Kind() == reflect.Struct {
				fields = jsonNames(t)
			}
			seen := map[string]string{} // the member (its documented name, or the key) -> the spelling given first
			var misspelt *adminProblem
			for dec.More() {
				kt, err := dec.Token()
				k, ok := kt.(string)
				if err != nil || !ok {
					return nil
				}
				p := k
				if path != "" {
					p = fmt.Sprintf("%s[%q]", path, k)
				}
				member, elem := k, reflect.Type(nil)
				switch {
				case fields != nil:
					i := slices.Index(fields, k)
					if i < 0 {
						i = slices.IndexFunc(fields, func(f string) bool { return strings.EqualFold(f, k) })
					}
					if i < 0 {
						break // unknown: Decode refused it already
					}
					member = fields[i]
					f, _ := t.FieldByName(fieldNameOf(t, member))
					elem = f.Type
					if member != k && misspelt == nil {
						misspelt = badInput(p, "unknown member: member names are case-sensitive: did you mean %q?", member)
					}
				case t != nil && (t.Kind() == reflect.Map || t.Kind() == reflect.Slice || t.Kind() == reflect.Array):
					elem = t.Elem()
				}
				if first, dup := seen[member]; dup {
					if first == k {
						return badInput(p, "given twice: give each member once")
					}
					field := member
					if path != "" {
						field = fmt.Sprintf("%s[%q]", path, member)
					}
					return badInput(field, "given twice, as %q and %q (member names are matched regardless of case): give it once, as %q", first, k, member)
				}
				seen[member] = k
				if d := walk(p, elem); d != nil {
					return d
				}
			}
			_, _ = dec.Token() // }
			return misspelt
		case json.Delim('['):
			var elem reflect.Type
			if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
				elem = t.Elem()
			}
			for dec.More() {
				if d := walk(path, elem); d != nil {
					return d
				}
			}
			_, _ = dec.Token() // ]
		}
		return nil
	}
	return walk("", t)
}

// jsonNames are the member names of struct t's fields, as encoding/json
// names them (the json tag's name, else the field's).
func jsonNames(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if name := jsonName(f); name != "" {
			names = append(names, name)
		}
	}
	return names
}

func jsonName(f reflect.StructField) string {
	if !f.IsExported() {
		return ""
	}
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	switch name {
	case "-":
		if f.Tag.Get("json") == "-" {
			return ""
		}
	case "":
		return f.Name
	}
	return name
}

// fieldNameOf is the Go name of struct t's field whose member name is
// member.
func fieldNameOf(t reflect.Type, member string) string {
	for f := range t.Fields() {
		if jsonName(f) == member {
			return f.Name
		}
	}
	return ""
}

func jsonKind(goKind string) string {
	switch {
	case strings.HasPrefix(goKind, "int"), strings.HasPrefix(goKind, "uint"):
		return "an integer"
	case goKind == "bool":
		return "true or false"
	case goKind == "string":
		return "a string"
	case goKind == "map", goKind == "struct":
		return "an object"
	}
	return "a " + goKind
}

// maxUnits bounds a monthly quota and a grant's units: an account's grants
// are summed (Limit, Remaining), and a few near the int64 limit would
// overflow into a negative limit. 10^15 is far beyond any real plan.
const maxUnits = shard.MaxUnits

// checkID validates the id of a plan, account or grant to create or change
// (snapshot.CheckID: printable UTF-8, no spaces, slashes, format or control
// characters). Ids are looked up as given: one stored before the check
// can still be read.
func checkID(field, id string) error {
	if err := snapshot.CheckID(id); err != nil {
		return badInput(field, "%v", err)
	}
	return nil
}

// storedID reports whether the ledger holds a plan, an account or (of
// account) a grant with this id: one stored before the id rules it breaks
// (an id in NFD, as macOS writes names) can still be changed, or a grant
// retried, while new ones are refused. A ledger error reads as not stored:
// the id's own problem is the answer then.
func (n *Node) storedID(ctx context.Context, l flush.Ledger, kind, account, id string) bool {
	switch kind {
	case "grant":
		rows, err := l.Grants(ctx, account)
		return err == nil && slices.ContainsFunc(rows, func(g flush.GrantRow) bool { return !g.Monthly && g.Grant == id })
	}
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return false
	}
	if kind == "account" {
		return s.HasAccount(id)
	}
	return slices.ContainsFunc(s.Plans, func(p snapshot.Plan) bool { return p.ID == id })
}

// wall is the node's wall clock, as a time.
func (n *Node) wall() time.Time { return time.Unix(0, n.clock.Now().Wall).UTC() }

// configSnapshot reads the config as the ledger has it now (not the node's
// copy, which may be a refresh behind a change just made).
func (n *Node) configSnapshot(ctx context.Context, l flush.Ledger) (*snapshot.Snapshot, error) {
	return l.Snapshot(ctx, n.wall())
}

// --- Plans ------------------------------------------------------------------

// planBody is a plan as PUT takes it. Hard and MonthlyQuota are required: a
// missing one is more likely a mistake than a wish for the zero value.
type planBody struct {
	// ID may come back from a GET (a plan read and put back): it must be
	// the path's.
	ID           *string `json:"id"`
	Rate         *string `json:"rate"`
	Burst        *int64  `json:"burst"`
	MonthlyQuota *int64  `json:"monthly_quota"`
	Hard         *bool   `json:"hard"`
}

func (n *Node) listPlans(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, map[string]any{"plans": nonNil(s.Plans)})
}

func (n *Node) getPlan(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return err
	}
	id := r.PathValue("id")
	for _, p := range s.Plans {
		if p.ID == id {
			return writeJSON(w, http.StatusOK, p)
		}
	}
	return &adminProblem{Status: http.StatusNotFound, Type: "not-found", Detail: fmt.Sprintf("plan %q does not exist", id)}
}

func (n *Node) putPlan(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	id := r.PathValue("id")
	if err := checkID("id", id); err != nil && !n.storedID(ctx, l, "plan", "", id) {
		return err
	}
	var b planBody
	if err := decodeBody(w, r, &b); err != nil {
		return err
	}
	if b.ID != nil && *b.ID != id {
		return badInput("id", "%q is not the plan this path names (%q): leave id out, or put to /admin/v1/plans/%s", *b.ID, id, *b.ID)
	}
	rateText, err := optional("rate", b.Rate, "TOKENS/PERIOD such as 10/s")
	if err != nil {
		return err
	}
	p := snapshot.Plan{ID: id, Rate: rateText}
	rate, err := snapshot.ParseRate(rateText)
	if err != nil {
		return badInput("rate", "%v (or leave it out for no rate limit)", err)
	}
	switch {
	case b.MonthlyQuota == nil:
		return badInput("monthly_quota", "required: units per calendar month (0 for a plan that runs on credits only)")
	case *b.MonthlyQuota < 0:
		return badInput("monthly_quota", "%d is negative", *b.MonthlyQuota)
	case *b.MonthlyQuota > maxUnits:
		return badInput("monthly_quota", "%d is more than %d units (sums of grants must not overflow)", *b.MonthlyQuota, int64(maxUnits))
	case b.Hard == nil:
		return badInput("hard", "required: true refuses requests past the quota, false lets them through and records overage")
	case b.Burst != nil && *b.Burst < 0:
		return badInput("burst", "%d is negative", *b.Burst)
	case b.Burst != nil && *b.Burst > 0 && rate.Unlimited():
		return badInput("burst", "a burst needs a rate (such as \"10/s\")")
	}
	p.MonthlyQuota, p.Hard = *b.MonthlyQuota, *b.Hard
	if b.Burst != nil {
		p.Burst = *b.Burst
	}
	// The token bucket's own bounds (burst x period under 2^62 ns), with
	// the default burst filled in as the snapshot will.
	sp, err := p.Shard()
	if err != nil {
		return badInput("rate", "%v (or leave it out for no rate limit)", err) // NB: parsed above already
	}
	if err := sp.Validate(); err != nil {
		field, why := "burst", strings.TrimPrefix(err.Error(), fmt.Sprintf("shard: plan %q: ", id))
		if p.Burst == 0 {
			field, why = "rate", why+" (the default burst is the rate's count: give a smaller burst, or a shorter period)"
		}
		return badInput(field, "%s", why)
	}
	if err := l.UpsertPlan(ctx, p); err != nil {
		return err
	}
	n.log.Info("admin API: plan set", "plan", id, "rate", p.Rate, "burst", p.Burst, "monthly_quota", p.MonthlyQuota, "hard", p.Hard, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, p)
}

// --- Accounts ---------------------------------------------------------------

type accountBody struct {
	Plan string `json:"plan"`
}

// AccountView is GET /admin/v1/accounts/{id}.
type AccountView struct {
	ID     string        `json:"id"`
	Plan   snapshot.Plan `json:"plan"`
	Keys   []KeyView     `json:"keys"`
	Grants []GrantView   `json:"grants"`
	Usage  UsageView     `json:"usage"`
}

// KeyView is a key as the admin API shows it: never the plaintext.
type KeyView struct {
	ID   string `json:"key_id"`
	Hash string `json:"hash"`
}

// GrantView is a grant with its used (settled) and reserved units.
type GrantView struct {
	ID        string    `json:"id"`
	Monthly   bool      `json:"monthly"`
	Period    string    `json:"period,omitempty"`
	Units     int64     `json:"units"`
	Used      int64     `json:"used"`
	Reserved  int64     `json:"reserved"`
	StartsAt  time.Time `json:"starts_at"`
	ExpiresAt time.Time `json:"expires_at,omitzero"`
}

// UsageView is an account's settled usage of a period, by route. It trails
// the charges by up to one settle interval.
type UsageView struct {
	Period  string           `json:"period"`
	Units   int64            `json:"units"`
	ByRoute map[string]int64 `json:"by_route"`
}

func (n *Node) listAccounts(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return err
	}
	type row struct {
		ID   string `json:"id"`
		Plan string `json:"plan"`
	}
	out := make([]row, 0, len(s.Accounts))
	for _, a := range s.Accounts {
		out = append(out, row{a.ID, a.Plan})
	}
	return writeJSON(w, http.StatusOK, map[string]any{"accounts": out})
}

func (n *Node) getAccount(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	id := r.PathValue("id")
	period := shard.PeriodOf(n.clock.Now().Wall)
	if q := r.URL.Query().Get("period"); q != "" {
		p, err := parseMonth("period", q)
		if err != nil {
			return err
		}
		period = p
	}
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return err
	}
	v := AccountView{ID: id, Keys: []KeyView{}, Grants: []GrantView{}}
	i := slices.IndexFunc(s.Accounts, func(a snapshot.Account) bool { return a.ID == id })
	if i < 0 {
		return &adminProblem{Status: http.StatusNotFound, Type: "not-found", Detail: fmt.Sprintf("account %q does not exist", id)}
	}
	for _, p := range s.Plans {
		if p.ID == s.Accounts[i].Plan {
			v.Plan = p
		}
	}
	for _, k := range s.Keys {
		if k.Account == id {
			v.Keys = append(v.Keys, KeyView{ID: k.ID, Hash: k.Hash})
		}
	}
	grants, err := l.Grants(ctx, id)
	if err != nil {
		return err
	}
	for _, g := range grants {
		v.Grants = append(v.Grants, GrantView{ID: g.Grant, Monthly: g.Monthly, Period: g.Period, Units: g.Units, Used: g.Used,
			Reserved: g.Reserved, StartsAt: g.StartsAt, ExpiresAt: g.ExpiresAt})
	}
	u, err := l.Usage(ctx, id, period)
	if err != nil {
		return err
	}
	v.Usage = UsageView{Period: period.String(), Units: u.Units, ByRoute: u.ByRoute}
	if v.Usage.ByRoute == nil {
		v.Usage.ByRoute = map[string]int64{}
	}
	return writeJSON(w, http.StatusOK, v)
}

func (n *Node) putAccount(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	id := r.PathValue("id")
	if err := checkID("id", id); err != nil && !n.storedID(ctx, l, "account", "", id) {
		return err
	}
	var b accountBody
	if err := decodeBody(w, r, &b); err != nil {
		return err
	}
	if b.Plan == "" {
		return badInput("plan", "required: the id of an existing plan")
	}
	if err := l.UpsertAccount(ctx, id, b.Plan); err != nil {
		if errors.Is(err, flush.ErrNotFound) { // the only thing that can be missing is the plan
			return badInput("plan", "plan %q does not exist: create it first (PUT /admin/v1/plans/%s, or quotad admin plans set %s)", b.Plan, b.Plan, b.Plan)
		}
		return err
	}
	n.log.Info("admin API: account set", "account", id, "plan", b.Plan, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, map[string]string{"id": id, "plan": b.Plan})
}

// --- Keys -------------------------------------------------------------------

// KeyPrefix starts every API key quotaring makes, so a leaked key is easy to
// recognize (secret scanners, logs).
const KeyPrefix = "qr_live_"

// NewKey is the answer to POST /admin/v1/accounts/{id}/keys. Key, the
// plaintext, is shown in this answer only: the ledger keeps its SHA-256.
type NewKey struct {
	KeyID   string `json:"key_id"`
	Key     string `json:"key"`
	Hash    string `json:"hash"`
	Account string `json:"account"`
}

const base62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// newKeyPlaintext makes KeyPrefix + 43 base62 characters from crypto/rand:
// 256 bits. Bytes are drawn by rejection (>= 248 is thrown away) so every
// character is equally likely.
func newKeyPlaintext() string {
	const n = 43
	out := make([]byte, 0, len(KeyPrefix)+n)
	out = append(out, KeyPrefix...)
	buf := make([]byte, 64)
	for len(out) < cap(out) {
		rand.Read(buf) // never fails (crypto/rand since Go 1.24)
		for _, b := range buf {
			if b < 248 && len(out) < cap(out) {
				out = append(out, base62[b%62])
			}
		}
	}
	return string(out)
}

// newID is prefix + 16 lower-case base32 characters from crypto/rand.
func newID(prefix string) string {
	b := make([]byte, 10)
	rand.Read(b)
	return prefix + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b))
}

func (n *Node) createKey(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	account := r.PathValue("id")
	if r.ContentLength != 0 { // NB: -1 when chunked: the body was ignored
		if data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxAdminBody)); err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				return err
			}
			return badInput("body", "%v", err)
		} else if len(bytes.TrimSpace(data)) > 0 {
			var empty struct{}
			r.Body = io.NopCloser(bytes.NewReader(data))
			if err := decodeBody(w, r, &empty); err != nil {
				return err
			}
		}
	}
	plain := newKeyPlaintext()
	k := snapshot.Key{ID: newID("key_"), Hash: snapshot.HashKey(plain), Account: account}
	if err := l.AddKey(ctx, k); err != nil {
		return noAccount(err, account)
	}
	n.log.Info("admin API: key created", "account", account, "key_id", k.ID, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusCreated, NewKey{KeyID: k.ID, Key: plain, Hash: k.Hash, Account: account})
}

func (n *Node) revokeKey(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	id := r.PathValue("key_id")
	if err := l.RevokeKey(ctx, id); err != nil {
		if errors.Is(err, flush.ErrNotFound) {
			return &adminProblem{Status: http.StatusNotFound, Type: "not-found", Detail: fmt.Sprintf("key %q does not exist", id)}
		}
		return err
	}
	n.log.Info("admin API: key revoked", "key_id", id, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, map[string]any{"key_id": id, "revoked": true})
}

// noAccount says which account is missing when the ledger did not find it.
func noAccount(err error, account string) error {
	if errors.Is(err, flush.ErrNotFound) {
		return &adminProblem{Status: http.StatusNotFound, Type: "not-found",
			Detail: fmt.Sprintf("account %q does not exist: create it first (PUT /admin/v1/accounts/%s, or quotad admin accounts set %s --plan PLAN)", account, account, account)}
	}
	return err
}

// --- Grants -----------------------------------------------------------------

// grantBody is a credit grant as POST takes it. Times are RFC 3339; StartsAt
// defaults to now, ExpiresAt to never, ID to a generated one.
type grantBody struct {
	ID        *string `json:"id"`
	Units     *int64  `json:"units"`
	StartsAt  *string `json:"starts_at"`
	ExpiresAt *string `json:"expires_at"`
}

// optional reads an optional string member of a body: left out is "", and
// given empty is refused, as quotad admin refuses a flag given empty: from
// a script, {"id": "$ORDER"} with ORDER unset made a new grant on each
// retry, {"expires_at": "$EXPIRY"} one that never lapses, and
// {"rate": "$RATE"} a plan without a rate limit. use says what to give.
func optional(field string, p *string, use string) (string, error) {
	switch {
	case p == nil:
		return "", nil
	case *p == "":
		return "", badInput(field, "empty: give %s, or leave the member out", use)
	}
	return *p, nil
}

func parseTime(field, s string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return t, badInput(field, "%q: want an RFC 3339 time such as 2026-07-01T00:00:00Z", s)
	}
	// The ledger stores Unix nanoseconds, which end in April 2262. The
	// bound is on the instant: 1970-01-01T00:00:00+14:00 is 1969 in UTC.
	t = t.UTC()
	if t.Year() < 1970 || t.Year() > 2261 {
		return t, badInput(field, "%q: want a time from 1970 to 2261 in UTC (leave expires_at out for a grant that never expires)", s)
	}
	return t, nil
}

func (n *Node) addGrant(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	account := r.PathValue("id")
	var b grantBody
	if err := decodeBody(w, r, &b); err != nil {
		return err
	}
	id, err := optional("id", b.ID, "the grant's id (a retry with it grants nothing again)")
	if err != nil {
		return err
	}
	startsAt, err := optional("starts_at", b.StartsAt, "an RFC 3339 time")
	if err != nil {
		return err
	}
	expiresAt, err := optional("expires_at", b.ExpiresAt, "an RFC 3339 time")
	if err != nil {
		return err
	}
	g := snapshot.Grant{ID: id, StartsAt: n.wall()}
	switch {
	case b.Units == nil:
		return badInput("units", "required: the number of units granted")
	case *b.Units <= 0:
		return badInput("units", "%d: want a positive number of units", *b.Units)
	case *b.Units > maxUnits:
		return badInput("units", "%d is more than %d units (sums of grants must not overflow)", *b.Units, int64(maxUnits))
	case g.ID == "":
		g.ID = newID("g_")
	case strings.HasPrefix(g.ID, "m:"):
		return badInput("id", "%q: ids starting with m: name monthly grants; choose another", g.ID)
	default:
		if err := checkID("id", g.ID); err != nil && !n.storedID(ctx, l, "grant", account, g.ID) {
			return err
		}
	}
	g.Units = *b.Units
	if startsAt != "" {
		if g.StartsAt, err = parseTime("starts_at", startsAt); err != nil {
			return err
		}
	}
	if expiresAt != "" {
		if g.ExpiresAt, err = parseTime("expires_at", expiresAt); err != nil {
			return err
		}
		now := n.wall()
		switch {
		case startsAt != "" && !g.ExpiresAt.After(g.StartsAt):
			return badInput("expires_at", "%s is not after starts_at %s", g.ExpiresAt.Format(time.RFC3339), g.StartsAt.Format(time.RFC3339))
		case !g.ExpiresAt.After(now):
			// With a past starts_at it was taken, and listed as if it
			// could be spent. A retry of a grant stored before it
			// lapsed is answered as any retry (200, or 409 for another
			// grant under the id): it was refused, blaming a starts_at
			// the caller never sent.
			passed := badInput("expires_at", "%s has passed (it is %s): the grant could never be spent", g.ExpiresAt.Format(time.RFC3339), now.Format(time.RFC3339))
			if id == "" {
				return passed
			}
			g.StartsAt, g.ExpiresAt = g.StartsAt.Truncate(time.Microsecond), g.ExpiresAt.Truncate(time.Microsecond)
			return n.existingGrant(ctx, w, l, account, g, startsAt != "", passed)
		}
	}
	// Postgres keeps microseconds: the 201 showed nanoseconds that a
	// retry's 200 then did not.
	g.StartsAt, g.ExpiresAt = g.StartsAt.Truncate(time.Microsecond), g.ExpiresAt.Truncate(time.Microsecond)
	if err := n.checkGrantTotal(ctx, l, account, g); err != nil {
		return err
	}
	if err := l.AddGrant(ctx, account, g); err != nil {
		if errors.Is(err, flush.ErrInvalid) && id != "" { // checked above but for its uniqueness
			return n.existingGrant(ctx, w, l, account, g, startsAt != "", badInput("id", "%s", ledgerDetail(err)))
		}
		return noAccount(err, account)
	}
	n.log.Info("admin API: grant added", "account", account, "grant", g.ID, "units", g.Units, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusCreated, grantAnswer(account, g, true))
}

// maxGrantTotal bounds the units of an account's unexpired grants taken
// together: each is at most maxUnits, but the owner sums them (Limit,
// Remaining), and ~9,300 grants of 10^15 wrapped the sum around to a
// negative limit. A thousand times the largest grant leaves the sum, with
// a monthly quota, far inside int64.
const maxGrantTotal = 1000 * maxUnits

// checkGrantTotal refuses g when the account's grants that have not
// expired would sum past maxGrantTotal with it. A grant whose id the
// account has is left to the ledger (a retry answers 200, another grant
// under the id 409). Two grants added at once may both pass: the bound is
// for absurd input, with a thousandfold margin, not for exact accounting.
func (n *Node) checkGrantTotal(ctx context.Context, l flush.Ledger, account string, g snapshot.Grant) error {
	rows, err := l.Grants(ctx, account)
	if err != nil {
		return noAccount(err, account)
	}
	now := n.wall()
	var total int64
	for _, row := range rows {
		if row.Monthly {
			continue
		}
		if row.Grant == g.ID {
			return nil
		}
		if !row.ExpiresAt.IsZero() && !row.ExpiresAt.After(now) {
			continue
		}
		if row.Units > maxGrantTotal-total { // NB: grants stored before this check may already pass it
			total = maxGrantTotal + 1
			break
		}
		total += row.Units
	}
	if total > maxGrantTotal-g.Units {
		return badInput("units", "account %q holds %d units in grants that have not expired; %d more would pass %d, the most an account's grants may hold together (the owner sums them): let some expire or be used up first",
			account, total, g.Units, int64(maxGrantTotal))
	}
	return nil
}

func grantAnswer(account string, g snapshot.Grant, created bool) map[string]any {
	return map[string]any{"account": account, "id": g.ID, "units": g.Units, "starts_at": g.StartsAt,
		"expires_at": nullTime(g.ExpiresAt), "created": created}
}

// existingGrant answers a grant whose id the account may have already (the
// ledger refused it as a duplicate, or its expires_at has passed): notFound
// is the answer when the account has no grant of that id. A grant's id is the key that makes a retry
// safe (a client that timed out cannot tell whether its grant was stored):
// the same grant again (units, expires_at, and starts_at when given: when
// left out it was the first request's now) answers 200 with created
// false, and changes nothing; another grant under the id is a 409.
func (n *Node) existingGrant(ctx context.Context, w http.ResponseWriter, l flush.Ledger, account string, g snapshot.Grant, startsGiven bool, notFound error) error {
	rows, err := l.Grants(ctx, account)
	if err != nil {
		return noAccount(err, account)
	}
	i := slices.IndexFunc(rows, func(x flush.GrantRow) bool { return !x.Monthly && x.Grant == g.ID })
	if i < 0 {
		return notFound
	}
	old := snapshot.Grant{ID: g.ID, Units: rows[i].Units, StartsAt: rows[i].StartsAt.UTC(), ExpiresAt: rows[i].ExpiresAt}
	if !old.ExpiresAt.IsZero() {
		old.ExpiresAt = old.ExpiresAt.UTC()
	}
	sameTime := func(a, b time.Time) bool { // NB: Postgres keeps microseconds
		return a.Truncate(time.Microsecond).Equal(b.Truncate(time.Microsecond))
	}
	if old.Units == g.Units && sameTime(old.ExpiresAt, g.ExpiresAt) && (!startsGiven || sameTime(old.StartsAt, g.StartsAt)) {
		return writeJSON(w, http.StatusOK, grantAnswer(account, old, false))
	}
	expires := "never expires"
	if !old.ExpiresAt.IsZero() {
		expires = "expires_at " + old.ExpiresAt.Format(time.RFC3339Nano)
	}
	return &adminProblem{Status: http.StatusConflict, Type: "conflict", Field: "id",
		Detail: fmt.Sprintf("id: account %q already has a grant %q, of %d units from %s that %s: ids are unique per account; "+
			"choose another id for another grant (the same grant again, as a retry, answers 200 and changes nothing)",
			account, g.ID, old.Units, old.StartsAt.Format(time.RFC3339Nano), expires)}
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// --- Routes -----------------------------------------------------------------

type routesBody struct {
	// Version may come back from a GET (a table read and put back); it is
	// ignored: every put makes a new version.
	Version *int64           `json:"version"`
	Default *int64           `json:"default"`
	Weights map[string]int64 `json:"weights"`
}

// RoutesView is the active route weights.
type RoutesView struct {
	Version int64            `json:"version"`
	Default int64            `json:"default"`
	Weights map[string]int64 `json:"weights"`
}

func (n *Node) getRoutes(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	s, err := n.configSnapshot(ctx, l)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, RoutesView{Version: s.Routes.Version, Default: s.Routes.Default, Weights: nonNilMap(s.Routes.Weights)})
}

// registeredAt is ServeMux's note of where a conflicting pattern was
// registered: our own source, no help to the caller.
var registeredAt = regexp.MustCompile(` \(registered at [^)]*\)`)

// validRoutes checks route weights with snapshot.Routes' own rules (Go 1.22
// ServeMux patterns) and snapshot.CheckPattern's (patterns that could never
// match), one pattern at a time first so that the answer names the bad one,
// then together for conflicts between patterns.
func validRoutes(def int64, weights map[string]int64) error {
	if def < 0 || def > maxUnits {
		return badInput("default", "%d is not a weight from 0 to %d", def, int64(maxUnits))
	}
	patterns := make([]string, 0, len(weights))
	for p := range weights {
		patterns = append(patterns, p)
	}
	slices.Sort(patterns)
	for _, p := range patterns {
		field := fmt.Sprintf("weights[%q]", p)
		if weights[p] < 0 {
			return badInput(field, "weight %d is negative (0 means rate limited but not billed)", weights[p])
		}
		if weights[p] > maxUnits {
			return badInput(field, "weight %d is more than %d units, the most one charge may cost", weights[p], int64(maxUnits))
		}
		one := snapshot.Snapshot{Routes: snapshot.Routes{Default: def, Weights: map[string]int64{p: weights[p]}}}
		if err := one.Build(); err != nil {
			why := strings.TrimPrefix(err.Error(), fmt.Sprintf("%v: route %q: ", snapshot.ErrInvalid, p))
			return badInput(field, "not a valid pattern (want \"METHOD /path\" as in Go's http.ServeMux, such as \"POST /v1/exports\" or \"GET /v1/tasks/{id}\"): %s", why)
		}
		if err := snapshot.CheckPattern(p); err != nil {
			return badInput(field, "%s", strings.TrimPrefix(err.Error(), fmt.Sprintf("route %q: ", p)))
		}
	}
	all := snapshot.Snapshot{Routes: snapshot.Routes{Default: def, Weights: weights}}
	if err := all.Build(); err != nil {
		why := strings.TrimPrefix(err.Error(), snapshot.ErrInvalid.Error()+": ")
		why = registeredAt.ReplaceAllString(why, "")
		return badInput("weights", "%s", strings.ReplaceAll(why, "\n", " "))
	}
	return nil
}

func (n *Node) putRoutes(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	var b routesBody
	if err := decodeBody(w, r, &b); err != nil {
		return err
	}
	def := int64(1) // unknown routes cost 1 unless configured otherwise
	if b.Default != nil {
		def = *b.Default
	}
	if err := validRoutes(def, b.Weights); err != nil {
		return err
	}
	if b.Weights == nil {
		// NB: a body without it (or null for it) replaced the table with an
		// empty one, and every route billed the default.
		return badInput("weights", `required: the whole table, {"PATTERN": UNITS, ...}; {} for an empty one, where every request costs the default`)
	}
	version, err := l.SetRoutes(ctx, def, b.Weights)
	if err != nil {
		return err
	}
	n.log.Info("admin API: routes set", "version", version, "default", def, "patterns", len(b.Weights), "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, RoutesView{Version: version, Default: def, Weights: nonNilMap(b.Weights)})
}

// --- Cluster ----------------------------------------------------------------

func (n *Node) listReservations(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	var from uint64 // NB: read before the ledger (see unsettled_here below)
	if n.wal != nil {
		from = n.wal.SettledSeq()
	}
	rs, err := l.Reservations(ctx)
	if err != nil {
		return err
	}
	type row struct {
		Node    string `json:"node"`
		Account string `json:"account"`
		Grant   string `json:"grant"`
		Units   int64  `json:"units"`
	}
	out := make([]row, 0, len(rs))
	for _, x := range rs {
		out = append(out, row{x.Node, x.Account, x.Grant, x.Units})
	}
	// What this node holds itself, read after the ledger's rows: its
	// reservations there are these, plus the units its charges not settled
	// yet spent of them (the ledger takes them off when they settle), plus
	// at most the units it counts in doubt. Units the ledger reserves for
	// it beyond all three are stranded (spendable by nobody until it stops
	// or starts); a difference seen once may be a reservation or hand-back
	// on its way. The unsettled charges are read from the settled mark of
	// before the ledger's read: a settle between the two only counts more.
	held, unsettled := []row{}, []row{}
	var doubt int64
	if n.eng != nil {
		for _, h := range n.eng.Held() {
			held = append(held, row{n.cfg.ID, h.Account, h.Grant, h.Units})
		}
		doubt = n.eng.Stats().UncertainUnits.Load()
	}
	if n.wal != nil {
		spent, err := unsettledSpent(n.wal, from)
		if err != nil {
			return err
		}
		for k, units := range spent {
			if units != 0 {
				unsettled = append(unsettled, row{n.cfg.ID, k.account, k.grant, units})
			}
		}
		slices.SortFunc(unsettled, func(a, b row) int { return strings.Compare(a.Account+" "+a.Grant, b.Account+" "+b.Grant) })
	}
	return writeJSON(w, http.StatusOK, map[string]any{"reservations": out, "node": n.cfg.ID, "held_here": held,
		"unsettled_here": unsettled, "in_doubt_here": doubt})
}

// unsettledSpent sums, by account and grant, what the records of log after
// from (to its durable end) take off this node's reservations in the
// ledger when they settle: a charge's units from reservations, less a
// refund's into them (records of older versions).
func unsettledSpent(log *wal.Log, from uint64) (map[grantKey]int64, error) {
	spent := map[grantKey]int64{}
	var rec shard.Record
	err := log.Scan(from, log.DurableSeq(), func(_ uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return err
		}
		sign := int64(0)
		switch {
		case !rec.Reserved:
		case rec.Type == shard.RecCharge:
			sign = 1
		case rec.Type == shard.RecRefund && !rec.Kept:
			sign = -1
		}
		for _, a := range rec.Allocs {
			spent[grantKey{rec.Account, a.Grant}] += sign * a.Units
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read this node's unsettled records: %w", err)
	}
	return spent, nil
}

// NodeView is a (node, incarnation) of the ledger with, for its latest
// incarnation, its state in this node's view of the ring (joining, serving,
// draining, or "" when it is not a member now).
type NodeView struct {
	Node        string    `json:"node"`
	Incarnation string    `json:"incarnation"`
	SettledSeq  uint64    `json:"settled_seq"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	// SettledThrough is when the incarnation last held nothing unsettled
	// (flush.NodeRow.SettledThrough); absent when never, or for an
	// incarnation of an older quotad.
	SettledThrough *time.Time `json:"settled_through,omitempty"`
	State          string     `json:"state"`
	AdminAddr      string     `json:"admin_addr,omitempty"`
	// Build is the quotad build the incarnation registered with
	// (quotad version --short); "" when an older quotad registered it.
	Build string `json:"build"`
}

func (n *Node) listNodes(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	rows, err := l.Nodes(ctx)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, map[string]any{"nodes": n.nodeViews(rows)})
}

// nodeViews adds to the ledger's rows the ring state of each node's latest
// incarnation.
func (n *Node) nodeViews(rows []flush.NodeRow) []NodeView {
	members := map[string][2]string{}
	if rg := n.Ring(); rg != nil {
		for _, m := range rg.View().Members {
			members[m.ID] = [2]string{string(m.State), m.AdminAddr}
		}
	}
	// The ring knows node ids, not incarnations: its state goes to the
	// incarnation that heartbeat last.
	latest := flush.LatestIncarnations(rows)
	out := make([]NodeView, 0, len(rows))
	for _, x := range rows {
		v := NodeView{Node: x.Node, Incarnation: x.Incarnation, SettledSeq: x.Settled, HeartbeatAt: x.Heartbeat, Build: x.Build}
		if !x.SettledThrough.IsZero() {
			st := x.SettledThrough
			v.SettledThrough = &st
		}
		if x.Heartbeat.Equal(latest[x.Node].Heartbeat) {
			v.State, v.AdminAddr = members[x.Node][0], members[x.Node][1]
		}
		out = append(out, v)
	}
	return out
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func nonNilMap(m map[string]int64) map[string]int64 {
	if m == nil {
		return map[string]int64{}
	}
	return m
}

// AlertView is a quota alert as the ledger records it (alerts.go): its
// figures and where its delivery stands.
type AlertView struct {
	Account    string     `json:"account"`
	Period     string     `json:"period"`
	Threshold  int        `json:"threshold"`
	Used       int64      `json:"used"`
	Limit      int64      `json:"limit"`
	State      string     `json:"state"` // pending, delivered, given_up, legacy
	CrossedAt  time.Time  `json:"crossed_at"`
	ClaimedAt  time.Time  `json:"claimed_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	Attempts   int        `json:"attempts"`
	LastError  string     `json:"last_error,omitempty"`
}

// Alert listing bounds: a ledger keeps every month's alerts.
const (
	alertsDefaultLimit = 1000
	alertsMaxLimit     = 10000
)

// listAlerts answers GET /admin/v1/alerts[?account=ID][&period=2026-06]
// [&state=S][&limit=N]: at most limit alerts (1,000 by default), and
// truncated when there were more.
func (n *Node) listAlerts(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	v := r.URL.Query()
	q := flush.AlertQuery{Account: v.Get("account"), State: flush.AlertState(v.Get("state")), Limit: alertsDefaultLimit}
	switch q.State {
	case "", flush.AlertPending, flush.AlertDelivered, flush.AlertGivenUp, flush.AlertLegacy:
	default:
		return badInput("state", "%q: want pending, delivered, given_up or legacy", q.State)
	}
	if p := v.Get("period"); p != "" {
		period, err := parseMonth("period", p)
		if err != nil {
			return err
		}
		q.Period = period
	}
	if s := v.Get("limit"); s != "" {
		lim, err := strconv.Atoi(s)
		if err != nil || lim < 1 || lim > alertsMaxLimit {
			return badInput("limit", "%q: want a number from 1 to %d", s, alertsMaxLimit)
		}
		q.Limit = lim
	}
	want := q.Limit
	q.Limit++ // one more tells whether there are more
	rows, err := l.Alerts(ctx, q)
	if err != nil {
		return err
	}
	truncated := len(rows) > want
	rows = rows[:min(len(rows), want)]
	out := make([]AlertView, 0, len(rows))
	for _, a := range rows {
		out = append(out, alertView(a))
	}
	return writeJSON(w, http.StatusOK, map[string]any{"alerts": out, "truncated": truncated})
}

func alertView(a flush.AlertRecord) AlertView {
	v := AlertView{Account: a.Account, Period: a.Period.String(), Threshold: a.Threshold, Used: a.Used, Limit: a.Limit,
		State: string(a.State), CrossedAt: a.CrossedAt, ClaimedAt: a.ClaimedAt, Attempts: a.Attempts, LastError: a.LastError}
	if !a.FinishedAt.IsZero() {
		v.FinishedAt = &a.FinishedAt
	}
	return v
}

// ParseThreshold reads an alert threshold as quotad admin alerts resend and
// the admin API take it: a percentage from 1 to 100 in digits alone, with
// an optional "%" ("80", "80%"; not "+80").
func ParseThreshold(s string) (int, error) {
	d := strings.TrimSuffix(s, "%")
	t, err := strconv.Atoi(d)
	if err != nil || d[0] < '0' || d[0] > '9' || t < 1 || t > 100 { // Atoi took d: not empty
		return 0, fmt.Errorf("%q: want a percentage from 1 to 100", s)
	}
	return t, nil
}

// resendAlert answers POST /admin/v1/alerts/{account}/{period}/{threshold}/resend:
// the alert (delivered or given up) is pending again, and the next sweep of
// a node with a webhook sends it.
func (n *Node) resendAlert(ctx context.Context, w http.ResponseWriter, r *http.Request, l flush.Ledger) error {
	account := r.PathValue("account")
	period, err := parseMonth("period", r.PathValue("period"))
	if err != nil {
		return err
	}
	threshold, err := ParseThreshold(r.PathValue("threshold"))
	if err != nil {
		return badInput("threshold", "%v", err)
	}
	a, err := l.ResendAlert(ctx, account, period, threshold)
	switch {
	case errors.Is(err, flush.ErrNotFound):
		return &adminProblem{Status: http.StatusNotFound, Type: "not-found", Detail: ledgerDetail(err) + " (quotad admin alerts lists them)"}
	case errors.Is(err, flush.ErrInvalid):
		return &adminProblem{Status: http.StatusConflict, Type: "conflict", Detail: ledgerDetail(err)}
	case err != nil:
		return err
	}
	n.log.Info("admin API: alert to be sent again", "account", account, "period", period.String(), "threshold", threshold, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, alertView(a))
}

// testAlert answers POST /admin/v1/alerts/test: this node sends one signed
// test alert to its webhook now, and says what the receiver answered. The
// answer is 200 whatever the receiver did (ok says); 409 when this node has
// no webhook.
func (n *Node) testAlert(ctx context.Context, w http.ResponseWriter, r *http.Request, _ flush.Ledger) error {
	if n.alerts == nil {
		return &adminProblem{Status: http.StatusConflict, Type: "conflict",
			Detail: "this node sends no quota alerts: start quotad serve with --alert-webhook URL and --alert-secret (or their QUOTAD_ environment twins)"}
	}
	res := n.alerts.sendTest(ctx)
	n.log.Info("admin API: test alert sent", "ok", res.OK, "status", res.Status, "err", res.Error, "remote", r.RemoteAddr)
	return writeJSON(w, http.StatusOK, res)
}
