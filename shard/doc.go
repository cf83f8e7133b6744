// Package shard is the pure state machine of one account: token bucket, monthly
// quota, prepaid credits, idempotent event ids and refunds.
//
// Nothing in this package reads a clock, does I/O, logs, or starts a goroutine.
// Time is an argument (Now: a wall reading that names the period, a monotonic
// reading that drives the bucket), and every state change that must survive a
// crash comes out as a Record for the caller to append to its log before it
// answers. Replaying the same records onto a checkpoint rebuilds the same state
// (Account.ApplyRecord), which is how a node recovers after kill -9.
//
// # A charge, in order
//
//  1. Period: the UTC calendar month of now.Wall, but never earlier than the
//     latest period this account has seen (a wall clock that jumps back never
//     moves an account to an earlier month; G5, G9). Entering a new month makes a
//     fresh monthly grant of Plan.MonthlyQuota units and clears the per-route
//     usage.
//  2. Dedup: a client-supplied event id already seen within the dedup window
//     answers Replayed with the original units and charges nothing, but emits
//     a RecReplay record: a retry served under the charge, which an attempt's
//     refund (RefundAttempt) must not un-bill, counted here and in the ledger
//     until RefundReplay takes it back, once: the engine names the replay in
//     its receipt (Receipt.ReplaySeq, its record's seq), and a take-back of a
//     replay named before changes nothing. The caller must wait until
//     Decision.Seq is durable before it answers, like the first time. The
//     same id for another route (Charge.Route) is not a retry but a client's
//     mistake: it answers IDReused and charges nothing, or a request to an
//     expensive route would be served for a cheap one's units. An id already
//     replayed Params.MaxReplays times answers ReplayLimit and charges
//     nothing: each replay is served for free, so the bound is what one
//     charge can buy. An id charged anew gets a generation, which names it
//     in the ledger (LedgerEventID), where an event id is billed once a
//     month: the next one after a refund (the retry of failed work), and
//     the next one for a use past the window (new work under a key used
//     again), which the account knows from the generations of the ids the
//     window let go this month, kept apart (Account.nextGen).
//  3. Token bucket: one token per request, whatever its units (rate limits
//     count requests, quotas count units). An empty bucket answers RateLimited
//     with RetryAfter until the next token. A refused request takes no token: it
//     does not drain the bucket (unlike gubernator's leaky variant), so a client
//     that hammers an exhausted quota still gets its rate back when it stops.
//  4. Balance: the units are taken from the active grants (StartsAt <= now <
//     ExpiresAt) that expire soonest first (the month's quota before a credit
//     that expires with it: CompareSpending); an expired grant is never spent.
//     Under a hard limit, not enough units answers QuotaExceeded with RetryAfter
//     until the end of the month when a monthly quota would help, and nothing is
//     taken (a refused charge leaves no trace, and its event id stays usable).
//     Under a soft limit the charge always goes through and what the grants
//     cannot cover is recorded as overage on the monthly grant.
//  5. Spend and emit a RecCharge record carrying the allocation (which grant
//     paid how much), so replay and settlement never re-decide anything.
//
// Weight-0 routes are rate limited but cost nothing: they take a token and
// emit no record.
//
// # Reservations
//
// When several nodes can spend one grant, a node may only spend units it holds
// a reservation for (see DESIGN.md, "Reservations"). An Account created with
// Params.Reservations spends a hard grant only from its Allowance; when the
// allowance is short it answers NeedReservation with the Shortfall, and the
// caller asks the ledger, applies the answer with Reserve (a RecReserve record)
// and charges again. A grant the ledger said was exhausted answers
// QuotaExceeded without asking again until MarkExhausted's deadline. Soft
// plans never reserve.
//
// # Refunds
//
// A refund returns an event's units to the grants that paid them, once; in
// reservations mode to the grant in the ledger (the record is not Reserved),
// not to this node's allowance, and the grant counts as exhausted no more. The
// account remembers client ids for the dedup window and the last RecentEvents
// generated ids; a refund for an event it does not remember answers
// UnknownEvent.
//
// # Concurrency
//
// An Account is not safe for concurrent use: its owner (package engine) holds
// a lock per stripe of accounts around every call.
package shard
