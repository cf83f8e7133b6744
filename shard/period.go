package shard

import (
	"strconv"
	"strings"
	"time"
)

// Period is a calendar month in UTC, counted as year*12 + month-1.
type Period int32

// PeriodOf names the UTC month of a wall reading (Unix ns).
func PeriodOf(wall int64) Period {
	y, m, _ := time.Unix(0, wall).UTC().Date()
	return Period(y*12 + int(m) - 1)
}

// Start is 00:00:00 UTC on the 1st of the month, in Unix ns.
func (p Period) Start() int64 {
	return time.Date(int(p)/12, time.Month(int(p)%12+1), 1, 0, 0, 0, 0, time.UTC).UnixNano()
}

// End is the start of the next month, in Unix ns.
func (p Period) End() int64 { return (p + 1).Start() }

// String formats the period as "2026-06".
func (p Period) String() string {
	y, m := int(p)/12, int(p)%12+1
	b := make([]byte, 0, 7)
	b = strconv.AppendInt(b, int64(y), 10)
	b = append(b, '-')
	if m < 10 {
		b = append(b, '0')
	}
	return string(strconv.AppendInt(b, int64(m), 10))
}

// ParsePeriod reads "2026-06".
func ParsePeriod(s string) (Period, bool) {
	t, err := time.Parse("2006-01", s)
	if err != nil {
		return 0, false
	}
	return PeriodOf(t.UnixNano()), true
}

// MonthlyGrantID is the id of the grant a plan's monthly quota becomes in
// period p: "m:2026-06". It is scoped by account, like every grant id.
func MonthlyGrantID(p Period) string { return "m:" + p.String() }

// MonthlyPeriod is the period of a monthly grant id ("m:2026-06"), and false
// for any other id.
func MonthlyPeriod(grantID string) (Period, bool) {
	s, ok := strings.CutPrefix(grantID, "m:")
	if !ok {
		return 0, false
	}
	p, ok := ParsePeriod(s)
	if !ok || MonthlyGrantID(p) != grantID {
		return 0, false
	}
	return p, true
}
