package cluster

import (
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router/pb"
)

func partitionOf(account string, count int) int {
	l := ring.DefaultLayout()
	l.PartitionCount = count
	return l.Partition(account)
}

func servingCount(v *pb.RingViewReply) int {
	k := 0
	for _, m := range v.Members {
		if m.State == "serving" {
			k++
		}
	}
	return k
}
