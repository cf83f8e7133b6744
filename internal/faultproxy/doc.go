// Package faultproxy is a loopback TCP proxy that injects network faults on
// command: added latency, a target that is down, connections cut, and a
// connection cut right after a PostgreSQL COMMIT, so that the transaction
// commits but the client never hears it. Tests and the chaos harness put it
// between quotad and the ledger (tc netem is not available on our machines).
//
// # Use
//
//	p, err := faultproxy.New("127.0.0.1:0", srv.Addr()) // srv: a pgtest.Server
//	if err != nil { ... }
//	defer p.Close()
//	// point the client at p.Addr() instead of srv.Addr()
//
//	p.SetLatency(20 * time.Millisecond) // every chunk, both ways
//	p.SetDown(true)                     // cut everything, refuse new connections
//	p.SetDown(false)
//	p.CutAfterCommit(1)                 // the next COMMIT commits, and the client gets an error
//
// The faults act on whole TCP connections: there is no packet loss or
// reordering, and "down" resets connections rather than black-holing them.
//
// # The commit cut
//
// The flush package settles a batch in one transaction and must cope with a
// COMMIT whose answer is lost: it cannot tell "committed" from "not
// committed" and retries with the same range (see DESIGN.md, "Settling to the
// ledger"). CutAfterCommit(n) produces exactly that case, deterministically:
//
//	client          proxy                          server
//	  | Q "commit" --> | swallow on; forward ------> | commits
//	  |                | (answer dropped) <--------- | CommandComplete, ReadyForQuery
//	  | <-- EOF ------ | close both sides            |
//
// The client is cut only after the server's ReadyForQuery (or after 10 s
// without one), so by the time the client sees its error, the commit is
// done and visible to other sessions.
//
// To see the COMMIT, the proxy follows the PostgreSQL v3 protocol from the
// client's side. After the startup phase every message is framed:
//
//	+------+----------------------+--------------------------+
//	| type | int32 length         | body (length-4 bytes)    |
//	+------+----------------------+--------------------------+
//	 1 byte  counts itself, not type
//
// and a simple query is type 'Q' with the SQL as a NUL-terminated body.
// The startup phase has untyped packets (int32 length, int32 code, body); an
// SSLRequest or GSSENCRequest packet is answered by the server with one
// unframed byte, 'N' (go on in plain text) or 'S'/'G' (encrypt). On 'S' or
// 'G' the proxy stops looking: it cannot read an encrypted stream, so
// CutAfterCommit never fires on it. The server's side is followed the same
// way, to find the ReadyForQuery ('Z') that ends the COMMIT.
//
// What counts as a COMMIT: a Query message whose whole text is COMMIT or END,
// optionally followed by WORK or TRANSACTION, in any case, with a trailing
// ';' allowed. pgx's tx.Commit sends the simple query "commit" (pgx v5
// tx.go; Exec without arguments always uses the simple protocol), psql sends
// what was typed. Not recognized: a COMMIT sent through the extended protocol
// (Parse/Bind/Execute, as JDBC does), COMMIT PREPARED, a COMMIT inside a
// multi-statement query string or behind a comment, and a custom pgx
// TxOptions.CommitQuery. A client that pipelines queries behind the COMMIT
// loses them with the cut, and could see the cut happen at an earlier
// query's ReadyForQuery.
//
// Any TCP server can sit behind the proxy; for one that does not speak
// PostgreSQL the parser soon gives up and CutAfterCommit does nothing.
//
// # Concurrency
//
// All methods are safe for concurrent use. Each connection has two
// goroutines, one per direction; Close returns after all of them and the
// accept loop have exited. Settings apply at once: a new latency to the next
// chunk, SetDown and CutAll to the connections open when they are called.
package faultproxy
