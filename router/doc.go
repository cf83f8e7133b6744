// Package router sends every charge to its account's owner, and is how
// nodes and programs talk to each other.
//
// # Pieces
//
//   - Router: on a node, Charge/Refund/Usage decide locally when this node
//     owns the account, and otherwise forward once to the owner over gRPC.
//
//   - Server (Router.Server): the gRPC service quota.proto describes. It
//     decides for accounts this node owns and answers WrongOwner{epoch,
//     owner} for the others. Only a client's call marked Route (hops 0:
//     charges, refunds and usage reads) is forwarded, once, with hops 1,
//     which is never forwarded again: a request takes at most one hop.
//
//   - Calls to one owner are coalesced: a call goes out at once when fewer
//     than MaxInflight are in flight to that owner, and otherwise waits and
//     leaves in the next batch, so batching adds no latency at low load. The
//     owner applies a batch and waits once for its log (one fsync).
//     MaxInflight is 4 by default. With 1, batches grow and a saturated
//     machine does more (1.1-1.4x the charges/s in BENCHMARKS.md), but an
//     owner answers a batch when its slowest charge is decided (one that
//     waits for a reservation from a slow ledger), and with one call in
//     flight everything queued for that owner waits behind it: under the
//     chaos harness's ledger-slow fault, p95 45 ms against 4.5 ms.
//
//   - The HTTP front (Middleware, NewProxy): the API key (X-Api-Key or
//     Authorization: Bearer) by its SHA-256 in the config snapshot, the
//     route's units from the route weights, the charge at the owner before
//     the handler or upstream runs, refusals as RFC 9457 problem+json (or
//     gRPC statuses for gRPC callers), RateLimit and X-Quota-* headers, the
//     usage endpoint, and a refund once when the answer is a failure under
//     the bill-on policy. On a node that owns the account the upstream runs
//     while the charge's record syncs (EarlyCharger); the client's answer
//     waits for both.
//
//   - Client (Dial): the embedded client for Go programs. It learns the ring
//     from any node (RingView), calls owners directly with the same
//     coalescing, follows WrongOwner, reads the config (Config RPC) so the
//     Middleware can run in the program, and never decides anything itself.
//     With DialOptions.Gateway it sends every call to its seeds instead,
//     marked Route. See "Embedding" below.
//
//   - The RPC token (ServerAuth, WithRPCToken, DialOptions.Token): a shared
//     secret every internal call carries and every node checks, so that
//     reaching the RPC port is not enough to charge or refund (auth.go).
//
// # Embedding
//
// A Go program dials any nodes (their RPC addresses) and wraps its handler
// in the Middleware, with the client as both Charger and Config:
//
//	client, err := router.Dial(ctx, "quotad-0.quotad:7400", "quotad-1.quotad:7400")
//	if err != nil {
//		return err
//	}
//	defer client.Close()
//	charge, err := router.Middleware(router.FrontOptions{Charger: client, Config: client})
//	if err != nil {
//		return err
//	}
//	return http.ListenAndServe(":8080", charge(api))
//
// To stop without cutting calls in flight, serve through an http.Server
// rather than http.ListenAndServe, and shut it down first, then the client
// (Client.Shutdown waits for every answer, and for the refunds the client
// sends by itself, before it closes):
//
//	srv := &http.Server{Addr: ":8080", Handler: charge(api)}
//	// ... srv.ListenAndServe() in a goroutine; on SIGTERM:
//	srv.Shutdown(ctx)
//	client.Shutdown(ctx)
//
// A cluster whose nodes run with --rpc-token needs the token to dial:
//
//	client, err := router.DialOptions{Token: os.Getenv("QUOTAD_RPC_TOKEN")}.Dial(ctx, "quotad-0.quotad:7400")
//
// A program that reaches the cluster only through one address (a load
// balancer, a Kubernetes Service from another cluster) and not the nodes'
// own RPC addresses dials it with Gateway: every call goes there, and the
// node that takes it forwards it to the owner (one hop more):
//
//	client, err := router.DialOptions{Gateway: true}.Dial(ctx, "quotad.example.internal:7400")
//
// Client.Charge, Refund and Usage call the owner directly. Check the error
// before the result: with an error the result's Reason is shard.Undecided,
// never accepted. ErrUnavailable means not decided now, or the outcome is
// unknown (the owner did not answer; the error then matches
// ErrOutcomeUnknown too): retry. Only a charge with an EventID
// and ClientID is safe to retry (with the same id: charged and billed
// once); a charge without ClientID sent again is a new charge, with a new
// id, which may bill twice when the first was applied. ErrInvalidRequest, ErrRejected (the node turned the call
// away: a wrong RPC token, a node of another version) and ErrClosed mean
// retrying cannot help. ErrClosed answers only calls Close stopped before
// they were sent; one it cut on its way answers ErrUnavailable, its outcome
// unknown.
//
// # Refusing rather than guessing
//
// A node never charges an account it does not own in its own view: the
// engine checks ownership under the account's lock. When the owner is
// unreachable, or views disagree for longer than a few redirections, the
// answer is ErrUnavailable (quota-unavailable), never a local decision
// (groupcache falls back to a local load on peer errors; for exact quotas
// that would double-spend).
//
// # Test faults
//
// Faults cuts RPC traffic to chosen addresses, like ring.FaultTransport does
// for gossip; quotad exposes both only behind a test flag.
package router
