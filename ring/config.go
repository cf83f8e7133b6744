package ring

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/hashicorp/memberlist"
)

// Presets name memberlist timings (see the package doc for what they give).
const (
	// PresetLAN is memberlist.DefaultLANConfig unchanged: production.
	PresetLAN = "lan"
	// PresetLocal is memberlist.DefaultLocalConfig tightened for tests on
	// loopback: a dead node is declared dead in about 1-3 s.
	PresetLocal = "local"
)

// MaxNodeIDLen bounds Config.NodeID (quotad serve --node-id): the name
// travels in every gossip message about the node.
const MaxNodeIDLen = 128

// defaultBroadcastWait bounds SetState and Leave when their context has no
// deadline: memberlist can only wait for its broadcast with a timeout.
const defaultBroadcastWait = 5 * time.Second

// Resolver looks up the addresses of a join name. *net.Resolver implements
// it; tests substitute a fake to stand in for a headless Service.
type Resolver interface {
	LookupHost(ctx context.Context, host string) (addrs []string, err error)
}

// Config configures a Ring. Start from DefaultConfig or LocalConfig and set
// NodeID, Meta and Join.
type Config struct {
	// NodeID is the memberlist node name. Members are keyed by it, never by
	// IP (several nodes may share 127.0.0.1). Unique in the cluster; at most
	// 128 bytes of printable UTF-8 without spaces.
	NodeID string

	// BindAddr and BindPort are where memberlist listens (TCP and UDP).
	// BindPort 0 picks a free port. Ignored when Transport is set.
	BindAddr string
	BindPort int

	// AdvertiseAddr and AdvertisePort are the address others reach this node
	// at. Empty AdvertiseAddr: the bound address (or, bound to 0.0.0.0, a
	// private IP of the host) and the bound port.
	AdvertiseAddr string
	AdvertisePort int

	// Meta carries the node's RPC, HTTP and admin addresses and its initial
	// State (empty means StateJoining). ID and GossipAddr are filled in by
	// the ring from NodeID and the advertised address.
	Meta Meta

	// Join lists seeds: "host:port", or a DNS name (such as a Kubernetes
	// headless Service) whose every A/AAAA record is a seed. A name without
	// a port uses this node's gossip port. Empty: this is the first node.
	Join []string

	// Preset selects memberlist timings: PresetLAN or PresetLocal.
	Preset string

	// PartitionCount, ReplicationFactor and Load shape the ring (see Layout
	// and the package doc). Every node must use the same values.
	PartitionCount    int
	ReplicationFactor int
	Load              float64

	// RejoinInterval is how often the node re-joins the seeds and the
	// members it last knew that are not alive now, so that the two sides of
	// a healed partition merge again. Must be positive.
	RejoinInterval time.Duration

	// ForgetAfter is how long a member that stopped being alive stays a
	// rejoin target. Must be at least RejoinInterval.
	ForgetAfter time.Duration

	// SecretKey, when set, encrypts and authenticates every gossip message
	// (memberlist's AES-GCM keyring): 16, 24 or 32 bytes, the same on every
	// node. A node without it, or with another key, cannot join or read the
	// cluster's gossip. Nil: gossip is plaintext and unauthenticated, so the
	// gossip port must be reachable only by the cluster's nodes.
	SecretKey []byte
	// OtherKeys are also accepted from peers (never used to send), so a
	// key can be rotated with rolling restarts (README, "Rotating").
	// Requires SecretKey.
	OtherKeys [][]byte

	// Transport, if set, replaces memberlist's NetTransport (tests, the
	// FaultTransport). The ring takes ownership: Close, or New when it
	// fails, shuts it down.
	Transport memberlist.Transport

	// Resolver resolves join names. If nil, a new net.Resolver is used.
	Resolver Resolver

	// Logger receives the ring's and memberlist's logs (memberlist's with
	// subsystem=memberlist); tag it with the node and component yourself,
	// the ring adds neither. If nil, logs are discarded.
	Logger *slog.Logger
}

// DefaultConfig returns the production configuration: memberlist's LAN
// timings on 0.0.0.0:7946 and DefaultLayout.
func DefaultConfig() Config {
	l := DefaultLayout()
	return Config{
		BindAddr:          "0.0.0.0",
		BindPort:          7946,
		Meta:              Meta{State: StateJoining},
		Preset:            PresetLAN,
		PartitionCount:    l.PartitionCount,
		ReplicationFactor: l.ReplicationFactor,
		Load:              l.Load,
		RejoinInterval:    10 * time.Second,
		ForgetAfter:       time.Hour,
	}
}

// LocalConfig returns a configuration for tests and demos on one machine:
// 127.0.0.1 on a free port, tight timings, a fast rejoin.
func LocalConfig() Config {
	c := DefaultConfig()
	c.BindAddr = "127.0.0.1"
	c.BindPort = 0
	c.Preset = PresetLocal
	c.RejoinInterval = 500 * time.Millisecond
	c.ForgetAfter = 10 * time.Minute
	return c
}

// Layout returns the ring shape the config describes.
func (c Config) Layout() Layout {
	return Layout{PartitionCount: c.PartitionCount, ReplicationFactor: c.ReplicationFactor, Load: c.Load}
}

// Validate reports every problem with c, joined. New calls it.
func (c Config) Validate() error {
	var errs []error
	if err := validateNodeID(c.NodeID); err != nil {
		errs = append(errs, err)
	}
	if c.Preset != PresetLAN && c.Preset != PresetLocal {
		errs = append(errs, fmt.Errorf("ring: Preset %q: want %q or %q", c.Preset, PresetLAN, PresetLocal))
	}
	if c.Transport == nil && net.ParseIP(c.BindAddr) == nil {
		errs = append(errs, fmt.Errorf("ring: BindAddr %q: want an IP address", c.BindAddr))
	}
	if c.BindPort < 0 || c.BindPort > 65535 || c.AdvertisePort < 0 || c.AdvertisePort > 65535 {
		errs = append(errs, fmt.Errorf("ring: ports %d/%d: want 0-65535", c.BindPort, c.AdvertisePort))
	}
	if c.AdvertiseAddr != "" {
		if net.ParseIP(c.AdvertiseAddr) == nil {
			errs = append(errs, fmt.Errorf("ring: AdvertiseAddr %q: want an IP address", c.AdvertiseAddr))
		}
		if c.AdvertisePort == 0 && c.BindPort == 0 {
			errs = append(errs, errors.New("ring: AdvertiseAddr set with AdvertisePort and BindPort both 0: the advertised port is unknown"))
		}
	}
	empty := 0
	for _, j := range c.Join {
		if j == "" {
			empty++
		} else if _, _, err := splitSeed(j, 1); err != nil {
			errs = append(errs, err)
		}
	}
	if empty > 0 {
		errs = append(errs, fmt.Errorf("ring: %d empty Join entries in %q (a stray comma in --join or QUOTAD_JOIN?)", empty, strings.Join(c.Join, ",")))
	}
	if err := c.Layout().Validate(); err != nil {
		errs = append(errs, err)
	}
	m := c.Meta
	if m.State == "" {
		m.State = StateJoining
	}
	m.ID, m.Preset = c.NodeID, c.Preset // as New encodes it: Validate passed meta New refused
	if _, err := encodeMeta(m, 0); err != nil {
		errs = append(errs, err)
	}
	switch len(c.SecretKey) {
	case 0, 16, 24, 32:
	default:
		errs = append(errs, fmt.Errorf("ring: SecretKey is %d bytes: want 16, 24 or 32 (AES-128, -192 or -256)", len(c.SecretKey)))
	}
	for i, k := range c.OtherKeys {
		switch len(k) {
		case 16, 24, 32:
		default:
			errs = append(errs, fmt.Errorf("ring: OtherKeys[%d] is %d bytes: want 16, 24 or 32", i, len(k)))
		}
	}
	if len(c.OtherKeys) > 0 && len(c.SecretKey) == 0 {
		errs = append(errs, errors.New("ring: OtherKeys without a SecretKey: a node that accepts a key must send with one"))
	}
	if c.RejoinInterval <= 0 {
		errs = append(errs, fmt.Errorf("ring: RejoinInterval %v: must be positive", c.RejoinInterval))
	}
	if c.ForgetAfter < c.RejoinInterval {
		errs = append(errs, fmt.Errorf("ring: ForgetAfter %v: must be at least RejoinInterval (%v)", c.ForgetAfter, c.RejoinInterval))
	}
	return errors.Join(errs...)
}

func validateNodeID(id string) error {
	if id == "" {
		return errors.New("ring: NodeID is empty")
	}
	if len(id) > MaxNodeIDLen {
		return fmt.Errorf("ring: NodeID is %d bytes, at most %d", len(id), MaxNodeIDLen)
	}
	if !utf8.ValidString(id) {
		return fmt.Errorf("ring: NodeID %q is not UTF-8", id)
	}
	for _, r := range id {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return fmt.Errorf("ring: NodeID %q has a space or control character", id)
		}
	}
	return nil
}

// memberlistConfig builds memberlist's configuration from c (validated).
func (c Config) memberlistConfig() *memberlist.Config {
	var mc *memberlist.Config
	switch c.Preset {
	case PresetLocal:
		mc = localPreset()
	default:
		mc = memberlist.DefaultLANConfig()
	}
	// A member declared dead may come back on another address (a pod
	// recreated with a new IP, a node moved): memberlist's default (0)
	// refuses the name a new address until the dead entry is dropped,
	// GossipToTheDeadTime later (30 s with lan), and meanwhile the node
	// back sees a ring with itself serving while the others do not (two
	// owners of its partitions for about 50 s in a review, and ERRORs that
	// two processes share an id). A member alive on its old address still
	// keeps its name.
	mc.DeadNodeReclaimTime = deadNodeReclaimTime
	mc.Name = c.NodeID
	mc.BindAddr = c.BindAddr
	mc.BindPort = c.BindPort
	mc.AdvertiseAddr = c.AdvertiseAddr
	mc.AdvertisePort = c.AdvertisePort
	if c.AdvertisePort == 0 {
		mc.AdvertisePort = c.BindPort
	}
	mc.Transport = c.Transport
	if len(c.SecretKey) > 0 {
		// memberlist adds SecretKey to the keyring and sends with it; it
		// decrypts with any key of the keyring, and refuses what none
		// decrypts (GossipVerifyIncoming and GossipVerifyOutgoing default
		// to true).
		mc.SecretKey = c.SecretKey
		if len(c.OtherKeys) > 0 {
			kr, err := memberlist.NewKeyring(c.OtherKeys, c.SecretKey)
			if err != nil {
				panic(err) // sizes checked by Validate
			}
			mc.Keyring = kr
		}
	}
	return mc
}

// deadNodeReclaimTime is how long after a member is declared dead its name
// may be taken by a member on another address (memberlist.Config.
// DeadNodeReclaimTime): at once, in effect, since declared dead it owns
// nothing.
const deadNodeReclaimTime = time.Millisecond

// MinFailureTimeout is the shortest time after which the other members can
// declare this node dead once it stops answering: a probe of it times out
// (ProbeTimeout), then its suspicion runs out at its shortest
// (SuspicionMult probe intervals, reached when peers confirm it; memberlist
// lengthens it by log10 of the members beyond 10, never shortens it). With
// the local preset that is 700 ms, with lan 4.5 s. A node that did not run
// for less than this (a pause, a stall) cannot have lost its accounts.
func (c Config) MinFailureTimeout() time.Duration {
	mc := c.memberlistConfig()
	return mc.ProbeTimeout + time.Duration(mc.SuspicionMult)*mc.ProbeInterval
}

// localPreset is memberlist.DefaultLocalConfig tightened for loopback tests.
// With n <= 10 members memberlist's suspicion timeout is
// SuspicionMult*ProbeInterval, shortened by peers' confirmations from
// SuspicionMaxTimeoutMult times that:
//
//	probe every 200 ms, ack within 100 ms
//	suspicion: 600 ms when a peer confirms, 1.8 s when none can
//
// so the majority declares a silent node dead in about 1-1.5 s and an
// isolated node declares the others dead in about 2-2.5 s.
func localPreset() *memberlist.Config {
	mc := memberlist.DefaultLocalConfig()
	mc.ProbeInterval = 200 * time.Millisecond
	mc.ProbeTimeout = 100 * time.Millisecond
	mc.SuspicionMult = 3
	mc.SuspicionMaxTimeoutMult = 3
	mc.GossipInterval = 50 * time.Millisecond
	mc.PushPullInterval = 2 * time.Second
	mc.GossipToTheDeadTime = 5 * time.Second
	mc.TCPTimeout = time.Second
	return mc
}
