// Package snapshot is the config a node serves from: plans, accounts and
// their credit grants, API keys (by SHA-256 hash) and the versioned route
// weights.
//
// The ledger is the source (package flush reads it every few seconds); the
// last good snapshot is kept in the node's log, so a node restarted while the
// ledger is down still knows its accounts (G8). A Snapshot is immutable once
// built: swap a pointer to change it.
//
//	s, err := snapshot.Decode(data) // validates
//	key, ok := s.Key(snapshot.HashKey("qr_live_..."))
//	route, units := s.Routes.Match("POST", "/v1/exports")
//	cfg, ok := s.AccountConfig(key.Account) // what shard needs
package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"

	"github.com/quotaring/quotaring/shard"
)

// Plan is a plan as configured. Rate is "10/s", "600/1m", or "" for none.
type Plan struct {
	ID           string `json:"id"`
	Rate         string `json:"rate,omitempty"`
	Burst        int64  `json:"burst,omitempty"`
	MonthlyQuota int64  `json:"monthly_quota"`
	Hard         bool   `json:"hard"`
}

// Grant is a grant of bought credits.
type Grant struct {
	ID        string    `json:"id"`
	Units     int64     `json:"units"`
	StartsAt  time.Time `json:"starts_at"`
	ExpiresAt time.Time `json:"expires_at,omitzero"`
	Used      int64     `json:"used,omitempty"` // settled, as the ledger knew it
}

// Account is an account as configured.
type Account struct {
	ID      string  `json:"id"`
	Plan    string  `json:"plan"`
	Credits []Grant `json:"credits,omitempty"`
	// MonthlyUsed is the settled use of monthly grants the ledger knows, by
	// grant id ("m:2026-06"), to seed an account a node starts to serve.
	MonthlyUsed map[string]int64 `json:"monthly_used,omitempty"`
	// RouteUsed is the settled use by route the ledger knows, by period
	// ("2026-06") and route, for the current period and any later one: the
	// usage endpoint's split by route at a node that takes the account over.
	RouteUsed map[string]map[string]int64 `json:"route_used,omitempty"`
}

// SetRouteUsed sets the settled use of route in period (RouteUsed).
func (a *Account) SetRouteUsed(period, route string, units int64) {
	if a.RouteUsed == nil {
		a.RouteUsed = make(map[string]map[string]int64)
	}
	m := a.RouteUsed[period]
	if m == nil {
		m = make(map[string]int64)
		a.RouteUsed[period] = m
	}
	m[route] = units
}

// Key is an API key: only its hash is stored.
type Key struct {
	ID      string `json:"id"`
	Hash    string `json:"hash"` // hex SHA-256 of the plaintext
	Account string `json:"account"`
}

// Snapshot is the whole config at one version.
type Snapshot struct {
	Version  int64     `json:"version"`
	Plans    []Plan    `json:"plans"`
	Accounts []Account `json:"accounts"`
	Keys     []Key     `json:"keys"`
	Routes   Routes    `json:"routes"`

	plans    map[string]shard.Plan
	accounts map[string]*Account
	keys     map[string]*Key
}

// HashKey is the hex SHA-256 of a plaintext API key.
func HashKey(plaintext string) string {
	sum := sha256.Sum256([]byte(plaintext))
	return hex.EncodeToString(sum[:])
}

// ParseRate reads a rate as new plans take it: TOKENS/PERIOD, TOKENS a whole
// number from 1 to shard.MaxUnits in decimal digits alone (no sign,
// exponent, fraction, separator or blank), PERIOD s, m, h or a duration of
// whole numbers and units ("1m30s", "500ms"); such as "10/s", "600/m",
// "100/1m30s", "5/h". "" is no limit. Its error names the part at fault and
// the form wanted.
//
// A plan stored before the check may hold a rate it refuses ("1e3/s"):
// Build still loads it, as it did (see legacyRate).
func ParseRate(s string) (shard.Rate, error) {
	if s == "" {
		return shard.Rate{}, nil
	}
	const form = "want TOKENS/PERIOD such as 10/s, 600/m or 100/1m30s"
	n, per, ok := strings.Cut(s, "/")
	if !ok {
		return shard.Rate{}, fmt.Errorf("rate %q: no /: %s", s, form)
	}
	if n == "" || strings.IndexFunc(n, func(c rune) bool { return c < '0' || c > '9' }) >= 0 {
		return shard.Rate{}, fmt.Errorf("rate %q: the count %q is not a whole number in digits (no sign, exponent, fraction, separator or space): %s", s, n, form)
	}
	tokens, err := strconv.ParseInt(n, 10, 64)
	if err != nil || tokens < 1 || tokens > shard.MaxUnits {
		return shard.Rate{}, fmt.Errorf("rate %q: the count %s is not from 1 to %d: %s", s, n, int64(shard.MaxUnits), form)
	}
	r := shard.Rate{Tokens: tokens}
	if d, ok := namedPeriod(per); ok {
		r.Per = d
		return r, nil
	}
	d, err := time.ParseDuration(per)
	if !ratePeriod.MatchString(per) || err != nil || d <= 0 {
		return shard.Rate{}, fmt.Errorf("rate %q: the period %q is not s, m, h or a positive duration of whole numbers and units (ms, s, m, h) such as 1m30s: %s", s, per, form)
	}
	r.Per = d
	return r, nil
}

// namedPeriod is the period a rate names by its unit alone: s, m or h.
func namedPeriod(per string) (time.Duration, bool) {
	switch per {
	case "s":
		return time.Second, true
	case "m":
		return time.Minute, true
	case "h":
		return time.Hour, true
	}
	return 0, false
}

// ratePeriod is a period ParseRate takes besides s, m and h: whole numbers
// with units, as time.ParseDuration writes them, without sign or fraction.
// The units are ms, s, m and h: ns and us were taken, and "10/1ns" (10^10
// tokens a second, a typo for 1ms) made a plan with no limit at all.
var ratePeriod = regexp.MustCompile(`^([0-9]+(ms|s|m|h))+$`)

// legacyRate is ParseRate as it was before it was strict: the count is
// the leading digits of what is before the / ("1e3/s" is 1/s, "+5/s" 5/s),
// the period s, m, h or any positive time.ParseDuration. Build reads a
// stored plan's rate with it when ParseRate refuses it, so that a ledger
// holding such a plan still loads (refusing it would leave every node
// without a config after a restart) and enforces what it did.
func legacyRate(s string) (shard.Rate, error) {
	n, per, ok := strings.Cut(s, "/")
	var r shard.Rate
	if _, err := fmt.Sscanf(n, "%d", &r.Tokens); err != nil || !ok || r.Tokens <= 0 {
		return r, fmt.Errorf("rate %q: want TOKENS/PERIOD such as 10/s or 600/m", s)
	}
	if d, ok := namedPeriod(per); ok {
		r.Per = d
		return r, nil
	}
	d, err := time.ParseDuration(per)
	if err != nil || d <= 0 {
		return r, fmt.Errorf("rate %q: period %q is not s, m, h or a positive duration", s, per)
	}
	r.Per = d
	return r, nil
}

// MaxPatternLen bounds a route pattern (CheckPattern), in bytes: each
// charge carries its route, and router.Client sends at most 1 KiB of it.
const MaxPatternLen = 1024

// MaxIDLen bounds an id (CheckID), in bytes.
const MaxIDLen = 200

// CheckID checks the id of a new plan, account or grant: 1 to MaxIDLen
// bytes of valid UTF-8, every character printable (unicode.IsPrint) and
// none a space, a format character (unicode.Cf: a zero-width space, a bidi
// mark), a control character or a slash. Two ids must not differ by what
// no one sees ("acme" and "acme\u200b" both list as acme), and an id must
// read back as it was stored (invalid UTF-8 comes back as U+FFFD, which
// finds nothing). Its error names the first character at fault and where
// it is. For the same reason it refuses the letters that show as blank
// (the Hangul fillers, the braille blank), a combining mark with no
// character before it to join, and an id not in Unicode normal form NFC:
// "ü" written as u and a combining diaeresis (as macOS writes file names)
// looks like, and is not, the "ü" of an id stored before.
//
// Build does not apply it: an id stored before the check still loads.
func CheckID(id string) error {
	if id == "" || len(id) > MaxIDLen {
		return fmt.Errorf("%q is %d bytes: an id is 1 to %d", id, len(id), MaxIDLen)
	}
	for i, n := 0, 1; i < len(id); n++ {
		r, size := utf8.DecodeRuneInString(id[i:])
		var what string
		switch {
		case r == utf8.RuneError && size == 1:
			return fmt.Errorf("%q: byte %d (0x%02X) is not UTF-8: write an id in UTF-8", id, i+1, id[i])
		case r == '/':
			what = "a slash, which would split the id's path in the admin API"
		case unicode.IsControl(r):
			what = "a control character"
		case unicode.IsSpace(r):
			what = "a space"
		case unicode.Is(unicode.Cf, r):
			what = "a format character, which does not show"
		case !unicode.IsPrint(r):
			what = "not printable"
		case blankLetters[r]:
			what = "a letter that shows as blank"
		case i == 0 && unicode.In(r, unicode.Mn, unicode.Me, unicode.Mc):
			what = "a combining mark with no character before it to join"
		}
		if what != "" {
			return fmt.Errorf("%q: character %d (U+%04X, at byte %d) is %s: an id is printable characters without spaces, slashes or invisible ones", id, n, r, i+1, what)
		}
		i += size
	}
	if !norm.NFC.IsNormalString(id) {
		return fmt.Errorf("%q is not in Unicode normal form NFC (a letter and its accent written as two characters, which looks like the one character): write it as %q", id, norm.NFC.String(id))
	}
	return nil
}

// blankLetters are the printable letters and symbols that show as blank
// space: U+115F and U+1160 (Hangul choseong and jungseong fillers), U+3164
// (Hangul filler), U+FFA0 (halfwidth Hangul filler) and U+2800 (braille
// pattern blank). "acme\u3164" lists as acme.
var blankLetters = map[rune]bool{0x115F: true, 0x1160: true, 0x3164: true, 0xFFA0: true, 0x2800: true}

// ErrInvalid wraps every validation error.
var ErrInvalid = errors.New("snapshot: invalid config")

// Shard is p as the shard enforces it: the rate parsed and, for a rate
// limit with no burst, the default burst of one period's worth of tokens.
// Only the rate is checked here; shard.Plan.Validate checks the rest.
func (p Plan) Shard() (shard.Plan, error) {
	rate, err := ParseRate(p.Rate)
	if err != nil {
		return shard.Plan{}, err
	}
	return p.shard(rate), nil
}

// storedShard is Shard for a plan read from the ledger: a rate ParseRate
// refuses that the lenient parser before it took loads as it did then
// (legacyRate), so that such a plan does not stop the whole config loading.
func (p Plan) storedShard() (shard.Plan, error) {
	rate, err := ParseRate(p.Rate)
	if err != nil {
		if old, lerr := legacyRate(p.Rate); lerr == nil {
			rate, err = old, nil
		}
	}
	if err != nil {
		return shard.Plan{}, err
	}
	return p.shard(rate), nil
}

func (p Plan) shard(rate shard.Rate) shard.Plan {
	sp := shard.Plan{ID: p.ID, Rate: rate, Burst: p.Burst, MonthlyQuota: p.MonthlyQuota, Hard: p.Hard}
	if !rate.Unlimited() && sp.Burst == 0 {
		sp.Burst = max(1, rate.Tokens)
	}
	return sp
}

// Build validates s and indexes it. Every error names the row at fault.
func (s *Snapshot) Build() error {
	s.plans = make(map[string]shard.Plan, len(s.Plans))
	for _, p := range s.Plans {
		sp, err := p.storedShard()
		if err != nil {
			return fmt.Errorf("%w: plan %q: %v", ErrInvalid, p.ID, err)
		}
		if err := sp.Validate(); err != nil {
			return fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if _, dup := s.plans[p.ID]; dup || p.ID == "" {
			return fmt.Errorf("%w: plan id %q is empty or used twice", ErrInvalid, p.ID)
		}
		s.plans[p.ID] = sp
	}
	s.accounts = make(map[string]*Account, len(s.Accounts))
	for i := range s.Accounts {
		a := &s.Accounts[i]
		if _, ok := s.plans[a.Plan]; !ok {
			return fmt.Errorf("%w: account %q names plan %q, which does not exist", ErrInvalid, a.ID, a.Plan)
		}
		if _, dup := s.accounts[a.ID]; dup || a.ID == "" {
			return fmt.Errorf("%w: account id %q is empty or used twice", ErrInvalid, a.ID)
		}
		for _, g := range a.Credits {
			if g.ID == "" || strings.HasPrefix(g.ID, "m:") || g.Units < 0 || (!g.ExpiresAt.IsZero() && !g.ExpiresAt.After(g.StartsAt)) {
				return fmt.Errorf("%w: account %q: grant %q needs an id not starting with m:, units >= 0 and expires_at after starts_at", ErrInvalid, a.ID, g.ID)
			}
		}
		s.accounts[a.ID] = a
	}
	s.keys = make(map[string]*Key, len(s.Keys))
	for i := range s.Keys {
		k := &s.Keys[i]
		if b, err := hex.DecodeString(k.Hash); err != nil || len(b) != sha256.Size {
			return fmt.Errorf("%w: key %q: hash must be 64 hex digits of SHA-256", ErrInvalid, k.ID)
		}
		if _, ok := s.accounts[k.Account]; !ok {
			return fmt.Errorf("%w: key %q names account %q, which does not exist", ErrInvalid, k.ID, k.Account)
		}
		s.keys[k.Hash] = k
	}
	return s.Routes.build()
}

// Decode reads and validates a snapshot.
func Decode(b []byte) (*Snapshot, error) {
	s := &Snapshot{Routes: Routes{Default: 1}} // unknown routes cost 1 unless configured
	if err := json.Unmarshal(b, s); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := s.Build(); err != nil {
		return nil, err
	}
	return s, nil
}

// Encode writes s as JSON.
func (s *Snapshot) Encode() ([]byte, error) { return json.Marshal(s) }

// Key finds a key by the hex SHA-256 of its plaintext.
func (s *Snapshot) Key(hash string) (Key, bool) {
	k, ok := s.keys[hash]
	if !ok {
		return Key{}, false
	}
	return *k, true
}

// HasAccount reports whether the account is configured.
func (s *Snapshot) HasAccount(id string) bool { _, ok := s.accounts[id]; return ok }

// AccountConfig is what shard needs to know about an account.
func (s *Snapshot) AccountConfig(id string) (shard.AccountConfig, bool) {
	a, ok := s.accounts[id]
	if !ok {
		return shard.AccountConfig{}, false
	}
	cfg := shard.AccountConfig{ID: a.ID, Plan: s.plans[a.Plan], MonthlyUsed: a.MonthlyUsed, RouteUsed: a.RouteUsed}
	for _, g := range a.Credits {
		gc := shard.GrantConfig{ID: g.ID, Units: g.Units, StartsAt: g.StartsAt.UnixNano(), Used: g.Used}
		if !g.ExpiresAt.IsZero() {
			gc.ExpiresAt = g.ExpiresAt.UnixNano()
		}
		cfg.Credits = append(cfg.Credits, gc)
	}
	return cfg, true
}

// AccountIDs lists the configured accounts, sorted.
func (s *Snapshot) AccountIDs() []string {
	ids := make([]string, 0, len(s.accounts))
	for id := range s.accounts {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// Routes maps requests to units. Patterns are Go 1.22 ServeMux patterns
// ("POST /v1/exports", "GET /v1/tasks/{id}"); the most specific pattern wins,
// as in net/http. A request no pattern matches costs Default.
type Routes struct {
	Version int64            `json:"version"`
	Default int64            `json:"default"`
	Weights map[string]int64 `json:"weights"`

	mux *http.ServeMux
}

// DefaultRoute names requests that match no pattern.
const DefaultRoute = "*"

// routeMark is the handler every route pattern is registered with in the
// mux that matches requests to routes: a request that gets another handler
// back with a pattern is one ServeMux would redirect (a path not in its
// canonical form, a subtree's root without its slash).
type routeMark struct{}

func (*routeMark) ServeHTTP(http.ResponseWriter, *http.Request) {}

func (r *Routes) build() (err error) {
	r.mux = http.NewServeMux()
	mark := &routeMark{}
	for p, w := range r.Weights {
		if w < 0 {
			return fmt.Errorf("%w: route %q: weight %d is negative", ErrInvalid, p, w)
		}
		if err := register(r.mux, p, mark); err != nil {
			return fmt.Errorf("%w: route %q: %v", ErrInvalid, p, err)
		}
	}
	if r.Default < 0 {
		return fmt.Errorf("%w: default route weight %d is negative", ErrInvalid, r.Default)
	}
	return nil
}

// httpMethods are the methods of RFC 9110 and PATCH: a pattern's host
// part that is one of them is a method missing its space.
var httpMethods = []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "CONNECT", "OPTIONS", "TRACE"}

// CheckPattern reports a route pattern that http.ServeMux accepts but that
// does not match what its writer meant: a method not in upper case
// (methods are case-sensitive, so "get /v1/tasks" matches nothing), a
// method glued to the path ("POST/v1/x" is the host "POST", which no
// request has), whitespace in the host (no Host header holds it), or in
// the path (text after the path, such as "GET /v1/x y", becomes part of
// it; a space in a path is written %20, which matches the same requests),
// or a path without its leading slash ("GET v1/x" is the host "v1" and the
// path "/x": a host must hold a dot or a port, or be localhost), or a path
// holding a query or a fragment ("GET /v1/q?x=1" matches only a request
// whose path holds an escaped ?, %3F, never /v1/q with the query x=1), or
// a % in the path that starts no escape ("GET /a%zz": Go's server answers
// such a request path 400 before any handler).
// Its error names the pattern and the fix. Patterns that ServeMux itself
// refuses are left to Build.
//
// New route tables must pass it (the admin API and Ledger.SetRoutes check
// them); Build does not apply it, so that a table stored before the check
// still loads (see Unmatchable).
func CheckPattern(p string) error {
	if len(p) > MaxPatternLen {
		return fmt.Errorf("route %.40q...: the pattern is %d bytes: want at most %d", p, len(p), MaxPatternLen)
	}
	// NB: split as ServeMux does: the method ends at the first space or
	// tab, and blanks after it are skipped.
	method, _, found := strings.Cut(strings.ReplaceAll(p, "\t", " "), " ")
	rest := p
	if !found {
		method = ""
	} else {
		rest = strings.TrimLeft(p[len(method)+1:], " \t")
	}
	if method != "" && method != strings.ToUpper(method) && !strings.Contains(method, "/") { // NB: with a '/' it is no method: ServeMux refuses it
		return fmt.Errorf("route %q: method %q is not upper case and matches no request (methods are case-sensitive): did you mean %s?",
			p, method, strings.ToUpper(method)+" "+rest)
	}
	i := strings.IndexByte(rest, '/')
	if i < 0 {
		return nil // ServeMux's own error says it better
	}
	host, path := rest[:i], rest[i:]
	if slices.Contains(httpMethods, strings.ToUpper(host)) {
		if method != "" {
			return fmt.Errorf("route %q: %q reads as a host, not a second method: write %q", p, host, method+" "+path)
		}
		return fmt.Errorf("route %q: %q reads as a host, not a method: put a space between the method and the path (%q)",
			p, host, strings.ToUpper(host)+" "+path)
	}
	if host != "" && !strings.ContainsAny(host, ".:[") && host != "localhost" && strings.IndexFunc(host, unicode.IsSpace) < 0 {
		return fmt.Errorf("route %q: %q reads as a host, not part of the path (a pattern is \"METHOD [HOST]/PATH\"): write %q; a pattern for one host names it in full, such as \"GET api.example.com/v1/x\"",
			p, host, strings.TrimSpace(method+" /"+rest))
	}
	if strings.IndexFunc(host, unicode.IsSpace) >= 0 {
		return fmt.Errorf("route %q: the host %q holds whitespace: write \"METHOD /path\" with one space after the method, or \"METHOD host/path\"", p, host)
	}
	if h, port, err := net.SplitHostPort(host); err == nil {
		if strings.Contains(h, ":") {
			h = "[" + h + "]" // an IPv6 address keeps its brackets in a pattern
		}
		return fmt.Errorf("route %q: the host %q names a port (%s): a request's host is matched without its port, so this pattern matches no request; write %q, which matches that host on any port",
			p, host, port, strings.TrimSpace(method+" "+h+path))
	}
	if host != strings.ToLower(host) || strings.HasSuffix(host, ".") {
		return fmt.Errorf("route %q: write the host %q in lower case without a final dot (%q): a request's host is matched that way, since "+
			"API.Example.com and api.example.com. name api.example.com", p, host, strings.TrimSuffix(strings.ToLower(host), "."))
	}
	if strings.IndexFunc(path, unicode.IsSpace) >= 0 {
		return fmt.Errorf("route %q: the path %q holds whitespace: write a space in a path as %%20, and nothing after the path", p, path)
	}
	if _, err := url.PathUnescape(path); err != nil {
		// Go's server answers a request path with a bad escape 400 before
		// any handler: the pattern matches no request.
		return fmt.Errorf("route %q: the path %q holds a %% that starts no escape of two hex digits (%v), which no request path can hold: write a %% in a path as %%25", p, path, err)
	}
	if i := strings.IndexAny(path, "?#"); i >= 0 {
		what := "the query (?...) is not part of a route pattern: a pattern matches the path alone, whatever the query"
		if path[i] == '#' {
			what = "a fragment (#...) is never sent to a server, so no request holds it"
		}
		return fmt.Errorf("route %q: the path %q holds %q: %s; write %q (a %q that is part of the path itself is written %s)",
			p, path, path[i], what, strings.TrimSpace(method+" "+host+path[:i]), path[i], url.PathEscape(path[i:i+1]))
	}
	return nil
}

// Unmatchable lists the patterns of r that CheckPattern refuses, with its
// errors, sorted: a table stored before the check may hold them. They load
// and bill as before (refusing the table would leave a node on an older
// one, or on none after a restart): all but a path with whitespace, ? or #
// (which match requests with it escaped) or a one-word host match no
// request, so the requests they were meant for cost Default. The node logs them so that
// an operator replaces the table.
func (r *Routes) Unmatchable() []error {
	var errs []error
	for _, p := range slices.Sorted(maps.Keys(r.Weights)) {
		if err := CheckPattern(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// register turns ServeMux's panic on a bad or conflicting pattern into an error.
func register(mux *http.ServeMux, pattern string, h http.Handler) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%v", p)
		}
	}()
	mux.Handle(pattern, h)
	return nil
}

// canonicalHost is host (a Host header, maybe with a port) in lower case,
// without its port and a final dot; an IPv6 address keeps its brackets, as
// patterns write it ("[::1]:8080" is "[::1]").
func canonicalHost(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
		if strings.Contains(h, ":") {
			host = "[" + h + "]"
		}
	}
	return strings.TrimSuffix(strings.ToLower(host), ".")
}

// Match names the route of a request and its units. It matches no pattern
// with a host part: MatchHost does.
func (r *Routes) Match(method, path string) (route string, units int64) {
	return r.MatchHost(method, "", path)
}

// MatchHost is Match for a request to host (its Host header; a port is
// ignored), so that patterns with a host part ("api.example.com/v1/x") can
// match, as in net/http. The host is matched in lower case without a final
// dot (API.Example.com. names api.example.com; patterns are written so,
// CheckPattern).
//
// path is the request's path as sent, escaped (url.URL.EscapedPath), since
// ServeMux matches segments of the escaped path: "/v1/exports/a%2Fb" is one
// segment after /v1/exports/ for it, and "%2e%2e" no dot-segment. Matched
// on the decoded path, such requests billed the default route while an
// upstream's ServeMux served the pattern.
func (r *Routes) MatchHost(method, host, path string) (route string, units int64) {
	route, units, _ = r.MatchRedirect(method, host, path)
	return route, units
}

// MatchRedirect is MatchHost, and also reports whether a Go ServeMux
// serving these patterns would only redirect the request: its path is not
// in canonical form ("/v1/tasks/../exports", "//v1/exports") or names a
// subtree without its final slash ("/v1/jobs" for "/v1/jobs/"). Such a
// request is still priced as the route it redirects to, since an upstream
// that cleans paths itself serves it as that route; the HTTP front refunds
// it when the upstream answers with the redirect to the canonical path.
func (r *Routes) MatchRedirect(method, host, path string) (route string, units int64, redirect bool) {
	if r.mux == nil {
		return DefaultRoute, r.Default, false
	}
	u := &url.URL{Path: path}
	if dec, err := url.PathUnescape(path); err == nil && dec != path {
		u.Path, u.RawPath = dec, path
	}
	req := &http.Request{Method: method, URL: u, Host: canonicalHost(host)}
	if h, pattern := r.mux.Handler(req); pattern != "" {
		if w, ok := r.Weights[pattern]; ok {
			_, exact := h.(*routeMark)
			return pattern, w, !exact
		}
	}
	return DefaultRoute, r.Default, false
}
