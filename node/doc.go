// Package node assembles one quotad: its data dir (wal), the engine, the
// ledger connection (flush: settler, reserver, snapshot refresher), the ring
// (membership and ownership), the router (internal gRPC and forwarding) and
// its HTTP servers (the public front and the admin port).
//
// It exists so that quotad serve, quotad demo and the tests build a node the
// same way, and so that several nodes can run in one process (nothing here
// is global).
//
// # Use
//
//	n, err := node.Start(ctx, node.Config{ID: "n1", DataDir: "data/n1",
//		Ledger: "sqlite:ledger.db", RPCAddr: "127.0.0.1:7400", ...})
//	if err != nil { ... }   // the error names the flag or file at fault
//	defer n.Shutdown(ctx)   // drain, settle, leave (below); Kill for crash tests
//	n.Router().Charge(ctx, router.ChargeRequest{...})   // or its HTTP front
//
// # Start
//
//	bind the RPC, HTTP, admin and gossip listeners
//	open the log (recovery: checkpoints + replay) and the engine
//	connect the ledger and migrate; register (node, incarnation); settle what
//	  the log holds; free this node's old reservations; read the snapshot.
//	  With the ledger down, serve from the snapshot kept in the log and keep
//	  trying in the background (G8).
//	join the ring as joining, start the servers; call each serving peer
//	  once (RingView) with this node's RPC token and TLS, and wait while any
//	  refuses them (peerauth.go); then become serving
//
// # Shutdown (SIGTERM)
//
//	state draining: the ring stops giving this node accounts
//	stop the HTTP front and the gRPC server, letting in-flight calls finish
//	  (DrainTimeout; the rest are cut off and refunded)
//	hand every reservation back; settle everything (both within
//	  SettleTimeout, and ending 5 s before the caller's deadline)
//	leave the ring; close (the ledger's connections within 2 s)
//
// The last serving member announces draining only after the second step:
// nobody could take its accounts over, and the refunds of requests cut off
// there need an owner.
//
// If the final settle fails (ledger down, or hung past its budget), the records stay in the log for
// the next start and Shutdown returns an error, so quotad exits non-zero.
package node
