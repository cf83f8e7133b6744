package faultproxy

import (
	"bytes"
	"encoding/binary"
	"sync/atomic"
)

// The proxy follows the PostgreSQL protocol (v3) in both directions, only far
// enough to find message boundaries: to see a client's COMMIT, and the
// server's ReadyForQuery after it. See the package doc for the framing.

// Startup-phase request codes (the int32 after the length).
const (
	codeCancelRequest = 80877102
	codeSSLRequest    = 80877103
	codeGSSENCRequest = 80877104
)

// maxCommitQuery bounds the Query messages the frontend parser buffers: no
// spelling of COMMIT it recognizes is longer.
const maxCommitQuery = 64

// maxStartupLen mirrors the server's limit on a startup packet; anything
// longer means we are not looking at PostgreSQL.
const maxStartupLen = 10000

// wireState is what the two directions of one connection tell each other.
type wireState struct {
	// pendingAnswers counts SSLRequest/GSSENCRequest packets the server has
	// not yet answered with its one unframed byte. The frontend parser adds
	// one before the request is forwarded, so the backend parser always
	// knows of it before the answer arrives.
	pendingAnswers atomic.Int32
	// opaque is set when the stream turns encrypted (the server answered 'S'
	// or 'G') or does not parse; both parsers then stop looking.
	opaque atomic.Bool
}

// frontendParser follows client-to-server bytes.
type frontendParser struct {
	ws *wireState

	startup bool    // the next packet is an untyped startup-phase one
	hdr     [8]byte // startup: int32 len, int32 code; typed: byte type, int32 len
	hdrN    int
	remain  int // body bytes of the current message still to come

	// query collects the body of a short Query ('Q') message.
	query    []byte
	inQuery  bool
	noCommit bool // set once the parser has given up (opaque)
}

func newFrontendParser(ws *wireState) *frontendParser {
	return &frontendParser{ws: ws, startup: true}
}

// advance consumes buf up to and including the end of the first COMMIT
// query that ends in it. It returns how many bytes it consumed and whether
// they end with a COMMIT. Called again with the rest, it goes on.
func (f *frontendParser) advance(buf []byte) (n int, commit bool) {
	for n < len(buf) {
		if f.noCommit || f.ws.opaque.Load() {
			f.noCommit = true
			return len(buf), false
		}
		if f.remain > 0 {
			k := min(f.remain, len(buf)-n)
			if f.inQuery {
				f.query = append(f.query, buf[n:n+k]...)
			}
			n += k
			f.remain -= k
			if f.remain == 0 && f.messageDone() {
				return n, true
			}
			continue
		}
		hdrLen := 5
		if f.startup {
			hdrLen = 8
		}
		k := copy(f.hdr[f.hdrN:hdrLen], buf[n:])
		f.hdrN += k
		n += k
		if f.hdrN < hdrLen {
			continue
		}
		f.hdrN = 0
		if f.startup {
			f.startupHeader()
		} else {
			f.typedHeader()
		}
		if f.remain == 0 && f.messageDone() {
			return n, true
		}
	}
	return n, false
}

// startupHeader handles the 8 bytes that begin a startup-phase packet.
func (f *frontendParser) startupHeader() {
	length := int(binary.BigEndian.Uint32(f.hdr[0:4]))
	code := binary.BigEndian.Uint32(f.hdr[4:8])
	if length < 8 || length > maxStartupLen {
		f.giveUp()
		return
	}
	f.remain = length - 8
	switch {
	case code == codeSSLRequest, code == codeGSSENCRequest:
		// The server answers with one unframed byte; the client then
		// sends another startup packet (after 'N') or encrypts.
		f.ws.pendingAnswers.Add(1)
	case code == codeCancelRequest:
		// The server closes the connection after it.
	case code>>16 == 3: // StartupMessage, protocol 3.x
		f.startup = false
	default:
		f.giveUp()
	}
}

// typedHeader handles the type byte and length of a regular message.
func (f *frontendParser) typedHeader() {
	length := int(binary.BigEndian.Uint32(f.hdr[1:5]))
	if length < 4 {
		f.giveUp()
		return
	}
	f.remain = length - 4
	f.inQuery = f.hdr[0] == 'Q' && f.remain <= maxCommitQuery
	f.query = f.query[:0]
}

// messageDone is called when a message's body is complete; it reports
// whether the message was a COMMIT.
func (f *frontendParser) messageDone() bool {
	if !f.inQuery {
		return false
	}
	f.inQuery = false
	return isCommit(f.query)
}

func (f *frontendParser) giveUp() {
	f.ws.opaque.Store(true)
	f.noCommit = true
	f.remain = 0
}

// isCommit reports whether the body of a Query message (NUL-terminated SQL)
// is exactly a commit: COMMIT or END, optionally followed by WORK or
// TRANSACTION, in any case, with surrounding spaces and a trailing ';'.
// pgx sends "commit"; psql and others send "COMMIT" or "END".
func isCommit(body []byte) bool {
	q := bytes.TrimSuffix(body, []byte{0})
	q = bytes.TrimSpace(q)
	for len(q) > 0 && q[len(q)-1] == ';' {
		q = bytes.TrimSpace(q[:len(q)-1])
	}
	words := bytes.Fields(bytes.ToLower(q))
	if len(words) == 0 || len(words) > 2 {
		return false
	}
	if w := string(words[0]); w != "commit" && w != "end" {
		return false
	}
	return len(words) == 1 || string(words[1]) == "work" || string(words[1]) == "transaction"
}

// backendParser follows server-to-client bytes.
type backendParser struct {
	ws     *wireState
	hdr    [5]byte // byte type, int32 len
	hdrN   int
	remain int
}

// advance consumes all of buf and reports whether it held the start of a
// ReadyForQuery ('Z') message: the server is done with a query.
func (b *backendParser) advance(buf []byte) (ready bool) {
	for len(buf) > 0 {
		if b.ws.opaque.Load() {
			return ready
		}
		if b.remain > 0 {
			k := min(b.remain, len(buf))
			buf = buf[k:]
			b.remain -= k
			continue
		}
		if b.hdrN == 0 && b.ws.pendingAnswers.Load() > 0 {
			// The one-byte answer to SSLRequest or GSSENCRequest: 'N' means
			// go on in plain text; anything else means encryption.
			b.ws.pendingAnswers.Add(-1)
			if buf[0] != 'N' {
				b.ws.opaque.Store(true)
			}
			buf = buf[1:]
			continue
		}
		k := copy(b.hdr[b.hdrN:], buf)
		b.hdrN += k
		buf = buf[k:]
		if b.hdrN < len(b.hdr) {
			continue
		}
		b.hdrN = 0
		length := int(binary.BigEndian.Uint32(b.hdr[1:5]))
		if length < 4 {
			b.ws.opaque.Store(true)
			return ready
		}
		b.remain = length - 4
		if b.hdr[0] == 'Z' {
			ready = true
		}
	}
	return ready
}
