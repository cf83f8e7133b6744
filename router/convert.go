package router

import (
	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
)

var reasonToPB = map[shard.Reason]pb.Reason{
	shard.OK: pb.Reason_OK, shard.Replayed: pb.Reason_REPLAYED, shard.RateLimited: pb.Reason_RATE_LIMITED,
	shard.QuotaExceeded: pb.Reason_QUOTA_EXCEEDED, shard.UnknownAccount: pb.Reason_UNKNOWN_ACCOUNT,
	shard.Refunded: pb.Reason_REFUNDED, shard.AlreadyRefunded: pb.Reason_ALREADY_REFUNDED,
	shard.UnknownEvent: pb.Reason_UNKNOWN_EVENT, shard.Invalid: pb.Reason_INVALID, shard.Kept: pb.Reason_KEPT,
	shard.IDReused: pb.Reason_ID_REUSED, shard.ReplayLimit: pb.Reason_REPLAY_LIMIT,
}

var reasonFromPB = map[pb.Reason]shard.Reason{
	pb.Reason_OK: shard.OK, pb.Reason_REPLAYED: shard.Replayed, pb.Reason_RATE_LIMITED: shard.RateLimited,
	pb.Reason_QUOTA_EXCEEDED: shard.QuotaExceeded, pb.Reason_UNKNOWN_ACCOUNT: shard.UnknownAccount,
	pb.Reason_REFUNDED: shard.Refunded, pb.Reason_ALREADY_REFUNDED: shard.AlreadyRefunded,
	pb.Reason_UNKNOWN_EVENT: shard.UnknownEvent, pb.Reason_INVALID: shard.Invalid, pb.Reason_KEPT: shard.Kept,
	pb.Reason_ID_REUSED: shard.IDReused, pb.Reason_REPLAY_LIMIT: shard.ReplayLimit,
}

func decisionToPB(d *shard.Decision) *pb.Decision {
	return &pb.Decision{Reason: reasonToPB[d.Reason], Units: d.Units, Limit: d.Limit, Remaining: d.Remaining, Reset_: d.Reset,
		RetryAfter: d.RetryAfter, RateBurst: d.RateBurst, RateRemaining: d.RateRemaining, RateReset: d.RateReset, RateWindow: d.RateWindow,
		MonthUnits: d.MonthUnits, MonthUsed: d.MonthUsed, CreditsStart: d.CreditsStart}
}

// decisionFromPB reads d; a nil d, or a reason this build does not know,
// reads as shard.Undecided (never accepted).
func decisionFromPB(d *pb.Decision) shard.Decision {
	if d == nil {
		return shard.Decision{}
	}
	return shard.Decision{Reason: reasonFromPB[d.Reason], Units: d.Units, Limit: d.Limit, Remaining: d.Remaining, Reset: d.Reset_,
		RetryAfter: d.RetryAfter, RateBurst: d.RateBurst, RateRemaining: d.RateRemaining, RateReset: d.RateReset, RateWindow: d.RateWindow,
		MonthUnits: d.MonthUnits, MonthUsed: d.MonthUsed, CreditsStart: d.CreditsStart}
}

func receiptToPB(r *shard.Receipt) *pb.Receipt {
	if r == nil {
		return nil
	}
	out := &pb.Receipt{EventId: r.EventID, Account: r.Account, Node: r.Node, Gen: r.Gen, Units: r.Units, Period: int32(r.Period), Wall: r.Wall, Key: r.Key, Route: r.Route, ReplaySeq: r.ReplaySeq}
	for _, a := range r.Allocs {
		out.Allocs = append(out.Allocs, &pb.Alloc{Grant: a.Grant, Units: a.Units})
	}
	return out
}

func receiptFromPB(r *pb.Receipt) *shard.Receipt {
	if r == nil {
		return nil
	}
	out := &shard.Receipt{EventID: r.EventId, Account: r.Account, Node: r.Node, Gen: r.Gen, Units: r.Units, Period: shard.Period(r.Period), Wall: r.Wall, Key: r.Key, Route: r.Route, ReplaySeq: r.ReplaySeq}
	for _, a := range r.Allocs {
		out.Allocs = append(out.Allocs, shard.Alloc{Grant: a.Grant, Units: a.Units})
	}
	return out
}

func chargeToPB(c *ChargeRequest) *pb.ChargeRequest {
	return &pb.ChargeRequest{Account: c.Account, EventId: c.EventID, ClientId: c.ClientID, Key: c.Key, Route: c.Route, Units: c.Units, Target: c.Target}
}

// chargeRequestFromPB is chargeToPB's inverse: a routed charge goes on as
// the caller sent it, every field (the Target too, or a reused key would
// be replayed at an owner reached through WrongOwner).
func chargeRequestFromPB(c *pb.ChargeRequest) ChargeRequest {
	return ChargeRequest{Account: c.Account, EventID: c.EventId, ClientID: c.ClientId, Key: c.Key, Route: c.Route, Units: c.Units, Target: c.Target}
}

func chargeFromPB(c *pb.ChargeRequest) engine.Request {
	return engine.Request{Account: c.Account, Charge: shard.Charge{EventID: c.EventId, ClientID: c.ClientId, Key: c.Key, Route: c.Route, Units: c.Units, Target: c.Target}}
}
