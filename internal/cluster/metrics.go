package cluster

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// MetricValue finds the sample of an unlabelled metric in a Prometheus text
// exposition.
func MetricValue(body, name string) (float64, bool) {
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name+" ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		return v, err == nil
	}
	return 0, false
}

// Metric reads one unlabelled metric from n's /metrics.
func (n *Node) Metric(ctx context.Context, name string) (float64, error) {
	code, body, err := n.AdminGet(ctx, "/metrics")
	if err != nil {
		return 0, err
	}
	if code != http.StatusOK {
		return 0, fmt.Errorf("cluster: %s /metrics answered %d", n.ID, code)
	}
	v, ok := MetricValue(body, name)
	if !ok {
		return 0, fmt.Errorf("cluster: %s /metrics has no %s", n.ID, name)
	}
	return v, nil
}

// Settled reports whether n's log is settled (quotaring_unsettled_records
// is 0).
func (n *Node) Settled(ctx context.Context) bool {
	v, err := n.Metric(ctx, "quotaring_unsettled_records")
	return err == nil && v == 0
}

// WaitSettled waits until every running node's log is settled, or ctx ends.
func (c *Cluster) WaitSettled(ctx context.Context) error {
	return Poll(ctx, 50*time.Millisecond, func() (bool, error) {
		for _, n := range c.Nodes {
			if n.Running() && !n.Settled(ctx) {
				return false, nil
			}
		}
		return true, nil
	})
}
