// Package router sends every charge to its account's owner, and is how
// nodes and programs talk to each other.
//
// # Pieces
//
//   - Router: on a node, Charge/Refund/Usage decide locally when this node
//     owns the account, and otherwise forward once to the owner over gRPC.
//   - Server (Router.Server): the gRPC service quota.proto describes. It
//     decides for accounts this node owns and answers WrongOwner{epoch,
//     owner} for the others. It never forwards, so a request takes at most
//     one hop.
//   - Calls to one owner are coalesced: a call goes out at once when fewer
//     than MaxInflight are in flight to that owner, and otherwise waits and
//     leaves in the next batch, so batching adds no latency at low load. The
//     owner applies a batch and waits once for its log (one fsync).
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
