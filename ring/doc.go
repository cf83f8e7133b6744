// Package ring decides which node owns each account.
//
// Nodes find each other with github.com/hashicorp/memberlist (gossip, failure
// detection) and place partitions with github.com/buraksezer/consistent
// (consistent hashing with bounded loads). An account hashes to one of
// PartitionCount partitions; each partition has exactly one owner among the
// members that are serving. Only StateServing members own partitions:
// joining members (still loading) and draining members (on their way out)
// are alive and listed, but own nothing.
//
// # Usage
//
//	cfg := ring.DefaultConfig()
//	cfg.NodeID = "quotad-0"
//	cfg.Meta = ring.Meta{RPCAddr: "10.0.0.5:7000", HTTPAddr: "10.0.0.5:8080", AdminAddr: "10.0.0.5:9090"}
//	cfg.Join = []string{"quotad-gossip.default.svc.cluster.local"} // headless Service
//	cfg.Logger = logger
//	r, err := ring.New(cfg) // joins as StateJoining
//	if err != nil {
//		return err
//	}
//	defer r.Close(context.Background())
//
//	changes, cancel := r.Subscribe(16)
//	defer cancel()
//	go func() {
//		for c := range changes {
//			owner.Release(c.Lost)   // settle and forget first,
//			owner.Acquire(c.Gained) // then reserve
//		}
//	}()
//	// ... load the log and snapshot, then take accounts:
//	err := r.SetState(ctx, ring.StateServing)
//	if err != nil && !errors.Is(err, ring.ErrUnconfirmed) { // unconfirmed: set, spreading by gossip
//		return err
//	}
//
//	m, ok := r.Owner(account)
//	switch {
//	case !ok: // nobody serves: refuse, never decide locally
//	case m.ID == r.Self().ID: // charge here
//	default: // forward to m.RPCAddr, sending r.Epoch()
//	}
//
//	// Shutdown: SetState(ctx, ring.StateDraining), settle, Leave(ctx), Close(ctx).
//
// A client that learns the ring from a View (router.Client) rebuilds the
// same answers with NewTable(layout, serving members) or reads View.Owners
// at Layout.Partition(account).
//
// # Layout defaults
//
// PartitionCount 1021, ReplicationFactor 100, Load 1.25 (DefaultLayout).
// Measured with sequential ids acct-1..acct-30000 and member names of six
// styles (node-N, nN, q-N, quotad-N, 10.0.0.N, pod-abc-N):
//
//   - PartitionCount 1021, a prime as consistent advises: about 340
//     partitions per node at 3 nodes and 10 at 100, so balance stays within
//     the load bound up to about 100 nodes (the hard limit is 1021 serving
//     members). It is fixed forever: changing it re-homes every account.
//     More partitions cost only a longer Change and View.Owners.
//   - ReplicationFactor 100 points per member: the circle itself is then
//     balanced (busiest of 3 members held 36.5% of keys; with 20 points,
//     consistent's default, 41.8%), so the load bound rarely has to push a
//     partition past its natural owner. Those pushes are what move
//     partitions between two members that both stayed up when a third
//     leaves: 0.4% of the moves with 100 points, 9% with 20. Every such move
//     is a handoff and, by G7, one extra burst. The price is the rebuild,
//     once per epoch change: 0.35 ms at 3 members, 0.75 ms at 10, 45 ms at
//     100 (BenchmarkNewTable; consistent re-sorts its circle per member).
//   - Load 1.25 caps a member at 1.25x the mean partition count. 1.1
//     balances tighter but raised the moves between surviving members from
//     0.4% to 3%; with 100 points the circle rarely needs the bound anyway.
//     Load must be above 1.0: at 1.0 consistent cannot place every partition
//     and panics, so Layout.Validate refuses it, and NewTable refuses member
//     counts that do not fit (ErrTooManyMembers) instead of panicking.
//
// The account hash is xxhash64 of the account id modulo PartitionCount;
// TestSpreadSequentialIDs checks that sequential ids spread (no member of
// three above 40%), and testdata/ pins the mapping (TestGolden, regenerate
// with -rewrite) so that a change of hash, layout or consistent version
// fails CI rather than re-homing accounts during a rolling deploy.
//
// # Failure detection and takeover
//
// memberlist probes one member per ProbeInterval; a member that misses its
// ack (directly, through IndirectChecks peers, and over TCP) is suspected,
// and declared dead when the suspicion times out. With up to 10 members the
// timeout is SuspicionMult*ProbeInterval once enough peers confirm the
// suspicion (SuspicionMult-2 of them), and SuspicionMaxTimeoutMult times
// that when nobody can confirm, as for an isolated node. The ring rebuilds
// as soon as memberlist reports the death, so takeover is detection plus
// one gossip hop.
//
//	preset  probe/ack   suspicion         majority takes over    isolated node gives up
//	lan     1 s/500 ms  4 s .. 24 s       about 5-8 s            about 25 s (5 s with 3 nodes)
//	local   200/100 ms  600 ms .. 1.8 s   0.85-1.1 s measured    2.5 s measured
//
// (With 3 members and "lan", nobody is expected to confirm, so both sides
// use the 4 s minimum.) The "local" numbers come from TestPartitionHeal and
// TestClusterLifecycle under -race on 2 cores.
//
// ("lan" is memberlist.DefaultLANConfig; "local" is DefaultLocalConfig with
// the probe, gossip (50 ms), push-pull (2 s) and suspicion tightened.) A
// loaded node's awareness multiplier (up to 8x) stretches its own probes.
//
// Between the two columns both sides of a partition own the isolated
// node's accounts; after the second, the isolated node, alone in its ring,
// owns every account until the partition heals (nothing tells a node it is
// the minority: one whose peers all crashed sees the same). Quotas stay
// exact through ledger reservations; rate limits count apart on each side,
// up to double for an account whose requests reach both (DESIGN.md, G1
// and G7).
//
// memberlist does not merge a healed partition by itself once it declared
// the other side dead (it stops probing and pushing state to dead members).
// Every RejoinInterval (10 s lan, 500 ms local) the ring re-joins its seeds
// and the members it knew that are not alive now (Rejoin), so a heal merges
// within about one interval plus a push-pull: 0.4 s measured with "local".
// Right after a heal, dead notices from the minority side can briefly
// remove a healthy member on the majority side until it refutes them (one
// gossip round, about 50 ms with "local"); subscribers see that as a Lost
// and Gained pair.
//
// # Epoch
//
// The epoch names a ring: xxhash64 of the layout and the sorted IDs of the
// serving members. Two nodes with the same epoch have the same owner for
// every account; different epochs mean their views differ. Calls carry the
// caller's epoch and answers the receiver's, for diagnosis; a receiver
// decides by ownership, not by comparing epochs: it decides an account it
// owns in its own view (and its engine agrees), and answers WrongOwner,
// naming the owner it sees, for any other.
// The epoch is a name, not a clock: it is not ordered, and it comes back
// when a set comes back (which is right: the owners come back too). Epoch
// 0 means nobody serves. Members joining or draining, and changes of
// address, do not change the epoch.
//
// # Subscribers
//
// Subscribe returns a channel of Change: the first one lists this node's
// current partitions as Gained, and each later one how they moved when the
// epoch changed. Apply Lost before Gained. The ring never waits for a
// subscriber: when its buffer is full, the queued Changes and the new one
// are composed into one, which keeps every loss (a partition lost and
// regained in the meantime appears in both lists, so the subscriber drops
// its state for it before taking it back). A subscriber is thus never
// behind in correctness, only in granularity. Cancel, or Close, closes the
// channel.
//
// # Concurrency
//
// memberlist calls the ring's callbacks from its own goroutines; they only
// copy the event into a map keyed by node name (the latest event per node)
// and signal. Calling back into memberlist from there would deadlock. One
// rebuild goroutine owns the member set: it applies the events, builds an
// immutable Table and publishes a snapshot through an atomic pointer, so
// Owner, OwnerOfPartition, Partition and Epoch take no lock and do not
// allocate (about 14 ns, BenchmarkOwner). A second
// goroutine runs Rejoin every RejoinInterval. Close stops both, shuts
// memberlist and its transport down, and returns when they have exited (it
// may wait for a join in flight, at most memberlist's TCPTimeout: 10 s lan,
// 1 s local). The package has no global state: any number of rings can run
// in one process.
//
// # Fault injection
//
// FaultTransport wraps memberlist's transport to cut traffic to and from
// chosen peers, so tests can partition nodes on one machine without root.
// It exists only for tests (quotad exposes it only behind a test flag) and
// all nodes of a cluster must use it or none.
package ring
